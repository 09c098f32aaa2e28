"""``Trainer.fit``'s machinery: run the steps a few ahead of the losses read back,
checkpoint every k steps, and after a lost worker get new slices, load the last
checkpoint and replay the steps after it (docs/architecture.md, Decision 10).
``resume=True`` loads the last checkpoint of an earlier run (a restarted script) the
same way; the progress bar and the returned ``FitResult`` count the steps read back."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import torch

from ..errors import (ClusterShutdownError, NotInitializedError, PathwaysError, ShardingError,
                      TimeoutError, WorkerLostError)
from ..client.array import Array
from .checkpoint import _Checkpoints
from .programs import split_loss

if TYPE_CHECKING:
    from .trainer import Trainer

# (named after the module it was first defined in, so logging configurations that name
# it keep working)
log = logging.getLogger("pathways_torch.trainer")

_AHEAD = 2          # fit: steps dispatched beyond the last loss read back


@dataclasses.dataclass
class Restart:
    """One elastic restart of ``Trainer.fit`` (in ``trainer.restarts``)."""

    failed_at: int          # the first step (1-based) whose loss was not read back yet
    resumed_from: int       # the checkpoint's step: fit went on with the step after it
    error: str              # the WorkerLostError
    wait_s: float           # releasing the old slices and getting new ones
    total_s: float          # and loading the checkpoint (its reads are dispatched)


class FitResult(list):
    """What ``Trainer.fit`` returns: the list of the losses (floats) of the steps run in
    this call, in order, one per step (after ``resume=True``, the steps after the
    checkpoint only; steps replayed after a lost worker are counted once), and the
    call's throughput as attributes:

    - ``steps``: steps run in this call (``len(result)``: replays not counted);
    - ``time_s``: wall time of the call, checkpoints, compiles and restarts included;
    - ``steps_per_s``, ``samples_per_s``, ``tokens_per_s``: ``steps``, samples and tokens
      of those steps over ``time_s`` (HF Trainer's ``train_samples_per_second``). A
      step's samples are dimension 0 of the first tensor of its inputs; its tokens the
      elements of the integer 2-D tensor of token ids (``input_ids`` in a dict batch,
      else the first integer 2-D tensor of the inputs). ``None`` where unknown (no such
      tensor, or no step run);
    - ``restarts``: restarts after a lost worker in this call (each is also in
      ``trainer.restarts``);
    - ``resumed_from``: the checkpoint's step that ``resume=True`` went on from (the
      first loss is step ``resumed_from + 1``'s), ``None`` when the call started afresh.

    Being a list, it compares equal to a list of the same losses and prints as one.
    """

    steps: int = 0
    time_s: float = 0.0
    steps_per_s: Optional[float] = None
    samples_per_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    restarts: int = 0
    resumed_from: Optional[int] = None


def fit(trainer: "Trainer", data: Any, *, steps: Optional[int], checkpoint_dir: Optional[str],
        checkpoint_every: int, max_restarts: int,
        on_step: Optional[Callable[[int, float], Any]], wait_timeout: float,
        keep_checkpoints: Optional[int], progress: bool = True,
        resume: bool = False) -> FitResult:
    """``Trainer.fit`` (see its docstring): the losses of the steps run, a FitResult."""
    t0 = time.monotonic()
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, not {checkpoint_every}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, not {max_restarts}")
    if max_restarts and checkpoint_dir is None:
        raise PathwaysError("fit(max_restarts=...) resumes from checkpoints: give "
                            "checkpoint_dir= (a directory every worker can write)")
    if resume and checkpoint_dir is None:
        raise PathwaysError("fit(resume=True) goes on from the last checkpoint of an "
                            "earlier run: give checkpoint_dir= (the directory it wrote)")
    batches = _Batches(data, steps, replay=checkpoint_dir is not None)
    ckpts = _Checkpoints(checkpoint_dir, keep_checkpoints) if checkpoint_dir else None
    start, resumed_from = 0, None
    if resume and ckpts is not None and ckpts.exists():
        start = resumed_from = _resume_from_dir(trainer, ckpts, batches)
    elif ckpts is not None:
        if resume:
            log.info("fit(resume=True): no checkpoint in %s yet; starting from step 0",
                     ckpts.root)
        ckpts.save(trainer, 0)
    show = progress and os.environ.get("PATHWAYS_PROGRESS") != "0"
    meter = _Meter(start, _total(data, batches), show)
    done, lost, restarts = start, None, 0
    try:
        while True:
            try:
                if lost is not None:
                    done = _resume(trainer, lost, meter.step + 1, ckpts, batches,
                                   wait_timeout)
                    meter.rewind(done, restarts)
                    lost = None
                _run(trainer, batches, done, meter, ckpts, checkpoint_every, on_step)
                break
            except WorkerLostError as e:
                if restarts >= max_restarts:
                    raise
                restarts += 1
                lost = e
                log.warning("a worker was lost at step %d (%s); restart %d of %d",
                            meter.step + 1, e, restarts, max_restarts)
    finally:
        meter.close()
    return meter.result(time.monotonic() - t0, restarts, resumed_from)


def _resume_from_dir(trainer: "Trainer", ckpts: _Checkpoints, batches: "_Batches") -> int:
    """``resume=True`` with a checkpoint there: load it and skip the batches before it;
    the step to go on from."""
    step, path, info = ckpts.latest()
    if not os.path.isdir(path):
        raise PathwaysError(f"fit(resume=True): {ckpts.root}/latest.json names step "
                            f"{step}'s checkpoint {path}, which is not there (removed?); "
                            "remove latest.json to start afresh")
    _load(trainer, path, info)
    ckpts.adopt(step)
    batches.skip(step)
    if batches.steps is not None and step >= batches.steps:
        log.warning("fit(resume=True): the checkpoint of step %d in %s is at or past the "
                    "last step (%d): no step to run", step, ckpts.root, batches.steps)
    else:
        log.warning("fit(resume=True): resumed from the checkpoint of step %d in %s; "
                    "going on with step %d", step, ckpts.root, step + 1)
    return step


def _load(trainer: "Trainer", path: str, info: dict) -> None:
    """A checkpoint of fit's directory into ``trainer``: ``Trainer.load`` and the
    learning rates of the sidecar (a scheduler's, which ``Trainer.save`` leaves out)."""
    trainer.load(path)
    for g, lr in zip(trainer.optimizer.param_groups, info.get("lrs", ())):
        g["lr"] = lr


def _run(trainer: "Trainer", batches: "_Batches", start: int, meter: "_Meter",
         ckpts: Optional[_Checkpoints], every: int, on_step) -> None:
    """Steps ``start`` .. end, a few dispatched ahead of the losses read back."""
    pending: "collections.deque" = collections.deque()

    def settle(keep: int) -> None:
        while len(pending) > keep:
            i, result, samples, tokens = pending.popleft()
            value = float(split_loss(result, Array)[0])
            meter.record(i, value, samples, tokens)
            if on_step is not None:
                on_step(i + 1, value)

    i = start
    while True:
        batch = batches.get(i)
        if batch is None:
            break
        inputs, targets = _split_batch(batch, i)
        samples, tokens = _sizes(inputs)
        pending.append((i, trainer.step(inputs, targets), samples, tokens))
        i += 1
        settle(_AHEAD)
        if ckpts is not None and i % every == 0:
            settle(0)
            ckpts.save(trainer, i)
            batches.forget_before(i)
    settle(0)


def _split_batch(batch: Any, i: int) -> Tuple[Any, Any]:
    """``(inputs, targets)`` of a batch: a pair as it is; a mapping (a Hugging Face
    style dict holding its labels) is the inputs, with no targets."""
    if isinstance(batch, Mapping):
        return batch, None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    what = (f"a {type(batch).__name__} of {len(batch)}"
            if isinstance(batch, (tuple, list)) else f"a {type(batch).__name__}")
    raise PathwaysError(f"fit: batch {i} is {what}; a batch is a pair (inputs, targets) "
                        "or a dict of the model's keyword arguments (labels included, "
                        "with Trainer(loss_fn=None))")


def _leaves(value: Any):
    """The tensor-like leaves (a ``.shape`` and a ``.dtype``) of a batch, in order."""
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _leaves(v)
    elif hasattr(value, "shape") and hasattr(value, "dtype"):
        yield value


def _is_int(dtype: Any) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return getattr(dtype, "kind", "") in ("i", "u")        # numpy


def _sizes(inputs: Any) -> Tuple[Optional[int], Optional[int]]:
    """(samples, tokens) of a step's inputs: dimension 0 of the first tensor; the
    elements of the token ids (``input_ids`` of a dict, else the first integer 2-D
    tensor). None where there is none."""
    samples = tokens = None
    try:
        leaves = list(_leaves(inputs))
        for t in leaves:
            if len(t.shape) >= 1:
                samples = int(t.shape[0])
                break
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        cands = ([ids] if ids is not None and hasattr(ids, "shape") else []) + leaves
        for t in cands:
            if len(t.shape) == 2 and _is_int(t.dtype):
                tokens = int(t.shape[0]) * int(t.shape[1])
                break
    except (TypeError, AttributeError, ValueError):     # an exotic leaf: no numbers
        pass
    return samples, tokens


def _total(data: Any, batches: "_Batches") -> Optional[int]:
    """The number of steps of the fit, where known (an iterable with a ``len``, a
    DataLoader, counts too)."""
    if batches.steps is not None or batches._kind != "iter":
        return batches.steps
    try:
        return len(data)
    except TypeError:
        return None


class _Meter:
    """The steps read back in this call: their losses, samples and tokens (a replay
    after a restart replaces the steps since the checkpoint), and the progress bar."""

    def __init__(self, start: int, total: Optional[int], show: bool) -> None:
        self.start = start
        self.losses: List[float] = []
        self.samples: List[Optional[int]] = []
        self.tokens: List[Optional[int]] = []
        self.bar = _bar_class()(total=total, initial=start, desc="fit", unit="step",
                                file=sys.stderr, dynamic_ncols=True) if show else None

    @property
    def step(self) -> int:
        """The last step (1-based) whose loss was read back."""
        return self.start + len(self.losses)

    def record(self, i: int, loss: float, samples: Optional[int],
               tokens: Optional[int]) -> None:
        self.losses.append(loss)
        self.samples.append(samples)
        self.tokens.append(tokens)
        if self.bar is not None:
            self.bar.loss, self.bar.samples, self.bar.tokens = loss, samples, tokens
            self.bar.update(1)

    def rewind(self, step: int, restarts: int) -> None:
        """A restart went back to the checkpoint of ``step``: its later steps run again
        (the bar goes back to ``step`` too)."""
        keep = max(step - self.start, 0)
        del self.losses[keep:], self.samples[keep:], self.tokens[keep:]
        if self.bar is not None:
            self.bar.n = self.bar.last_print_n = self.step
            self.bar.loss = self.losses[-1] if self.losses else None
            self.bar.restarts = restarts
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def result(self, time_s: float, restarts: int,
               resumed_from: Optional[int]) -> FitResult:
        out = FitResult(self.losses)
        n = len(self.losses)
        out.steps, out.time_s, out.restarts = n, time_s, restarts
        out.resumed_from = resumed_from
        out.steps_per_s = n / time_s if time_s > 0 else None
        out.samples_per_s = _per_s(self.samples, time_s)
        out.tokens_per_s = _per_s(self.tokens, time_s)
        return out


_BAR: Any = None


def _bar_class():
    """tqdm's bar (imported on the first fit that shows one) whose postfix is the last
    loss and the samples/s and tokens/s at the step rate tqdm shows beside it (its
    smoothed rate), worked out whenever it draws the bar."""
    global _BAR
    if _BAR is None:
        import tqdm

        class _FitBar(tqdm.tqdm):
            loss: Optional[float] = None
            samples: Optional[int] = None       # of the last step read back
            tokens: Optional[int] = None
            restarts = 0

            @property
            def format_dict(self):
                d = super().format_dict
                rate, elapsed = d.get("rate"), d.get("elapsed")
                if rate is None and elapsed and self.n > self.initial:
                    rate = (self.n - self.initial) / elapsed    # as tqdm's format_meter
                post = [] if self.loss is None else [f"loss={self.loss:.4g}"]
                for name, per_step in (("samples", self.samples), ("tokens", self.tokens)):
                    if rate is not None and per_step is not None:
                        post.append(f"{name}/s={self.format_sizeof(rate * per_step)}")
                if self.restarts:
                    post.append(f"restarts={self.restarts}")
                d["postfix"] = ", ".join(post) or None
                return d

        _BAR = _FitBar
    return _BAR


def _per_s(counts: List[Optional[int]], time_s: float) -> Optional[float]:
    if not counts or any(c is None for c in counts) or time_s <= 0:
        return None
    return sum(counts) / time_s


def _resume(trainer: "Trainer", lost: Exception, failed_at: int, ckpts: _Checkpoints,
            batches: "_Batches", wait_timeout: float) -> int:
    """New slices of the same shapes, the last checkpoint loaded: the step to go on
    from. Every slice is replaced, not only the lost ones: a live one may hold an
    op that waits for the dead (a transfer), and its state is stale anyway."""
    t0 = time.monotonic()
    step, path, info = ckpts.latest()
    old = list(trainer.slices)
    for s in old:
        s._release()                # no copy of the trained values: a worker is lost
    deadline = t0 + wait_timeout
    new: list = []
    try:
        for s in old:
            new.append(_reacquire(s, deadline, lost))
    except BaseException:
        for s in new:
            s.release()
        raise
    waited = time.monotonic() - t0
    trainer._place(new)
    _load(trainer, path, info)
    trainer.restarts.append(Restart(failed_at=failed_at, resumed_from=step,
                                    error=str(lost), wait_s=waited,
                                    total_s=time.monotonic() - t0))
    log.warning("resumed from the checkpoint of step %d after %.1f s (%.1f s waiting "
                "for devices)", step, time.monotonic() - t0, waited)
    return step


class _Batches:
    """Batch ``i`` of a fit, again after a restart: callables and sequences are
    indexed; a plain iterable's batches are kept from the last checkpoint on."""

    def __init__(self, data: Any, steps: Optional[int], replay: bool) -> None:
        from ..client.loader import DataLoader
        self.steps, self._replay = steps, replay
        self._data, self._it, self._kept = data, None, {}
        if isinstance(data, DataLoader) and data.is_stream:
            # a stream's epochs have no known length: batch i is the i-th position
            # from where the loader stood, found by asking as the fit goes (the rest
            # of the epoch, or on into the next ones when steps= says so)
            self._kind, self._pos = "stream", []
            self._start = (data.epoch, data.index)
        elif isinstance(data, DataLoader):
            # batch i is the loader's batch at its position when fit began, plus i:
            # a replay (or resume=True) names the same batch again, which the hosts
            # load again (on the new slices after a restart)
            self._kind, self._start = "loader", data.position
            if steps is None:
                self.steps = len(data) - data.index      # the rest of the epoch
        elif callable(data) and not hasattr(data, "__iter__"):
            if steps is None:
                raise PathwaysError("fit(data=callable) needs steps=: the callable "
                                    "gives the batch of each step")
            self._kind = "call"
        elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
            self._kind = "seq"
            self.steps = len(data) if steps is None else min(steps, len(data))
        elif hasattr(data, "__iter__"):
            self._kind, self._it, self._next = "iter", iter(data), 0
        else:
            raise PathwaysError(f"fit(data=...) takes a callable step -> batch (a pair "
                                f"(inputs, targets) or a dict), a sequence or an "
                                f"iterable of batches, not "
                                f"{type(data).__name__}")

    def _stream(self, i: int):
        """Batch ``i`` of a fit over a stream's loader. Positions are found by asking
        the hosts whether a batch exists; a replay takes the same (epoch, index) again,
        which the hosts load again."""
        return self._data._take(*self._pos[i]) if self._find(i) else None

    def _find(self, i: int) -> bool:
        """Find the positions of the stream's steps up to ``i``; False if it ends first."""
        d = self._data
        while len(self._pos) <= i:
            e, j = (self._pos[-1][0], self._pos[-1][1] + 1) if self._pos else self._start
            rows = d._rows(e, j)
            if rows is None and self.steps is not None and j > 0:
                e, j = e + 1, 0             # steps= goes on into the next epoch
                rows = d._rows(e, j)
            if rows is None:                # the epoch (or the stream) ended
                self.steps = len(self._pos)
                return False
            self._pos.append((e, j, rows))
        return True

    def get(self, i: int):
        """Batch ``i``, or None after the last."""
        if self.steps is not None and i >= self.steps:
            return None
        if self._kind == "call":
            return self._data(i)
        if self._kind == "seq":
            return self._data[i]
        if self._kind == "loader":
            return self._data.at(self._start + i)
        if self._kind == "stream":
            return self._stream(i)
        if not self._replay and i == self._next:   # no checkpoints: nothing to keep
            self._next += 1
            try:
                return next(self._it)
            except StopIteration:
                self.steps = i
                return None
        while self._next <= i:
            try:
                self._kept[self._next] = next(self._it)
            except StopIteration:
                self.steps = self._next
                return None
            self._next += 1
        if i not in self._kept:
            raise PathwaysError(f"batch {i} of the iterable is gone; fit keeps the batches "
                                "since the last checkpoint only")
        return self._kept[i]

    def skip(self, n: int) -> None:
        """Go on at batch ``n`` (``resume=True``): a callable or a sequence is indexed
        from there; a plain iterable's first ``n`` batches are drawn and dropped, and
        so are a stream loader's (named, so that its hosts load in order)."""
        if self._kind == "stream":
            for k in range(n):
                if self._stream(k) is None:
                    return
        if self._kind != "iter":
            return
        while self._next < n:
            try:
                next(self._it)
            except StopIteration:
                self.steps = self._next
                return
            self._next += 1

    def forget_before(self, i: int) -> None:
        for k in [k for k in self._kept if k < i]:
            del self._kept[k]


def _reacquire(old, deadline: float, lost: Exception):
    """A slice shaped like ``old`` on its island, as soon as the resource manager has
    one (the replacement of a lost host registers with fresh devices)."""
    from ..client import runtime
    last = ""
    while True:
        try:
            return runtime.slice(old.mesh_shape, old.axis_names, island=old.island)
        except (ShardingError, NotInitializedError, ClusterShutdownError):
            raise
        except PathwaysError as e:
            # Exhausted, or allocated on the dead host before the coordinator marked it
            # lost (its executor cannot start): ask again.
            last = str(e)
        if time.monotonic() > deadline:
            free = collections.Counter((d.island, d.host) for d in runtime.devices()
                                       if d.state == "free")
            where = ", ".join(f"island {i} host {h}: {n}" for (i, h), n in sorted(
                free.items())) or "none"
            raise TimeoutError(
                f"after losing a worker ({lost}), no slice of {old.size} devices came back "
                f"on island {old.island} in time (free devices: {where}; last answer: "
                f"{last}). Restart the lost worker (pathways-run --worker --island "
                f"{old.island} ...) or give fit a longer wait_timeout") from lost
        time.sleep(0.25)
