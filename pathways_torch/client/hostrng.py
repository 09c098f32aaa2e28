"""Random numbers a program draws from Python's ``random`` or numpy's global generator.

A program is traced once and then runs compiled on the workers, so a number that
Python code draws while it is traced is a constant of the program: every later call
takes the same draw. Torch's own generator is fine (each call of a program that uses
it gets a new seed), but some models draw from the host's generators in their
forward: Hugging Face's MusicGen drops layers with ``random.uniform``, Whisper's and
wav2vec2's SpecAugment pick masked positions with ``np.random``, BigBird its random
attention blocks, and hand-written stochastic depth often reads ``random.random()``.
In torch each step draws anew; here every step would drop the same layers.

``watch()`` wraps those generators' module-level functions while a program is traced
(on the tracing thread only) and records where each draw came from, so the trace can
warn with the line. Example::

    with hostrng.watch() as draws:
        gm = make_fx(fn)(*args)
    if draws:
        warn(...)           # "modeling_musicgen.py:530 random.uniform"
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
from typing import Iterator, List

_PY = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample",
       "shuffle", "gauss", "normalvariate", "betavariate", "expovariate", "triangular",
       "getrandbits", "lognormvariate", "vonmisesvariate", "paretovariate")
_NP = ("rand", "randn", "random", "random_sample", "ranf", "sample", "randint",
       "random_integers", "uniform", "normal", "standard_normal", "choice",
       "permutation", "shuffle", "binomial", "beta", "poisson", "exponential", "gamma",
       "bytes", "multinomial", "geometric", "laplace", "lognormal")


def _recorder(fn, label: str, thread: int, draws: List[str]):
    def drawn(*args, **kwargs):
        if threading.get_ident() == thread:
            f = sys._getframe(1)
            path = f.f_code.co_filename.split(os.sep)
            where = f"{os.path.join(*path[-2:])}:{f.f_lineno} {label}"
            if where not in draws:
                draws.append(where)
        return fn(*args, **kwargs)
    return drawn


@contextlib.contextmanager
def watch() -> Iterator[List[str]]:
    """Record the draws from ``random`` and ``numpy.random`` made on this thread
    inside the block: ``"file.py:line function"``, each place once."""
    draws: List[str] = []
    thread = threading.get_ident()
    patched = []
    modules = [(random, _PY, "random")]
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        modules.append((np_random, _NP, "np.random"))
    for module, names, prefix in modules:
        for name in names:
            fn = getattr(module, name, None)
            if fn is not None:
                patched.append((module, name, fn))
                setattr(module, name, _recorder(fn, f"{prefix}.{name}", thread, draws))
    try:
        yield draws
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)


def _generator_types() -> tuple:
    kinds = [random.Random]
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        kinds += [np_random.Generator, np_random.RandomState]
    return tuple(kinds)


def _state(g):
    if isinstance(g, random.Random):
        return g.getstate()
    st = g.bit_generator.state if hasattr(g, "bit_generator") else \
        g.get_state(legacy=False)                   # numpy Generator, RandomState
    return _plain(st)


def _plain(v):
    """A comparable copy of a numpy bit generator's state (arrays as bytes)."""
    if isinstance(v, dict):
        return tuple((k, _plain(x)) for k, x in v.items())
    return v.tobytes() if hasattr(v, "tobytes") else v


def generators(fn) -> list:
    """``[(name, generator, state)]`` for the generator objects a traced function can
    reach by name, which ``watch`` does not see: ``random.Random`` and numpy
    ``Generator``/``RandomState`` instances in its globals and closure (and in those of
    the functions and modules it closes over: a module's attributes, its forward's
    globals), and the global ones behind ``from random import randint``. Compared
    after the trace by ``moved``."""
    kinds = _generator_types()
    found: dict = {id(random._inst): ("random (from random import ...)", random._inst)}
    np_random = sys.modules.get("numpy.random")
    glob = getattr(getattr(np_random, "mtrand", None), "_rand", None)
    if glob is not None:
        found[id(glob)] = ("numpy.random (from numpy.random import ...)", glob)
    seen: set = set()
    import torch

    def look(values, where: str) -> None:
        for k, v in values:
            if isinstance(v, kinds) and id(v) not in found:
                found[id(v)] = (f"{where}{k}", v)

    def visit(obj, depth: int) -> None:
        if depth > 3 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for sub in obj.modules():
                if id(sub) in seen and sub is not obj:
                    continue
                seen.add(id(sub))
                look(vars(sub).items(), f"{type(sub).__name__}.")
                visit(getattr(type(sub), "forward", None), depth + 1)
            return
        f = getattr(obj, "__func__", obj)
        g = getattr(f, "__globals__", None)
        if g is None:
            return
        if id(g) not in seen:
            seen.add(id(g))
            look(list(g.items()), "")
        for cell in getattr(f, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if isinstance(v, kinds):
                look([(f.__code__.co_name + "'s closure", v)], "")
            elif callable(v):
                visit(v, depth + 1)

    visit(fn, 0)
    out = []
    for name, g in found.values():
        try:
            out.append((name, g, _state(g)))
        except Exception:                           # an odd subclass: not watched
            pass
    return out


def moved(before: list) -> List[str]:
    """The names of the generators of ``generators()`` that drew since."""
    out = []
    for name, g, state in before:
        try:
            if _state(g) != state:
                out.append(name)
        except Exception:
            pass
    return out
