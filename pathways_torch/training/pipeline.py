"""``pw.Pipeline``: GPipe over several slices, one recorded dataflow graph per step.

An nn.Sequential is split into stages, one per slice. A step runs every microbatch's
forward through the stages, then every backward in reverse, accumulating each stage's
gradients on its slice, then each stage's optimizer update; the stage backwards reuse the
activations their forwards saved (``_Stash``) instead of recomputing them.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..client.array import Array
from ..client.graph import graph
from ..errors import PathwaysError, TraceError
from ..parallel.strategies import Pipeline
from ..sharding import P
from .batches import _axis_size, _moved, _place_batch, split_pair
from . import scaling
from .programs import (alone, autocast, clip_coef, grad_hooks, grad_square_sum,
                       loss_and_rest, make_apply_fn, mode, reparametrized, requires_grad,
                       returned, with_inner_backward)


def pipeline_step(trainer, inputs, targets, lrs, hyper) -> Array:
    """One GPipe step of ``trainer`` (a Pipeline Trainer); returns the mean loss."""
    m = trainer.parallelism.microbatches
    xs, ys = split_pair(inputs, targets, m, "microbatches")
    stages, slices = trainer._stages, trainer.slices
    axis = trainer.parallelism.axis
    last = len(stages) - 1
    own = _own_tensors(trainer, trainer.replicas[0])
    fixed = _own_tensors(trainer, trainer.fixed[0])
    options = trainer.options
    tied = {c for tie in trainer._ties for c in tie.values()}
    hooked = tied and set(grad_hooks(trainer.model)) & tied
    if hooked:
        raise PathwaysError(
            f"{sorted(hooked)[0]!r} is shared by two pipeline stages and has a hook "
            "(register_hook), which torch runs once on its whole gradient; each stage "
            "computes a part of it. Remove the hook or untie the parameter")
    # per_program > 1: each stage program computes a group of micro-batches in turn
    # and a group's activations (and their gradients) move stacked, in one transfer
    g = trainer.parallelism.per_program
    group = (lambda one, **kw: one) if g == 1 else _in_turn
    sfx = "" if g == 1 else f"_x{g}"
    fwd = [trainer._program(f"stage{k}_fwd{sfx}", group(
               _make_stage_fwd(mod, k == 0, trainer.model, options), first=k == 0))
           for k, (mod, _) in enumerate(stages)]
    bwd = [trainer._program(f"stage{k}_bwd{sfx}", group(
               _make_stage_bwd(mod, k == 0, trainer.model, options, m), first=k == 0))
           for k, (mod, _) in enumerate(stages[:-1])]
    last_bwd = trainer._program(f"last_bwd{sfx}", group(
        _make_last_bwd(stages[-1][0], trainer.loss_fn, m, last == 0, trainer.model,
                       options), first=last == 0))
    # precision="fp16": each stage holds a copy of the loss scale (the last scales the
    # loss with it, every stage unscales its own gradients), all updated alike
    scalers = [trainer._scalers[k] or None for k in range(len(stages))]
    apply_prog = trainer._program("apply", make_apply_fn(trainer.opt, trainer._groups,
                                                         trainer.options))
    mean_prog = trainer._program("mean", lambda ls: torch.stack(ls).sum() / len(ls)) \
        if g == 1 else trainer._program("mean_groups", lambda ls: torch.cat(ls).sum() / m)
    dim = 0 if g == 1 else 1        # a group's tensors are stacked on a new dimension 0

    def placed(parts, j, slice_):
        """Unit j's (a micro-batch's, or a group's list of) batch parts on ``slice_``."""
        if g == 1:
            return _place_batch(parts[j], slice_, axis)
        return [_place_batch(parts[i], slice_, axis) for i in range(j * g, (j + 1) * g)]
    with graph():
        # a parameter shared by two stages (tied embeddings) lives on its home stage;
        # each other stage that uses it gets a copy for this step
        params = [dict(p) for p in own]
        _lend_tied(trainer, params, fixed)
        # GPipe: all forwards, microbatch by microbatch through the stages ...
        units = m // g
        acts = [[None] * (len(stages)) for _ in range(units)]      # stage inputs
        saved = [[None] * (len(stages)) for _ in range(units)]     # what backward needs
        for j in range(units):
            h = placed(xs, j, slices[0])
            for k in range(len(stages)):
                h = h if k == 0 else _batch_to(h, slices[k], axis, dim)
                acts[j][k] = h
                if k < last:
                    h, saved[j][k] = fwd[k](params[k], fixed[k], h)
        # ... then all backwards, accumulating gradients per stage. In micro-batch
        # order: the last stage computes its forward inside its backward program, so
        # its buffers (BatchNorm's running statistics) move in the order torch's loop
        # over micro-batches moves them.
        acc: List[Optional[dict]] = [None] * len(stages)
        losses = []
        for j in range(units):
            y = placed(ys, j, slices[last])
            gx, acc[last], loss = last_bwd(params[last], fixed[last], acts[j][last], y,
                                           acc[last] if acc[last] is not None else {},
                                           scalers[last])
            losses.append(loss)
            for k in reversed(range(last)):
                gy = _batch_to(gx, slices[k], axis, dim)
                gx, acc[k] = bwd[k](params[k], fixed[k], acts[j][k], saved[j][k], gy,
                                    acc[k] if acc[k] is not None else {})
                saved[j][k] = None
        redrawn = [k for k in range(last) if bwd[k].draws_random()]
        if redrawn:
            # the stash was not replayed (see _Stash) and the stage draws random numbers:
            # its backward would differentiate other dropout masks than its forward's
            raise TraceError(
                f"pipeline stage {redrawn[0]}'s backward recomputes its forward, which "
                "draws random numbers (dropout), so its gradients would not be those of "
                "the forward's masks: the tensors autograd saved differed between the "
                "two traces. Please report it with the stage's layers; meanwhile put the "
                "random layers in the last stage (stages=[...] bounds), which computes "
                "its forward and backward in one program")
        _gather_tied(trainer, acc)
        verdicts = [{}] * len(stages)
        if options.max_grad_norm is not None or options.scaling:
            # clip_grad_norm_'s norm and GradScaler's found_inf are over the whole model:
            # every stage's part meets on the first stage's slice, and the clipping
            # factor and whether to skip go back to each stage
            check = trainer._program("grad_check", _make_grad_check(options))
            parts = [check(acc[k], scalers[k]) for k in range(len(stages)) if acc[k]]
            combine = trainer._program("grad_combine", _make_combine(options))
            both = combine([_moved(p, slices[0]) for p in parts])
            verdicts = [_moved({k: a for k, a in both.items() if k != "norm"}, s)
                        if own[k] or options.scaling else {} for k, s in enumerate(slices)]
            if "norm" in both:
                trainer._grad_norm = both["norm"]
        created = []
        for k in range(len(stages)):
            if not own[k]:
                # a stage with no parameters of its own (activations only, or only a
                # tied one) updates nothing but its copy of the loss scale
                if options.scaling:
                    trainer._program("loss_scale", _make_scale_update(options))(
                        scalers[k], verdicts[k]["found"])
                continue
            st = {n: trainer.states[0][n] for n in own[k]}
            # parameters and state are updated in place (written back to their Arrays)
            created.append(apply_prog(own[k], st, lrs, [acc[k]], hyper,
                                      verdicts[k].get("coef"), scalers[k],
                                      verdicts[k].get("found")))
        loss = mean_prog(losses)
    for c in created:       # (under loss scaling, kept if the update was not skipped:
        trainer._store_created(0, c)        # a read, after the graph is submitted)
    return loss


