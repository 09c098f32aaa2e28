"""Python numbers inside a traced optimizer step: inputs with guards, not constants.

An optimizer written outside torch.optim (timm's, a paper's, the user's own) keeps
step counts as Python numbers (``state["step"] += 1``) and computes with them and with
its hyperparameters in Python (``math.sqrt(1 - beta2 ** step)``). Traced as they are,
those numbers would be constants of the step program, and a step count that changes
every step would compile a program every step.

So while such a step is traced, every Python number of its param groups and of its
per-parameter state is a ``Num``: its value now, a function of the *sources* (the
numbers before the step) that recomputes it, and a traced 0-d tensor that computes it
on the device from the step's one vector of sources. Arithmetic (and ``math``'s
functions, in the optimizer's module) gives more Nums; a torch op that receives one
takes its tensor. Whatever Python does with a value itself is a *guard*: a branch on a
comparison records its outcome, a ``float()``/``int()``/``range()`` its value. A trace
serves every later step whose sources give the same guard outcomes (``Book.select``);
another outcome traces again. The numbers the step leaves in its state and groups are
recomputed on the client from the sources (``Book.advance``), so the client keeps them
as torch would, without reading anything back.

Example::

    book = Book()
    slot = book.select(layout, sources)          # before the call: which trace
    ...                                           # the call (traces on a new slot)
    book.advance(layout, slot, sources)          # after: the numbers the step left
"""

from __future__ import annotations

import contextlib
import math
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

#: traces of one layout before a warning that the step's numbers keep retracing (when
#: values are guarded; when only branches are)
_MANY = 3
_MANY_BRANCHES = 8


class Num:
    """A Python number of a traced optimizer step (see the module docstring)."""

    __slots__ = ("value", "fn", "t")

    def __init__(self, value, fn: Callable, t: torch.Tensor) -> None:
        self.value, self.fn, self.t = value, fn, t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch's argument parser takes an object with __torch_function__ wherever it
        # takes a number; the optimizer's TorchFunctionMode (optim._TensorScalars),
        # active while the step is traced, hands the op the Num's tensor before this
        # runs, so this serves only a Num that meets torch outside it
        kwargs = kwargs or {}
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        dtype = first.dtype if first is not None and first.is_floating_point() else None
        return func(*to_tensors(tuple(args), dtype),
                    **{k: to_tensors(v, dtype) for k, v in kwargs.items()})

    # --- what Python does with the value itself: guarded
    def _guard(self, outcome, fn: Callable, what: str):
        _BOOK.guard(fn, outcome, what)
        return outcome

    def __bool__(self):
        return self._guard(bool(self.value), lambda s: bool(self.fn(s)), "bool()")

    def __float__(self):
        return self._guard(float(self.value), lambda s: float(self.fn(s)), "float()")

    def __int__(self):
        return self._guard(int(self.value), lambda s: int(self.fn(s)), "int()")

    def __index__(self):
        return self._guard(self.value.__index__(), lambda s: self.fn(s).__index__(),
                           "an index")

    def __hash__(self):
        return self._guard(hash(self.value), lambda s: hash(self.fn(s)), "hash()")

    def __format__(self, spec):
        return format(self._guard(self.value, self.fn, "a format"), spec)

    def __repr__(self):
        return f"Num({self.value!r})"

    def __round__(self, n=None):
        return self._guard(round(self.value, n), lambda s: round(self.fn(s), n), "round()")


def _value(x):
    return x.value if isinstance(x, Num) else x


def _fn(x) -> Callable:
    return x.fn if isinstance(x, Num) else (lambda s, x=x: x)


def _tensor(x, like: torch.Tensor) -> torch.Tensor:
    return x.t if isinstance(x, Num) else torch.full((), x, dtype=like.dtype)


def _number(x) -> bool:
    return isinstance(x, Num) or (isinstance(x, (int, float)) and not isinstance(x, bool))


def _binary(name: str, py: Callable, reflected: bool = False):
    def op(self, other):
        if not _number(other):
            return NotImplemented
        a, b = (other, self) if reflected else (self, other)
        value = py(_value(a), _value(b))
        fa, fb = _fn(a), _fn(b)
        ta, tb = _tensor(a, self.t), _tensor(b, self.t)
        return Num(value, lambda s: py(fa(s), fb(s)), _TORCH[name](ta, tb))
    op.__name__ = f"__{'r' if reflected else ''}{name}__"
    return op


_TORCH = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.div,
          "pow": torch.pow, "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"),
          "mod": torch.remainder}
_PY = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
       "truediv": lambda a, b: a / b, "pow": lambda a, b: a ** b,
       "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b}
for _name, _py in _PY.items():
    setattr(Num, f"__{_name}__", _binary(_name, _py))
    setattr(Num, f"__r{_name}__", _binary(_name, _py, reflected=True))


def _compare(name: str, py: Callable):
    def op(self, other):
        if not _number(other):
            return NotImplemented
        fa, fb = self.fn, _fn(other)
        return self._guard(py(self.value, _value(other)), lambda s: py(fa(s), fb(s)),
                           f"a comparison ({name})")
    op.__name__ = f"__{name}__"
    return op


