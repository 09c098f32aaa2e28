"""The optimizer update inside the step program: torch.optim's own code, traced.

The step program builds a torch optimizer of the user's class over the traced
parameters, hands it the state held on the workers and the gradients, and calls its
``step()``. Its in-place updates of parameters and state are the program's input
mutations, written back to their Arrays (donated: the update happens in place on the
workers). So every formula is torch's, options included (amsgrad, nesterov, maximize,
centered, ...). Per-step Python numbers never reach the trace as constants: the
learning rate comes in as a 0-d input, the step count is optimizer state on the
workers (``capturable=True``), so a schedule or the step count never forces a retrace.

Example (what the step program does, on traced tensors)::

    new_state = update(spec, [params], [grads], [states], [lr])
"""

from __future__ import annotations

import functools
import inspect
from typing import Dict, List

import torch
from torch.overrides import TorchFunctionMode

from ..errors import PathwaysError

#: torch.optim optimizers whose update is tensor arithmetic.
SUPPORTED = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
             "Adadelta")


class UnsupportedOptimizer(PathwaysError, TypeError):
    """pw.Trainer runs torch.optim's SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop,
    Adagrad and Adadelta."""


def describe(opt: torch.optim.Optimizer) -> Dict:
    """The optimizer's class and, per parameter group, the constructor arguments of
    the traced copy (hashable: they are part of the program's cache key)."""
    cls = type(opt)
    if cls.__module__.split(".")[:2] != ["torch", "optim"] or cls.__name__ not in SUPPORTED:
        raise UnsupportedOptimizer(
            f"pw.Trainer runs torch.optim's {', '.join(SUPPORTED[:-1])} and "
            f"{SUPPORTED[-1]}, not {cls.__module__}.{cls.__name__} (its update needs "
            "values read back in Python, or is not torch.optim's)")
    params = _constructor_args(cls)
    groups = []
    for g in opt.param_groups:
        kw = {k: v for k, v in g.items()
              if k in params and k not in ("params", "lr", "foreach", "fused",
                                           "capturable", "differentiable")}
        if any(isinstance(v, torch.Tensor) for v in _leaves(kw)):
            raise UnsupportedOptimizer(
                f"{cls.__name__}: hyperparameters other than lr must be Python numbers")
        kw["foreach"] = False
        if "capturable" in params:
            kw["capturable"] = True
        groups.append(tuple(sorted(kw.items())))
    return {"cls": cls, "kind": cls.__name__, "groups": tuple(groups)}


@functools.lru_cache(maxsize=None)
def _constructor_args(cls) -> frozenset:
    # describe() runs every step (a scheduler may change hyperparameters); the
    # signature of a class does not change
    return frozenset(inspect.signature(cls.__init__).parameters)


def _leaves(kw):
    for v in kw.values():
        yield from (v if isinstance(v, (tuple, list)) else (v,))


def _traced_copy(spec: Dict, params: List[List[torch.Tensor]]):
    groups = [dict(params=ps, lr=1e-3, **dict(kw)) for ps, kw in zip(params, spec["groups"])]
    return spec["cls"](groups, lr=1e-3)


class _StopAfterInit(Exception):
    pass


def initial_state(spec: Dict, group: int, params: List[torch.Tensor]) -> List[Dict]:
    """torch's own initial state of ``params`` (CPU tensors) in group ``group``, made
    by the optimizer's ``_init_group`` (stopped before it updates anything).

    SGD's momentum buffer is the exception torch makes: absent until the first step,
    which copies the gradient (a buffer of zeros gives the same numbers only without
    dampening, so it starts as zeros then and absent otherwise)."""
    if spec["kind"] == "SGD":
        kw = dict(spec["groups"][group])
        if kw.get("momentum", 0) and not kw.get("dampening", 0):
            return [{"momentum_buffer": torch.zeros_like(p)} for p in params]
        return [{} for _ in params]
    ps = [p.detach().clone().requires_grad_() for p in params]
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt = _traced_copy(dict(spec, groups=(spec["groups"][group],)), [ps])
    init = opt._init_group

    def init_only(*args, **kwargs):
        init(*args, **kwargs)
        raise _StopAfterInit

    opt._init_group = init_only
    try:
        opt.step()
    except _StopAfterInit:
        pass
    return [{k: v.detach() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
            for p in ps]


def update(spec: Dict, params: List[List[torch.Tensor]], grads: List[List[torch.Tensor]],
           states: List[List[Dict[str, torch.Tensor]]], lrs: List[torch.Tensor]
           ) -> List[List[Dict[str, torch.Tensor]]]:
    """One optimizer step on traced tensors, per group: updates ``params`` and the
    tensors of ``states`` in place; returns every parameter's state afterwards (state
    the step created, SGD's first momentum buffer, is new there)."""
    opt = _traced_copy(spec, params)
    for g, lr in zip(opt.param_groups, lrs):
        # a tensor that requires grad takes torch.optim's tensor-lr paths everywhere
        g["lr"] = lr.detach().requires_grad_()
    for ps, gs, sts in zip(params, grads, states):
        for p, grad, st in zip(ps, gs, sts):
            p.grad = grad
            if st:
                opt.state[p] = dict(st)
    with torch.no_grad(), _TensorScalars():
        opt.step()
    return [[opt.state[p] for p in ps] for ps in params]


class _TensorScalars(TorchFunctionMode):
    """torch.optim passes the (tensor) learning rate as ``alpha=``/``value=`` of
    ``add_``/``addcdiv_``/``addcmul_``, which take Python numbers only (a read of the
    value while tracing): fold the factor into a tensor operand instead."""

    # add_(t, alpha=a) is add_(t * a); addcdiv_(t1, t2, value=v) is addcdiv_(t1 * v, t2)
    _FOLD = {"add", "add_", "sub", "sub_", "addcdiv", "addcdiv_", "addcmul", "addcmul_"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for key in ("alpha", "value"):
            v = kwargs.get(key)
            if isinstance(v, torch.Tensor):
                kwargs = {k: x for k, x in kwargs.items() if k != key}
                name = getattr(func, "__name__", "")
                if name in self._FOLD:
                    return func(args[0], args[1] * v, *args[2:], **kwargs)
                raise UnsupportedOptimizer(f"torch.optim called {name} with a tensor "
                                           f"{key}; pathways_torch cannot trace that")
        return func(*args, **kwargs)


def lr_tensors(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Each group's current learning rate (what a scheduler wrote), as a 0-d input."""
    return [torch.tensor(float(g["lr"]), dtype=torch.float32) for g in opt.param_groups]