def _batch_to(a: Array, slice_, axis: Optional[str], dim: int = 0) -> Array:
    """A micro-batch's activations or their gradient on the next stage's slice, split
    over ``axis`` along the batch dimension ``dim`` as the batch is (replicated where it
    does not divide; ``dim`` 1 for a group's, stacked on dimension 0)."""
    split = axis and a.ndim > dim and a.shape[dim] % _axis_size(slice_, axis) == 0
    return a.to(slice_, P(*[None] * dim, axis) if split else P())


def _own_tensors(trainer, tensors: Dict[str, Array]) -> List[Dict[str, Array]]:
    """``tensors`` (the model's parameters or buffers, by name) split by stage."""
    return [{n: t for n, t in tensors.items() if n.split(".", 1)[0] in names}
            for _, names in trainer._stages]


def _lend_tied(trainer, params: List[dict], fixed: List[dict]) -> None:
    """Each stage's copies of the tied parameters it uses but another stage holds,
    under the stage's own name for them (frozen ones beside the buffers)."""
    for k, tie in enumerate(trainer._ties):
        for alias, canonical in tie.items():
            if canonical in trainer.replicas[0]:
                params[k][alias] = trainer.replicas[0][canonical].to(trainer.slices[k])
            else:
                fixed[k][alias] = trainer.fixed[0][canonical].to(trainer.slices[k])


