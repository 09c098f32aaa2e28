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

from .client.array import Array, put, wait
from .client.program import Program, program
from .client.graph import Graph, graph
from .client.runtime import (Device, Slice, devices, dispatch_mode, init, is_initialized,
                             shutdown, slice)
from .errors import (ClusterShutdownError, DataDependentError, NotInitializedError,
                     PathwaysError, PlacementError, ProgramError, ResourceExhaustedError,
                     OutOfMemoryError, ShapeError, ShardingError, TimeoutError, TraceError,
                     WorkerLostError)
from .sharding import P

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "devices", "slice", "put", "wait", "program",
    "graph", "dispatch_mode", "P", "Array", "Slice", "Device", "Program", "Graph",
    "PathwaysError", "NotInitializedError", "ClusterShutdownError", "ResourceExhaustedError",
    "ShardingError", "PlacementError", "TraceError", "ShapeError", "DataDependentError",
    "ProgramError", "WorkerLostError", "TimeoutError", "OutOfMemoryError",
]
