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

import copy
import dataclasses
import json
import os
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from .._trees import plain_batch
from ..client.array import Array, put
from ..client.capture import KEEPERS, tracing_now
from ..client.connection import raise_buffer_error
from ..client.graph import seq_of
from ..client.loader import made_by_loader
from ..client.checkpoint import entries as checkpoint_entries, load_arrays, save_arrays
from ..client import runtime, torch_paths
from ..client.program import Program
from ..client.rng import SeedStream
from ..errors import ClusterShutdownError, PathwaysError, TraceError, warn_at_caller
from ..parallel.strategies import (DataParallel, MultiIsland, Pipeline, TensorParallel,
                                   mesh_sizes)
from ..sharding import P, validate_spec
from . import elastic
from . import ema as ema_mod, follow, numbers, optim as fopt, reads, scaling
from .batches import _place_batch
from .elastic import Restart
from .follow import _flags, modes as _modes
from .islands import multi_island_step
from .pipeline import _split_stages, pipeline_eval, pipeline_step, stage_ties
from .programs import (FOUND_INF, GRAD_NORM, GROUP_TENSORS, Options, make_eval_fn,
                       make_predict_fn, make_step_fn, precision_mode, split_loss)

KEEPERS.append(reads.keep_trained)   # programs that call a trained module