def _gather_tied(trainer, acc: List[dict]) -> None:
    """The gradients of the lent copies, added to their parameter's on its home stage
    (then clipped, checked and applied once, as torch's one ``.grad``)."""
    parts: Dict[str, list] = {}
    for k, tie in enumerate(trainer._ties):
        for alias in tie:
            if alias in acc[k]:
                acc[k] = dict(acc[k])
                parts.setdefault(tie[alias], []).append(acc[k].pop(alias))
    if not parts:
        return
    add = trainer._program("tied_grads", lambda g, others: g + sum(others))
    for canonical, grads in parts.items():
        h = trainer._tie_home[canonical]
        acc[h] = dict(acc[h])
        acc[h][canonical] = add(acc[h][canonical],
                                [g.to(trainer.slices[h]) for g in grads])


def _make_scale_update(options):
    def loss_scale(scaler, found):
        scaling.update_scale(scaler, found, options.scaling)
        return found        # (a program returns something)
    return loss_scale


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
        ends = [0] + [b for _, b in bounds]
        if (not bounds or any(len(b) != 2 for b in bounds)
                or any(a != ends[k] or b <= a for k, (a, b) in enumerate(bounds))
                or ends[-1] != n):
            raise PathwaysError(
                f"pw.Pipeline stage bounds {pipe.stages!r} must cut the model's {n} layers "
                "into consecutive, non-empty (start, end) ranges from 0 to "
                f"{n}, each starting where the last ended: e.g. [(0, {n // 2}), "
                f"({n // 2}, {n})]")
    if len(bounds) != len(pipe.slices):
        raise PathwaysError(f"{len(bounds)} stages need {len(bounds)} slices, got "
                            f"{len(pipe.slices)}")
    names = list(model._modules)
    return [(model[a:b], names[a:b]) for a, b in bounds]


def stage_ties(model: torch.nn.Module, stages) -> Tuple[List[Dict[str, str]],
                                                        Dict[str, int]]:
    """The parameters a stage uses that another stage holds (a language model's tied
    input and output embeddings): per stage, {its name for it: the model's name}, and
    each such parameter's home stage (the one holding the model's name). A buffer two
    stages share (two running statistics in one) is refused."""
    canonical = {id(t): n for n, t in list(model.named_parameters()) +
                 list(model.named_buffers())}
    home_of = {n: k for k, (_, names) in enumerate(stages) for n in names}
    ties: List[Dict[str, str]] = [{} for _ in stages]
    homes: Dict[str, int] = {}
    for k, (mod, _) in enumerate(stages):
        for n, t in mod.named_parameters(remove_duplicate=False):
            c = canonical[id(t)]
            if home_of[c.split(".", 1)[0]] != k:
                ties[k][n] = c
                homes[c] = home_of[c.split(".", 1)[0]]
        for n, t in mod.named_buffers(remove_duplicate=False):
            c = canonical[id(t)]
            if home_of[c.split(".", 1)[0]] != k:
                raise PathwaysError(
                    f"buffer {c!r} (stage {home_of[c.split('.', 1)[0]]}) is also {n!r} "
                    f"(stage {k}): pw.Pipeline keeps a buffer on one stage. Choose "
                    "stage bounds (stages=[(0, a), (a, b), ...]) that keep both layers "
                    "in one stage, or give the second layer its own buffer")
    return ties, homes


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


def _in_turn(one, first: bool):
    """A stage program over a group of micro-batches, ``one`` (the single micro-batch
    forward, backward or last-stage program below) run on each in turn, as separate
    programs would run them: buffers and gradient sums move micro-batch after
    micro-batch. The first stage gets the group's inputs as a list; a later stage its
    predecessor's outputs (or, backwards, their gradients) stacked on dimension 0."""
    def members(xs):
        return list(xs) if first else [x.detach() for x in xs.unbind(0)]

    def stacked(gxs):
        return gxs[0] if first else torch.stack(gxs)    # (first: a placeholder)

    def fwd(params, fixed, xs):
        outs = [one(params, fixed, x) for x in members(xs)]
        return torch.stack([y for y, _ in outs]), [s for _, s in outs]

    def bwd(params, fixed, xs, saved, gys, acc):
        gxs = []
        for x, s, gy in zip(members(xs), saved, gys.unbind(0)):
            gx, acc = one(params, fixed, x, s, gy, acc)
            gxs.append(gx)
        return stacked(gxs), acc

    def last(params, fixed, xs, targets, acc, scaler=None):
        gxs, losses = [], []
        for x, y in zip(members(xs), targets):
            gx, acc, loss = one(params, fixed, x, y, acc, scaler)
            gxs.append(gx)
            losses.append(loss)
        return stacked(gxs), acc, torch.stack(losses)

    return {"stage_fwd": fwd, "stage_bwd": bwd, "last_bwd": last}[one.__name__]


