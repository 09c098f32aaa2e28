"""torch_xla, imported without changing torch for the user's own code; and which ops it
runs on the CPU.

Importing torch_xla replaces, for the whole process, ``torch.nn.GRU`` with its
scan-based GRU (which refuses ``proj_size`` and PackedSequence and warns on
``bidirectional``) and ``torch.nn.utils.clip_grad_norm_`` with its XLA version (which
refuses ``foreach=True``). The client imports torch_xla on its first trace, and hosts run
user code (datasets, colocated functions), so without this a GRU or a clipping call
would behave differently depending on whether it came before or after the first
``@pw.program``. torch's own are put back, unless the user imported torch_xla first and
so asked for its patches.

Example::

    from pathways_torch._xla import import_torch_xla
    torch_xla = import_torch_xla()      # torch.nn.GRU is still torch's
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import ModuleType
from typing import Callable, Iterator, List


_IMPORTED: List[ModuleType] = []
_IMPORT_LOCK = threading.Lock()


def import_torch_xla() -> ModuleType:
    """``import torch_xla``, with torch.nn's GRU and clip_grad_norm_ left as they were.
    Thread-safe: a second thread waits for the first's import to finish, rather than
    taking the module from ``sys.modules`` half-initialised (two first traces at once
    failed with "partially initialized module 'torch_xla'")."""
    if _IMPORTED:
        return _IMPORTED[0]
    with _IMPORT_LOCK:
        if not _IMPORTED:
            with _ctrl_c_after():
                with _deferred_submodules():
                    import torch_xla
                _restore_torch_nn()
                _IMPORTED.append(torch_xla)
    return _IMPORTED[0]


#: torch_xla 2.9's ``__init__`` imports two modules only for names it re-exports, and
#: they pull in torch._inductor and functorch's AOT compiler: 2.5 of its 4 s of import
#: on this machine, paid by every client's first trace and every worker's start. The
#: version whose import lines these stand-ins match; any other imports as it is.
_DEFERRED_FOR = "2.9.0"


@contextlib.contextmanager
def _deferred_submodules() -> Iterator[None]:
    """While ``import torch_xla`` runs, let ``torch_xla.stablehlo`` and
    ``torch_xla.experimental.gru`` be stand-ins that import the real module when used:
    ``torch_xla.save_as_stablehlo(...)`` imports it on its call, and the scan GRU it
    installs as ``torch.nn.GRU`` (which ``_restore_torch_nn`` takes back anyway) on its
    construction. Afterwards the stand-ins leave ``sys.modules``, so ``import
    torch_xla.stablehlo`` gets the real module."""
    import sys
    try:
        from importlib.metadata import version
        ours = version("torch_xla") == _DEFERRED_FOR
    except Exception:            # noqa: BLE001 - not installed as a distribution
        ours = False
    names = ("torch_xla.stablehlo", "torch_xla.experimental.gru")
    if not ours or "torch_xla" in sys.modules or any(n in sys.modules for n in names):
        yield
        return
    stand_ins = {n: _stand_in(n) for n in names}
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name, mod in stand_ins.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]
            parent, _, attr = name.rpartition(".")
            if getattr(sys.modules.get(parent), attr, None) is mod:
                delattr(sys.modules[parent], attr)


def _stand_in(name: str) -> ModuleType:
    """A module for ``name`` whose names torch_xla's ``__init__`` imports forward to
    the real module, imported on first use."""
    import importlib

    import torch

    mod = ModuleType(name)
    if name.endswith(".gru"):
        class GRU(torch.nn.GRU):
            def __new__(cls, *args, **kwargs):
                return importlib.import_module(name).GRU(*args, **kwargs)
        mod.GRU = GRU
        return mod

    def forward(attr: str) -> Callable:
        def call(*args, **kwargs):
            return getattr(importlib.import_module(name), attr)(*args, **kwargs)
        call.__name__ = call.__qualname__ = attr
        return call
    for attr in ("save_as_stablehlo", "save_torch_model_as_stablehlo"):
        setattr(mod, attr, forward(attr))
    return mod


@contextlib.contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that comes during the block until it ends, then deliver it
    as it would have been. torch_xla's import runs for seconds on a program's first
    call; interrupted half-way it stays half-initialised in ``sys.modules`` (sympy
    under it too), and every later trace failed ("module 'sympy' has no attribute
    'printing'") until the process restarted. Only the main thread receives signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: List[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if held:
        if old is signal.default_int_handler:
            raise KeyboardInterrupt
        if callable(old):
            old(signal.SIGINT, None)
        elif old == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


def _restore_torch_nn() -> None:
    """torch.nn.GRU and clip_grad_norm_ as torch defines them. Restored from their
    modules, not from what torch.nn held before: a library imported earlier (peft,
    transformers) may have imported torch_xla already, which swapped them then."""
    import torch.nn as nn
    import torch.nn.modules.rnn as rnn
    import torch.nn.utils.clip_grad as clip
    nn.GRU = rnn.GRU
    nn.utils.clip_grad_norm_ = clip.clip_grad_norm_


def cpu_fallbacks(run: Callable[[], object]) -> List[str]:
    """The ops torch_xla ran on the CPU (its fallback) while ``run()`` ran, as
    ``torch.<op>`` names, from its fallback counters. An exception from ``run`` counts
    as no answer about it (its fallbacks until then are still returned)."""
    import torch_xla.debug.metrics as met

    def counts():
        return {c: met.counter_value(c) for c in met.counter_names() if c.startswith("aten::")}

    before = counts()
    try:
        run()
    except Exception:
        pass
    after = counts()
    return sorted(c.replace("aten::", "torch.") for c in after if after[c] != before.get(c))
