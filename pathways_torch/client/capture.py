"""Capture: trace a torch function with torch_xla lazy tensors into a portable program.

The client runs the function once per input signature on placeholder tensors
(``create_placeholder_tensor``: shape and dtype, no memory, so tracing a program over
a 100 GB input costs nothing). Nothing executes: the lazy IR of the outputs is lowered
to an HLO module (``_get_xla_tensors_hlo_proto``), which is what travels to the
workers. Output shapes and dtypes are known from the lazy tensors, before anything runs.
A dispatch-mode guard turns every read of a value (``.item()``, ``bool(t)``,
``.cpu()``, data-dependent shapes) into ``DataDependentError`` before it reaches XLA,
where reading a placeholder would crash the process.

The HLO's parameters follow the graph's device-data order, not the argument order:
each parameter is mapped back to a program input (by tensor id) or to a constant the
function created (a Python scalar, a tensor literal), whose value ships with the program.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from typing import Any, Callable, List, Sequence, Tuple

import torch

from ..errors import DataDependentError, PathwaysError, ShapeError, TraceError

_lock = threading.RLock()
_device = None


def xla_device():
    """The client's local XLA device, used only for tracing (created once)."""
    global _device
    if _device is None:
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla
        _device = torch_xla.device()
    return _device


@dataclasses.dataclass
class Traced:
    name: str
    hlo: bytes
    params: List[Tuple[str, int]]        # ("i", input index) or ("c", constant index)
    constants: List[torch.Tensor]        # CPU tensors
    out_avals: List[Tuple[Tuple[int, ...], torch.dtype]]
    out_tree: Any                        # pytree spec of the outputs
    out_static: List[Any]                # per flat output leaf: None for tensors, else the value
    fingerprint: str


_VALUE_READS = None


def _value_reads():
    global _VALUE_READS
    if _VALUE_READS is None:
        aten = torch.ops.aten
        _VALUE_READS = {
            aten._local_scalar_dense.default: ".item(), bool(t), float(t) or `if t:`",
            aten.is_nonzero.default: "bool(t) or `if t:`",
            aten.equal.default: "torch.equal",
            aten.nonzero.default: "nonzero (a shape that depends on data)",
            aten.masked_select.default: "masked_select (a shape that depends on data)",
            aten._unique2.default: "unique (a shape that depends on data)",
            aten.unique_consecutive.default: "unique_consecutive",
        }
    return _VALUE_READS


def _data_dependent(name: str, what: str) -> DataDependentError:
    return DataDependentError(
        f"program '{name}' reads a tensor's value while being traced ({what}). Programs "
        "are traced once, on shapes and dtypes only, so their Python control flow and "
        "shapes cannot depend on data: use torch.where / masks, or move that logic "
        "outside the program and read the result with Array.torch()")


def _guard(name: str):
    from torch.utils._python_dispatch import TorchDispatchMode
    reads = _value_reads()
    to_copy = torch.ops.aten._to_copy.default

    class _Guard(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in reads:
                raise _data_dependent(name, reads[func])
            if func is to_copy and kwargs.get("device") is not None and \
                    torch.device(kwargs["device"]).type == "cpu":
                raise _data_dependent(name, ".cpu(), .numpy(), print(t) or .tolist()")
            return func(*args, **kwargs)

    return _Guard()


def _executions() -> Tuple[int, int]:
    import torch_xla.debug.metrics as met
    transfers = met.metric_data("TransferFromDeviceTime")
    return (met.counter_value("ExecuteComputation") or 0,
            transfers[0] if transfers else 0)


_SHAPE_WORDS = ("shape", "size", "dimension", "dtype", "expected", "got torch.", "must match", "expected", "broadcast",
                "mat1", "mat2", "same number", "cannot be multiplied", "scalar type")


def _check_with_meta(fn: Callable, name: str, in_avals, build_args, sig: str) -> None:
    """Run ``fn`` on meta tensors: PyTorch's own shape and dtype checks, for free.

    torch_xla's lazy tensors are more lenient than eager PyTorch in places (a float @
    int matmul promotes instead of failing), so a program that plain PyTorch rejects
    is rejected here too. Failures that are not about shapes or dtypes (ops without
    meta kernels, reads of values) are left to the lazy trace.
    """
    try:
        metas = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in in_avals]
        args, kwargs = build_args(metas)
        fn(*args, **kwargs)
    except PathwaysError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError) as e:
        text = str(e).lower()
        if "meta" in text or not any(w in text for w in _SHAPE_WORDS):
            return
        raise ShapeError(f"program '{name}' does not accept inputs ({sig}): "
                         f"{type(e).__name__}: {e}\nCheck the shapes and dtypes of the "
                         "arguments.") from e
    except Exception:
        return


def trace(fn: Callable, name: str, in_avals: Sequence[Tuple[Tuple[int, ...], torch.dtype]],
          build_args: Callable[[List[torch.Tensor]], Tuple[tuple, dict]]) -> Traced:
    """Trace ``fn`` on placeholders of ``in_avals``; ``build_args`` places them in the args."""
    from torch.utils import _pytree as pytree
    sig = ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for s, d in in_avals)
    # The XLA device must exist before the first autograd use (the meta check may be
    # one): the autograd engine sizes its per-device queues when it first starts.
    xla_device()
    _check_with_meta(fn, name, in_avals, build_args, sig)
    with _lock:
        dev = xla_device()
        import torch_xla
        from torch_xla.core.xla_builder import create_placeholder_tensor
        X = torch_xla._XLAC
        placeholders = [create_placeholder_tensor(tuple(shape), dtype)
                        for shape, dtype in in_avals]
        ids = {X._xla_get_tensor_id(p): k for k, p in enumerate(placeholders)}
        args, kwargs = build_args(placeholders)
        before = _executions()
        try:
            with _guard(name):
                out = fn(*args, **kwargs)
        except PathwaysError:
            raise
        except Exception as e:
            if "access XLA data" in str(e):
                raise _data_dependent(name, "printing or reading it") from e
            msg = (f"tracing program '{name}' with inputs ({sig}) failed: "
                   f"{type(e).__name__}: {e}")
            if isinstance(e, (RuntimeError, ValueError, IndexError)) and any(
                    w in str(e).lower() for w in _SHAPE_WORDS):
                raise ShapeError(msg + "\nCheck the shapes and dtypes of the arguments.") from e
            raise TraceError(msg) from e
        if _executions() != before:
            raise _data_dependent(name, "something made XLA execute")
        leaves, out_tree = pytree.tree_flatten(out)
        outs, statics = [], []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.device.type != "xla":
                    leaf = leaf.to(dev)        # a tensor made inside the function
                outs.append(leaf)
                statics.append(None)
            else:
                statics.append(leaf)
        if not outs:
            raise TraceError(f"program '{name}' returns no tensor; return at least one")
        data_ids, data = X._get_tensors_xla_device_data_node(outs)
        params, constants = [], []
        for tid, t in zip(data_ids, data):
            if tid in ids:
                params.append(("i", ids[tid]))
            else:
                params.append(("c", len(constants)))
                constants.append(t.cpu())
        hlo = X._get_xla_tensors_hlo_proto(outs)
        out_avals = [(tuple(o.shape), o.dtype) for o in outs]
    h = hashlib.sha256(hlo)
    h.update(repr(params).encode())
    for c in constants:
        h.update(repr((c.dtype, tuple(c.shape))).encode())
        h.update(c.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return Traced(name, hlo, params, constants, out_avals, out_tree, statics, h.hexdigest()[:24])
