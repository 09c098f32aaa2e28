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
