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

import collections
import contextlib
import functools
import inspect
import types
from typing import Dict, List, Tuple

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from ..client import opmath
from ..errors import PathwaysError
from . import numbers

#: torch.optim optimizers whose update is tensor arithmetic.
SUPPORTED = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
             "Adadelta", "ASGD", "Rprop", "Muon", "Adafactor")


class UnsupportedOptimizer(PathwaysError, TypeError):
    """An optimizer pw.Trainer cannot run (LBFGS, SparseAdam), or one holding what a
    compiled step cannot keep."""


_WHY = {
    "LBFGS": ("its step calls a closure that re-evaluates the loss several times and "
              "decides on the values (line search), where a step is one compiled program"),
    "SparseAdam": "it takes sparse gradients, and a step computes dense ones: use Adam",
}


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


#: in a group's inputs, the prefix of a generic optimizer's 0-d group tensors
GROUP_TENSOR = "pw.group."


class Chain:
    """Several optimizers over disjoint parameters, stepped together, as one: what
    ``pw.Trainer`` makes of a list (Muon for the weight matrices and AdamW for the
    rest). ``param_groups`` lists every optimizer's groups (the same dicts, so their
    schedulers' writes are seen); ``state`` reads and writes each parameter's state in
    the optimizer that holds it.

    Example::

        opts = [torch.optim.Muon(matrices, lr=2e-2), torch.optim.AdamW(others, lr=1e-3)]
        trainer = pw.Trainer(model, opts, loss_fn, slice=s)
    """

    def __init__(self, optimizers) -> None:
        self.optimizers = list(optimizers)
        for o in self.optimizers:
            if not isinstance(o, torch.optim.Optimizer):
                raise UnsupportedOptimizer(f"a list of optimizers holds a "
                                           f"{type(o).__name__}, not a torch.optim.Optimizer")
        self.refresh()

    def refresh(self) -> None:
        """Know which optimizer holds each parameter (again, after ``add_param_group``)."""
        owner: Dict[int, torch.optim.Optimizer] = {}
        for o in self.optimizers:
            for g in o.param_groups:
                for p in g["params"]:
                    if owner.setdefault(id(p), o) is not o:
                        raise UnsupportedOptimizer(
                            f"a parameter of shape {list(p.shape)} is in both "
                            f"{type(owner[id(p)]).__name__} and {type(o).__name__}: give "
                            "each parameter to one optimizer")
        self._owner = owner

    @property
    def param_groups(self) -> List[Dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> "_ChainState":
        return _ChainState(self)

    def state_dict(self) -> Dict:
        """Each optimizer's ``state_dict()``, in order (after ``trainer.sync_to()``)."""
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, sd: Dict) -> None:
        for o, one in zip(self.optimizers, sd["optimizers"]):
            o.load_state_dict(one)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def __repr__(self) -> str:
        return f"Chain({', '.join(type(o).__name__ for o in self.optimizers)})"


class _ChainState:
    """``Chain.state``: each parameter's state in its own optimizer (a defaultdict
    there, as in torch)."""

    def __init__(self, chain: Chain) -> None:
        self._chain = chain

    def _of(self, p) -> Dict:
        o = self._chain._owner.get(id(p))
        if o is None:
            raise KeyError(p)
        return o.state

    def __getitem__(self, p):
        return self._of(p)[p]

    def __setitem__(self, p, value) -> None:
        self._of(p)[p] = value

    def __contains__(self, p) -> bool:
        o = self._chain._owner.get(id(p))
        return o is not None and p in o.state

    def get(self, p, default=None):
        return self[p] if p in self else default

    def values(self):
        return [v for o in self._chain.optimizers for v in o.state.values()]

    def items(self):
        return [kv for o in self._chain.optimizers for kv in o.state.items()]


def members(opt) -> List[torch.optim.Optimizer]:
    """The optimizers ``opt`` stands for: itself, or a Chain's."""
    return opt.optimizers if isinstance(opt, Chain) else [opt]


