"""The programs a Trainer runs, built from the model: a training step (forward,
backward, gradient clipping, the optimizer update), gradients alone and the update
alone (``MultiIsland``, ``Pipeline``: gradients are exchanged or accumulated first),
evaluation and prediction.

Each is an ordinary function of tensors that ``pw.program`` traces (see
client/capture.py: the joint forward-backward graph comes from ``make_fx``). They
follow torch's semantics on purpose:

- the model is called as the user would: ``model(x)``, ``model(*x)``, ``model(**x)``;
- buffers that forward updates in place (BatchNorm's running statistics) are the
  program's input mutations, written back to the Trainer's Arrays;
- the update is torch.optim's own code (optim.py), after torch's
  ``clip_grad_norm_``;
- ``precision="bf16"`` is ``torch.autocast("cpu", torch.bfloat16)`` around forward
  and loss (the trace runs on CPU fake tensors, so the CPU autocast policy applies);
  ``precision="fp16"`` is the same in float16, with torch.amp.GradScaler's dynamic
  loss scaling (scaling.py);
- evaluation and prediction trace the model in eval mode; a training step in the
  modes the user set when the model is in train mode (a batch norm frozen with
  ``.eval()`` stays frozen, as in a torch loop), and in train mode when the model as a
  whole is in eval mode (``from_pretrained`` returns one; Hugging Face's Trainer calls
  ``model.train()`` too).

Example::

    fn = make_step_fn(model, loss_fn, spec, groups, options)
    loss, created = pw.program(fn)(params, fixed, states, acc, lrs, inputs, targets, hyper,
                                   scaler)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..errors import PathwaysError, TraceError, warn_at_caller
from . import leaks, optim as fopt
from . import scaling
from .scaling import LossScaling

#: what ``precision=`` takes, with PyTorch Lightning's names for the same modes
PRECISIONS = {None: None, "fp32": None, "32": None, "32-true": None, "bf16": "bf16",
              "bf16-mixed": "bf16", "fp16": "fp16", "16": "fp16", "16-mixed": "fp16"}


def precision_mode(precision: Any) -> Optional[str]:
    """None (float32), "bf16" or "fp16" for a ``precision=`` value; a clear error for
    the rest (Lightning's "-true" modes are a model converted to half precision)."""
    key = str(precision) if isinstance(precision, int) else precision
    if key in PRECISIONS:
        return PRECISIONS[key]
    hint = ""
    if isinstance(key, str) and key.endswith("-true"):
        hint = (": half-precision parameters are a model converted before the Trainer "
                "is built (model.bfloat16() or model.half()) with precision left unset")
    raise PathwaysError(
        f"precision must be None or 'fp32' (float32), 'bf16' (autocast to bfloat16) or "
        f"'fp16' (autocast to float16 with dynamic loss scaling), or Lightning's "
        f"'bf16-mixed' / '16-mixed', not {precision!r}{hint}")


@dataclasses.dataclass(frozen=True)
class Options:
    """The Trainer's knobs that change what a step computes."""

    max_grad_norm: Optional[float] = None
    accumulate: int = 1
    precision: Optional[str] = None          # None (float32), "bf16" or "fp16"
    max_grad_value: Optional[float] = None   # clip_grad_value_, before the norm
    scaling: Optional[LossScaling] = None    # precision="fp16": GradScaler's settings

    def __post_init__(self):
        object.__setattr__(self, "precision", precision_mode(self.precision))
        if self.precision != "fp16" and self.scaling is not None:
            raise PathwaysError("loss scaling (scaler=) goes with precision='fp16'")
        if int(self.accumulate) != self.accumulate or self.accumulate < 1:
            raise PathwaysError(f"accumulate must be an integer >= 1, not {self.accumulate}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise PathwaysError(f"max_grad_norm must be positive, not {self.max_grad_norm}")
        if self.max_grad_value is not None and not self.max_grad_value > 0:
            raise PathwaysError(f"max_grad_value must be positive, not {self.max_grad_value}")


# ---------------------------------------------------------------------- the model call

@contextlib.contextmanager
def reparametrized(model: torch.nn.Module, tensors: Dict[str, torch.Tensor],
                   loss_fn: Any = None):
    """The module with its parameters and buffers replaced by ``tensors`` (tied weights
    stay tied) for the duration of the block. The backward must run inside it too:
    ``torch.utils.checkpoint`` recomputes the forward during the backward, with
    whatever parameters the module holds then."""
    from torch.nn.utils.stateless import _reparametrize_module
    storages = {n: _storage(t) for n, t in tensors.items()}
    stand_ins = _StandIns.wanted(model, tensors, loss_fn)
    try:
        # stack_weights: restored in reverse, so a module registered under two names
        # (ALBERT's one block in every layer) gets its own tensors back, not the first
        # swap's stand-ins
        with _reparametrize_module(model, tensors, tie_weights=True, stack_weights=True), \
                (stand_ins or contextlib.nullcontext()):
            yield
            _refuse_data_assignments(tensors, storages)
            _keep_rebound_buffers(model, tensors)
    finally:
        # RNNs cache their weights in _flat_weights, which would keep the traced ones
        for m in model.modules():
            if isinstance(m, torch.nn.RNNBase):
                m._init_flat_weights()


_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)


class _StandIns(torch.overrides.TorchFunctionMode):
    """The traced tensors in place of the module's own parameters and buffers where
    code reaches those through a reference of its own: a list kept in ``__init__``
    (``self.plist = list(self.parameters())``, a regulariser over it, SAM's
    ``torch.autograd.grad(loss, self.plist)``) or a loss_fn's closure. Those read the
    real tensors, which a trace takes as constants: no gradient reached the
    parameters through them, silently (2e-3 off after 3 steps)."""

    def __init__(self, by_id: Dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.by_id = by_id

    @classmethod
    def wanted(cls, model: torch.nn.Module, tensors: Dict[str, torch.Tensor],
               loss_fn: Any = None) -> Optional["_StandIns"]:
        """The mode, if a module's attributes or the loss_fn's closure hold some of the
        module's tensors (in a list, tuple, set or dict, or as themselves); None
        otherwise: a mode costs every traced call (about 20% of a GPT's trace)."""
        own = dict(model.named_parameters(remove_duplicate=False))
        own.update(model.named_buffers(remove_duplicate=False))
        by_id = {id(t): tensors[n] for n, t in own.items() if n in tensors}
        places = [v for m in model.modules() for k, v in m.__dict__.items()
                  if k not in _MODULE_INTERNALS]
        if loss_fn is not None:     # its closure, a partial's arguments, its globals
            places += [v for _, v in leaks._reach(loss_fn)]
        for v in places:
            items = v.values() if isinstance(v, dict) else \
                v if isinstance(v, (list, tuple, set)) else (v,)
            try:
                if any(id(x) in by_id for x in items):
                    return cls(by_id)
            except TypeError:
                continue
        return None

    def _swap(self, a):
        if isinstance(a, torch.Tensor):
            return self.by_id.get(id(a), a)
        if type(a) in (list, tuple) and a and isinstance(a[0], torch.Tensor):
            return type(a)(self.by_id.get(id(x), x) for x in a)
        return a

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args = tuple(self._swap(a) for a in args)
        if kwargs:
            kwargs = {k: self._swap(v) for k, v in kwargs.items()}
        return func(*args, **(kwargs or {}))


def _storage(t) -> Optional[int]:
    try:
        return t.untyped_storage()._cdata
    except Exception:       # a tensor subclass without storage
        return None


def _refuse_data_assignments(tensors: Dict[str, torch.Tensor], storages: dict) -> None:
    """A forward that assigns a parameter's or buffer's ``.data`` (MoCo's momentum
    encoder: ``pk.data = pk.data * m + pq.data * (1 - m)``) swaps the tensor's storage,
    which a trace records nowhere: the update was lost, silently, and the encoder
    never moved. Refused, with the in-place form torch computes the same."""
    swapped = [n for n, t in tensors.items()
               if storages.get(n) is not None and _storage(t) != storages[n]]
    if swapped:
        raise TraceError(
            f"the forward assigns .data of {', '.join(swapped[:4])}"
            f"{' ...' if len(swapped) > 4 else ''}: a traced step cannot rebind a "
            "tensor's data, so the new value would be lost. Update it in place instead, "
            "which torch computes the same: with torch.no_grad(): "
            "pk.mul_(m).add_(pq.detach(), alpha=1 - m) (or pk.lerp_(pq.detach(), 1 - m), "
            "or pk.copy_(new_value))")


_warned_rebound: set = set()


def _keep_rebound_buffers(model: torch.nn.Module, tensors: Dict[str, torch.Tensor]) -> None:
    """A forward that assigns a registered buffer anew (``self.h = h.detach()``, a
    recurrent state carried between batches; ``self.count = self.count + 1``) rebinds
    it in the module, which the reparametrization then undoes: the new value is copied
    into the buffer the program was given, an in-place update that the step writes
    back, as torch's module would keep it. A new value of another shape or dtype
    cannot be (the buffer is an input of that shape): it is said, once, and dropped."""
    for name, given in tensors.items():
        owner, _, leaf = name.rpartition(".")
        try:
            mod = model.get_submodule(owner) if owner else model
        except AttributeError:
            continue
        now = mod._buffers.get(leaf) if leaf in mod._buffers else given
        if now is given or not isinstance(now, torch.Tensor):
            continue
        if now.shape == given.shape and now.dtype == given.dtype:
            with torch.no_grad():
                given.copy_(now.detach())
        elif name not in _warned_rebound:
            _warned_rebound.add(name)
            warn_at_caller(
                f"pw.Trainer: the forward assigned the buffer {name!r} a "
                f"{now.dtype}{list(now.shape)} value where it holds "
                f"{given.dtype}{list(given.shape)}; a program updates buffers in place, "
                "so the new value is not kept (torch's module would keep it). Keep the "
                "buffer's shape (pad, or make it for the largest batch), or return the "
                "value from the forward and pass it back in", UserWarning)


def call_model(model: torch.nn.Module, inputs: Any):
    """``model(inputs)``: a dict is passed as keyword arguments, a tuple or list as
    positional ones, anything else as the one argument."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def split_loss(result: Any, leaf: type = torch.Tensor) -> Tuple[Any, Any]:
    """(the loss, the rest) of what a ``loss_fn`` returned: a tensor is the loss alone
    (the rest None); a tuple or list whose first element is a tensor (Hugging Face's
    ``compute_loss(..., return_outputs=True)``), a dict with ``"loss"`` or an object
    with ``.loss`` holds the loss beside metrics, and the step returns it whole.
    ``leaf=Array`` reads the same rule from what a step returned (``fit``)."""
    if isinstance(result, leaf):
        return result, None
    if isinstance(result, Mapping) and isinstance(result.get("loss"), leaf):
        return result["loss"], result
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], leaf):
        return result[0], result
    if isinstance(getattr(result, "loss", None), leaf):
        return result.loss, result
    raise TraceError(
        f"loss_fn returned a {type(result).__name__}: return the loss (a tensor), or a "
        "tuple whose first element is the loss or a dict with 'loss' to have metrics "
        "returned beside it")


def alone(loss: torch.Tensor, rest: Any, where: str) -> torch.Tensor:
    """The loss, refusing a loss_fn that returned more where a step cannot return it."""
    if rest is not None:
        raise TraceError(
            f"loss_fn returned a {type(rest).__name__} (the loss and more); {where} "
            "combines the losses of several programs, so there loss_fn must return the "
            "loss alone: compute metrics with trainer.predict or trainer.evaluate")
    return loss


def loss_and_rest(out: Any, targets: Any, loss_fn: Optional[Callable]):
    """(loss, rest): ``split_loss`` of ``loss_fn(out, targets)``, or with
    ``loss_fn=None`` the loss the model returned (Hugging Face's ``.loss`` /
    ``["loss"]``, or a scalar tensor) and None (a step does not return the model's
    own outputs)."""
    if loss_fn is not None:
        return split_loss(loss_fn(out, targets))
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.dim() == 0:
        loss = out
    if not isinstance(loss, torch.Tensor):
        what = (f"a tensor of shape {list(out.shape)}" if isinstance(out, torch.Tensor)
                else type(out).__name__)
        raise TraceError(
            "pw.Trainer(loss_fn=None) takes the loss from the model's output, which has "
            f"none ({what}): put the labels in the inputs (Hugging Face: labels=...) so "
            "the model returns .loss, or pass a loss_fn")
    return loss, None


@contextlib.contextmanager
def mode(model: torch.nn.Module, training: bool, whole: Optional[torch.nn.Module] = None):
    """Trace ``model`` in eval mode, or for training in the user's modes (train mode if
    the model is in eval mode), and leave every module's flag as it was. ``whole``:
    the model that ``model`` is a part of (a pipeline stage), whose mode the user set."""
    flags = [(m, m.training) for m in model.modules()]
    if not (training and (model if whole is None else whole).training):
        model.train(training)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def autocast(options: Options):
    if options.precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if options.precision == "fp16":
        return torch.autocast("cpu", dtype=torch.float16)
    return contextlib.nullcontext()


def forward_loss(model, loss_fn, options: Options, inputs, targets):
    """(the loss, what else loss_fn returned or None) of a reparametrized model (see
    ``reparametrized``)."""
    with autocast(options):
        loss, rest = loss_and_rest(call_model(model, inputs), targets, loss_fn)
    # a half-precision loss is reported in float32; a float64 one stays float64, as in torch
    return (loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss), rest


def returned(loss: torch.Tensor, rest: Any) -> Any:
    """What a step or an evaluation returns: the loss, or loss_fn's whole result with
    its tensors detached."""
    if rest is None:
        return loss.detach()
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, rest)


# ---------------------------------------------------------------------- pieces of a step

def gradients(loss: torch.Tensor, params: Dict[str, torch.Tensor]) -> Dict[str, Optional[torch.Tensor]]:
    """d loss / d params; None for parameters the loss does not use (torch leaves
    their ``.grad`` None, and the optimizer skips them)."""
    names = list(params)
    gs = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
    return dict(zip(names, with_inner_backward([params[n] for n in names], gs)))


def with_inner_backward(leaves: List[torch.Tensor], grads, scale: float = 1.0) -> list:
    """``grads`` plus what a ``.backward()`` inside the forward or the loss_fn put in the
    traced parameters' ``.grad``: WGAN-GP ported from a torch loop calls
    ``penalty.backward(retain_graph=True)`` and returns the critic's loss, and torch's
    optimizer steps on the sum (that gradient was dropped, silently). A pipeline's
    micro-batch weighs ``scale`` (1 / micro-batches), as its loss does."""
    out = []
    for t, g in zip(leaves, grads):
        inner, t.grad = t.grad, None
        if inner is not None and scale != 1.0:
            inner = inner * scale
        out.append(g if inner is None else inner if g is None else inner + g)
    return out


#: in what a step created, the 0-d tensors a generic optimizer made in its groups
GROUP_TENSORS = "pw.groups"
#: in what a loss-scaled step created, whether its update was skipped (1.0) or not
FOUND_INF = "pw.found_inf"
#: in what a clipping step created, the total norm clip_grad_norm_ returned
GRAD_NORM = "pw.grad_norm"


def clip_and_update(spec: Dict, groups: List[List[str]], options: Options, params,
                    grads, states, lrs):
    """``clip_grad_value_`` and ``clip_grad_norm_`` (when asked, in that order) and the
    optimizer step, in place; returns the state the step created (absent from
    ``states``) or replaced (a generic step may assign a new tensor), per parameter
    name, and under ``GRAD_NORM`` the norm the clipping measured."""
    created = {}
    with torch.no_grad():
        grads = clip_values(grads, options.max_grad_value)
        if options.max_grad_norm is not None:
            with_grad = [params[n] for n in params if grads.get(n) is not None]
            for n in params:
                params[n].grad = grads.get(n)
            norm = torch.nn.utils.clip_grad_norm_(with_grad, options.max_grad_norm,
                                                  foreach=False)
            created[GRAD_NORM] = {"norm": norm}
            grads = {n: params[n].grad for n in params}
            for n in params:
                params[n].grad = None
    after, group_tensors = fopt.update(spec, [[params[n] for n in g] for g in groups],
                        [[grads.get(n) for n in g] for g in groups],
                        [[states[n] for n in g] for g in groups], lrs, groups)
    if group_tensors:
        created[GROUP_TENSORS] = {f"{gi}:{k}": t for (gi, k), t in group_tensors.items()}
    for g, sts in zip(groups, after):
        for n, st in zip(g, sts):
            new = {k: v for k, v in st.items() if isinstance(v, torch.Tensor)
                   and (k not in states[n] or v is not states[n][k])}
            if new:
                created[n] = new
    return created


def scaled_update(options: Options, scaler, params, states, grads,
                  update: Callable[[Dict[str, Any]], Dict],
                  found: Optional[torch.Tensor] = None,
                  parts: Optional[List[List[str]]] = None) -> Dict:
    """``update(grads)`` (clipping and the optimizer step; it returns the state it
    created), under loss scaling as GradScaler runs it: on the unscaled gradients,
    undone where they overflowed, the scale updated after, and what it created marked
    with ``FOUND_INF`` (kept only if the update was not skipped). ``found``, when given,
    is whether any of several programs' gradients overflowed (a pipeline's stages),
    which replaces this program's own. Without loss scaling, ``update(grads)``."""
    if not options.scaling:
        return update(grads)
    grads, own = scaling.unscale(grads, scaler)
    shared = found is not None
    found = own if found is None else found
    before = scaling.kept(params, states)
    created = update(grads)
    if parts is not None and len(parts) > 1 and not shared:
        # several optimizers (a list): GradScaler checks and skips each on its own
        # gradients; the scale backs off if any of them overflowed
        old_params, old_states = before
        for names in parts:
            scaling.skip_if(scaling.non_finite([grads.get(n) for n in names]),
                            ({n: old_params[n] for n in names if n in old_params},
                             {n: old_states[n] for n in names if n in old_states}),
                            {n: params[n] for n in names if n in params},
                            {n: states[n] for n in names if n in states})
    else:
        scaling.skip_if(found, before, params, states)
    scaling.update_scale(scaler, found, options.scaling)
    if set(created) - {GRAD_NORM}:      # state the update made (a read of found decides)
        created[FOUND_INF] = {"found": found}
    return created