for _name, _py in {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
                   "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
                   "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b}.items():
    setattr(Num, f"__{_name}__", _compare(_name, _py))


def _unary(py: Callable, tf: Callable):
    def op(self):
        f = self.fn
        return Num(py(self.value), lambda s: py(f(s)), tf(self.t))
    return op


Num.__neg__ = _unary(lambda a: -a, torch.neg)
Num.__pos__ = _unary(lambda a: +a, lambda t: t)
Num.__abs__ = _unary(abs, torch.abs)


# ---------------------------------------------------------------------- math, traced

def _math(name: str, tf: Callable):
    py = getattr(math, name)

    def fn(*args):
        if not any(isinstance(a, Num) for a in args):
            return py(*args)
        values, fns = [_value(a) for a in args], [_fn(a) for a in args]
        like = next(a.t for a in args if isinstance(a, Num))
        return Num(py(*values), lambda s: py(*(f(s) for f in fns)),
                   tf(*(_tensor(a, like) for a in args)))
    fn.__name__ = name
    return fn


_MATH = {name: _math(name, tf) for name, tf in {
    "sqrt": torch.sqrt, "exp": torch.exp, "log": torch.log, "log2": torch.log2,
    "log10": torch.log10, "log1p": torch.log1p, "expm1": torch.expm1, "pow": torch.pow,
    "cos": torch.cos, "sin": torch.sin, "tanh": torch.tanh, "atan": torch.atan,
    "floor": torch.floor, "ceil": torch.ceil, "fabs": torch.abs}.items()}


class _MathModule:
    """``math`` as the optimizer's module sees it while its step is traced."""

    def __getattr__(self, name):
        return _MATH.get(name) or getattr(math, name)


class traced_math:
    """Within the block, ``math`` and the ``math`` functions a module imported by name
    take Nums, in the modules of ``cls`` and its bases."""

    def __init__(self, cls) -> None:
        self.modules = {sys.modules[c.__module__] for c in cls.__mro__
                        if c.__module__ in sys.modules
                        and not c.__module__.startswith(("torch.", "builtins"))}
        self.saved: List[Tuple[Any, str, Any]] = []

    def __enter__(self):
        for mod in self.modules:
            for k, v in list(vars(mod).items()):
                if v is math:
                    self.saved.append((mod, k, v))
                    setattr(mod, k, _MathModule())
                elif callable(v) and getattr(v, "__name__", None) in _MATH \
                        and getattr(math, v.__name__) is v:
                    self.saved.append((mod, k, v))
                    setattr(mod, k, _MATH[v.__name__])
        return self

    def __exit__(self, *exc):
        for mod, k, v in self.saved:
            setattr(mod, k, v)
        self.saved.clear()


# ---------------------------------------------------------------------- the book

class _Trace:
    """What one trace of the step recorded: guards and the numbers it left."""

    def __init__(self) -> None:
        self.guards: List[Tuple[Callable, Any, str]] = []
        self.state: Dict[Tuple[str, str], Callable] = {}       # (param, key) -> fn
        self.groups: Dict[Tuple[int, str], Any] = {}           # (group, key) -> fn / tuple
        self.group_tensors: Dict[Tuple[int, str], torch.Tensor] = {}   # traced, returned


class TraceKey(str):
    """In a step program's key (a static string): the trace whose guards the numbers
    pass, and their layout. The Book says when these keep changing
    (``warns_itself``), in the optimizer's terms rather than the program's."""

    warns_itself = True

    def __new__(cls, layout: tuple, slot: int) -> "TraceKey":
        return super().__new__(cls, f"trace {slot} of {layout!r}")


class Book:
    """A Trainer's record of the numbers of its traced optimizer steps: the numbers
    each parameter's state holds (``mirror``, what torch's state would hold), and per
    layout of sources the traces made so far with their guards."""

    def __init__(self) -> None:
        self.mirror: Dict[str, Dict[str, Any]] = {}
        # 0-d tensors the steps keep in param groups (Arrays on the workers)
        self.group_tensors: Dict[Tuple[int, str], Any] = {}
        self.traces: Dict[tuple, List[_Trace]] = {}
        self.recording: Optional[_Trace] = None
        self.warned = False

    def select(self, layout: tuple, sources: List) -> int:
        """The trace whose guards hold for ``sources`` (an index; a new one traces)."""
        traces = self.traces.setdefault(layout, [])
        for k, tr in enumerate(traces):
            if tr is not None and all(fn(sources) == outcome for fn, outcome, _ in tr.guards):
                return k
        if not self.warned and _too_many(traces):
            self.warned = True
            _warn_retrace(traces)
        traces.append(None)
        return len(traces) - 1

    def guard(self, fn: Callable, outcome, what: str) -> None:
        if self.recording is None:
            return                       # a Num used after its trace: nothing to guard
        where = _user_frame()
        self.recording.guards.append((fn, outcome, f"{what} at {where}"))

    def advance(self, layout: tuple, slot: int, sources: List, groups: List[Dict]) -> None:
        """After a step: the numbers its state and groups hold now, as torch's step
        would have left them, computed from the sources of the step."""
        tr = self.traces[layout][slot]
        for (name, key), fn in tr.state.items():
            self.mirror.setdefault(name, {})[key] = fn(sources)
        for (gi, key), fn in tr.groups.items():
            groups[gi][key] = (tuple(f(sources) for f in fn) if isinstance(fn, tuple)
                               else fn(sources))


_BOOK = Book()          # the book of the trace in progress (traces run one at a time)


@contextlib.contextmanager
def recording(book: Book, layout: tuple, slot: int):
    """Record the trace of ``slot`` into ``book``; the record is kept only if the trace
    completes."""
    global _BOOK
    prev, _BOOK = _BOOK, book
    book.recording = rec = _Trace()
    try:
        yield rec
        traces = book.traces.setdefault(layout, [])
        traces.extend([None] * (slot + 1 - len(traces)))
        traces[slot] = rec
    finally:
        book.recording, _BOOK = None, prev


def _user_frame() -> str:
    """file:line of the optimizer code that used a value (outside this module)."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if not frame.filename.endswith(("numbers.py", "overrides.py")):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


def _exact(traces: List[_Trace]) -> List[str]:
    """The guards on a value itself (float(), an index, ...), not on a comparison."""
    return [what for tr in traces if tr is not None for _, _, what in tr.guards
            if not what.startswith(("a comparison", "bool()"))]


def _too_many(traces: List[_Trace]) -> bool:
    """Whether the next trace of a layout deserves a warning: the third when values
    themselves are guarded (each new value is a trace), the eighth when only branches
    are (a warm-up, a rectification: a few outcomes)."""
    return len(traces) + 1 >= (_MANY if _exact(traces) else _MANY_BRANCHES)


def _warn_retrace(traces: List[_Trace]) -> None:
    import warnings
    from ..errors import RetraceWarning
    seen = _exact(traces) or [what for tr in traces if tr is not None
                              for _, _, what in tr.guards]
    warnings.warn(RetraceWarning(
        f"the optimizer's step is being traced and compiled again ({len(traces) + 1} "
        "programs so far) for new values of its Python numbers: its code uses a "
        f"changing number as a plain value ({', '.join(sorted(set(seen))[:3])}), so "
        "each new value is a new program. Compute with the number instead (arithmetic "
        "and math's functions are followed), or keep it in a tensor"), stacklevel=6)


# ---------------------------------------------------------------------- sources

def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def kept(v) -> bool:
    """Whether a step may leave ``v`` in its state or groups for the client to keep: a
    number (a source of the next step) or a constant of the trace (a flag, a name,
    None), which the next step's key holds."""
    return isinstance(v, Num) or is_number(v) or v is None or isinstance(v, (bool, str))


def group_sources(groups: List[Dict]) -> List[Tuple[tuple, Any]]:
    """(path, value) of every number of ``groups`` (numbers in tuples included), by
    group index and key."""
    out = []
    for gi, g in enumerate(groups):
        for k in sorted(g):
            v = g[k]
            if k == "params":
                continue
            if is_number(v):
                out.append((("g", gi, k, -1), v))
            elif isinstance(v, (tuple, list)):
                out.extend((("g", gi, k, i), x) for i, x in enumerate(v) if is_number(x))
    return out


def state_sources(mirror: Dict[str, Dict[str, Any]], names: List[str]
                  ) -> List[Tuple[tuple, Any]]:
    """(path, value) of the numbers of the parameters' state the client keeps."""
    return [(("s", n, k, -1), mirror[n][k]) for n in names if n in mirror
            for k in sorted(mirror[n]) if is_number(mirror[n][k])]


def state_constants(mirror: Dict[str, Dict[str, Any]], names: List[str]) -> tuple:
    """The flags, names and Nones of that state: constants of a trace, so its key."""
    return tuple(("c", n, k, mirror[n][k]) for n in names if n in mirror
                 for k in sorted(mirror[n]) if not is_number(mirror[n][k]))


def nums(sources: List[Tuple[tuple, Any]], vec: torch.Tensor) -> Dict[tuple, Num]:
    """A Num per source, reading its slot of the step's vector ``vec``."""
    return {path: Num(v, (lambda s, i=i: s[i]), vec[i])
            for i, (path, v) in enumerate(sources)}


def output(x) -> Callable:
    """The function of the sources that gives ``x`` (a Num or a plain number)."""
    return _fn(x)


def to_tensors(x, dtype: Optional[torch.dtype]):
    """``x`` with its Nums as 0-d tensors: of ``dtype`` (the tensor they meet), else as
    torch takes a Python number (int64 for an int, the default float dtype)."""
    if isinstance(x, Num):
        if dtype is not None:
            return x.t.to(dtype)
        return x.t.to(torch.int64 if isinstance(x.value, int) else torch.get_default_dtype())
    if isinstance(x, (tuple, list)):
        return type(x)(to_tensors(y, dtype) for y in x)
    return x
