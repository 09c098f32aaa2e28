"""The typed errors of pathways_torch.

Every error the runtime raises on purpose derives from :class:`PathwaysError` and says
what to do about it. Errors that are also plain Python categories (a bad value, a
timeout) derive from those too, so ``except ValueError`` keeps working.

Example::

    try:
        s = pw.slice((64,))
    except pw.ResourceExhaustedError as e:
        print(e)        # says how many devices are free, and where
"""

from __future__ import annotations

import builtins
import os
import sys
import warnings

__all__ = [
    "PathwaysError", "DataLoaderError", "ColocatedError",
    "NotInitializedError",
    "ClusterShutdownError",
    "ResourceExhaustedError",
    "ShardingError",
    "PlacementError",
    "TraceError",
    "ShapeError",
    "DataDependentError",
    "ProgramError",
    "WorkerLostError",
    "TimeoutError",
    "OutOfMemoryError",
    "CheckpointError",
]


class PathwaysError(Exception):
    """Base class of every error that pathways_torch raises on purpose."""


class NotInitializedError(PathwaysError, RuntimeError):
    """The API was used before ``pw.init()`` (or after ``pw.shutdown()``)."""


class ClusterShutdownError(PathwaysError, RuntimeError):
    """An Array or slice was used after the cluster it lived on was shut down or released."""


class ResourceExhaustedError(PathwaysError, RuntimeError):
    """A slice asked for more devices than are free; the message says what is free."""


class ShardingError(PathwaysError, ValueError):
    """A partition spec names an unknown mesh axis or does not divide a dimension."""


class PlacementError(PathwaysError, ValueError):
    """Program inputs live on different slices, or an Array is used where it cannot be."""


class TraceError(PathwaysError):
    """Tracing a ``@pw.program`` function failed in the client (nothing ran on a worker)."""


class ShapeError(TraceError, ValueError):
    """Shapes or dtypes of a program's inputs do not fit what the function does with them."""


class DataDependentError(TraceError):
    """The traced function read a tensor's value (``.item()``, ``if t:``, ``print(t)``)."""


class ProgramError(PathwaysError, RuntimeError):
    """A program failed on a worker. ``program`` and ``host`` say which and where."""

    def __init__(self, message: str, program: str = "", host: str = "") -> None:
        super().__init__(message)
        self.program = program
        self.host = host


class WorkerLostError(PathwaysError, RuntimeError):
    """The worker (or executor) that held or was computing an Array is gone."""


class TimeoutError(PathwaysError, builtins.TimeoutError):
    """A blocking call passed its deadline (``pw.init(timeout=...)`` or ``timeout=``)."""


class OutOfMemoryError(ProgramError, MemoryError):
    """A program's outputs (or a put) do not fit in a worker's buffer budget."""


class CheckpointError(PathwaysError, OSError):
    """A checkpoint could not be written or read (the message says where and why)."""


class StaleModuleError(PathwaysError, RuntimeError):
    """The script changed a ``pw.Trainer``'s module in place while the module held the
    values of before the last step (the trained ones live on the workers): call
    ``trainer.sync_to()`` before changing it; the next step takes the changed values."""


class DataLoaderError(ProgramError):
    """A ``pw.DataLoader``'s dataset, factory or collate function failed on a worker
    host; the message names the host, the sample index and the batch."""


class ColocatedError(ProgramError):
    """A ``pw.colocated`` function raised (or returned what cannot travel) on a host;
    ``program`` is the function's name and ``host`` where it ran."""


class SyncWarning(UserWarning):
    """A script read a ``pw.Trainer``'s module (``model.parameters()``, a weight) after
    every step, so every step's trained values were copied back from the workers; the
    message names the line. Filter it like any warning once that is what you want."""


class RetraceWarning(UserWarning):
    """A program was traced (and compiled) again because a static argument, a Python
    number passed where a tensor could go, keeps changing; the message names it.
    Pass it as a tensor to make it an input. Filter it like any warning::

        warnings.simplefilter("ignore", pw.RetraceWarning)
    """


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def warn_at_caller(message: str, category: type) -> None:
    """``warnings.warn`` at the first frame outside pathways_torch, torch and
    contextlib (the runtime's context managers): the script's line, however deep in
    the runtime the warning is found."""
    import contextlib
    torch = sys.modules.get("torch")
    inside = (_PACKAGE, os.path.abspath(contextlib.__file__)) + (
        (os.path.dirname(os.path.abspath(torch.__file__)),) if torch is not None else ())
    f, level = sys._getframe(1), 2
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(inside):
        f, level = f.f_back, level + 1
    warnings.warn(message, category, stacklevel=level if f is not None else 2)