def clip_values(grads: Dict[str, Any], limit: Optional[float]) -> Dict[str, Any]:
    """``torch.nn.utils.clip_grad_value_``: each gradient clamped to [-limit, limit]."""
    if limit is None:
        return grads
    return {n: (g.clamp(-limit, limit) if g is not None else None) for n, g in grads.items()}


def grad_hooks(model: torch.nn.Module) -> Dict[str, list]:
    """The hooks registered on the model's parameters with ``register_hook`` (gradient
    scaling or clamping), by name: a step registers them on the traced parameters, so
    they change the gradients as in torch. Hooks run after ``.grad`` accumulates have
    no place in a program that takes gradients with ``autograd.grad``: refused."""
    hooks = {}
    for n, p in model.named_parameters():
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise TraceError(
                f"parameter {n!r} has a register_post_accumulate_grad_hook, which "
                "pw.Trainer cannot run (its step computes gradients, never .grad); "
                "use register_hook, which it runs, or remove the hook")
        if p._backward_hooks:
            hooks[n] = list(p._backward_hooks.values())
    return hooks


def requires_grad(params: Dict[str, torch.Tensor], hooks: Dict[str, list]) -> None:
    """The traced parameters as leaves of the backward, with the user's hooks."""
    for n, t in params.items():
        t.requires_grad_()
        for h in hooks.get(n, ()):
            t.register_hook(h)


