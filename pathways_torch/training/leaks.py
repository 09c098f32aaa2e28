"""What a traced step left behind in the script's objects: tensors without numbers.

A torch forward may keep what it computes: a module storing its last attention map
(``self.attn = probs``), a forward hook appending activations to a list or keeping
statistics for a logger, a ``loss_fn`` that remembers its last loss. A ``pw.Trainer``
runs that Python once, while it traces the step on fake tensors, and the step then runs
on the workers: what was stored is a ``FakeTensor`` that no later step updates (printing
it shows no values, ``.item()`` raises ``DataDependentOutputException``).

After each trace the Trainer looks where such values go (the modules' attributes, and
what the user's forward and backward hooks and ``loss_fn`` reach: closure cells, bound
objects, defaults and the module-level names they use, two containers deep) and warns
once per place, saying how to get the value each step: return it from ``loss_fn``
beside the loss. Example of what it catches::

    acts = []
    model[1].register_forward_hook(lambda m, i, o: acts.append(o.detach()))
    trainer.step(x, y)     # UserWarning: acts[0] holds a tensor stored while ...
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, List, Set, Tuple

import torch

from ..errors import warn_at_caller

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_WIDTH = 64          # elements of a container looked at (its last ones: a growing list)


def _fake_types() -> tuple:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return (FakeTensor, FunctionalTensor)


def _find(v: Any, path: str, depth: int, fakes: tuple, seen: Set[int],
          out: List[str]) -> None:
    if id(v) in seen:
        return
    seen.add(id(v))
    if isinstance(v, fakes):
        out.append(path)
    elif depth <= 0 or isinstance(v, (str, bytes, torch.Tensor, torch.nn.Module)):
        return
    elif isinstance(v, (list, tuple)):
        start = max(0, len(v) - _WIDTH)
        for i in range(start, len(v)):
            _find(v[i], f"{path}[{i}]", depth - 1, fakes, seen, out)
    elif isinstance(v, dict):
        for k in list(v)[-_WIDTH:]:
            _find(v[k], f"{path}[{k!r}]", depth - 1, fakes, seen, out)


def _reach(fn: Any) -> Iterator[Tuple[str, Any]]:
    """What a hook or loss function can store into: (name, object)."""
    if isinstance(fn, functools.partial):
        yield from ((f"an argument of {fn.func!r}", a) for a in fn.args)
        yield from ((f"{k}=", a) for k, a in (fn.keywords or {}).items())
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    if owner is not None and hasattr(owner, "__dict__") \
            and not isinstance(owner, torch.nn.Module):
        yield from ((f"{type(owner).__name__}.{k}", a) for k, a in vars(owner).items())
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            yield name, cell.cell_contents
        except ValueError:           # an empty cell
            continue
    for i, d in enumerate(getattr(fn, "__defaults__", None) or ()):
        yield f"default {i}", d
    g = getattr(fn, "__globals__", {})
    yield from ((n, g[n]) for n in code.co_names if n in g)


def _places(model: torch.nn.Module, loss_fn: Any) -> Iterator[Tuple[str, str, Any]]:
    """(where it was stored, what stored it, the object) for everything to look at."""
    from .reads import _ours
    for name, m in model.named_modules():
        prefix = f"model.{name}" if name else "model"
        for k, v in vars(m).items():
            if not k.startswith("_"):
                yield f"{prefix}.{k}", f"the forward of {type(m).__name__}", v
        for attr in _HOOKS:
            for h in getattr(m, attr, {}).values():
                if not _ours(h):
                    who = f"{attr[1:-1].replace('_', ' ')} {getattr(h, '__qualname__', h)!r} on {prefix}"
                    for n, v in _reach(h):
                        yield n, who, v
    if loss_fn is not None:
        for n, v in _reach(loss_fn):
            yield n, f"loss_fn {getattr(loss_fn, '__qualname__', loss_fn)!r}", v
    classes = {type(m) for m in model.modules()
               if not type(m).__module__.startswith("torch.")}
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        # the globals and closure a forward names: a cache dict filled in the forward
        for n, v in _reach(cls.__dict__.get("forward")):
            yield n, f"the forward of {cls.__name__}", v


def _reparametrized(model: torch.nn.Module
                    ) -> Iterator[Tuple[torch.nn.Module, str, Callable[[], Any]]]:
    """(module, attribute, how its hook computes it) for each tensor that torch's older
    reparametrizations (``nn.utils.weight_norm``, ``spectral_norm``, ``prune``) compute
    in a forward pre-hook and keep as a plain attribute."""
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm
    for m in model.modules():
        for h in m._forward_pre_hooks.values():
            if isinstance(h, WeightNorm):
                yield m, h.name, functools.partial(h.compute_weight, m)
            elif isinstance(h, SpectralNorm):
                yield m, h.name, functools.partial(h.compute_weight, m,
                                                   do_power_iteration=False)
            elif isinstance(h, BasePruningMethod):
                yield m, h._tensor_name, functools.partial(h.apply_mask, m)


def _recompute(model: torch.nn.Module, fakes: tuple) -> None:
    """Give back real values to the attributes of ``_reparametrized`` that the trace
    left fake, computed from the module's weights as the hook computes them (the
    user's code did not store them: no warning is due, and a CPU forward recomputes
    them anyway)."""
    for m, name, compute in _reparametrized(model):
        if isinstance(getattr(m, name, None), fakes):
            with torch.no_grad():      # called inside the Trainer's step: reads do not sync
                setattr(m, name, compute())


def check(trainer: Any) -> None:
    """After a trace of ``trainer``'s programs: warn once for each place that now
    holds a traced tensor (after giving the values torch's own weight hooks keep
    back, ``_recompute``)."""
    fakes = _fake_types()
    _recompute(trainer.model, fakes)
    warned = trainer._watch.warned
    seen: Set[int] = set()
    for where, who, v in _places(trainer.model, trainer.loss_fn):
        found: List[str] = []
        _find(v, where, 2, fakes, seen, found)
        for path in found:
            if f"leak:{path}" in warned:
                continue
            warned.add(f"leak:{path}")
            warn_at_caller(
                f"pw.Trainer: {path} holds a tensor that {who} stored while the step "
                "was traced. The step runs on the workers, so later steps do not update "
                "it and it holds no numbers (printing shows none; .item() raises). To "
                "read such a value every step, return it from loss_fn beside the loss "
                "(return loss, {'name': value}): trainer.step returns it as a pw.Array. "
                "A cache filled in the forward (a base grid keyed by shape) cannot "
                "keep it: compute it in every call, or keep it in a buffer",
                UserWarning)