def describe(opt, dynamic: frozenset = frozenset()) -> Dict:
    """The optimizer's classes (``members``: each with its number of parameter groups;
    one unless ``opt`` is a ``Chain``) and, per parameter group, the constructor
    arguments of the traced copy (hashable: they are part of the program's cache key).
    A name in ``dynamic`` is keyed by its value's sign only: its value is an input
    (``scalars``)."""
    classes, groups = [], []
    for o in members(opt):
        classes.append((type(o), len(o.param_groups), o))
        groups.extend(_describe_groups(o, dynamic))
    return {"members": tuple(classes), "groups": tuple(groups)}


def generic(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s own ``step`` is traced with its Python numbers followed
    (numbers.py): an optimizer from outside torch.optim (timm's, the user's own)."""
    cls = type(opt)
    return not (cls.__module__.split(".")[:2] == ["torch", "optim"]
                and cls.__name__ in SUPPORTED) and cls.__name__ not in _WHY


def _describe_generic(opt: torch.optim.Optimizer) -> List[tuple]:
    """A traced optimizer's groups by what is not a number (flags, names: constants of
    the trace); its numbers are sources (numbers.py)."""
    groups = []
    for g in opt.param_groups:
        kw = []
        for k in sorted(g):
            v = g[k]
            if k == "params" or numbers.is_number(v) or (
                    isinstance(v, torch.Tensor) and v.dim() == 0):
                continue            # numbers are sources; 0-d tensors group state
            if isinstance(v, (tuple, list)):
                v = tuple(None if numbers.is_number(x) else x for x in v)
            try:
                hash(v)
            except TypeError:
                raise UnsupportedOptimizer(
                    f"{type(opt).__name__}'s param group holds {k}={type(v).__name__}, "
                    "which a compiled step cannot take: numbers, flags and names only")
            if isinstance(v, torch.Tensor):
                raise UnsupportedOptimizer(
                    f"{type(opt).__name__}'s param group holds {k}, a tensor of shape "
                    f"{list(v.shape)}: numbers, flags, names and 0-d tensors only")
            kw.append((k, v))
        groups.append((("pw.generic", True),) + tuple(kw))
    return groups


def _describe_groups(opt: torch.optim.Optimizer, dynamic: frozenset) -> List[tuple]:
    cls = type(opt)
    if generic(opt):
        return _describe_generic(opt)
    if cls.__module__.split(".")[:2] != ["torch", "optim"] or cls.__name__ not in SUPPORTED:
        raise UnsupportedOptimizer(
            f"pw.Trainer cannot run {cls.__module__}.{cls.__name__}: "
            f"{_WHY[cls.__name__]}. It runs torch.optim's {', '.join(SUPPORTED)}, and "
            "optimizers from outside torch.optim (their own step, traced)")
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
            # half-precision parameters take torch's eager formulas (its default) where
            # they trace: their bias corrections and step sizes are numbers there, which
            # the capturable formulas fold into the half-precision tensors in another
            # order (RAdam's, ASGD's and Rprop's eager formulas branch on values)
            kw["capturable"] = cls.__name__ not in _EAGER_HALF or not all(
                p.dtype in opmath.HALF for p in g["params"])
        groups.append(tuple(sorted(kw.items())))
    return groups


#: torch.optim classes whose eager (not capturable) step traces on a step-count tensor
_EAGER_HALF = frozenset({"Adam", "AdamW", "Adamax", "NAdam", "RMSprop"})


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


def _split(spec: Dict):
    """(class, first group, end, the optimizer) of each optimizer the spec describes;
    a generic one's class is None."""
    at = 0
    for cls, n, opt in spec["members"]:
        yield (None if generic(opt) else cls), at, at + n, opt
        at += n


def _traced_copy(cls, kws, params: List[List[torch.Tensor]], lr: float = 1e-3):
    groups = [dict(params=ps, lr=lr, **_numbers(kw)) for ps, kw in zip(params, kws)]
    return cls(groups, lr=lr)