# ---------------------------------------------------------------------- programs

def make_step_fn(model, loss_fn, spec: Dict, groups: List[List[str]], options: Options,
                 last: bool = True):
    """One SPMD step. With ``accumulate=k`` the first k-1 calls (``last=False``) only add
    their gradients to ``acc``; the k-th adds its own, averages, clips and updates.
    With loss scaling (``scaler``: the scale and growth tracker, updated in place) the
    gradients are of the scaled loss until the update unscales them (torch's order:
    ``scaler.scale(loss).backward()`` per micro-batch, ``unscale_`` once)."""
    k = options.accumulate
    scales = options.scaling

    def train_step(params, fixed, states, acc, lrs, inputs, targets, hyper, scaler):
        requires_grad(params, grad_hooks(model))
        with mode(model, True), reparametrized(model, {**params, **fixed}, loss_fn):
            loss, rest = forward_loss(model, loss_fn, options, inputs, targets)
            grads = gradients(scaling.scale_loss(loss, scaler) if scales else loss, params)
        if k > 1:
            with torch.no_grad():
                for n, g in grads.items():
                    if g is not None:
                        acc[n].add_(g)
                if not last:
                    return returned(loss, rest), {}
                grads = {n: (acc[n] / k if g is not None else None) for n, g in grads.items()}
                for t in acc.values():
                    t.zero_()
        if spec.get("book") is not None:
            hyper = hyper[0]        # beside it, the trace of the numbers (a key only)
        created = scaled_update(options, scaler, params, states, grads, lambda gs:
                                clip_and_update(dict(spec, groups=hyper), groups, options,
                                                params, gs, states, lrs),
                                parts=member_parts(spec, groups))
        return returned(loss, rest), created
    return train_step