class Trainer:
    """Train ``model`` with ``optimizer`` and ``loss_fn(model(inputs), targets)``.

    ``inputs`` is what the model takes: a tensor (``model(x)``), a tuple or list
    (``model(*x)``) or a dict (``model(**x)``); with ``loss_fn=None`` the model returns
    its own loss (Hugging Face: labels inside ``inputs``, ``.loss`` in the output).

    ``optimizer`` is a torch.optim optimizer of the model's parameters, or a list of
    them over disjoint parameters, stepped together (Muon for the weight matrices and
    AdamW for the rest), with ``scheduler`` then a list too (one per optimizer that
    has one).

    ``max_grad_norm`` clips the global gradient norm before each update (as
    ``torch.nn.utils.clip_grad_norm_``, whose returned norm ``grad_norm`` gives for
    logging), ``max_grad_value`` each gradient's elements
    (as ``clip_grad_value_``, before the norm when both are given); ``accumulate=k`` makes every k calls of
    ``step`` one update (equal to one step on the k micro-batches concatenated);
    ``precision="bf16"`` runs forward and loss under ``torch.autocast("cpu",
    torch.bfloat16)`` with fp32 parameters and optimizer state; ``precision="fp16"``
    under float16 autocast with torch.amp.GradScaler's dynamic loss scaling (an update
    whose gradients overflow is skipped and the scale halved, as ``scaler.step`` and
    ``scaler.update`` do; ``scaler=`` a GradScaler whose settings and state to start
    from, which ``sync_to`` brings up to date; ``loss_scale`` reads the scale). Lightning's
    "bf16-mixed" and "16-mixed" name the same modes. ``scheduler`` (a
    ``torch.optim.lr_scheduler`` of ``optimizer``) is stepped after every update and
    saved in checkpoints; ReduceLROnPlateau, which needs a metric, is stepped by the
    user (each step reads the learning rate and hyperparameters the optimizer holds).
    ``seed`` starts the stream of RNG seeds of the steps (default: follow torch's, so
    ``torch.manual_seed`` before or after building the Trainer sets it, as it sets a
    torch loop's masks): dropout draws new masks every step, the same seed gives the
    same run, and checkpoints hold the stream's position. ``ema`` (a
    ``torch.optim.swa_utils.AveragedModel`` of ``model``) is updated after every update
    on the workers, as ``ema.update_parameters(model)`` after ``optimizer.step()``
    would be (leave that call out); reading ``ema`` syncs it, checkpoints hold it.
    """

    @reads.internal
    def __init__(self, model: torch.nn.Module, optimizer: Any,
                 loss_fn: Optional[Callable] = None, *, slice=None, parallelism=None,
                 max_grad_norm: Optional[float] = None,
                 max_grad_value: Optional[float] = None, accumulate: int = 1,
                 precision: Optional[str] = None, scheduler=None,
                 seed: Optional[int] = None, ema=None,
                 scaler: Optional["torch.amp.GradScaler"] = None) -> None:
        model = _uncompiled(model)
        _refuse_process_wrappers(model)
        reads.sync_others(model, follow._WATCHES)    # a Trainer before this one on it
        # this Trainer starts from the optimizer's state as of now; it takes a later
        # step's state from another Trainer that shares the optimizer (follow.py)
        self._step_clock = 0
        self._state_clock = follow.tick()
        if isinstance(optimizer, (list, tuple)):
            optimizer = fopt.Chain(optimizer)
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise PathwaysError(f"scaler= takes a torch.amp.GradScaler, not a "
                                f"{type(scaler).__name__}")
        scales = (precision_mode(precision) == "fp16"
                  and (scaler is None or scaler.is_enabled()))
        if scaler is not None and precision_mode(precision) != "fp16":
            raise PathwaysError(
                "scaler= (a GradScaler) goes with precision='fp16': bfloat16 and float32 "
                "gradients need no loss scaling")
        self.options = Options(max_grad_norm, int(accumulate), precision, max_grad_value,
                               scaling.LossScaling.of(scaler) if scales else None)
        self._grad_scaler = scaler
        if isinstance(scheduler, (list, tuple)):
            scheduler = _Schedulers(scheduler) if scheduler else None
        for sch in getattr(scheduler, "schedulers", [scheduler]):
            if isinstance(sch, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise PathwaysError(
                    "ReduceLROnPlateau steps on a metric you measure, which the Trainer "
                    "does not have: leave it out of scheduler= and call "
                    "sched.step(float(trainer.evaluate(x, y))) yourself (once an epoch, "
                    "as in torch); every step reads the learning rate it writes")
        self.scheduler = scheduler
        # the Python numbers of optimizers whose own step is traced (numbers.py)
        self._book = (numbers.Book() if any(fopt.generic(o) for o in fopt.members(optimizer))
                      else None)
        self.opt = dict(fopt.describe(optimizer), book=self._book)
        # float hyperparameters seen to change between steps (a OneCycleLR's momentum),
        # inputs of the step from then on rather than part of its key
        self._dynamic: frozenset = frozenset()
        self._floats = fopt.floats(optimizer)
        if isinstance(parallelism, (Pipeline, MultiIsland)):
            self.slices = list(parallelism.slices)
        elif slice is not None:
            self.slices = [slice]
            parallelism = parallelism or DataParallel(slice.axis_names[0])
        else:
            raise PathwaysError("pw.Trainer needs slice= (or a Pipeline / MultiIsland "
                                "parallelism that names its slices)")
        self.parallelism = parallelism
        hooked = [type(o).__name__ for o in fopt.members(optimizer)
                  if o._optimizer_step_pre_hooks or o._optimizer_step_post_hooks]
        if hooked:
            raise PathwaysError(
                f"{', '.join(hooked)} has step hooks (register_step_pre_hook / "
                "register_step_post_hook): the Trainer's update is part of a compiled "
                "program, where they would run once, while it is traced. Remove them and "
                "do that work between trainer.step calls (hooks on parameters, "
                "p.register_hook, do run in the step)")
        if isinstance(parallelism, (Pipeline, MultiIsland)) and self._book is not None:
            raise PathwaysError(
                f"{type(parallelism).__name__} runs torch.optim's optimizers; "
                f"{', '.join(type(o).__name__ for o in fopt.members(optimizer) if fopt.generic(o))}"
                " is traced with its Python numbers, which DataParallel, "
                "FullyShardedDataParallel and TensorParallel follow")
        if scales and self._book is not None:
            raise PathwaysError(
                "precision='fp16' (loss scaling) runs torch.optim's optimizers; "
                f"{', '.join(type(o).__name__ for o in fopt.members(optimizer) if fopt.generic(o))}"
                " is traced with its Python numbers, which a skipped update would still "
                "advance: use precision='bf16', which needs no loss scaling")
        if isinstance(parallelism, (Pipeline, MultiIsland)) and accumulate > 1:
            raise PathwaysError(f"accumulate={accumulate} runs with DataParallel, FSDP and "
                                f"TensorParallel; a {type(parallelism).__name__} step "
                                "already accumulates over its micro-batches / islands: "
                                "give it the whole batch")
        ids = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        named = dict(model.named_parameters())
        # the optimizer's parameters, of which those that require grad are trained (as
        # in torch, at every step: a change of requires_grad is followed, see step)
        self._held = {n: p for n, p in named.items() if id(p) in ids}
        self._group_of = {n: ids[id(p)] for n, p in self._held.items() if p.requires_grad}
        self._flags = _flags(self._held)
        if not self._group_of:
            raise PathwaysError(
                "the optimizer holds none of the model's parameters: build it from "
                "model.parameters() of the same model you pass to pw.Trainer")
        _refuse_outside_parameters(optimizer, named, loss_fn)
        _refuse_shared_storage(named)
        self._groups = [[n for n in self._group_of if self._group_of[n] == gi]
                        for gi in range(len(optimizer.param_groups))]
        fixed = {n: p for n, p in named.items() if n not in self._group_of}
        fixed.update(dict(model.named_buffers()))
        self._shapes = {n: tuple(t.shape) for n, t in {**named, **fixed}.items()}
        if isinstance(parallelism, TensorParallel):
            parallelism.check_names(list(self._shapes))
        self._ties: List[Dict[str, str]] = []        # Pipeline: see pipeline.stage_ties
        self._tie_home: Dict[str, int] = {}
        if isinstance(parallelism, Pipeline):
            self._stages = _split_stages(model, parallelism)
            self._ties, self._tie_home = stage_ties(model, self._stages)
            wide = next((s for s in self.slices if len(s.devices) > 1), None)
            if parallelism.axis is None and wide is not None:
                warn_at_caller(
                    f"pw.Pipeline without axis=: a stage's slice has {len(wide.devices)} "
                    "devices, and each computes the whole micro-batch (the same numbers "
                    "on every device); pass axis= one of "
                    f"{tuple(wide.axis_names)} to split micro-batches over it",
                    UserWarning)
        self._place(self.slices)
        homes = self._homes
        self.replicas: List[Dict[str, Array]] = []
        self.states: List[Dict[str, Dict[str, Array]]] = []
        self.fixed: List[Dict[str, Array]] = []
        self.acc: List[Dict[str, Array]] = []        # accumulated gradients (accumulate > 1)
        self._parked: List[Dict[str, Dict[str, Array]]] = []  # state of frozen parameters
        initial = self._initial_states(list(self._group_of))
        for home_of in homes:
            self._parked.append({})
            self.replicas.append({n: put(named[n].detach(), home_of(n), self.param_specs[n])
                                  for n in self._group_of})
            self.fixed.append({n: put(t.detach(), home_of(n), self.param_specs[n])
                               for n, t in fixed.items()})
            self.states.append({n: {k: put(t, home_of(n), self._state_spec(n, t))
                                    for k, t in initial[n].items()}
                                for n in self._group_of})
            self.acc.append({n: put(torch.zeros_like(named[n].detach()), home_of(n),
                                    self.param_specs[n])
                             for n in self._group_of} if self.options.accumulate > 1 else {})
        self.steps = next((int(st["step"]) for st in optimizer.state.values()
                           if "step" in st), 0)
        if self._book is not None:    # 0-d tensors a generic optimizer keeps in its groups
            for gi in self._generic_groups():
                for k, v in optimizer.param_groups[gi].items():
                    if isinstance(v, torch.Tensor) and v.dim() == 0:
                        self._book.group_tensors[(gi, k)] = put(v.detach().clone(),
                                                                self.slices[0], P())
        # precision="fp16": the loss scale and growth tracker (scaling.py), a copy on
        # each slice that updates (an island's replica, a pipeline stage), all alike
        self._scalers: List[Dict[str, Array]] = [{} for _ in self._scaler_slices()]
        if scales:
            self._put_scalers(scaling.initial(scaler))
        self.micro = 0                                # micro-steps since the last update
        self._calls = 0                                # step() calls made
        # (loss, its stream position, call) of recent steps on pw.DataLoader batches
        self._loader_losses: List[tuple] = []
        self._warned_fp16 = False       # a step under float16 autocast without scaling
        self._grad_norm: Optional[Array] = None     # of the last update (max_grad_norm)
        self.seeds = SeedStream.of_torch() if seed is None else SeedStream(seed)
        self._programs: Dict[str, Program] = {}
        self._modules = list(self.model.modules())
        self._modes = _modes(self._modules)
        self.restarts: List[Restart] = []         # fit's elastic restarts
        # A step's gradients stay on the workers: gradients a CPU backward left on the
        # module (a sanity check before the Trainer) would read as every step's, so
        # they go, as torch's next zero_grad() would take them
        for p in self._held.values():
            p.grad = None
        # the module and optimizer hold what the workers hold as of this update count
        self._version = self._synced = self._opt_synced = 0
        self._closed = False            # the cluster shut down: nothing left to read
        # reads of the module and optimizer see the trained values (reads.py), and
        # what the script does to them is followed from now on (follow.py)
        reads.install(self)
        self._watch = follow.Watch(self.model, self.optimizer, follow.array_ids(self),
                                   self.loss_fn)
        self._watch.owner = weakref.ref(self)
        # an AveragedModel of the model, updated on the workers after every update
        self._ema = ema_mod.Averaged(self, ema) if ema is not None else None
        runtime.before_shutdown(self._sync_before_shutdown)
        runtime.before_release(self._sync_before_release)

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
        # parameters and buffers alike: FSDP shards BatchNorm statistics too
        self.param_specs = {n: self._param_spec(n, shape, homes[0](n))
                            for n, shape in self._shapes.items()}

    def _param_spec(self, name: str, shape, slice_) -> P:
        if isinstance(self.parallelism, (Pipeline, MultiIsland)):
            return P()
        spec = self.parallelism.param_spec(name, shape, mesh_sizes(slice_))
        validate_spec(spec, shape, slice_.axis_names, slice_.mesh_shape,
                      f"parameter {name!r}")
        return spec

    def _state_spec(self, name: str, t: torch.Tensor) -> P:
        """Optimizer state shaped like its parameter is laid out like it; the rest
        (a step count) is replicated."""
        return self.param_specs[name] if tuple(t.shape) == self._shapes[name] else P()

    def _initial_states(self, wanted: List[str]) -> Dict[str, Dict[str, torch.Tensor]]:
        """For the trained parameters ``wanted``: the torch optimizer's state where it
        has some (a resumed run), else the state its first step would create."""
        out, wanted = {}, set(wanted)
        for gi, group in enumerate(self._groups):
            names = [n for n in group if n in wanted]
            fresh = fopt.initial_state(self.opt, gi, [self._held[n] for n in names],
                                       float(self.optimizer.param_groups[gi]["lr"]))
            for n, st in zip(names, fresh):
                existing = self.optimizer.state.get(self._held[n], {})
                follow.check_state_shapes(n, self._held[n], existing)
                out[n] = ({k: v.detach().clone() for k, v in existing.items()
                           if isinstance(v, torch.Tensor)} if existing else st)
                held = {k: v for k, v in existing.items()
                        if not isinstance(v, torch.Tensor) and numbers.kept(v)}
                if held and self._book is not None:
                    self._book.mirror[n] = held
        return out

    def _frozen(self) -> List[str]:
        """The optimizer's parameters that this Trainer does not train now."""
        return [n for n in self._held if n not in self.states[0]]

    @property
    def params(self) -> Dict[str, Array]:
        """The trained parameters (of the first replica), as Arrays."""
        return self.replicas[0]

    def _program(self, key: str, fn: Callable) -> Program:
        """A cached program of this Trainer, drawing its random numbers from the
        Trainer's seed stream. No ``donate_argnums``: what a program updates in place
        (parameters, state, buffers) it donates by itself, and nothing else may go."""
        prog = self._programs.get(key)
        if prog is None:
            prog = self._programs[key] = Program(
                fn, name=f"{key}_{type(self.model).__name__}", seeds=self.seeds)
        return prog

    def _hyper(self):
        """The optimizer's static hyperparameters now (a program key) and each group's
        learning rate and changing hyperparameters (inputs: a scheduler that sets
        momentum every step costs one retrace, when it first changes it)."""
        now = fopt.floats(self.optimizer)
        if now != self._floats:
            changed = {k for old, new in zip(self._floats, now) for k in new
                       if old.get(k) != new[k]}
            self._dynamic, self._floats = self._dynamic | changed, now
        self.opt = dict(fopt.describe(self.optimizer, self._dynamic), book=self._book)
        return self.opt["groups"], fopt.scalars(self.optimizer, self._dynamic)

    def _numbers(self, hyper, lrs):
        """For an update by a generic optimizer (numbers.py): the step's numbers as one
        input, and the trace whose guards they pass in the program's key. Returns
        (hyper, lrs, what ``_advance`` needs after the call)."""
        if self._book is None:
            return hyper, lrs, None
        groups = self.optimizer.param_groups
        spans = self._generic_groups()
        sources = [(path, v) for path, v in numbers.group_sources(groups)
                   if path[1] in spans]
        names = [n for gi in spans for n in self._groups[gi]]
        sources += numbers.state_sources(self._book.mirror, names)
        layout = (tuple(path for path, _ in sources)
                  + numbers.state_constants(self._book.mirror, names))
        values = [v for _, v in sources]
        slot = self._book.select(layout, values)
        self._book.pending = (layout, slot, sources)
        lrs = [dict(d) for d in lrs]
        lrs[0]["pw.numbers"] = torch.tensor(values, dtype=torch.float64)
        for (gi, k), a in self._book.group_tensors.items():
            lrs[gi][fopt.GROUP_TENSOR + k] = a
        return (hyper, numbers.TraceKey(layout, slot)), lrs, (layout, slot, values)

    def _generic_groups(self) -> List[int]:
        """The indices of the param groups of generic optimizers (numbers.py)."""
        spans, at = [], 0
        for o in fopt.members(self.optimizer):
            if fopt.generic(o):
                spans.extend(range(at, at + len(o.param_groups)))
            at += len(o.param_groups)
        return spans

    def _advance(self, pending) -> None:
        if pending is not None:
            layout, slot, values = pending
            self._book.advance(layout, slot, values, self.optimizer.param_groups)

    @property
    def _scaler(self) -> Dict[str, Array]:
        """The first replica's loss scale and growth tracker ({} without scaling)."""
        return self._scalers[0]

    def _scaler_slices(self) -> list:
        """Where a copy of the loss scale lives: with each island's replica, each
        pipeline stage, or the Trainer's one slice."""
        if isinstance(self.parallelism, (MultiIsland, Pipeline)):
            return list(self.slices)
        return [self.slices[0]]

    def _put_scalers(self, values: Dict[str, Any]) -> None:
        """The loss scale and growth tracker ``values`` (tensors, or the first copy's
        Arrays) on every slice that holds a copy."""
        def on(t, s):
            if isinstance(t, Array):
                return t if t.slice is s else t.to(s, P())
            return put(t, s, P())
        self._scalers = [{k: on(t, s) for k, t in values.items()}
                         for s in self._scaler_slices()]

    def _store_created(self, r: int, created: Dict[str, Dict[str, Array]]) -> None:
        norm = created.pop(GRAD_NORM, None)
        if norm is not None and r == 0:
            self._grad_norm = norm["norm"]
        found = created.pop(FOUND_INF, None)
        if found is not None and float(found["found"].torch()):
            return      # a skipped first update: torch's optimizer made no state either
        for n, st in created.items():
            if n == GROUP_TENSORS:      # a generic optimizer's group tensors
                self._book.group_tensors.update(
                    {(int(k.split(":")[0]), k.split(":", 1)[1]): a for k, a in st.items()})
                continue
            self.states[r][n].update(st)

    # ------------------------------------------------------------------ steps
    @reads.internal
    def step(self, inputs: Any, targets: Any = None) -> Any:
        """Dispatch one training step; returns the loss (a ``pw.Array``) at once, or,
        when ``loss_fn`` returns metrics beside the loss (a tuple whose first element is
        the loss, a dict with ``"loss"``), that whole result with Arrays for tensors
        (under Pipeline and MultiIsland, which combine several programs' losses, the
        loss alone is allowed).

        With ``accumulate=k``, each call is a micro-step whose loss it returns; the
        optimizer update (and the scheduler's step) happens on every k-th call.
        """
        _outside_trace("step")
        self._check_open()
        # a step computes its own gradients: traced with them on even when called
        # inside an evaluation loop's torch.no_grad() or inference_mode()
        with torch.inference_mode(False), torch.enable_grad():
            try:
                out = self._step(inputs, targets)
            finally:
                follow.after_call(self)
        self._calls += 1
        # (after this step is on its way: a loop that catches the error loses no batch)
        self._surface_failed_batches()
        self._watch_batch(inputs, targets, out)
        return out

    def _watch_batch(self, inputs: Any, targets: Any, out: Any) -> None:
        """A step on a ``pw.DataLoader`` batch: its loss is watched (the executor pushes
        a completion watermark), so that if the batch failed to load, which skips the
        step, the next step raises the loader's error even when the script never reads
        that loss, as torch's loop would have stopped at the batch."""
        if not any(made_by_loader(leaf) for leaf in pytree.tree_leaves((inputs, targets))):
            return
        loss = split_loss(out, Array)[0] if not isinstance(out, Array) else out
        seq = seq_of(loss._seq)
        ask = getattr(loss._conn, "ask", None)     # (a slice spanning hosts has none)
        if ask is not None and ask(seq):
            self._loader_losses = (self._loader_losses + [(loss, seq, self._calls)])[-16:]

    def _surface_failed_batches(self) -> None:
        """Raise the error of an earlier step's batch that failed to load, unless the
        script read that step's loss (which raised it already)."""
        pending, self._loader_losses = self._loader_losses, []
        for k, (loss, seq, call) in enumerate(pending):
            if loss._id is None or getattr(loss, "_read_failed", False):
                continue
            rep = loss._conn.known([loss._id], seq)
            if rep is None:
                self._loader_losses.append((loss, seq, call))
            elif rep.failed[0]:
                self._loader_losses += pending[k + 1:]
                loss._read_failed = True
                raise_buffer_error(rep.errors[0], f"trainer.step call {call}, skipped (the "
                                   "weights and optimizer state stay as they were)")

    def _step(self, inputs: Any, targets: Any) -> Any:
        inputs, targets = plain_batch(inputs), plain_batch(targets)
        if not self._warned_fp16 and self.options.scaling is None and any(
                dt == torch.float16 for _, dt in torch_paths.autocast_state()):
            self._warned_fp16 = True
            warn_at_caller(
                "trainer.step runs under a float16 torch.autocast without loss scaling "
                "(a GradScaler cannot wrap a Trainer's step: its backward and update run "
                "on the workers), so small gradients underflow to zero: build the Trainer "
                "with precision='fp16' instead (float16 autocast with GradScaler's "
                "scaling inside the step; scaler= for its options)", UserWarning)
        follow.follow(self)
        modes = _modes(self._modules)
        if modes != self._modes:        # a module's .train()/.eval() since the last step
            self._modes = modes
            self._programs.clear()
        hyper, lrs = self._hyper()
        if isinstance(self.parallelism, Pipeline):
            loss = pipeline_step(self, inputs, targets, lrs, hyper)
        elif isinstance(self.parallelism, MultiIsland):
            loss = multi_island_step(self, inputs, targets, lrs, hyper)
        else:
            k = self.options.accumulate
            # counted once the step is queued: a step that fails before (a trace error,
            # a wrong batch, Ctrl-C while tracing) leaves the count, as torch's would
            micro = self.micro + 1
            last = micro == k
            s = self.slices[0]
            axis = getattr(self.parallelism, "batch_axis", None)
            key = "train_step" if k == 1 else ("accum_update" if last else "accumulate")
            prog = self._program(key, make_step_fn(self.model, self.loss_fn, self.opt,
                                                   self._groups, self.options, last=last))
            pending = None
            if last:
                hyper, lrs, pending = self._numbers(hyper, lrs)
            loss, created = prog(self.replicas[0], self.fixed[0], self.states[0],
                                 self.acc[0], lrs, _place_batch(inputs, s, axis),
                                 _place_batch(targets, s, axis), hyper, self._scaler)
            self.micro = 0 if last else micro
            self._store_created(0, created)
            self._advance(pending)
            if not last:
                return loss
        self.steps += 1
        self._version += 1
        self._step_clock = self._state_clock = follow.tick()
        if self._ema is not None:
            self._ema.update()
        for opt in fopt.members(self.optimizer):
            opt._opt_called = True      # what optimizer.step() tells torch's schedulers
        if self.scheduler is not None:
            self.scheduler.step()
        return loss

    @reads.internal
    def evaluate(self, inputs: Any, targets: Any = None) -> Any:
        """The loss on a batch in eval mode (no dropout, BatchNorm's running
        statistics, no gradients, no update), as a ``pw.Array`` at once (or loss_fn's
        whole result, as ``step`` returns it)."""
        _outside_trace("evaluate")
        self._check_open()
        inputs, targets = plain_batch(inputs), plain_batch(targets)
        follow.follow(self)
        buffers = self._buffer_ids()
        try:
            if isinstance(self.parallelism, Pipeline):
                return pipeline_eval(self, inputs, targets)
            s, axis = self.slices[0], getattr(self.parallelism, "batch_axis", None)
            prog = self._program("evaluate", make_eval_fn(self.model, self.loss_fn,
                                                          self.options))
            return prog(self.replicas[0], self.fixed[0], _place_batch(inputs, s, axis),
                        _place_batch(targets, s, axis))
        finally:
            self._buffers_updated(buffers)
            follow.after_call(self)

    @reads.internal
    def predict(self, inputs: Any) -> Any:
        """The model's outputs on a batch in eval mode, as ``pw.Array``s in the
        model's output structure (a tensor, a tuple, a dict, a ModelOutput)."""
        _outside_trace("predict")
        self._check_open()
        inputs = plain_batch(inputs)
        follow.follow(self)
        buffers = self._buffer_ids()
        try:
            if isinstance(self.parallelism, Pipeline):
                return pipeline_eval(self, inputs, None, outputs=True)
            s, axis = self.slices[0], getattr(self.parallelism, "batch_axis", None)
            prog = self._program("predict", make_predict_fn(self.model, self.options))
            return prog(self.replicas[0], self.fixed[0], _place_batch(inputs, s, axis))
        finally:
            self._buffers_updated(buffers)
            follow.after_call(self)

    def _buffer_ids(self) -> Dict[str, Optional[int]]:
        return {n: a._id for n, a in {**self.replicas[0], **self.fixed[0]}.items()}

    def _buffers_updated(self, before: Dict[str, Optional[int]]) -> None:
        """After ``evaluate``/``predict``: a forward that updates a buffer in eval mode
        (a call counter, a cache), or a parameter (an embedding's ``max_norm`` renorms
        the rows it looks up, in place), wrote it back on the workers, so the module's
        copy is stale: a read of the module then fetches it, as after a step. The
        optimizer's state did not change."""
        if any(a._id != before.get(n)
               for n, a in {**self.replicas[0], **self.fixed[0]}.items()):
            optimizer_current = self._opt_synced == self._version
            self._version += 1
            if optimizer_current:
                self._opt_synced = self._version

    # ------------------------------------------------------------------ state
    @reads.internal
    def state_dict(self) -> Dict[str, Any]:
        """Everything a resume needs, as ``save`` writes it, fetched to the client:
        parameters, buffers, optimizer state (``model``, ``optim``), the step count and
        random stream, the learning rates and the scheduler's state (``lrs``,
        ``scheduler``), and under ``accumulate=k`` the gradients summed so far and the
        position in the accumulation (``acc``, ``micro``). ``torch.save`` takes it::

            torch.save(trainer.state_dict(), "ckpt.pt")
            trainer2.load_state_dict(torch.load("ckpt.pt", weights_only=False))
        """
        follow.follow(self)
        sd = self._state()
        # as model.state_dict(): without the buffers registered persistent=False, so
        # that sd["model"] loads into the module with load_state_dict's strict check
        for n in _non_persistent(self.model):
            sd["model"].pop(n, None)
        side = self._side()
        side.pop("ema_n", None)             # the "ema" entry holds it
        sd.update(side)
        if self.options.accumulate > 1:
            sd["acc"] = {n: a.torch() for n, a in self.acc[0].items()}
        return sd

    def _state(self, only=None, optimizer: bool = True) -> Dict[str, Any]:
        """``state_dict()``, with the module's tensors limited to the names ``only``,
        and without the optimizer's state unless ``optimizer``."""
        model = {n: a.torch() for n, a in {**self.replicas[0], **self.fixed[0]}.items()
                 if only is None or n in only}
        if not optimizer:
            return {"model": model}
        return {
            "model": model,
            "optim": {n: {k: a.torch() for k, a in st.items()}      # frozen ones too
                      for n, st in {**self._parked[0], **self.states[0]}.items()},
            "steps": torch.tensor(self.steps),
            "rng": self._rng_tensor(),
            **({"ema": self._ema.state()} if self._ema is not None else {}),
            **({"scaler": {k: a.torch() for k, a in self._scaler.items()}}
               if self._scaler else {}),
            **({"numbers": copy.deepcopy(self._book.mirror),
                "group_tensors": {gk: a.torch() for gk, a in
                                  self._book.group_tensors.items()}} if self._book else {}),
        }

    def _rng_tensor(self) -> torch.Tensor:
        base = self.seeds.base - (1 << 64) if self.seeds.base >= 1 << 63 else self.seeds.base
        return torch.tensor([base, self.seeds.position], dtype=torch.int64)

    def _set_rng(self, t: torch.Tensor) -> None:
        base, position = (int(v) for v in t.tolist())
        self.seeds.restore(base, position)

    @reads.internal
    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Put a ``state_dict()`` back on the slices (layout as the strategy says)."""
        follow.follow(self, discard_stale=True)     # the layout the script made
        self._version += 1
        transient = _non_persistent(self.model)     # not in a state_dict: kept as they are
        for r, home_of in enumerate(self._homes):
            for n in self.replicas[r]:
                self.replicas[r][n] = put(sd["model"][n], home_of(n), self.param_specs[n])
            for n in self.fixed[r]:
                if n in sd["model"] or n not in transient:   # (a missing one: KeyError)
                    self.fixed[r][n] = put(sd["model"][n], home_of(n), self.param_specs[n])
            for n, st in self.states[r].items():
                for k in list(sd["optim"][n]):
                    t = sd["optim"][n][k]
                    st[k] = put(t, home_of(n), self._state_spec(n, t))
            for n in self._frozen():
                saved = sd["optim"].get(n)
                self._parked[r].pop(n, None)
                if saved:
                    self._parked[r][n] = {k: put(t, home_of(n), self._state_spec(n, t))
                                          for k, t in saved.items()}
        self.steps = int(sd["steps"])
        if "rng" in sd:
            self._set_rng(sd["rng"])
        if self._ema is not None and "ema" in sd:
            self._ema.load_state(sd["ema"])
        if self._scaler and "scaler" in sd:
            self._put_scalers({k: sd["scaler"][k] for k in self._scaler})
        follow.record(self, stale=True)    # the module's old values: replaced (a read fetches)
        if self._book is not None and "numbers" in sd:
            first = self.slices[0]
            self._book.group_tensors = {gk: put(t, first, P())
                                        for gk, t in sd.get("group_tensors", {}).items()}
        if self.options.accumulate > 1:
            # a state_dict without accumulators resumes at an accumulation boundary
            for r, home_of in enumerate(self._homes):
                for n, a in self.acc[r].items():
                    t = sd["acc"][n] if "acc" in sd else torch.zeros(a.shape, dtype=a.dtype)
                    self.acc[r][n] = put(t, home_of(n), self.param_specs[n])
        self._load_side(copy.deepcopy({k: v for k, v in sd.items() if k in _SIDE}))

    @property
    def grad_norm(self) -> Optional[Array]:
        """The total gradient norm of the last update, before clipping, as
        ``clip_grad_norm_`` returns it for logging (a 0-d ``pw.Array``: reading it waits
        for that step only); None before the first update or without ``max_grad_norm``.

        It is the norm the clipping measured: of the whole model (every FSDP shard,
        every pipeline stage), after ``max_grad_value``, of the unscaled gradients under
        ``precision="fp16"`` (inf or nan on an update skipped for overflow). To log it
        without clipping, pass ``max_grad_norm=float("inf")``, which scales nothing::

            tr = pw.Trainer(model, opt, loss_fn, slice=s, max_grad_norm=1.0)
            loss = tr.step(x, y)
            print(float(loss), float(tr.grad_norm))
        """
        return self._grad_norm

    @property
    def loss_scale(self) -> Optional[float]:
        """The loss scale of ``precision="fp16"`` now (``GradScaler.get_scale()``; it
        waits for the steps dispatched), or None without loss scaling."""
        return float(self._scaler["scale"].torch()) if self._scaler else None

    @reads.internal
    def sync_to(self, model: Optional[torch.nn.Module] = None) -> torch.nn.Module:
        """Copy the trained parameters and buffers back into ``model`` (default: the
        Trainer's own), the optimizer state into the torch optimizer and the loss scale
        into ``scaler=``, so that plain torch can go on where the Trainer stopped."""
        return self._sync(model, optimizer=True)

    def _sync(self, model: Optional[torch.nn.Module], optimizer: bool) -> torch.nn.Module:
        """``sync_to``; the optimizer's state only with ``optimizer`` (a read of the
        module needs the parameters alone: a third of the bytes under Adam)."""
        model = self.model if model is None else _uncompiled(model)
        # what the script changed since the last step goes to the workers first; a
        # change of a stale module (StaleModuleError at a step) is overwritten here
        follow.follow(self, discard_stale=model is self.model)
        version = self._version
        # the Trainer's own module gets what a step updated since it last agreed with
        # the workers; what no step writes (a frozen encoder, a GAN's discriminator
        # trained by another Trainer) is as current there as here
        only = self._watch.stale_names(self) if model is self.model else None
        optimizer = optimizer and model is self.model
        sd = self._state(only, optimizer=optimizer)
        # matched by name as if nothing were torch.compile'd (a compiled block adds
        # "_orig_mod."), so a compiled model syncs to a plain copy and back
        trained = {_plain(n): t for n, t in sd["model"].items()}
        ours = [(_plain(n), t) for n, t in
                list(model.named_parameters()) + list(model.named_buffers())]
        if only is not None:
            ours = [(n, t) for n, t in ours if n in trained]
        missing = [n for n, _ in ours if n not in trained]
        unexpected = sorted(set(trained) - {n for n, _ in ours})
        wrong = [f"{n}: {list(t.shape)} here, {list(trained[n].shape)} trained"
                 for n, t in ours if n in trained and t.shape != trained[n].shape]
        if missing or unexpected or wrong:
            raise PathwaysError(
                "sync_to: the module is not the one this Trainer trains "
                f"(missing from the Trainer: {missing[:5]}, not in the module: "
                f"{unexpected[:5]}, shapes: {wrong[:5]}); pass the model you built the "
                "Trainer with, or a copy of it")
        with torch.no_grad():
            for n, t in ours:
                t.copy_(trained[n])
        if optimizer:
            named = dict(self.model.named_parameters())
            for n, st in sd["optim"].items():
                if st:          # SGD without momentum keeps none: torch has no entry
                    self.optimizer.state[named[n]].update(
                        {k: v.clone() for k, v in st.items()})
            for n, held in sd.get("numbers", {}).items():
                self.optimizer.state[named[n]].update(held)
            for (gi, k), t in sd.get("group_tensors", {}).items():
                self.optimizer.param_groups[gi][k] = t
            if self._grad_scaler is not None and "scaler" in sd:
                self._grad_scaler.load_state_dict(dict(
                    self._grad_scaler.state_dict(), scale=float(sd["scaler"]["scale"]),
                    _growth_tracker=int(sd["scaler"]["growth"])))
            self._opt_synced = version
            self._watch.record_state(self)
        if model is self.model:
            self._synced = version
            follow.record(self)
        return model

    @reads.internal
    def _sync_if_stale(self, optimizer: bool = True) -> None:
        """What a read of the module (``optimizer=False``) or the optimizer
        (``state_dict()``, a forward on the CPU) sees: the trained values, as in a
        torch loop (see reads.py)."""
        stale = self._synced != self._version or (
            optimizer and self._opt_synced != self._version)
        if stale and not self._closed and not torch.compiler.is_compiling():
            follow.follow(self)     # a change of the stale module raises, not lost
            self._sync(None, optimizer=optimizer)

    def _check_open(self) -> None:
        if self._closed:
            raise ClusterShutdownError(
                "this pw.Trainer's slice was released or its cluster shut down; its "
                "trained values were copied into its module and optimizer first. Build "
                "a new pw.Trainer on a new slice to train on")

    def _sync_before_release(self, s) -> None:
        """One of this Trainer's slices is released: as before ``pw.shutdown()``."""
        if not self._closed and any(x is s for x in self.slices):
            self._sync_before_shutdown()

    @reads.internal
    def _sync_before_shutdown(self) -> None:
        """``pw.shutdown()`` ends the workers that hold the trained values: copy them
        into the module first, so a script that saves after shutting down saves them."""
        try:
            if self._version != self._synced or self._version != self._opt_synced:
                self.sync_to()
            if self._ema is not None:
                self._ema._sync_if_stale()
        except Exception as e:
            raise PathwaysError(
                f"pw.Trainer could not copy its trained values into its module ({e}): "
                "the module keeps the values of its last sync; call trainer.sync_to() "
                "before pw.shutdown()") from e
        finally:
            self._closed = True

    @reads.internal
    def save(self, path: str) -> None:
        """Write the state in the torch.distributed.checkpoint format (a directory).

        Each slice's executor writes the parameters, buffers and optimizer state it
        holds; only the metadata passes through the client. ``trainer.json`` beside them
        holds the learning rates and the scheduler's state. Plain PyTorch reads the tensors::

            trainer.save("ckpt")
            sd = {"model": {n: torch.empty_like(p) for n, p in model.state_dict().items()},
                  "optim": {...}, "steps": torch.tensor(0)}
            torch.distributed.checkpoint.load(sd, checkpoint_id="ckpt")
        """
        follow.follow(self)
        arrays = {f"model.{n}": a for n, a in {**self.replicas[0], **self.fixed[0]}.items()}
        for n, st in {**self._parked[0], **self.states[0]}.items():     # frozen ones too
            arrays.update({f"optim.{n}.{k}": a for k, a in st.items()})
        for n, a in self.acc[0].items():
            arrays[f"acc.{n}"] = a
        home = self._homes[0]
        first = next(iter(self.replicas[0]))
        arrays["steps"] = put(torch.tensor(self.steps), home(first), P())
        for (gi, k), a in (self._book.group_tensors.items() if self._book else ()):
            arrays[f"optim_group.{gi}.{k}"] = a
        arrays["rng"] = put(self._rng_tensor(), home(first), P())
        arrays.update({f"scaler.{k}": a for k, a in self._scaler.items()})
        if self._ema is not None:
            arrays.update(self._ema.checkpoint_arrays())
        save_arrays(path, arrays)
        side = self._side()
        side["scheduler"] = _jsonable(side["scheduler"])
        with open(os.path.join(path, "trainer.json"), "w") as f:
            json.dump(side, f)

    def _side(self) -> Dict[str, Any]:
        """The state that lives on the client (``_SIDE``): the accumulation position,
        the learning rates the scheduler wrote, its state, a generic optimizer's
        numbers. ``save`` writes it as trainer.json, ``state_dict`` holds it."""
        side = {"micro": self.micro,
                "lrs": [float(g["lr"]) for g in self.optimizer.param_groups],
                "scheduler": copy.deepcopy(self.scheduler.state_dict())
                if self.scheduler is not None else None}
        if self._ema is not None:
            side["ema_n"] = self._ema.n
        if self._book is not None:      # a generic optimizer's numbers (numbers.py)
            side["numbers"] = copy.deepcopy(self._book.mirror)
            side["group_numbers"] = [{k: v for k, v in g.items() if numbers.is_number(v)}
                                     for g in self.optimizer.param_groups]
        return side

    def _load_side(self, side: Dict[str, Any]) -> None:
        """Put back what ``_side`` gave (missing keys: a fresh accumulation, the
        learning rates and scheduler as they are)."""
        self.micro = int(side.get("micro", 0))
        for g, lr in zip(self.optimizer.param_groups, side.get("lrs", ())):
            g["lr"] = lr                      # what the scheduler had written
        if self._book is not None and "numbers" in side:
            self._book.mirror = side["numbers"]
            for g, held in zip(self.optimizer.param_groups, side.get("group_numbers", ())):
                g.update(held)
        if self.scheduler is not None and side.get("scheduler") is not None:
            self.scheduler.load_state_dict(side["scheduler"])

    @reads.internal
    def load(self, path: str) -> None:
        """Read a checkpoint written by ``save`` (or by torch.distributed.checkpoint with
        the same keys); the executors read their parts from the files directly."""
        follow.follow(self, discard_stale=True)     # the layout the script made
        self._version += 1
        frozen = self._frozen()
        saved = checkpoint_entries(path)

        def optim_keys(n):
            return {key[len(f"optim.{n}."):]: saved[key] for key in saved
                    if key.startswith(f"optim.{n}.") and "." not in key[len(f"optim.{n}."):]}
        # a frozen parameter's optimizer state, if it had some when saved
        parked = {n: optim_keys(n) for n in frozen}
        # state a step creates (SGD's momentum with dampening, a generic optimizer's
        # whole state) is in the checkpoint but not yet in a fresh Trainer
        extra = {n: {k: v for k, v in optim_keys(n).items() if k not in self.states[0][n]}
                 for n in self.states[0]}
        groups = {key: v for key, v in saved.items() if key.startswith("optim_group.")}
        side_path = os.path.join(path, "trainer.json")
        side = {}
        if os.path.exists(side_path):
            with open(side_path) as f:
                side = json.load(f)
        for r, home_of in enumerate(self._homes):
            wanted = {}
            for n, a in self.replicas[r].items():
                wanted[f"model.{n}"] = (home_of(n), a.shape, a.dtype, self.param_specs[n])
            for n, a in self.fixed[r].items():
                wanted[f"model.{n}"] = (home_of(n), a.shape, a.dtype, self.param_specs[n])
            for n, st in self.states[r].items():
                for k, a in st.items():
                    wanted[f"optim.{n}.{k}"] = (home_of(n), a.shape, a.dtype,
                                                self._state_spec(n, a))
            for n, a in self.acc[r].items():
                wanted[f"acc.{n}"] = (home_of(n), a.shape, a.dtype, self.param_specs[n])
            for n, ks in {**parked, **extra}.items():
                for k, (shape, dtype) in ks.items():
                    wanted[f"optim.{n}.{k}"] = (home_of(n), shape, dtype, self._state_spec(
                        n, torch.empty(shape, device="meta")))
            if r == 0:
                first = next(iter(self.replicas[0]))
                wanted["steps"] = (home_of(first), torch.Size([]), torch.int64, P())
                for key, (shape, dtype) in groups.items():
                    wanted[key] = (home_of(first), shape, dtype, P())
                if side:
                    wanted["rng"] = (home_of(first), torch.Size([2]), torch.int64, P())
                if self._ema is not None and "ema_n" in side:
                    wanted.update(self._ema.wanted())
            if self._scaler and "scaler.scale" in saved:     # with every replica
                wanted.update({f"scaler.{k}": (home_of(next(iter(self.replicas[r]))),
                                               a.shape, a.dtype, P())
                               for k, a in self._scaler.items()})
            got = load_arrays(path, wanted)
            for n in self.replicas[r]:
                self.replicas[r][n] = got[f"model.{n}"]
            for n in self.fixed[r]:
                self.fixed[r][n] = got[f"model.{n}"]
            for n, st in self.states[r].items():
                for k in list(st) + list(extra.get(n, ())):
                    st[k] = got[f"optim.{n}.{k}"]
            for n in self.acc[r]:
                self.acc[r][n] = got[f"acc.{n}"]
            for n, ks in parked.items():
                self._parked[r].pop(n, None)
                if ks:
                    self._parked[r][n] = {k: got[f"optim.{n}.{k}"] for k in ks}
            if r == 0:
                if groups:
                    self._book.group_tensors = {
                        (int(key.split(".")[1]), key.split(".", 2)[2]): got[key]
                        for key in groups}
                self.steps = int(got["steps"].torch())
                if "rng" in got:
                    self._set_rng(got["rng"].torch())
                if self._ema is not None and "ema_n" in side:
                    self._ema.loaded(got, int(side["ema_n"]))
            if self._scaler and "scaler.scale" in saved:
                self._scalers[r] = {k: got[f"scaler.{k}"] for k in self._scaler}
        if self._scaler and "scaler.scale" not in saved:    # saved without loss scaling
            self._put_scalers(scaling.initial(self._grad_scaler))
        elif self._scaler and isinstance(self.parallelism, Pipeline):
            self._put_scalers(self._scaler)         # the first stage's, to every stage
        self._load_side(side)
        follow.record(self, stale=True)    # the module's old values: replaced (a read fetches)

    # ------------------------------------------------------------------ elastic training
    def fit(self, data: Any, *, steps: Optional[int] = None,
            checkpoint_dir: Optional[str] = None, checkpoint_every: int = 100,
            max_restarts: int = 0, on_step: Optional[Callable[[int, float], Any]] = None,
            wait_timeout: float = 300.0, keep_checkpoints: Optional[int] = 2,
            progress: bool = True, resume: bool = False) -> "elastic.FitResult":
        """Train on ``data`` for ``steps`` steps, checkpointing, and resume elastically
        when a worker is lost; returns the losses of the steps run, as a ``FitResult``
        (a list of floats with the run's metrics as attributes).

        ``data`` gives the batch of each step: a pair ``(inputs, targets)``, or a dict
        (any Mapping, e.g. a Hugging Face batch) that is the inputs, labels included,
        stepped as ``step(batch, None)`` (use ``loss_fn=None`` so the model's ``.loss``
        is the loss). ``i`` counts from 0 (from the checkpoint's step with
        ``resume=True``):

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
        restart it sees the replayed steps again.

        Progress: a tqdm bar on stderr over the steps (its total is ``steps`` where
        known), advanced as each step's loss is read back, shows the steps/s, the last
        loss and the samples/s (dimension 0 of the first tensor of the inputs) and
        tokens/s (the elements of ``input_ids`` in a dict batch, else of the first
        integer 2-D tensor of the inputs), and ``restarts=`` after a lost worker, when
        it goes back to the checkpoint's step for the replay. ``progress=False``, or
        ``PATHWAYS_PROGRESS=0`` in the environment, turns it off.

        ``resume=True`` (needs ``checkpoint_dir``) is for a restarted script: when
        ``checkpoint_dir/latest.json`` exists, fit loads that checkpoint into this
        Trainer (parameters, buffers, optimizer state, step counter, RNG position,
        scheduler, and the learning rates from the sidecar) and goes on with the step
        after it: a callable or a sequence is indexed from the checkpoint's step on
        (``data(6)``, ``data(7)``, ... after the checkpoint of step 6), a plain iterable
        has that many batches drawn and dropped first (give it the same batches in the
        same order), ``on_step`` counts on (7, 8, ...) and ``steps`` is still the total
        (``steps=10`` runs steps 7..10). Without ``latest.json`` fit starts from step 0.
        The earlier run's checkpoints count towards ``keep_checkpoints``.

        The returned ``FitResult`` is a list of the losses of the steps run in this call
        (after ``resume=True``, those after the checkpoint only; steps replayed after a
        lost worker appear once). Its attributes: ``steps`` (steps run, replays not
        counted), ``time_s`` (the call's wall time, compiles, checkpoints and restarts
        included), ``steps_per_s``, ``samples_per_s``, ``tokens_per_s`` (``None`` when
        unknown), ``restarts`` and ``resumed_from`` (the checkpoint's step that
        ``resume=True`` went on from, else ``None``). Example::

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


def _uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module that ``torch.compile(model)`` wraps (the same parameters, named as
    in the model itself); XLA compiles the whole step, so the wrapper adds nothing."""
    if "torch._dynamo" not in sys.modules:      # nothing was compiled
        return model
    from torch._dynamo.eval_frame import OptimizedModule
    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model


class _Schedulers:
    """A list of schedulers (one per optimizer of a list) stepped and saved together."""

    def __init__(self, schedulers) -> None:
        self.schedulers = list(schedulers)

    def step(self) -> None:
        for sch in self.schedulers:
            sch.step()

    def state_dict(self) -> Dict[str, Any]:
        return {"schedulers": [sch.state_dict() for sch in self.schedulers]}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        for sch, one in zip(self.schedulers, sd["schedulers"]):
            sch.load_state_dict(one)


def _refuse_process_wrappers(model: torch.nn.Module) -> None:
    """torch's FullyShardedDataParallel (FSDP1) gathers its flat parameters with
    collectives between processes, which a traced step cannot run: refused at once,
    saying what pw does instead (it failed in the trace with an assertion about the
    meta device). DistributedDataParallel without collectives in its forward runs."""
    if any(type(m).__name__ == "FullyShardedDataParallel" and
           type(m).__module__.startswith("torch.distributed") for m in model.modules()):
        raise PathwaysError(
            "the model is wrapped in torch's FullyShardedDataParallel, whose collectives "
            "between processes cannot run in a traced step: pass pw.Trainer the plain "
            "module (before wrapping), with parallelism=pw.FullyShardedDataParallel "
            "(pw.FSDP), which shards it over the slice's devices")


def _refuse_shared_storage(named: Dict[str, torch.Tensor]) -> None:
    """Two parameter objects over one storage (``head.weight = nn.Parameter(
    emb.weight)``, or ``head.weight.data = emb.weight.data``): torch's optimizer updates
    the storage through both, each with its own gradient, so they stay one tensor. The
    workers hold each parameter as its own Array, which would untie them, silently:
    refused, saying how to tie them as torch ties modules."""
    seen: Dict[int, List[Tuple[int, int, str]]] = {}
    for n, p in named.items():
        if p.numel() == 0 or p.device.type != "cpu":
            continue
        if type(p.data) is not torch.Tensor:        # a DTensor: torch's fully_shard
            raise PathwaysError(
                f"parameter {n!r} is a {type(p.data).__name__} (torch's fully_shard or "
                "another distributed wrapper sharded it): pass pw.Trainer the plain "
                "module, before sharding it; parallelism=pw.FullyShardedDataParallel "
                "(pw.FSDP) shards it over the slice's devices")
        start = p.data_ptr()
        end = start + p.numel() * p.element_size()   # (a slice's elements lie within)
        others = seen.setdefault(p.untyped_storage().data_ptr(), [])
        hit = next((o for a, b, o in others if a < end and start < b), None)
        others.append((start, end, n))
        if hit is not None:
            raise PathwaysError(
                f"parameters {hit!r} and {n!r} are two Parameters over one storage "
                "(nn.Parameter(other.weight), or .data assigned from another parameter): "
                "torch updates that storage through both, and pw.Trainer would train them "
                f"apart. Tie them as one Parameter (model.{n} = model.{hit}, which "
                "torch and pw.Trainer train as one, its gradients summed), or give the "
                "second its own copy (.clone())")


def _outside_trace(what: str) -> None:
    """A Trainer call made while another program is traced (a ``loss_fn`` calling a
    teacher's ``trainer.predict``) cannot run inside that program: refused, saying
    where to call it instead (it failed on a tensor subclass's ``.numpy()``)."""
    if tracing_now():
        raise TraceError(
            f"trainer.{what} was called while a step was being traced (from a loss_fn, a "
            "forward or a hook): a step is one program, and another Trainer's work cannot "
            "run inside it. Call it before the step (teacher_out = "
            "teacher_trainer.predict(x)) and pass its result in, as targets or beside "
            "the inputs")


def _refuse_outside_parameters(optimizer, named: Dict[str, Any], loss_fn) -> None:
    """The optimizer holds parameters the model does not (a loss module's learnable
    temperature, uncertainty weights in a param group of their own): a step computes
    the gradients of the model's parameters only, so these would stay as they are
    while torch trains them. Refused, saying how to make them the model's."""
    mine = {id(p) for p in named.values()}
    outside = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
    if not outside:
        return
    by_loss = {}
    if isinstance(loss_fn, torch.nn.Module):
        by_loss = {id(p): n for n, p in loss_fn.named_parameters()}
    said = [f"loss_fn's {by_loss[id(p)]!r}" if id(p) in by_loss
            else f"a {str(p.dtype).replace('torch.', '')}{list(p.shape)} parameter"
            for p in outside[:3]]
    raise PathwaysError(
        f"the optimizer holds {len(outside)} parameter(s) that are not the model's "
        f"({', '.join(said)}{', ...' if len(outside) > 3 else ''}): pw.Trainer trains "
        "the parameters of the model it is given, so these would never change. Make "
        "them the model's: a loss module with parameters as a submodule of the model "
        "(model.criterion = criterion, and pass model.criterion as loss_fn; not on an "
        "nn.Sequential, which would run it as a layer), a free "
        "nn.Parameter registered on it (model.register_parameter('log_vars', p)) and "
        "read through it in loss_fn (model.log_vars)")


# The keys of ``Trainer._side``: client-side state that ``state_dict`` holds beside the
# arrays, and ``save`` writes as trainer.json.
_SIDE = ("micro", "lrs", "scheduler", "numbers", "group_numbers")


def _non_persistent(model: torch.nn.Module) -> set:
    """The names of ``model``'s buffers registered with ``persistent=False``."""
    return {f"{prefix}.{b}" if prefix else b for prefix, mod in model.named_modules()
            for b in mod._non_persistent_buffers_set}


def _plain(name: str) -> str:
    return name.replace("_orig_mod.", "")


def _jsonable(value):
    """A scheduler's state_dict as JSON (what cannot be written, a lambda, is left out:
    torch's own state_dict leaves LambdaLR's functions out the same way)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items() if _is_jsonable(v)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value if _is_jsonable(v)]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value


def _is_jsonable(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, dict, list, tuple,
                                       torch.Tensor))
