"""Tensors to and from raw bytes (dtype name + shape + little-endian payload).

No pickle: the receiver rebuilds the tensor from the dtype name, the shape and the
bytes, and checks that the byte count matches before it trusts them.
"""

from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch

_DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool,
    "complex64": torch.complex64,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# numpy has these, and tensors of them carry no conjugate or negative view bit
_NUMPY = frozenset(_DTYPES.values()) - {torch.bfloat16, torch.complex64}

CHUNK_BYTES = 4 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``; raises TypeError for dtypes the wire lacks."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot travel; use one of {sorted(_DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}") from None


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def to_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as contiguous little-endian bytes (CPU tensors)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype in _NUMPY and not t.is_neg():  # one torch call: each gives up the GIL
        return t.numpy().tobytes()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def byte_view(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's elements as a byte view of its own storage (no copy).

    The view keeps the tensor alive; write it out before the tensor may change.
    """
    if not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def from_bytes(data, dtype_str: str, shape: Sequence[int]) -> torch.Tensor:
    """Rebuild a CPU tensor; raises ValueError if the byte count does not match."""
    dtype = dtype_from_name(dtype_str)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    want = nbytes(dtype, shape)
    if len(data) != want:
        raise ValueError(
            f"payload has {len(data)} bytes, but {dtype_str}{list(shape)} needs {want}"
        )
    if want == 0:
        return torch.empty(shape, dtype=dtype)
    buf = bytearray(data) if isinstance(data, bytes) else data
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


def meta_of(t: torch.Tensor, msg) -> None:
    """Fill a ``pathways.TensorMeta`` message."""
    msg.dtype = dtype_name(t.dtype)
    msg.shape.extend(t.shape)


def chunks(data: bytes, size: int = CHUNK_BYTES) -> Tuple[memoryview, ...]:
    view = memoryview(data)
    if len(view) == 0:
        return (view,)
    return tuple(view[i:i + size] for i in range(0, len(view), size))