class _StopAfterInit(Exception):
    pass


def initial_state(spec: Dict, group: int, params: List[torch.Tensor], lr: float
                  ) -> List[Dict]:
    """torch's own initial state of ``params`` (CPU tensors) in group ``group``, made
    by the optimizer's ``_init_group`` (stopped before it updates anything), at the
    group's learning rate ``lr`` (Rprop's step sizes and ASGD's eta start from it).

    SGD's momentum buffer is the exception torch makes: absent until the first step,
    which copies the gradient (a buffer of zeros gives the same numbers only without
    dampening, so it starts as zeros then and absent otherwise)."""
    cls = next(c for c, lo, hi, _ in _split(spec) if lo <= group < hi)
    if cls is None:
        return [{} for _ in params]          # a generic step creates its state
    if cls.__name__ == "SGD":
        kw = _numbers(spec["groups"][group])
        if kw.get("momentum", 0) and not kw.get("dampening", 0):
            return [{"momentum_buffer": torch.zeros_like(p)} for p in params]
        return [{} for _ in params]
    ps = [p.detach().clone().requires_grad_() for p in params]
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt = _traced_copy(cls, [spec["groups"][group]], [ps], lr)
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
           inputs: List[Dict[str, torch.Tensor]], names: List[List[str]]
           ) -> Tuple[List[List[Dict[str, torch.Tensor]]], Dict]:
    """One optimizer step on traced tensors, per group: updates ``params`` and the
    tensors of ``states`` in place; returns every parameter's state afterwards, and
    the 0-d tensors generic steps made in their groups by (group, key) (state
    the step created, SGD's first momentum buffer, is new there; a generic step's
    state may replace a tensor). ``inputs``: each group's ``scalars`` (the first
    group's holding the generic steps' numbers, ``"pw.numbers"``); ``names``: the
    parameters' names, by group."""
    after, rec = [], None
    with contextlib.ExitStack() as stack:
        book = spec.get("book")
        if book is not None and any(c is None for c, *_ in _split(spec)):
            layout, slot, sources = book.pending
            rec = stack.enter_context(numbers.recording(book, layout, slot))
            vec = inputs[0]["pw.numbers"]
            nums = numbers.nums(sources, vec)
        for cls, lo, hi, user in _split(spec):
            if cls is None:
                after.extend(_generic_step(user, book, nums, lo, params[lo:hi],
                                           grads[lo:hi], states[lo:hi], names[lo:hi],
                                           inputs[lo:hi]))
            else:
                after.extend(_torch_step(cls, spec["groups"][lo:hi], params[lo:hi],
                                         grads[lo:hi], states[lo:hi], inputs[lo:hi]))
    return after, (rec.group_tensors if rec is not None else {})


def _torch_step(cls, kws, params, grads, states, inputs) -> List[List[Dict]]:
    """torch.optim's update over its groups, on a copy of the class (capturable, lr
    and changing hyperparameters as inputs)."""
    opt = _traced_copy(cls, kws, params)
    for g, kw, ins in zip(opt.param_groups, kws, inputs):
        # a tensor that requires grad takes torch.optim's tensor-lr paths everywhere
        g["lr"] = ins["lr"].detach().requires_grad_()
        for k, v in kw:
            if _dynamic(v):
                t = ins[k]
                g[k] = (tuple(Hyper(x, t[i]) for i, x in enumerate(g[k]))
                        if isinstance(g[k], tuple) else Hyper(g[k], t))
    narrow = {}
    for ps, gs, sts in zip(params, grads, states):
        for p, grad, st in zip(ps, gs, sts):
            p.grad = grad
            if st:
                opt.state[p] = dict(st)
                step = st.get("step")
                if p.dtype == torch.float64 and step is not None and step.dtype != p.dtype:
                    # torch (not capturable) takes the count as a Python float: its
                    # bias corrections are float64 math; a float32 count is exact, its
                    # powers are not
                    narrow[p] = step.dtype
                    opt.state[p]["step"] = step.to(torch.float64)
    with torch.no_grad(), _TensorScalars(), _traceable(cls.__name__):
        opt.step()
    for p, dtype in narrow.items():
        opt.state[p]["step"] = opt.state[p]["step"].to(dtype)
    return [[opt.state[p] for p in ps] for ps in params]


