"""``pw.Trainer``: train an ordinary nn.Module with a torch.optim optimizer on a slice.

One compiled program per step does forward, backward and the optimizer update; the
parameters and optimizer state stay on the workers (each step's outputs become the
next step's inputs), only the batch moves, and steps are dispatched ahead: ``step``
returns the loss as a ``pw.Array`` future without waiting for the previous step.

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

from typing import Any, Callable, Dict, Optional

import torch
from torch.utils import _pytree as pytree

from . import optim as fopt
from .client.array import Array, put
from .client.program import Program
from .errors import PathwaysError, ShardingError
from .parallel.strategies import DataParallel, mesh_sizes
from .sharding import P, validate_spec


class Trainer:
    """Data-, fully-sharded- or tensor-parallel training of ``model`` on ``slice``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable, *, slice, parallelism=None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.slice = slice
        self.parallelism = parallelism or DataParallel(slice.axis_names[0])
        self.opt = fopt.describe(optimizer)
        self._mesh = mesh_sizes(slice)
        self._group_of: Dict[str, int] = {}
        ids = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.param_specs: Dict[str, P] = {}
        params, frozen = {}, {}
        for name, p in model.named_parameters():
            if not p.requires_grad or id(p) not in ids:
                frozen[name] = p          # not trained: an input like a buffer
                continue
            self._group_of[name] = ids[id(p)]
            spec = self.parallelism.param_spec(name, tuple(p.shape), self._mesh)
            validate_spec(spec, p.shape, slice.axis_names, slice.mesh_shape,
                          f"parameter {name!r}")
            self.param_specs[name] = spec
            params[name] = put(p.detach(), slice, spec)
        if not params:
            raise PathwaysError(
                "the optimizer holds none of the model's parameters: build it from "
                "model.parameters() of the same model you pass to pw.Trainer")
        self.params: Dict[str, Array] = params
        self.buffers = {name: put(b.detach(), slice, P())
                        for name, b in list(model.named_buffers()) + list(frozen.items())}
        self.state: Dict[str, Dict[str, Array]] = {}
        self._init_state()
        self.steps = self._optimizer_steps()
        # The step function closes over what it needs, not over the Trainer, so that
        # dropping a Trainer frees its worker buffers at once (no reference cycle).
        self._program = Program(_make_step_fn(model, loss_fn, dict(self._group_of)),
                                name=f"train_step_{type(model).__name__}")

    # ------------------------------------------------------------------ state
    def _state_names(self, name: str):
        g = self.opt["groups"][self._group_of[name]]
        return fopt.state_names(self.opt["kind"], g.get("momentum", 0.0))

    def _init_state(self) -> None:
        """Optimizer state from the torch optimizer if it has some, else zeros."""
        by_param = {p: n for n, p in self.model.named_parameters()}
        for name, arr in self.params.items():
            p = dict(self.model.named_parameters())[name]
            existing = self.optimizer.state.get(p, {})
            self.state[name] = {}
            for sname in self._state_names(name):
                t = existing.get(sname)
                t = torch.zeros_like(p.detach()) if t is None else t.detach()
                self.state[name][sname] = put(t, self.slice, self.param_specs[name])
        del by_param

    def _optimizer_steps(self) -> int:
        for st in self.optimizer.state.values():
            if "step" in st:
                return int(st["step"])
        return 0

    def _batch(self, value):
        def place(t):
            if isinstance(t, Array):
                return t
            t = torch.as_tensor(t)
            spec = self.parallelism.batch_spec(tuple(t.shape), self._mesh)
            try:
                validate_spec(spec, t.shape, self.slice.axis_names, self.slice.mesh_shape,
                              "batch")
            except ShardingError as e:
                raise ShardingError(f"{e}; use a batch size that the data axis divides") \
                    from None
            return put(t, self.slice, spec)
        return pytree.tree_map(place, value)

    def step(self, inputs: Any, targets: Any) -> Array:
        """Dispatch one training step; returns the loss (a ``pw.Array``) at once."""
        self.steps += 1
        kind = self.opt["kind"]
        sc = []
        for gi, g in enumerate(self.opt["groups"]):
            lr = float(self.optimizer.param_groups[gi]["lr"])
            sc.append({k: torch.tensor(v, dtype=torch.float32)
                       for k, v in fopt.scalars(kind, g, lr, self.steps).items()})
        hyper = (kind, tuple(tuple(sorted(g.items())) for g in self.opt["groups"]))
        new_params, new_state, loss = self._program(
            self.params, self.buffers, self.state, sc, self._batch(inputs),
            self._batch(targets), hyper)
        self.params, self.state = new_params, new_state
        return loss

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Parameters, buffers and optimizer state, fetched to the client as tensors."""
        return {
            "model": {**{n: a.torch() for n, a in self.params.items()},
                      **{n: a.torch() for n, a in self.buffers.items()}},
            "optim": {n: {k: a.torch() for k, a in st.items()}
                      for n, st in self.state.items()},
            "steps": torch.tensor(self.steps),
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Put a ``state_dict()`` back on the slice (shardings as the strategy says)."""
        for n in self.params:
            self.params[n] = put(sd["model"][n], self.slice, self.param_specs[n])
        for n in self.buffers:
            self.buffers[n] = put(sd["model"][n], self.slice, P())
        for n, st in self.state.items():
            for k in st:
                st[k] = put(sd["optim"][n][k], self.slice, self.param_specs[n])
        self.steps = int(sd["steps"])

    def sync_to(self, model: Optional[torch.nn.Module] = None) -> torch.nn.Module:
        """Copy the trained parameters and buffers back into ``model`` (default: the
        Trainer's own) and the optimizer state into the torch optimizer."""
        model = model or self.model
        sd = self.state_dict()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in sd["model"]:
                    p.copy_(sd["model"][n])
            for n, b in model.named_buffers():
                if n in sd["model"]:
                    b.copy_(sd["model"][n])
        if model is self.model:
            named = dict(self.model.named_parameters())
            for n, st in sd["optim"].items():
                torch_state = self.optimizer.state[named[n]]
                torch_state.update({k: v.clone() for k, v in st.items()})
                torch_state["step"] = torch.tensor(float(self.steps))
        return model

    def save(self, path: str) -> None:
        """Write the state in the torch.distributed.checkpoint format (a directory)."""
        import torch.distributed.checkpoint as dcp
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(self.state_dict(), checkpoint_id=path)

    def load(self, path: str) -> None:
        """Read a checkpoint written by ``save`` (or by torch.distributed.checkpoint)."""
        import torch.distributed.checkpoint as dcp
        import warnings
        sd = {
            "model": {**{n: torch.empty(a.shape, dtype=a.dtype) for n, a in self.params.items()},
                      **{n: torch.empty(a.shape, dtype=a.dtype)
                         for n, a in self.buffers.items()}},
            "optim": {n: {k: torch.empty(a.shape, dtype=a.dtype) for k, a in st.items()}
                      for n, st in self.state.items()},
            "steps": torch.tensor(0),
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, checkpoint_id=path)
        self.load_state_dict(sd)


def _make_step_fn(model: torch.nn.Module, loss_fn: Callable, group_of: Dict[str, int]):
    """The traced training step: forward, backward and the optimizer update."""

    def train_step(params, buffers, state, sc, inputs, targets, hyper):
        kind, groups = hyper
        names = list(params)
        leaves = [params[n].requires_grad_() for n in names]
        out = torch.func.functional_call(model, {**params, **buffers}, (inputs,))
        loss = loss_fn(out, targets)
        grads = torch.autograd.grad(loss, leaves)
        new_params, new_state = {}, {}
        for n, p, g in zip(names, leaves, grads):
            gi = group_of[n]
            new_params[n], new_state[n] = fopt.update(kind, dict(groups[gi]), sc[gi],
                                                      p.detach(), g, state[n])
        return new_params, new_state, loss.detach()

    return train_step