def member_parts(spec: Dict, groups: List[List[str]]) -> List[List[str]]:
    """The parameter names each optimizer of ``spec`` (one, or a list's) holds."""
    parts, first = [], 0
    for _, count, _ in spec.get("members", ()):
        parts.append([n for g in groups[first:first + count] for n in g])
        first += count
    return parts


def make_grad_fn(model, loss_fn, options: Options, flat: bool = False):
    """Forward and backward only: the gradients (one flat buffer with ``flat``, which
    travels between islands as one transfer) and the loss; with loss scaling
    (``scaler``), the gradients of the scaled loss."""
    def grads(params, fixed, inputs, targets, scaler=None):
        requires_grad(params, grad_hooks(model))
        with mode(model, True), reparametrized(model, {**params, **fixed}, loss_fn):
            loss = alone(*forward_loss(model, loss_fn, options, inputs, targets),
                         "MultiIsland")
            gs = gradients(scaling.scale_loss(loss, scaler) if options.scaling else loss,
                           params)
        gs = {n: (g if g is not None else torch.zeros_like(params[n])) for n, g in gs.items()}
        if flat:
            return torch.cat([g.reshape(-1) for g in gs.values()]), loss.detach()
        return gs, loss.detach()
    return grads


def unflatten(flat, shapes: Dict[str, tuple]) -> Dict[str, torch.Tensor]:
    out, at = {}, 0
    for n, shape in shapes.items():
        k = 1
        for d in shape:
            k *= d
        out[n] = flat[at:at + k].reshape(shape)
        at += k
    return out


