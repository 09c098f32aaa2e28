"""``pw.Pipeline``: GPipe over several slices, one recorded dataflow graph per step.

An nn.Sequential is split into stages, one per slice. A step runs every microbatch's
forward through the stages, then every backward in reverse, accumulating each stage's
gradients on its slice, then each stage's optimizer update; the stage backwards reuse the
activations their forwards saved (``_Stash``) instead of recomputing them.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..client.array import Array
from ..client.graph import graph
from ..errors import PathwaysError
from ..parallel.strategies import Pipeline
from .batches import _place_batch, _split
from . import scaling
from .programs import (alone, autocast, clip_coef, grad_hooks, grad_square_sum,
                       loss_and_rest, make_apply_fn, mode, reparametrized, requires_grad,
                       returned)


def pipeline_step(trainer, inputs, targets, lrs, hyper) -> Array:
    """One GPipe step of ``trainer`` (a Pipeline Trainer); returns the mean loss."""
    m = trainer.parallelism.microbatches
    xs, ys = _split(inputs, m, "microbatches"), _split(targets, m, "microbatches")
    stages, slices = trainer._stages, trainer.slices
    last = len(stages) - 1
    params = [{n: trainer.replicas[0][n] for n in trainer.replicas[0]
               if n.split(".", 1)[0] in names} for _, names in stages]
    fixed = [{n: t for n, t in trainer.fixed[0].items() if n.split(".", 1)[0] in names}
             for _, names in stages]
    options = trainer.options
    fwd = [trainer._program(f"stage{k}_fwd", _make_stage_fwd(mod, k == 0, options))
           for k, (mod, _) in enumerate(stages)]
    bwd = [trainer._program(f"stage{k}_bwd", _make_stage_bwd(mod, k == 0, trainer.model,
                                                             options))
           for k, (mod, _) in enumerate(stages[:-1])]
    last_bwd = trainer._program("last_bwd", _make_last_bwd(stages[-1][0], trainer.loss_fn, m,
                                                           last == 0, trainer.model, options))
    # precision="fp16": each stage holds a copy of the loss scale (the last scales the
    # loss with it, every stage unscales its own gradients), all updated alike
    scalers = [trainer._scalers[k] or None for k in range(len(stages))]
    apply_prog = trainer._program("apply", make_apply_fn(trainer.opt, trainer._groups,
                                                         trainer.options))
    mean_prog = trainer._program("mean", lambda ls: torch.stack(ls).sum() / len(ls))
    with graph():
        # GPipe: all forwards, microbatch by microbatch through the stages ...
        acts = [[None] * (len(stages)) for _ in range(m)]      # stage inputs
        saved = [[None] * (len(stages)) for _ in range(m)]     # what backward needs
        for j in range(m):
            h = _place_batch(xs[j], slices[0], None)
            for k in range(len(stages)):
                h = h if k == 0 else h.to(slices[k])
                acts[j][k] = h
                if k < last:
                    h, saved[j][k] = fwd[k](params[k], fixed[k], h)
        # ... then all backwards, in reverse, accumulating gradients per stage.
        acc: List[Optional[dict]] = [None] * len(stages)
        losses = []
        for j in reversed(range(m)):
            y = _place_batch(ys[j], slices[last], None)
            gx, acc[last], loss = last_bwd(params[last], fixed[last], acts[j][last], y,
                                           acc[last] if acc[last] is not None else {},
                                           scalers[last])
            losses.append(loss)
            for k in reversed(range(last)):
                gy = gx.to(slices[k])
                gx, acc[k] = bwd[k](params[k], fixed[k], acts[j][k], saved[j][k], gy,
                                    acc[k] if acc[k] is not None else {})
                saved[j][k] = None
        verdicts = [{}] * len(stages)
        if options.max_grad_norm is not None or options.scaling:
            # clip_grad_norm_'s norm and GradScaler's found_inf are over the whole model:
            # every stage's part meets on the first stage's slice, and the clipping
            # factor and whether to skip go back to each stage
            check = trainer._program("grad_check", _make_grad_check(options))
            parts = [check(acc[k], scalers[k]) for k in range(len(stages))]
            combine = trainer._program("grad_combine", _make_combine(options))
            both = combine([_moved(p, slices[0]) for p in parts])
            verdicts = [_moved({k: a for k, a in both.items() if k != "norm"}, s)
                        for s in slices]
            if "norm" in both:
                trainer._grad_norm = both["norm"]
        created = []
        for k in range(len(stages)):
            st = {n: trainer.states[0][n] for n in params[k]}
            # parameters and state are updated in place (written back to their Arrays)
            created.append(apply_prog(params[k], st, lrs, [acc[k]], hyper,
                                      verdicts[k].get("coef"), scalers[k],
                                      verdicts[k].get("found")))
        loss = mean_prog(losses)
    for c in created:       # (under loss scaling, kept if the update was not skipped:
        trainer._store_created(0, c)        # a read, after the graph is submitted)
    return loss


def _make_grad_check(options):
    """A stage's part of what is decided over every stage's gradients: the square sum
    for clip_grad_norm_, and under loss scaling whether any overflowed, both of the
    unscaled gradients (GradScaler.unscale_ comes before clipping)."""
    value = options.max_grad_value

    def grad_check(grads, scaler):
        out = {}
        if options.scaling:
            grads, out["found"] = scaling.unscale(grads, scaler)
        if options.max_grad_norm is not None:
            out["sq"] = grad_square_sum(grads, None if value is None else float(value))
        return out
    return grad_check


def _make_combine(options):
    """The stages' parts combined: the clipping factor, and found_inf if any overflowed."""
    def grad_combine(parts):
        out = {}
        if options.max_grad_norm is not None:
            out["norm"] = torch.stack([p["sq"] for p in parts]).sum().sqrt()
            out["coef"] = clip_coef(out["norm"], float(options.max_grad_norm))
        if options.scaling:
            out["found"] = torch.stack([p["found"] for p in parts]).amax()
        return out
    return grad_combine


