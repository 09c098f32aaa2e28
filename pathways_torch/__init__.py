"""pathways_torch: Pathways for PyTorch.

One Python program (the client) drives every accelerator of a cluster. Torch functions
decorated with ``@pw.program`` are traced through torch_xla's lazy tensors into
compiled, sharded programs that run on virtual slices of devices; calls return
``pw.Array`` futures at once.

Example::

    import torch
    import pathways_torch as pw
    from pathways_torch import P

    pw.init(devices_per_host=8)
    s = pw.slice((4, 2), axis_names=("data", "model"))
    x = pw.put(torch.randn(64, 128), s, P("data", None))
    w = pw.put(torch.randn(128, 256), s, P(None, "model"))

    @pw.program
    def layer(x, w):
        return torch.relu(x @ w)

    print(layer(x, w).torch())
    pw.shutdown()
"""

import importlib as _importlib
import os as _os

# gRPC's at-fork handlers (on by default in its wheels) can hang a child forked while
# gRPC threads are busy, and garble descriptors the parent is using: a torch DataLoader
# with worker processes in a client or on a host hit both. Nothing here uses gRPC in a
# forked child, so the handlers stay off unless the environment says otherwise. Read
# when gRPC starts, so it is set before any channel or server exists.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from .errors import (CheckpointError, ClusterShutdownError, ColocatedError, DataDependentError,
                     DataLoaderError, NotInitializedError,
                     OutOfMemoryError, PathwaysError, PlacementError, ProgramError,
                     ResourceExhaustedError, RetraceWarning, ShapeError, ShardingError,
                     StaleModuleError, SyncWarning,
                     TimeoutError, TraceError, WorkerLostError)
from .sharding import P

__version__ = "0.1.0"

# The client API imports torch and torch_xla; the coordinator and worker processes
# import this package too and must not pay for that, so those names load on first use.
_LAZY = {
    "Array": "client.array", "put": "client.array", "wait": "client.array",
    "Program": "client.program", "program": "client.program",
    "Graph": "client.graph", "graph": "client.graph",
    "Profile": "client.profile", "profile": "client.profile",
    "Device": "client.runtime", "Slice": "client.runtime", "devices": "client.runtime",
    "dispatch_mode": "client.runtime", "init": "client.runtime",
    "is_initialized": "client.runtime", "shutdown": "client.runtime",
    "slice": "client.runtime", "manual_seed": "client.runtime",
    "Trainer": "training.trainer", "FitResult": "training.elastic",
    "DataParallel": "parallel.strategies", "FullyShardedDataParallel": "parallel.strategies",
    "TensorParallel": "parallel.strategies", "Pipeline": "parallel.strategies",
    "MultiIsland": "parallel.strategies",
    "DataLoader": "client.loader", "colocated": "client.colocated",
}

__all__ = [
    "init", "shutdown", "is_initialized", "devices", "slice", "put", "wait", "program",
    "graph", "dispatch_mode", "profile", "manual_seed", "P", "Array", "Slice", "Device",
    "Program", "Graph",
    "Profile",
    "Trainer", "FitResult", "DataParallel", "FullyShardedDataParallel", "TensorParallel", "Pipeline",
    "MultiIsland", "DataLoader", "colocated",
    "PathwaysError", "NotInitializedError", "ClusterShutdownError", "ResourceExhaustedError",
    "ShardingError", "PlacementError", "TraceError", "ShapeError", "DataDependentError",
    "ProgramError", "WorkerLostError", "TimeoutError", "OutOfMemoryError", "CheckpointError",
    "DataLoaderError", "ColocatedError", "RetraceWarning", "StaleModuleError",
    "SyncWarning",
]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pathways_torch' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