def make_apply_fn(spec: Dict, groups: List[List[str]], options: Options,
                  flat_shapes: Optional[Dict[str, tuple]] = None):
    """The update with the mean of ``grad_list`` (summed in its order, so every replica
    that sums the same list computes the same update). ``coef``, when given, is the
    clipping factor computed over several programs' gradients (a pipeline's stages),
    which replaces clipping this program's own. With loss scaling (``scaler``, each
    island's or stage's copy) the mean gradient is unscaled, and the update skipped where
    it overflowed: every island sees the same mean, so every island skips alike; a
    pipeline's stages skip alike by ``found``, their overflows combined."""
    def apply(params, states, lrs, grad_list, hyper, coef=None, scaler=None, found=None):
        total = grad_list[0]
        if flat_shapes is not None:
            for other in grad_list[1:]:
                total = total + other
            grads = unflatten(total / len(grad_list), flat_shapes)
        else:
            grads = {}
            for n in params:
                g = grad_list[0][n]
                for other in grad_list[1:]:
                    g = g + other[n]
                grads[n] = g / len(grad_list) if len(grad_list) > 1 else g
        opts = options
        if coef is not None:
            opts = dataclasses.replace(options, max_grad_norm=None, max_grad_value=None)
        names = set(params)
        sub = [[n for n in g if n in names] for g in groups]

        def update(gs):     # on unscaled gradients: clipped by the global norm's factor
            if coef is not None:
                gs = {n: g * coef for n, g in clip_values(gs, options.max_grad_value).items()}
            return clip_and_update(dict(spec, groups=hyper), sub, opts, params, gs, states,
                                   lrs)
        return scaled_update(options, scaler, params, states, grads, update, found)
    return apply


