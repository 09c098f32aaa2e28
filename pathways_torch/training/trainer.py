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

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..client.array import Array, put
from ..client.checkpoint import load_arrays, save_arrays
from ..client.program import Program
from ..errors import PathwaysError
from ..parallel.strategies import DataParallel, MultiIsland, Pipeline, mesh_sizes
from ..sharding import P, validate_spec
from . import elastic
from . import optim as fopt
from .batches import _place_batch
from .elastic import Restart
from .islands import multi_island_step
from .pipeline import _split_stages, pipeline_step
from .programs import _make_step_fn


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
            return pipeline_step(self, inputs, targets, sc, hyper)
        if isinstance(self.parallelism, MultiIsland):
            return multi_island_step(self, inputs, targets, sc, hyper)
        s = self.slices[0]
        axis = getattr(self.parallelism, "batch_axis", None)
        prog = self._program("train_step", _make_step_fn(self.model, self.loss_fn,
                                                         self._group_of), donate=(0, 2))
        new_params, new_state, loss = prog(
            self.replicas[0], self.fixed[0], self.states[0], sc,
            _place_batch(inputs, s, axis), _place_batch(targets, s, axis), hyper)
        self.replicas[0], self.states[0] = new_params, new_state
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
            wait_timeout: float = 300.0, keep_checkpoints: Optional[int] = 2,
            progress: bool = True, resume: bool = False) -> List[float]:
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
        return elastic.fit(self, data, steps=steps, checkpoint_dir=checkpoint_dir,
                           checkpoint_every=checkpoint_every, max_restarts=max_restarts,
                           on_step=on_step, wait_timeout=wait_timeout,
                           keep_checkpoints=keep_checkpoints, progress=progress,
                           resume=resume)