def _moved(arrays: Dict[str, Array], slice_) -> Dict[str, Array]:
    return {k: a if a.slice is slice_ else a.to(slice_) for k, a in arrays.items()}


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
    stages = [(model[a:b], names[a:b]) for a, b in bounds]
    _refuse_shared(model, stages)
    return stages


def _refuse_shared(model: torch.nn.Module, stages) -> None:
    """A parameter or buffer two stages hold (a language model's tied input and output
    embeddings) would have two homes, each updated with half its gradient: refused
    with what to do."""
    owner: Dict[int, tuple] = {}
    for k, (mod, _) in enumerate(stages):
        for n, t in list(mod.named_parameters(remove_duplicate=False)) + \
                list(mod.named_buffers(remove_duplicate=False)):
            first = owner.setdefault(id(t), (k, n))
            if first[0] != k:
                raise PathwaysError(
                    f"{first[1]!r} (stage {first[0]}) and {n!r} (stage {k}) are one "
                    "tensor, shared by two pipeline stages (tied weights); pw.Pipeline "
                    "keeps each parameter on one stage's slice. Untie them (give the "
                    "second layer a copy: nn.Parameter(t.detach().clone())), or choose "
                    "stage bounds (stages=[(0, a), (a, b), ...]) that keep both layers "
                    "in one stage")


def _stage(mod, params, fixed):
    """The stage reparametrized for a forward and its backward (see programs.py)."""
    # A stage is model[a:b]: its parameter names are the full model's ("3.weight"), and
    # a slice of an nn.Sequential keeps the children's names, so they line up.
    return reparametrized(mod, {**params, **fixed})


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


def _make_stage_fwd(mod, first: bool, options):
    """A stage's forward (under the precision's autocast, as the whole model's would
    run); also returns the tensors its backward needs (see _Stash)."""
    def stage_fwd(params, fixed, x):
        for t in params.values():
            t.requires_grad_()
        if not first:
            x = x.requires_grad_()
        stash = _Stash(x, params)
        with stash.hooks(), mode(mod, True), _stage(mod, params, fixed), autocast(options):
            y = mod(x)
        return y.detach(), [t.detach() for t in stash.recorded]
    return stage_fwd


