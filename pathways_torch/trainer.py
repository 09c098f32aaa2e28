"""``pw.Trainer``: train an ordinary nn.Module with a torch.optim optimizer on slices.

Forward, backward and the optimizer update run as compiled programs on the workers;
parameters and optimizer state stay there (each step's outputs are the next step's
inputs), only the batch moves, and steps are dispatched ahead: ``step`` returns the loss
as a ``pw.Array`` future without waiting for the previous step.

- ``DataParallel``, ``FullyShardedDataParallel``, ``TensorParallel``: one SPMD program
  per step on one slice.
- ``Pipeline``: GPipe over several slices, one recorded dataflow graph per step.
- ``MultiIsland``: one replica per island, gradients exchanged over DCN transfers.

Example::

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    s = pw.slice((4,), axis_names=("data",))
    trainer = pw.Trainer(model, opt, torch.nn.functional.cross_entropy, slice=s,
                         parallelism=pw.DataParallel("data"))
    for x, y in batches:
        loss = trainer.step(x, y)          # a pw.Array; float(loss) blocks
    trainer.sync_to(model)
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from . import optim as fopt
from .client.array import Array, put
from .client.checkpoint import load_arrays, save_arrays
from .client.graph import graph
from .client.program import Program
from .errors import (ClusterShutdownError, NotInitializedError, PathwaysError, ShardingError,
                     TimeoutError, WorkerLostError)
from .parallel.strategies import DataParallel, MultiIsland, Pipeline, mesh_sizes
from .sharding import P, validate_spec


class Trainer:
    """Train ``model`` with ``optimizer`` and ``loss_fn(model(inputs), targets)``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable, *, slice=None, parallelism=None) -> None:
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.opt = fopt.describe(optimizer)
        if isinstance(parallelism, (Pipeline, MultiIsland)):
            self.slices = list(parallelism.slices)
        elif slice is not None:
            self.slices = [slice]
            parallelism = parallelism or DataParallel(slice.axis_names[0])
        else:
            raise PathwaysError("pw.Trainer needs slice= (or a Pipeline / MultiIsland "
                                "parallelism that names its slices)")
        self.parallelism = parallelism
        ids = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        named = dict(model.named_parameters())
        self._group_of = {n: ids[id(p)] for n, p in named.items()
                          if p.requires_grad and id(p) in ids}
        if not self._group_of:
            raise PathwaysError(
                "the optimizer holds none of the model's parameters: build it from "
                "model.parameters() of the same model you pass to pw.Trainer")
        fixed = {n: p for n, p in named.items() if n not in self._group_of}
        fixed.update(dict(model.named_buffers()))
        self._shapes = {n: tuple(named[n].shape) for n in self._group_of}
        if isinstance(parallelism, Pipeline):
            self._stages = _split_stages(model, parallelism)
        self._place(self.slices)
        homes = self._homes
        self.replicas: List[Dict[str, Array]] = []
        self.states: List[Dict[str, Dict[str, Array]]] = []
        self.fixed: List[Dict[str, Array]] = []
        for home_of in homes:
            self.replicas.append({n: put(named[n].detach(), home_of(n), self.param_specs[n])
                                  for n in self._group_of})
            self.fixed.append({n: put(t.detach(), home_of(n), P()) for n, t in fixed.items()})
            self.states.append({n: {k: put(t, home_of(n), self.param_specs[n])
                                    for k, t in self._initial_state(n, named[n]).items()}
                                for n in self._group_of})
        self.steps = next((int(st["step"]) for st in optimizer.state.values()
                           if "step" in st), 0)
        self._programs: Dict[str, Program] = {}
        self.restarts: List[Restart] = []         # fit's elastic restarts

    # ------------------------------------------------------------------ layout helpers
    def _place(self, slices) -> None:
        """Say where everything lives on ``slices`` (at start, and again after ``fit``
        replaced lost slices): replicas[r] is one full copy of the trained state, each
        tensor on its own slice (Pipeline: a stage's slice)."""
        # (the placement functions close over locals, never over self: a Trainer must
        # not sit in a reference cycle, or dropping it would not free worker memory)
        slices = list(slices)
        self.slices = slices
        if isinstance(self.parallelism, Pipeline):
            home = {n: k for k, (_, names) in enumerate(self._stages) for n in names}
            homes = [lambda n: slices[home[n.split(".", 1)[0]]]]
        elif isinstance(self.parallelism, MultiIsland):
            homes = [lambda n, s=s: s for s in slices]
        else:
            homes = [lambda n: slices[0]]
        if isinstance(self.parallelism, (Pipeline, MultiIsland)):
            self.parallelism = dataclasses.replace(self.parallelism, slices=tuple(slices))
        self._homes = homes
        self.param_specs = {n: self._param_spec(n, self._shapes[n], homes[0](n))
                            for n in self._group_of}

    def _param_spec(self, name: str, shape, slice_) -> P:
        if isinstance(self.parallelism, (Pipeline, MultiIsland)):
            return P()
        spec = self.parallelism.param_spec(name, shape, mesh_sizes(slice_))
        validate_spec(spec, shape, slice_.axis_names, slice_.mesh_shape,
                      f"parameter {name!r}")
        return spec

    def _initial_state(self, name: str, p: torch.Tensor) -> Dict[str, torch.Tensor]:
        g = self.opt["groups"][self._group_of[name]]
        existing = self.optimizer.state.get(p, {})
        return {k: (existing[k].detach() if k in existing else torch.zeros_like(p.detach()))
                for k in fopt.state_names(self.opt["kind"], g.get("momentum", 0.0))}

    @property
    def params(self) -> Dict[str, Array]:
        """The trained parameters (of the first replica), as Arrays."""
        return self.replicas[0]

    def _batch(self, value, slice_, axis: Optional[str]):
        def place(t):
            if isinstance(t, Array):
                return t
            t = torch.as_tensor(t)
            spec = P(axis) if (axis and t.dim()) else P()
            try:
                validate_spec(spec, t.shape, slice_.axis_names, slice_.mesh_shape, "batch")
            except ShardingError as e:
                raise ShardingError(f"{e}; use a batch size that the data axis divides") \
                    from None
            return put(t, slice_, spec)
        return pytree.tree_map(place, value)

    def _program(self, key: str, fn: Callable, donate: Tuple[int, ...] = ()) -> Program:
        """A cached step program; ``donate``: arguments (parameters, optimizer state)
        whose memory the outputs reuse, so updates happen in place on the workers."""
        prog = self._programs.get(key)
        if prog is None:
            prog = self._programs[key] = Program(fn, name=f"{key}_{type(self.model).__name__}",
                                                 donate_argnums=donate)
        return prog

    def _scalars(self) -> Tuple[list, tuple]:
        kind = self.opt["kind"]
        sc = []
        for gi, g in enumerate(self.opt["groups"]):
            lr = float(self.optimizer.param_groups[gi]["lr"])
            sc.append({k: torch.tensor(v, dtype=torch.float32)
                       for k, v in fopt.scalars(kind, g, lr, self.steps).items()})
        hyper = (kind, tuple(tuple(sorted(g.items())) for g in self.opt["groups"]))
        return sc, hyper

    # ------------------------------------------------------------------ steps
    def step(self, inputs: Any, targets: Any) -> Array:
        """Dispatch one training step; returns the loss (a ``pw.Array``) at once."""
        self.steps += 1
        sc, hyper = self._scalars()
        if isinstance(self.parallelism, Pipeline):
            return self._pipeline_step(inputs, targets, sc, hyper)
        if isinstance(self.parallelism, MultiIsland):
            return self._multi_island_step(inputs, targets, sc, hyper)
        s = self.slices[0]
        axis = getattr(self.parallelism, "batch_axis", None)
        prog = self._program("train_step", _make_step_fn(self.model, self.loss_fn,
                                                         self._group_of), donate=(0, 2))
        new_params, new_state, loss = prog(
            self.replicas[0], self.fixed[0], self.states[0], sc, self._batch(inputs, s, axis),
            self._batch(targets, s, axis), hyper)
        self.replicas[0], self.states[0] = new_params, new_state
        return loss

    def _multi_island_step(self, inputs, targets, sc, hyper) -> Array:
        n = len(self.slices)
        axis = self.parallelism.axis
        xs, ys = _split(inputs, n, "islands"), _split(targets, n, "islands")
        # Gradients travel as one flat buffer per island: one transfer, not one per tensor.
        grad_prog = self._program("grads", _make_grad_fn(self.model, self.loss_fn, flat=True))
        shapes = {n: tuple(a.shape) for n, a in self.replicas[0].items()}
        apply_prog = self._program("apply_flat", _make_apply_fn(self._group_of, shapes),
                                   donate=(0, 1))
        mean_prog = self._program("mean", lambda ls: torch.stack(ls).mean())
        with graph():
            grads, losses = [], []
            for r, s in enumerate(self.slices):
                g, l = grad_prog(self.replicas[r], self.fixed[r], self._batch(xs[r], s, axis),
                                 self._batch(ys[r], s, axis))
                grads.append(g)
                losses.append(l)
            for r, s in enumerate(self.slices):
                # every replica sums the same gradients in the same order: identical updates
                gathered = [g if i == r else _tree_to(g, s) for i, g in enumerate(grads)]
                self.replicas[r], self.states[r] = apply_prog(
                    self.replicas[r], self.states[r], sc, gathered, hyper)
            loss = mean_prog([l if i == 0 else l.to(self.slices[0])
                              for i, l in enumerate(losses)])
        return loss

    def _pipeline_step(self, inputs, targets, sc, hyper) -> Array:
        m = self.parallelism.microbatches
        xs, ys = _split(inputs, m, "microbatches"), _split(targets, m, "microbatches")
        stages, slices = self._stages, self.slices
        last = len(stages) - 1
        params = [{n: self.replicas[0][n] for n in self.replicas[0]
                   if n.split(".", 1)[0] in names} for _, names in stages]
        fixed = [{n: t for n, t in self.fixed[0].items() if n.split(".", 1)[0] in names}
                 for _, names in stages]
        fwd = [self._program(f"stage{k}_fwd", _make_stage_fwd(mod, k == 0))
               for k, (mod, _) in enumerate(stages)]
        bwd = [self._program(f"stage{k}_bwd", _make_stage_bwd(mod, k == 0))
               for k, (mod, _) in enumerate(stages[:-1])]
        last_bwd = self._program("last_bwd", _make_last_bwd(stages[-1][0], self.loss_fn, m,
                                                            last == 0))
        apply_prog = self._program("apply", _make_apply_fn(self._group_of), donate=(0, 1))
        mean_prog = self._program("mean", lambda ls: torch.stack(ls).sum() / len(ls))
        with graph():
            # GPipe: all forwards, microbatch by microbatch through the stages ...
            acts = [[None] * (len(stages)) for _ in range(m)]      # stage inputs
            saved = [[None] * (len(stages)) for _ in range(m)]     # what backward needs
            for j in range(m):
                h = self._batch(xs[j], slices[0], None)
                for k in range(len(stages)):
                    h = h if k == 0 else h.to(slices[k])
                    acts[j][k] = h
                    if k < last:
                        h, saved[j][k] = fwd[k](params[k], fixed[k], h)
            # ... then all backwards, in reverse, accumulating gradients per stage.
            acc: List[Optional[dict]] = [None] * len(stages)
            losses = []
            for j in reversed(range(m)):
                y = self._batch(ys[j], slices[last], None)
                gx, acc[last], loss = last_bwd(params[last], fixed[last], acts[j][last], y,
                                               acc[last] if acc[last] is not None else {})
                losses.append(loss)
                for k in reversed(range(last)):
                    gy = gx.to(slices[k])
                    gx, acc[k] = bwd[k](params[k], fixed[k], acts[j][k], saved[j][k], gy,
                                        acc[k] if acc[k] is not None else {})
                    saved[j][k] = None
            new_params, new_states = {}, {}
            for k in range(len(stages)):
                st = {n: self.states[0][n] for n in params[k]}
                p, s = apply_prog(params[k], st, sc, [acc[k]], hyper)
                new_params.update(p)
                new_states.update(s)
            self.replicas[0], self.states[0] = new_params, new_states
            loss = mean_prog(losses)
        return loss

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """Parameters, buffers and optimizer state, fetched to the client as tensors."""
        return {
            "model": {**{n: a.torch() for n, a in self.replicas[0].items()},
                      **{n: a.torch() for n, a in self.fixed[0].items()}},
            "optim": {n: {k: a.torch() for k, a in st.items()}
                      for n, st in self.states[0].items()},
            "steps": torch.tensor(self.steps),
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Put a ``state_dict()`` back on the slices (layout as the strategy says)."""
        for r, home_of in enumerate(self._homes):
            for n in self.replicas[r]:
                self.replicas[r][n] = put(sd["model"][n], home_of(n), self.param_specs[n])
            for n in self.fixed[r]:
                self.fixed[r][n] = put(sd["model"][n], home_of(n), P())
            for n, st in self.states[r].items():
                for k in st:
                    st[k] = put(sd["optim"][n][k], home_of(n), self.param_specs[n])
        self.steps = int(sd["steps"])

    def sync_to(self, model: Optional[torch.nn.Module] = None) -> torch.nn.Module:
        """Copy the trained parameters and buffers back into ``model`` (default: the
        Trainer's own) and the optimizer state into the torch optimizer."""
        model = model or self.model
        sd = self.state_dict()
        with torch.no_grad():
            for n, t in list(model.named_parameters()) + list(model.named_buffers()):
                if n in sd["model"]:
                    t.copy_(sd["model"][n])
        if model is self.model:
            named = dict(self.model.named_parameters())
            for n, st in sd["optim"].items():
                torch_state = self.optimizer.state[named[n]]
                torch_state.update({k: v.clone() for k, v in st.items()})
                torch_state["step"] = torch.tensor(float(self.steps))
        return model

    def save(self, path: str) -> None:
        """Write the state in the torch.distributed.checkpoint format (a directory).

        Each slice's executor writes the parameters and optimizer state it holds; only
        the metadata passes through the client. Plain PyTorch reads the result::

            trainer.save("ckpt")
            sd = {"model": {n: torch.empty_like(p) for n, p in model.state_dict().items()},
                  "optim": {...}, "steps": torch.tensor(0)}
            torch.distributed.checkpoint.load(sd, checkpoint_id="ckpt")
        """
        arrays = {f"model.{n}": a for n, a in {**self.replicas[0], **self.fixed[0]}.items()}
        for n, st in self.states[0].items():
            arrays.update({f"optim.{n}.{k}": a for k, a in st.items()})
        home = self._homes[0]
        first = next(iter(self.replicas[0]))
        arrays["steps"] = put(torch.tensor(self.steps), home(first), P())
        save_arrays(path, arrays)

    def load(self, path: str) -> None:
        """Read a checkpoint written by ``save`` (or by torch.distributed.checkpoint with
        the same keys); the executors read their parts from the files directly."""
        for r, home_of in enumerate(self._homes):
            wanted = {}
            for n, a in self.replicas[r].items():
                wanted[f"model.{n}"] = (home_of(n), a.shape, a.dtype, self.param_specs[n])
            for n, a in self.fixed[r].items():
                wanted[f"model.{n}"] = (home_of(n), a.shape, a.dtype, P())
            for n, st in self.states[r].items():
                for k, a in st.items():
                    wanted[f"optim.{n}.{k}"] = (home_of(n), a.shape, a.dtype,
                                                self.param_specs[n])
            if r == 0:
                first = next(iter(self.replicas[0]))
                wanted["steps"] = (home_of(first), torch.Size([]), torch.int64, P())
            got = load_arrays(path, wanted)
            for n in self.replicas[r]:
                self.replicas[r][n] = got[f"model.{n}"]
            for n in self.fixed[r]:
                self.fixed[r][n] = got[f"model.{n}"]
            for n, st in self.states[r].items():
                for k in st:
                    st[k] = got[f"optim.{n}.{k}"]
            if r == 0:
                self.steps = int(got["steps"].torch())

    # ------------------------------------------------------------------ elastic training
    def fit(self, data: Any, *, steps: Optional[int] = None,
            checkpoint_dir: Optional[str] = None, checkpoint_every: int = 100,
            max_restarts: int = 0, on_step: Optional[Callable[[int, float], Any]] = None,
            wait_timeout: float = 300.0, keep_checkpoints: Optional[int] = 2) -> List[float]:
        """Train on ``data`` for ``steps`` steps, checkpointing, and resume elastically
        when a worker is lost; returns the loss of every step, as floats.

        ``data`` gives the batch ``(inputs, targets)`` of each step (``i`` counts from 0
        in this call):

        - a callable ``data(i) -> (inputs, targets)`` (then ``steps`` is required);
        - a sequence (``len`` and ``data[i]``, e.g. a list of batches): ``steps``
          defaults to ``len(data)``;
        - any other iterable (a generator, a DataLoader): until it ends or ``steps``.

        Every ``checkpoint_every`` steps, and once before the first step (the "step 0"
        checkpoint: the state fit starts from), the workers write ``trainer.save`` to
        ``checkpoint_dir/step-NNNNNN/``, then ``checkpoint_dir/latest.json`` (written
        last, atomically) records the step, so a checkpoint that a dying worker left
        half written is never used. Only the ``keep_checkpoints`` newest are kept
        (``None``: all).

        When a step, a loss or a checkpoint fails with ``pw.WorkerLostError`` (and only
        then), up to ``max_restarts`` times: the Trainer releases its slices, waits up to
        ``wait_timeout`` s until the resource manager can give it slices of the same
        shapes on the same islands again (a restarted worker registers as the
        replacement of the lost host: ``LocalCluster`` does it, or ``pathways-run
        --worker`` started again), rebuilds its slices (``trainer.slices``: slices you
        passed in are released) and programs, loads the last checkpoint and continues
        from the step after it. Each restart is appended to ``trainer.restarts``. The
        steps after the checkpoint run again on the same batches: a callable or a
        sequence is indexed again; batches of a plain iterable are kept in memory since
        the last checkpoint, so the replay is exact either way, and so are the numbers:
        the checkpoint holds parameters, buffers, optimizer state and the step counter
        (Adam's bias correction), and the sidecar the learning rates. Devices that do not
        come back in time raise ``pw.TimeoutError``; a loss beyond ``max_restarts`` (or
        before the step-0 checkpoint exists) re-raises the ``WorkerLostError``.

        ``on_step(i, loss)`` is called after step ``i`` (1-based) with its loss; steps are
        dispatched ahead, so it runs a step or two behind the dispatch, and after a
        restart it sees the replayed steps again. Example::

            trainer = pw.Trainer(model, opt, F.cross_entropy, slice=pw.slice((2,)))
            losses = trainer.fit(lambda i: batches[i % len(batches)], steps=1000,
                                 checkpoint_dir="/shared/ckpt", checkpoint_every=50,
                                 max_restarts=3, on_step=lambda i, l: print(i, l))
            print(trainer.restarts)     # [Restart(failed_at=..., resumed_from=..., ...)]
        """
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
            ckpts.save(self, 0)
        done, lost, restarts = 0, None, 0
        while True:
            try:
                if lost is not None:
                    done = self._resume(lost, len(losses) + 1, ckpts, batches,
                                        wait_timeout)
                    del losses[done:]
                    lost = None
                self._run(batches, done, losses, ckpts, checkpoint_every, on_step)
                return losses
            except WorkerLostError as e:
                if restarts >= max_restarts:
                    raise
                restarts += 1
                lost = e
                log.warning("a worker was lost at step %d (%s); restart %d of %d",
                            len(losses) + 1, e, restarts, max_restarts)

    def _run(self, batches: "_Batches", start: int, losses: List[float],
             ckpts: Optional["_Checkpoints"], every: int, on_step) -> None:
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
            pending.append((i, self.step(inputs, targets)))
            i += 1
            settle(_AHEAD)
            if ckpts is not None and i % every == 0:
                settle(0)
                ckpts.save(self, i)
                batches.forget_before(i)
        settle(0)

    def _resume(self, lost: Exception, failed_at: int, ckpts: "_Checkpoints",
                batches: "_Batches", wait_timeout: float) -> int:
        """New slices of the same shapes, the last checkpoint loaded: the step to go on
        from. Every slice is replaced, not only the lost ones: a live one may hold an
        op that waits for the dead (a transfer), and its state is stale anyway."""
        t0 = time.monotonic()
        step, path, info = ckpts.latest()
        old = list(self.slices)
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
        self._place(new)
        self.load(path)
        for g, lr in zip(self.optimizer.param_groups, info.get("lrs", ())):
            g["lr"] = lr
        self.restarts.append(Restart(failed_at=failed_at, resumed_from=step,
                                     error=str(lost), wait_s=waited,
                                     total_s=time.monotonic() - t0))
        log.warning("resumed from the checkpoint of step %d after %.1f s (%.1f s waiting "
                    "for devices)", step, time.monotonic() - t0, waited)
        return step


# ---------------------------------------------------------------------- elastic helpers

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


class _Checkpoints:
    """``root/step-NNNNNN/`` written by ``Trainer.save``; ``root/latest.json`` names the
    newest complete one (replaced atomically after the save returned)."""

    def __init__(self, root: str, keep: Optional[int]) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 or None, not {keep}")
        self.root, self.keep = os.path.abspath(root), keep
        self.written: List[str] = []
        os.makedirs(self.root, exist_ok=True)

    def save(self, trainer: "Trainer", step: int) -> None:
        name = f"step-{step:06d}"
        path = os.path.join(self.root, name)
        shutil.rmtree(path, ignore_errors=True)     # no stale parts of an earlier run
        trainer.save(path)
        info = {"step": step, "path": name, "trainer_steps": trainer.steps,
                "lrs": [float(g["lr"]) for g in trainer.optimizer.param_groups]}
        tmp = os.path.join(self.root, "latest.json.tmp")
        with open(tmp, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.root, "latest.json"))
        if name in self.written:
            self.written.remove(name)
        self.written.append(name)
        while self.keep is not None and len(self.written) > self.keep:
            shutil.rmtree(os.path.join(self.root, self.written.pop(0)), ignore_errors=True)

    def latest(self) -> Tuple[int, str, dict]:
        with open(os.path.join(self.root, "latest.json")) as f:
            info = json.load(f)
        return int(info["step"]), os.path.join(self.root, info["path"]), info


def _reacquire(old, deadline: float, lost: Exception):
    """A slice shaped like ``old`` on its island, as soon as the resource manager has
    one (the replacement of a lost host registers with fresh devices)."""
    from .client import runtime
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


# ---------------------------------------------------------------------- helpers

def _split(value, n: int, what: str) -> list:
    """Split every tensor of a batch pytree into ``n`` equal parts along dimension 0."""
    leaves, spec = pytree.tree_flatten(value)
    parts = []
    for t in leaves:
        t = torch.as_tensor(t)
        if t.shape[0] % n:
            raise ShardingError(f"a batch of {t.shape[0]} cannot be split into {n} equal "
                                f"{what}; use a batch size divisible by {n}")
        parts.append(t.chunk(n))
    return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(n)]