def _make_stage_fwd(mod, first: bool, model, options):
    """A stage's forward (under the precision's autocast, as the whole model's would
    run); also returns the tensors its backward needs (see _Stash)."""
    def stage_fwd(params, fixed, x):
        for t in params.values():
            t.requires_grad_()
        if not first:
            x = x.requires_grad_()
        stash = _Stash(x, params)
        with stash.hooks(), mode(mod, True, model), _stage(mod, params, fixed), \
                autocast(options):
            y = _one_tensor(mod(x), mod)
        return y.detach(), [t.detach() for t in stash.recorded]
    return stage_fwd


def _one_tensor(y, mod):
    """A stage's output, which goes to the next stage: one tensor."""
    if isinstance(y, torch.Tensor):
        return y
    raise TraceError(
        f"a pw.Pipeline stage ({type(mod).__name__} of {_layers(mod)}) returned "
        f"{type(y).__name__}, not one tensor: a pipeline passes one tensor from each "
        "stage to the next (its activations, and back their gradient). Put what the "
        "next stage needs into that tensor (torch.cat along the last dimension, "
        "split again in the next stage), or train with pw.DataParallel or "
        "pw.FullyShardedDataParallel, which take any outputs. An auxiliary loss of "
        "a middle stage (a mixture of experts' balance loss) cannot reach the last "
        "stage's loss_fn otherwise")


def _layers(mod) -> str:
    names = [type(m).__name__ for m in getattr(mod, "children", lambda: [])()]
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "") if names else "it"


def _accumulate(acc, names, grads):
    return {n: (acc[n] + g if n in acc else g) for n, g in zip(names, grads)}


def _make_stage_bwd(mod, first: bool, model, options, microbatches: int):
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
        with mode(mod, True, model), _stage(mod, params, fixed):
            with _Stash(x, params, saved).hooks(), autocast(options):
                y = mod(x)
            grads = torch.autograd.grad(y, wrt, grad_outputs=gy)
        grads = with_inner_backward(wrt, grads, 1 / microbatches)
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
        with mode(mod, True, model), _stage(mod, params, fixed):
            with autocast(options):
                loss = alone(*loss_and_rest(mod(x), targets, loss_fn), "a Pipeline")
            if loss.dtype in (torch.float16, torch.bfloat16):
                loss = loss.float()     # reported in float32, as a whole model's step
            part = loss / microbatches
            grads = torch.autograd.grad(
                scaling.scale_loss(part, scaler) if options.scaling else part, wrt)
        grads = with_inner_backward(wrt, grads, 1 / microbatches)
        gx = torch.zeros((), dtype=loss.dtype) if first else grads[0]
        return gx, _accumulate(acc, names, grads if first else grads[1:]), loss.detach()
    return last_bwd


def pipeline_eval(trainer, inputs, targets, outputs: bool = False):
    """The whole batch through the stages in eval mode: the loss, or (``outputs``) the
    last stage's outputs."""
    stages, slices = trainer._stages, trainer.slices
    axis = trainer.parallelism.axis
    h = _place_batch(inputs, slices[0], axis)
    with graph():
        options = trainer.options
        all_params = _own_tensors(trainer, trainer.replicas[0])
        all_fixed = _own_tensors(trainer, trainer.fixed[0])
        _lend_tied(trainer, all_params, all_fixed)
        for k, (mod, names) in enumerate(stages):
            params, fixed = all_params[k], all_fixed[k]
            h = h if k == 0 else _batch_to(h, slices[k], axis)
            final = k == len(stages) - 1
            if final and not outputs:
                prog = trainer._program("eval_last", _make_stage_eval(mod, trainer.loss_fn,
                                                                      True, options))
                return prog(params, fixed, h, _place_batch(targets, slices[k], axis))
            prog = trainer._program(f"stage{k}_eval",
                                    _make_stage_eval(mod, None, False, options, final))
            h = prog(params, fixed, h, None)
    return h


def _make_stage_eval(mod, loss_fn, with_loss: bool, options, last: bool = True):
    def stage_eval(params, fixed, x, targets):
        with mode(mod, False), torch.no_grad(), _stage(mod, params, fixed), \
                autocast(options):
            y = mod(x)
            if not with_loss:
                return y if last else _one_tensor(y, mod)
            loss, rest = loss_and_rest(y, targets, loss_fn)
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return returned(loss, rest)
    return stage_eval
