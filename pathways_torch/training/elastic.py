"""``Trainer.fit``'s machinery: run the steps a few ahead of the losses read back,
checkpoint every k steps, and after a lost worker get new slices, load the last
checkpoint and replay the steps after it (docs/architecture.md, Decision 10)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional

from ..errors import (ClusterShutdownError, NotInitializedError, PathwaysError, ShardingError,
                      TimeoutError, WorkerLostError)
from .checkpoint import _Checkpoints

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


def fit(trainer: "Trainer", data: Any, *, steps: Optional[int], checkpoint_dir: Optional[str],
        checkpoint_every: int, max_restarts: int,
        on_step: Optional[Callable[[int, float], Any]], wait_timeout: float,
        keep_checkpoints: Optional[int], progress: bool = True,
        resume: bool = False) -> List[float]:
    """``Trainer.fit`` (see its docstring): the losses of every step, as floats."""
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, not {checkpoint_every}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, not {max_restarts}")
    if max_restarts and checkpoint_dir is None:
        raise PathwaysError("fit(max_restarts=...) resumes from checkpoints: give "
                            "checkpoint_dir= (a directory every worker can write)")
    batches = _Batches(data, steps, replay=checkpoint_dir is not None)
    ckpts = _Checkpoints(checkpoint_dir, keep_checkpoints) if checkpoint_dir else None
    losses: List[float] = []
    if ckpts is not None:
        ckpts.save(trainer, 0)
    done, lost, restarts = 0, None, 0
    while True:
        try:
            if lost is not None:
                done = _resume(trainer, lost, len(losses) + 1, ckpts, batches, wait_timeout)
                del losses[done:]
                lost = None
            _run(trainer, batches, done, losses, ckpts, checkpoint_every, on_step)
            return losses
        except WorkerLostError as e:
            if restarts >= max_restarts:
                raise
            restarts += 1
            lost = e
            log.warning("a worker was lost at step %d (%s); restart %d of %d",
                        len(losses) + 1, e, restarts, max_restarts)


def _run(trainer: "Trainer", batches: "_Batches", start: int, losses: List[float],
         ckpts: Optional[_Checkpoints], every: int, on_step) -> None:
    """Steps ``start`` .. end, a few dispatched ahead of the losses read back."""
    pending: "collections.deque" = collections.deque()

    def settle(keep: int) -> None:
        while len(pending) > keep:
            i, loss = pending.popleft()
            losses.append(float(loss))
            if on_step is not None:
                on_step(i + 1, losses[-1])

    i = start
    while True:
        batch = batches.get(i)
        if batch is None:
            break
        inputs, targets = batch
        pending.append((i, trainer.step(inputs, targets)))
        i += 1
        settle(_AHEAD)
        if ckpts is not None and i % every == 0:
            settle(0)
            ckpts.save(trainer, i)
            batches.forget_before(i)
    settle(0)


def _resume(trainer: "Trainer", lost: Exception, failed_at: int, ckpts: _Checkpoints,
            batches: "_Batches", wait_timeout: float) -> int:
    """New slices of the same shapes, the last checkpoint loaded: the step to go on
    from. Every slice is replaced, not only the lost ones: a live one may hold an
    op that waits for the dead (a transfer), and its state is stale anyway."""
    t0 = time.monotonic()
    step, path, info = ckpts.latest()
    old = list(trainer.slices)
    for s in old:
        s.release()
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
    trainer.load(path)
    for g, lr in zip(trainer.optimizer.param_groups, info.get("lrs", ())):
        g["lr"] = lr
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
        self.steps, self._replay = steps, replay
        self._data, self._it, self._kept = data, None, {}
        if callable(data) and not hasattr(data, "__iter__"):
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
            raise PathwaysError(f"fit(data=...) takes a callable step -> (inputs, targets), "
                                f"a sequence or an iterable of batches, not "
                                f"{type(data).__name__}")

    def get(self, i: int):
        """Batch ``i``, or None after the last."""
        if self.steps is not None and i >= self.steps:
            return None
        if self._kind == "call":
            return self._data(i)
        if self._kind == "seq":
            return self._data[i]
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
