"""The optimizer update inside the step program: torch.optim's own code, traced.

The step program builds a torch optimizer of the user's class over the traced
parameters, hands it the state held on the workers and the gradients, and calls its
``step()``. Its in-place updates of parameters and state are the program's input
mutations, written back to their Arrays (donated: the update happens in place on the
workers). So every formula is torch's, options included (amsgrad, nesterov, maximize,
centered, ...). Per-step Python numbers never reach the trace as constants: the
learning rate comes in as a 0-d input, the step count is optimizer state on the
workers (``capturable=True``), so a schedule or the step count never forces a retrace.
The same holds for the other float hyperparameters a scheduler changes (OneCycleLR and
CyclicLR cycle ``momentum`` or ``betas``; weight-decay schedules write
``weight_decay``): once one changes between steps it becomes a 0-d input too
(``Hyper``), so a value per step costs one retrace, not one a step.

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


#: float hyperparameters of the step that may become inputs (``Hyper``) once they
#: change; the others (initial_accumulator_value, flags) stay part of the key.
DYNAMIC = frozenset({"momentum", "dampening", "weight_decay", "betas", "eps", "alpha",
                     "rho", "lr_decay", "momentum_decay"})
#: in a key, a hyperparameter that is an input: the sign(s) of its value, which
#: torch.optim's branches (``if weight_decay != 0``) read
_DYNAMIC_TAG = "pw.input"


def _sign(v: float) -> int:
    return (v > 0) - (v < 0)


def floats(opt: torch.optim.Optimizer) -> List[Dict[str, object]]:
    """Each group's hyperparameters of ``DYNAMIC`` (numbers, or tuples of numbers)."""
    return [{k: (tuple(v) if isinstance(v, (tuple, list)) else v)
             for k, v in g.items() if k in DYNAMIC} for g in opt.param_groups]


def describe(opt: torch.optim.Optimizer, dynamic: frozenset = frozenset()) -> Dict:
    """The optimizer's class and, per parameter group, the constructor arguments of
    the traced copy (hashable: they are part of the program's cache key). A name in
    ``dynamic`` is keyed by its value's sign only: its value is an input
    (``scalars``)."""
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
        for k in dynamic & kw.keys():
            v = kw[k]
            kw[k] = (_DYNAMIC_TAG, tuple(map(_sign, v)) if isinstance(v, (tuple, list))
                     else _sign(v))
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


def _dynamic(v) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and v[0] == _DYNAMIC_TAG


def _numbers(kw: tuple) -> Dict:
    """A group's keyword arguments with each input hyperparameter replaced by a number
    of its sign (0.5, 0 or -0.5: what torch's argument checks accept)."""
    def stand_in(sign):
        return tuple(map(stand_in, sign)) if isinstance(sign, tuple) else 0.5 * sign
    return {k: stand_in(v[1]) if _dynamic(v) else v for k, v in kw}


def _traced_copy(spec: Dict, params: List[List[torch.Tensor]]):
    groups = [dict(params=ps, lr=1e-3, **_numbers(kw)) for ps, kw in zip(params, spec["groups"])]
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
        kw = _numbers(spec["groups"][group])
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
           states: List[List[Dict[str, torch.Tensor]]],
           inputs: List[Dict[str, torch.Tensor]]) -> List[List[Dict[str, torch.Tensor]]]:
    """One optimizer step on traced tensors, per group: updates ``params`` and the
    tensors of ``states`` in place; returns every parameter's state afterwards (state
    the step created, SGD's first momentum buffer, is new there). ``inputs``: each
    group's ``scalars``."""
    opt = _traced_copy(spec, params)
    for g, kw, ins in zip(opt.param_groups, spec["groups"], inputs):
        # a tensor that requires grad takes torch.optim's tensor-lr paths everywhere
        g["lr"] = ins["lr"].detach().requires_grad_()
        for k, v in kw:
            if _dynamic(v):
                t = ins[k]
                g[k] = (tuple(Hyper(x, t[i]) for i, x in enumerate(g[k]))
                        if isinstance(g[k], tuple) else Hyper(g[k], t))
    for ps, gs, sts in zip(params, grads, states):
        for p, grad, st in zip(ps, gs, sts):
            p.grad = grad
            if st:
                opt.state[p] = dict(st)
    with torch.no_grad(), _TensorScalars():
        opt.step()
    return [[opt.state[p] for p in ps] for ps in params]


class Hyper(float):
    """A hyperparameter that is an input of the step, inside the traced optimizer: a
    float to torch.optim's Python code (a stand-in value of the input's sign, so its
    checks and branches take the path the key names) that carries the traced 0-d
    tensor ``t``. Arithmetic with numbers gives another Hyper (``1 - beta1``), with
    tensors a tensor; ``_TensorScalars`` hands ``t`` to the torch op a Hyper reaches."""

    def __new__(cls, value: float, t: torch.Tensor) -> "Hyper":
        h = super().__new__(cls, value)
        h.t = t
        return h


def _hyper_op(name: str):
    fop = getattr(float, name)

    def op(self, other):
        if isinstance(other, torch.Tensor):
            return NotImplemented
        value = fop(self, other)
        if value is NotImplemented:
            return value
        o = other.t if isinstance(other, Hyper) else other
        return Hyper(value, getattr(self.t, name)(o))
    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__pow__", "__rpow__"):
    setattr(Hyper, _name, _hyper_op(_name))
Hyper.__neg__ = lambda self: Hyper(-float(self), -self.t)


def _tensors(x, dtype):
    if isinstance(x, Hyper):
        return x.t.to(dtype) if dtype is not None else x.t
    if isinstance(x, (tuple, list)):
        return type(x)(_tensors(y, dtype) for y in x)
    return x


class _TensorScalars(TorchFunctionMode):
    """torch.optim passes the (tensor) learning rate as ``alpha=``/``value=`` of
    ``add_``/``addcdiv_``/``addcmul_``, which take Python numbers only (a read of the
    value while tracing): fold the factor into a tensor operand instead. A ``Hyper``
    an op receives becomes its tensor, of the dtype of the tensor it scales."""

    # add_(t, alpha=a) is add_(t * a); addcdiv_(t1, t2, value=v) is addcdiv_(t1 * v, t2)
    _FOLD = {"add", "add_", "sub", "sub_", "addcdiv", "addcdiv_", "addcmul", "addcmul_"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, Hyper) for a in (*args, *kwargs.values())):
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            dtype = first.dtype if first is not None and first.is_floating_point() else None
            args, kwargs = _tensors(args, dtype), {k: _tensors(v, dtype)
                                                   for k, v in kwargs.items()}
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


def scalars(opt: torch.optim.Optimizer, dynamic: frozenset = frozenset()
            ) -> List[Dict[str, torch.Tensor]]:
    """Each group's current learning rate (what a scheduler wrote) and hyperparameters
    of ``dynamic``, as float32 inputs (0-d; ``betas``: one per beta)."""
    return [{k: torch.tensor([float(x) for x in v] if isinstance(v, (tuple, list))
                             else float(v), dtype=torch.float32)
             for k, v in g.items() if k == "lr" or k in dynamic}
            for g in opt.param_groups]