def _generic_step(user: torch.optim.Optimizer, book, nums: Dict, first: int, params,
                  grads, states, names, inputs) -> List[List[Dict]]:
    """The user's optimizer's own ``step`` on a shallow copy holding the traced
    parameters and state, its Python numbers as ``Num``s (numbers.py), and its groups'
    0-d tensors (timm's Lamb keeps its step count in one) as inputs. Records in the
    book's trace what the step left: numbers of state and groups (recomputed on the
    client after each step), the group tensors it made, and guards."""
    cls = type(user)
    # a shallow copy of every attribute (copy.copy would go through Optimizer's
    # __getstate__, which keeps only defaults, state and param_groups)
    opt = object.__new__(cls)
    opt.__dict__.update(user.__dict__)
    opt.param_groups, opt.state = [], collections.defaultdict(dict)
    opt._optimizer_step_pre_hooks = collections.OrderedDict()   # refused at construction
    opt._optimizer_step_post_hooks = collections.OrderedDict()
    given = {}
    for gi, (g, ps, ins) in enumerate(zip(user.param_groups, params, inputs), first):
        g2 = {}
        for k, v in g.items():
            if isinstance(v, (tuple, list)) and any(numbers.is_number(x) for x in v):
                v = type(v)(nums.get(("g", gi, k, i), x) for i, x in enumerate(v))
            elif not isinstance(v, torch.Tensor):
                v = nums.get(("g", gi, k, -1), v)
            g2[k] = v
        for k, t in ins.items():
            if k.startswith(GROUP_TENSOR):
                g2[k[len(GROUP_TENSOR):]] = t
        g2["params"] = ps
        opt.param_groups.append(g2)
        given[gi] = dict(g2)
    for ps, gs, sts, ns in zip(params, grads, states, names):
        for p, grad, st, n in zip(ps, gs, sts, ns):
            p.grad = grad
            held = {k: nums.get(("s", n, k, -1), v) for k, v in book.mirror.get(n, {}).items()}
            if st or held:
                opt.state[p] = {**st, **held}
    with torch.no_grad(), _TensorScalars(), numbers.traced_math(cls):
        try:
            cls.step(opt)
        except (AssertionError, ValueError, RuntimeError, TypeError) as e:
            if "closure" not in str(e).lower():
                raise
            raise UnsupportedOptimizer(
                f"{cls.__name__}.step needs a closure ({type(e).__name__}: "
                f"{str(e).splitlines()[0]}): it "
                "evaluates the loss again (sharpness-aware minimisation, a line search), "
                "and pw.Trainer's step is one compiled program with one forward and "
                "backward, which calls no closure. Write the second pass in the model's "
                "forward or the loss_fn (SAM: the gradient's norm, then the loss at the "
                "perturbed weights with torch.func.functional_call, and a plain "
                "optimizer), or write the whole step as a @pw.program") from None
    rec = book.recording
    for gi, g2 in enumerate(opt.param_groups, first):
        for k, v in g2.items():
            if k == "params" or (k in given[gi] and v is given[gi][k]):
                continue
            if isinstance(v, torch.Tensor):
                if v.dim() != 0:
                    raise UnsupportedOptimizer(
                        f"{cls.__name__} keeps {k}, a tensor of shape {list(v.shape)}, "
                        "in a param group: a compiled step keeps 0-d tensors there")
                rec.group_tensors[(gi, k)] = v      # made or replaced by the step
            elif numbers.kept(v):
                rec.groups[(gi, k)] = numbers.output(v)
            elif isinstance(v, tuple) and all(numbers.kept(x) for x in v):
                rec.groups[(gi, k)] = tuple(numbers.output(x) for x in v)
            else:
                raise UnsupportedOptimizer(
                    f"{cls.__name__}'s step sets {k} = {type(v).__name__} in a param "
                    "group: a compiled step keeps numbers, flags, names and 0-d tensors")
    out = []
    for ps, ns in zip(params, names):
        part = []
        for p, n in zip(ps, ns):
            tensors = {}
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    tensors[k] = v
                elif numbers.kept(v):
                    rec.state[(n, k)] = numbers.output(v)
                else:
                    raise UnsupportedOptimizer(
                        f"{cls.__name__} keeps state[{k!r}] = {type(v).__name__} for "
                        f"parameter {n!r}: a compiled step keeps tensors, numbers, "
                        "flags, names and None")
            part.append(tensors)
        out.append(part)
    return out