def _tree_to(tree, slice_):
    return pytree.tree_map(lambda a: a.to(slice_) if isinstance(a, Array) else a, tree)


def _split_stages(model: torch.nn.Module, pipe: Pipeline):
    """[(stage module, names of the model's children in it)] for an nn.Sequential."""
    if not isinstance(model, torch.nn.Sequential):
        raise PathwaysError("pw.Pipeline splits an nn.Sequential into stages; wrap the "
                            "model's layers in one")
    n = len(model)
    if isinstance(pipe.stages, int):
        s = pipe.stages
        if not 1 <= s <= n:
            raise PathwaysError(f"cannot split {n} layers into {s} stages")
        bounds = [(n * k // s, n * (k + 1) // s) for k in range(s)]
    else:
        bounds = [tuple(b) for b in pipe.stages]
    if len(bounds) != len(pipe.slices):
        raise PathwaysError(f"{len(bounds)} stages need {len(bounds)} slices, got "
                            f"{len(pipe.slices)}")
    names = list(model._modules)
    return [(model[a:b], names[a:b]) for a, b in bounds]


def _stage_call(mod, params, fixed, x):
    # A stage is model[a:b]: its parameter names are the full model's ("3.weight"), and
    # a slice of an nn.Sequential keeps the children's names, so they line up.
    return torch.func.functional_call(mod, {**params, **fixed}, (x,))


def _make_step_fn(model, loss_fn, group_of):
    """One SPMD step: forward, backward and the optimizer update."""
    def train_step(params, fixed, state, sc, inputs, targets, hyper):
        names = list(params)
        leaves = [params[n].requires_grad_() for n in names]
        loss = loss_fn(torch.func.functional_call(model, {**params, **fixed}, (inputs,)),
                       targets)
        grads = dict(zip(names, torch.autograd.grad(loss, leaves)))
        new_params, new_state = _apply(group_of, params, state, sc, [grads], hyper)
        return new_params, new_state, loss.detach()
    return train_step


def _make_grad_fn(model, loss_fn, flat: bool = False):
    def grads(params, fixed, inputs, targets):
        names = list(params)
        leaves = [params[n].requires_grad_() for n in names]
        loss = loss_fn(torch.func.functional_call(model, {**params, **fixed}, (inputs,)),
                       targets)
        gs = torch.autograd.grad(loss, leaves)
        if flat:
            return torch.cat([g.reshape(-1) for g in gs]), loss.detach()
        return dict(zip(names, gs)), loss.detach()
    return grads


def _unflatten(flat, shapes: Dict[str, tuple]) -> Dict[str, torch.Tensor]:
    out, at = {}, 0
    for n, shape in shapes.items():
        k = 1
        for d in shape:
            k *= d
        out[n] = flat[at:at + k].reshape(shape)
        at += k
    return out


def _apply(group_of, params, state, sc, grad_list, hyper):
    """The optimizer update with the mean of ``grad_list`` (summed in its order)."""
    kind, groups = hyper
    new_params, new_state = {}, {}
    for n, p in params.items():
        g = grad_list[0][n]
        for other in grad_list[1:]:
            g = g + other[n]
        if len(grad_list) > 1:
            g = g / len(grad_list)
        gi = group_of[n]
        new_params[n], new_state[n] = fopt.update(kind, dict(groups[gi]), sc[gi],
                                                  p.detach(), g, state[n])
    return new_params, new_state


def _make_apply_fn(group_of, flat_shapes: Optional[Dict[str, tuple]] = None):
    def apply(params, state, sc, grad_list, hyper):
        if flat_shapes is not None:
            total = grad_list[0]
            for other in grad_list[1:]:
                total = total + other
            grad_list = [_unflatten(total / len(grad_list), flat_shapes)]
        return _apply(group_of, params, state, sc, grad_list, hyper)
    return apply


class _Stash:
    """Saved-tensor hooks that let a stage's backward reuse its forward's activations.

    The forward program runs under ``record`` and returns every tensor autograd saves.
    The backward program traces the same forward under ``replay``, which hands autograd
    those tensors (program inputs) instead of the recomputed ones; the recomputation then
    feeds nothing and XLA drops it, so no stage computes its forward twice (GPipe without
    rematerialisation: activations are kept on the stage's slice until its backward).
    Saved tensors that are the program's own inputs are referred to, not copied.

    What autograd saves depends on the backend (the client's meta-tensor shape check saves
    differently from XLA), so the replay uses the stash only if the two sequences agree
    in shape and dtype, and otherwise the recomputed tensors: slower, never wrong.
    """

    def __init__(self, x, params: Dict[str, torch.Tensor], saved=None) -> None:
        self.inputs = {id(x): x, **{id(t): t for t in params.values()}}
        self.keys: Dict[int, int] = {}
        self.recorded: list = []     # tensors autograd saved in this trace, in order
        self.saved = saved
        self._use_saved: Optional[bool] = None

    def pack(self, t):
        hit = self.inputs.get(id(t))
        if hit is not None:
            return hit
        k = self.keys.get(id(t))
        if k is None:
            k = self.keys[id(t)] = len(self.recorded)
            self.recorded.append(t)         # also keeps ids unique while tracing
        return k

    def unpack(self, k):
        if isinstance(k, torch.Tensor):
            return k
        if self.saved is None:
            return self.recorded[k]
        if self._use_saved is None:
            self._use_saved = len(self.saved) == len(self.recorded) and all(
                a.shape == b.shape and a.dtype == b.dtype
                for a, b in zip(self.saved, self.recorded))
        return self.saved[k] if self._use_saved else self.recorded[k]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _make_stage_fwd(mod, first: bool):
    """A stage's forward; also returns the tensors its backward needs (see _Stash)."""
    def stage_fwd(params, fixed, x):
        for t in params.values():
            t.requires_grad_()
        if not first:
            x = x.requires_grad_()
        stash = _Stash(x, params)
        with stash.hooks():
            y = _stage_call(mod, params, fixed, x)
        return y.detach(), [t.detach() for t in stash.recorded]
    return stage_fwd


def _accumulate(acc, names, grads):
    return {n: (acc[n] + g if n in acc else g) for n, g in zip(names, grads)}


def _make_stage_bwd(mod, first: bool):
    """Backpropagate ``gy`` through the stage with the forward's saved tensors;
    accumulate the parameters' gradients."""
    def stage_bwd(params, fixed, x, saved, gy, acc):
        names = list(params)
        leaves = [params[n].requires_grad_() for n in names]
        if not first:
            x = x.requires_grad_()
        with _Stash(x, params, saved).hooks():
            y = _stage_call(mod, params, fixed, x)
        wrt = leaves if first else [x] + leaves
        grads = torch.autograd.grad(y, wrt, grad_outputs=gy)
        gx = torch.zeros((), dtype=y.dtype) if first else grads[0]
        return gx, _accumulate(acc, names, grads if first else grads[1:])
    return stage_bwd


def _make_last_bwd(mod, loss_fn, microbatches: int, first: bool):
    """The last stage: forward, loss / microbatches, backward; accumulate grads."""
    def last_bwd(params, fixed, x, targets, acc):
        names = list(params)
        leaves = [params[n].requires_grad_() for n in names]
        if not first:
            x = x.requires_grad_()
        loss = loss_fn(_stage_call(mod, params, fixed, x), targets)
        wrt = leaves if first else [x] + leaves
        grads = torch.autograd.grad(loss / microbatches, wrt)
        gx = torch.zeros((), dtype=loss.dtype) if first else grads[0]
        return gx, _accumulate(acc, names, grads if first else grads[1:]), loss.detach()
    return last_bwd
