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
from .programs import _make_apply_fn


def pipeline_step(trainer, inputs, targets, sc, hyper) -> Array:
    """One GPipe step of ``trainer`` (a Pipeline Trainer); returns the mean loss."""
    m = trainer.parallelism.microbatches
    xs, ys = _split(inputs, m, "microbatches"), _split(targets, m, "microbatches")
    stages, slices = trainer._stages, trainer.slices
    last = len(stages) - 1
    params = [{n: trainer.replicas[0][n] for n in trainer.replicas[0]
               if n.split(".", 1)[0] in names} for _, names in stages]
    fixed = [{n: t for n, t in trainer.fixed[0].items() if n.split(".", 1)[0] in names}
             for _, names in stages]
    fwd = [trainer._program(f"stage{k}_fwd", _make_stage_fwd(mod, k == 0))
           for k, (mod, _) in enumerate(stages)]
    bwd = [trainer._program(f"stage{k}_bwd", _make_stage_bwd(mod, k == 0))
           for k, (mod, _) in enumerate(stages[:-1])]
    last_bwd = trainer._program("last_bwd", _make_last_bwd(stages[-1][0], trainer.loss_fn, m,
                                                           last == 0))
    apply_prog = trainer._program("apply", _make_apply_fn(trainer._group_of), donate=(0, 1))
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
                                           acc[last] if acc[last] is not None else {})
            losses.append(loss)
            for k in reversed(range(last)):
                gy = gx.to(slices[k])
                gx, acc[k] = bwd[k](params[k], fixed[k], acts[j][k], saved[j][k], gy,
                                    acc[k] if acc[k] is not None else {})
                saved[j][k] = None
        new_params, new_states = {}, {}
        for k in range(len(stages)):
            st = {n: trainer.states[0][n] for n in params[k]}
            p, s = apply_prog(params[k], st, sc, [acc[k]], hyper)
            new_params.update(p)
            new_states.update(s)
        trainer.replicas[0], trainer.states[0] = new_params, new_states
        loss = mean_prog(losses)
    return loss


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