def _accumulate(acc, names, grads):
    return {n: (acc[n] + g if n in acc else g) for n, g in zip(names, grads)}


def _make_stage_bwd(mod, first: bool, model, options):
    """Backpropagate ``gy`` through the stage with the forward's saved tensors;
    accumulate the parameters' gradients."""
    def stage_bwd(params, fixed, x, saved, gy, acc):
        names = list(params)
        requires_grad(params, grad_hooks(model))
        leaves = [params[n] for n in names]
        if not first:
            x = x.requires_grad_()
        # the forward program updated the buffers already (BatchNorm): not twice
        fixed = {n: t.clone() for n, t in fixed.items()}
        wrt = leaves if first else [x] + leaves
        with mode(mod, True), _stage(mod, params, fixed):
            with _Stash(x, params, saved).hooks(), autocast(options):
                y = mod(x)
            grads = torch.autograd.grad(y, wrt, grad_outputs=gy)
        gx = torch.zeros((), dtype=y.dtype) if first else grads[0]
        return gx, _accumulate(acc, names, grads if first else grads[1:])
    return stage_bwd


def _make_last_bwd(mod, loss_fn, microbatches: int, first: bool, model, options):
    """The last stage: forward, loss / microbatches (times the loss scale, with one:
    ``scaler.scale(loss / m).backward()``), backward; accumulate grads."""
    def last_bwd(params, fixed, x, targets, acc, scaler=None):
        names = list(params)
        requires_grad(params, grad_hooks(model))
        leaves = [params[n] for n in names]
        if not first:
            x = x.requires_grad_()
        wrt = leaves if first else [x] + leaves
        with mode(mod, True), _stage(mod, params, fixed):
            with autocast(options):
                loss = alone(*loss_and_rest(mod(x), targets, loss_fn), "a Pipeline")
            if loss.dtype in (torch.float16, torch.bfloat16):
                loss = loss.float()     # reported in float32, as a whole model's step
            part = loss / microbatches
            grads = torch.autograd.grad(
                scaling.scale_loss(part, scaler) if options.scaling else part, wrt)
        gx = torch.zeros((), dtype=loss.dtype) if first else grads[0]
        return gx, _accumulate(acc, names, grads if first else grads[1:]), loss.detach()
    return last_bwd


def pipeline_eval(trainer, inputs, targets, outputs: bool = False):
    """The whole batch through the stages in eval mode: the loss, or (``outputs``) the
    last stage's outputs."""
    stages, slices = trainer._stages, trainer.slices
    h = _place_batch(inputs, slices[0], None)
    with graph():
        options = trainer.options
        for k, (mod, names) in enumerate(stages):
            params = {n: a for n, a in trainer.replicas[0].items()
                      if n.split(".", 1)[0] in names}
            fixed = {n: a for n, a in trainer.fixed[0].items() if n.split(".", 1)[0] in names}
            h = h if k == 0 else h.to(slices[k])
            final = k == len(stages) - 1
            if final and not outputs:
                prog = trainer._program("eval_last", _make_stage_eval(mod, trainer.loss_fn,
                                                                      True, options))
                return prog(params, fixed, h, _place_batch(targets, slices[k], None))
            prog = trainer._program(f"stage{k}_eval",
                                    _make_stage_eval(mod, None, False, options))
            h = prog(params, fixed, h, None)
    return h


def _make_stage_eval(mod, loss_fn, with_loss: bool, options):
    def stage_eval(params, fixed, x, targets):
        with mode(mod, False), torch.no_grad(), _stage(mod, params, fixed), \
                autocast(options):
            y = mod(x)
            if not with_loss:
                return y
            loss, rest = loss_and_rest(y, targets, loss_fn)
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return returned(loss, rest)
    return stage_eval