@contextlib.contextmanager
def _traceable(kind: str):
    """torch.optim's code with its reads of values replaced, for the optimizers whose
    update reads them (Adafactor: the step count and two norms, through ``.item()``)."""
    if kind != "Adafactor":
        yield
        return
    from torch.optim import _adafactor
    old = _adafactor._single_tensor_adafactor
    _adafactor._single_tensor_adafactor = _adafactor_update
    try:
        yield
    finally:
        _adafactor._single_tensor_adafactor = old


def _adafactor_update(params, grads, row_vars, col_vars, variances, state_steps,
                      grad_scale, found_inf, *, d, lr, beta2_decay, weight_decay, eps1,
                      eps2, maximize, has_complex):
    """torch.optim's ``_single_tensor_adafactor`` (torch 2.9), line for line, with its
    three ``.item()`` reads and the Python ``min``/``max`` of them as tensor ops."""
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        step_t = state_steps[i]
        row_var, col_var, variance = row_vars[i], col_vars[i], variances[i]
        if eps1 is None:
            eps1 = torch.finfo(param.dtype).eps
        step_t += 1
        one_minus_beta2_t = step_t ** beta2_decay
        rho_t = torch.clamp(1 / step_t.sqrt(), max=lr) if not isinstance(lr, torch.Tensor) \
            else torch.minimum(lr, 1 / step_t.sqrt())
        alpha = torch.clamp(param.norm(2) / (param.numel() ** 0.5), min=eps2) * rho_t
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        if grad.dim() > 1:
            row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            row_var.lerp_(row_mean, one_minus_beta2_t)
            col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
            col_var.lerp_(col_mean, one_minus_beta2_t)
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            variance.lerp_(grad * grad, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        denom = torch.clamp(update.norm(2) / ((update.numel() ** 0.5) * d), min=1.0)
        param.add_(update * (-alpha / denom).to(update.dtype))


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
    if isinstance(x, numbers.Num):
        return numbers.to_tensors(x, dtype)
    if isinstance(x, Hyper):
        return x.t.to(dtype) if dtype is not None else x.t
    if isinstance(x, (tuple, list)):
        return type(x)(_tensors(y, dtype) for y in x)
    return x


def _builtin(func) -> bool:
    """A torch function implemented in C++ (an aten op behind torch's argument parser)."""
    return isinstance(func, (types.BuiltinFunctionType, types.MethodDescriptorType,
                             types.WrapperDescriptorType))


@functools.lru_cache(maxsize=None)
def _numbers_only(name: str) -> Tuple[frozenset, frozenset]:
    """(positions, names) of the arguments of aten op ``name`` that no overload takes
    as a tensor: ``cosine_similarity``'s ``eps``, ``full_like``'s ``fill_value``."""
    try:
        schemas = torch._C._jit_get_schemas_for_operator("aten::" + name)
    except RuntimeError:
        schemas = []
    if not schemas:
        return frozenset(), frozenset()
    tensor_at, tensor_named, seen_at, seen_named = set(), set(), set(), set()
    for schema in schemas:
        for i, arg in enumerate(schema.arguments):
            takes_tensor = "Tensor" in str(arg.type)
            seen_named.add(arg.name)
            if not arg.kwarg_only:
                seen_at.add(i)
                if takes_tensor:
                    tensor_at.add(i)
            if takes_tensor:
                tensor_named.add(arg.name)
    # alpha= and value= scale an operand instead (_TensorScalars._FOLD)
    return frozenset(seen_at - tensor_at), frozenset(seen_named - tensor_named -
                                                     {"alpha", "value"})


def _as_values(name: str, args, kwargs):
    """The step's numbers where op ``name`` takes only a Python number as their values,
    which the step guards (a changed value traces again, as after a ``float()``):
    as a 0-d tensor there, torch's argument parser would read it, which a trace cannot
    (AdamP's ``F.cosine_similarity(..., eps=group["eps"])``). Not a torch.optim
    hyperparameter: its float is a stand-in."""
    at, named = _numbers_only(name)
    if not at and not named:
        return args, kwargs

    def value(x):
        if isinstance(x, numbers.Num):
            return int(x) if isinstance(x.value, int) else float(x)
        return x
    return (tuple(value(a) if i in at else a for i, a in enumerate(args)),
            {k: value(v) if k in named else v for k, v in kwargs.items()})


def _scalar_tensor_meets_half(tree) -> bool:
    """Half-precision tensors and a 0-d float32/float64 tensor in one op: inside a
    torch.optim step that tensor is what torch's eager run has as a Python number (a
    bias correction, a step size from the count or the learning rate)."""
    half = opmath.half_type(tree)
    return half is not None and any(
        isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point() and
        t.dtype != half for t in pytree.tree_leaves(tree))


class _TensorScalars(TorchFunctionMode):
    """torch.optim passes the (tensor) learning rate as ``alpha=``/``value=`` of
    ``add_``/``addcdiv_``/``addcmul_``, which take Python numbers only (a read of the
    value while tracing): fold the factor into a tensor operand instead. A ``Hyper``
    an op receives becomes its tensor, of the dtype of the tensor it scales."""

    # add_(t, alpha=a) is add_(t * a); addcdiv_(t1, t2, value=v) is addcdiv_(t1 * v, t2)
    _FOLD = {"add", "add_", "sub", "sub_", "addcdiv", "addcdiv_", "addcmul", "addcmul_"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if any(isinstance(a, (Hyper, numbers.Num)) or (isinstance(a, (tuple, list)) and any(
                isinstance(x, (Hyper, numbers.Num)) for x in a))
               for a in (*args, *kwargs.values())):
            if name.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
                return self._unrolled(name, args, kwargs)
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            dtype = first.dtype if first is not None and first.is_floating_point() else None
            if _builtin(func):
                args, kwargs = _as_values(name, args, kwargs)
            half = opmath.half_type((args, kwargs))
            if half is not None:
                return self._in_float(func, name, half, args, kwargs)
            args, kwargs = _tensors(args, dtype), {k: _tensors(v, dtype)
                                                   for k, v in kwargs.items()}
        elif _scalar_tensor_meets_half((args, kwargs)):
            return self._in_float(func, name, opmath.half_type((args, kwargs)), args, kwargs)
        for key in ("alpha", "value"):
            v = kwargs.get(key)
            if isinstance(v, torch.Tensor):
                kwargs = {k: x for k, x in kwargs.items() if k != key}
                if name in self._FOLD:
                    return func(args[0], args[1] * v, *args[2:], **kwargs)
                if name.startswith("_foreach_") and name[9:] in self._FOLD:
                    return func(args[0], torch._foreach_mul(args[1], v), *args[2:], **kwargs)
                raise UnsupportedOptimizer(f"the optimizer called {name} with a tensor "
                                           f"{key}; pathways_torch cannot trace that")
        return func(*args, **kwargs)

    def _in_float(self, func, name: str, half: torch.dtype, args, kwargs):
        """An op of half-precision tensors and a number, as torch runs it: torch takes
        the number as a Python scalar, which its kernel keeps in float32 with the
        operands (``exp_avg.lerp_(grad, 1 - beta)``, ``p.addcdiv_(m, d, value=-lr)``),
        and rounds the result once. As a half-precision 0-d tensor the number was
        rounded first, and a folded ``value`` rounded its product: timm's Adafactor
        with bfloat16 momentum drifted 5e-5 from torch in 4 steps."""
        def up(v):
            return v.float() if isinstance(v, torch.Tensor) and v.dtype == half else v
        args_f = _tensors(pytree.tree_map(up, args), torch.float32)
        kwargs_f = {k: _tensors(pytree.tree_map(up, v), torch.float32)
                    for k, v in kwargs.items()}
        if name.rstrip("_") in ("add", "sub") and isinstance(kwargs_f.get("alpha"),
                                                              torch.Tensor):
            kwargs_f["alpha"] = kwargs_f["alpha"].to(half).float()   # as torch's kernel
        if name.rstrip("_") == "addcmul":
            # a 0-d factor takes the tensors' type, as in torch (SGD's tensor-lr path,
            # p.addcmul_(grad, lr, value=-1), is its eager p.add_(grad, alpha=-lr))
            args_f = tuple(a.to(half).float() if i in (1, 2) and isinstance(a, torch.Tensor)
                           and a.dim() == 0 else a for i, a in enumerate(args_f))
        out = opmath.rounded(self.__torch_function__(func, (), args_f, kwargs_f), half)
        inplace = (name.endswith("_") and not name.startswith("__")) or \
            name.startswith("__i")
        if inplace and isinstance(out, torch.Tensor):
            return args[0].copy_(out)
        return out

    def _unrolled(self, name: str, args, kwargs):
        """A ``torch._foreach_*`` op given a traced number: its overloads would read
        the number's value (a Scalar), so it runs as the per-tensor op it stands for
        (``_foreach_lerp_(xs, ys, w)`` is ``x.lerp_(y, w)`` for each pair), each through
        this mode."""
        base = name[len("_foreach_"):]
        n = len(args[0])
        if base.rstrip("_") in ("addcmul", "addcdiv") and len(args) == 4:
            args, kwargs = args[:3], {**kwargs, "value": args[3]}   # keyword-only per tensor

        def at(a, i):
            return a[i] if isinstance(a, (list, tuple)) and len(a) == n else a
        op = getattr(torch.Tensor, base, None)
        if op is None:                                  # _foreach_maximum_: no maximum_
            pure = getattr(torch, base.rstrip("_"))

            def op(x, *a, **k):
                return x.copy_(pure(x, *a, **k))
        out = [self.__torch_function__(op, (), tuple(at(a, i) for a in args),
                                       {k: at(v, i) for k, v in kwargs.items()})
               for i in range(n)]
        return None if base.endswith("_") else out


def scalars(opt: torch.optim.Optimizer, dynamic: frozenset = frozenset()
            ) -> List[Dict[str, torch.Tensor]]:
    """Each group's current learning rate (what a scheduler wrote) and hyperparameters
    of ``dynamic``, as inputs (0-d; ``betas``: one per beta): float32, or float64 for a
    group that holds float64 parameters (torch applies a Python float there; an lr
    rounded to float32 moved float64 training off torch's by 1e-7 a step)."""
    def dtype(g: Dict) -> torch.dtype:
        wide = any(p.dtype == torch.float64 for p in g["params"])
        return torch.float64 if wide else torch.float32

    return [{k: torch.tensor([float(x) for x in v] if isinstance(v, (tuple, list))
                             else float(v), dtype=dtype(g))
             for k, v in g.items() if k == "lr" or k in dynamic}
            for g in opt.param_groups]