def grad_square_sum(grads: Dict[str, torch.Tensor], max_value: Optional[float] = None
                    ) -> torch.Tensor:
    """Sum of the squares of every gradient, value-clipped first when asked (a part of
    the global norm)."""
    grads = clip_values(grads, max_value)
    return torch.stack([(g.float() if g.dtype in (torch.float16, torch.bfloat16) else g)
                        .pow(2).sum() for g in grads.values()]).sum()


def clip_coef(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_``'s factor for the total norm ``total``."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def make_eval_fn(model, loss_fn, options: Options):
    """The loss in eval mode: no dropout, BatchNorm's running statistics, no update."""
    def evaluate(params, fixed, inputs, targets):
        requires_grad(params, {})   # as the module's own: a forward may read the flag
        with mode(model, False), torch.no_grad(), \
                reparametrized(model, {**params, **fixed}, loss_fn):
            return returned(*forward_loss(model, loss_fn, options, inputs, targets))
    return evaluate


def make_predict_fn(model, options: Options):
    """The model's outputs in eval mode (any pytree: tensors, tuples, dicts,
    Hugging Face ModelOutputs)."""
    def predict(params, fixed, inputs):
        requires_grad(params, {})
        with mode(model, False), torch.no_grad(), autocast(options), \
                reparametrized(model, {**params, **fixed}):
            return call_model(model, inputs)
    return predict
