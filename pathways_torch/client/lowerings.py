"""Static-shape formulas for ops that torch_xla has no lowering for but real models reach.

torch_xla runs an op it does not lower on the CPU, reading its input's values: in a
trace on placeholders that cannot work (capture refuses such ops by name). Some of them
only *look* data-dependent: their output shape is static and a formula of ordinary ops
computes them. Capture decomposes these while it records the graph, so the program holds
only ops XLA compiles. The ones here are what mixture-of-experts layers use (Hugging
Face's default ``grouped_mm`` experts path: ``torch.histc`` to count tokens per expert,
then a grouped matmul over the rows sorted by expert), the backward of a
weight-normed layer, a median along a dimension, interpolation (resample.py), average
pooling with options XLA lacks (pooling.py), covariance (covariance.py), lgamma, digamma and
polygamma (special.py; torch.distributions needs them), torch.fft (dft.py), a few
elementwise functions (``exp2``, ``hypot``, ``fmax``, ``signbit``, ``round(decimals=)``),
cumulative ``cummin`` and ``logcumsumexp``, ``nn.Embedding(max_norm=)``'s renorm,
``F.embedding_bag``, and
the linear algebra XLA has under other names (Cholesky, triangular solves; the
singular-matrix check of ``linalg.inv`` reads a value and is skipped: XLA gives inf/nan
where torch would raise).

Example::

    table = lowerings.table()    # {op overload: python decomposition}
"""

from __future__ import annotations

import functools
import math
import struct
import threading
from typing import Callable, Dict, Optional

import numpy as np
import torch
import torch.utils._pytree as pytree

from ..errors import DataDependentError, ShapeError


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """torch.histc as a comparison count: O(numel x bins), static shapes."""
    if min == max:
        raise DataDependentError(
            "torch.histc without min= and max= takes its range from the data; give both "
            "(the range then is static) or compute the histogram outside the program")
    xs = x.reshape(-1)
    # torch's CPU kernel: pos = (x - min) * bins / (max - min), clamped to the last bin at max
    pos = ((xs - min) * bins / (max - min)).floor().to(torch.int64)
    pos = torch.where(xs == max, torch.full_like(pos, bins - 1), pos)
    inside = (xs >= min) & (xs <= max)
    hits = (pos.unsqueeze(1) == torch.arange(bins, device=x.device)) & inside.unsqueeze(1)
    return hits.sum(0).to(x.dtype)


def _group_mask(offs: torch.Tensor, rows: int, groups: int, dtype) -> torch.Tensor:
    """[rows, groups]: 1 where row r belongs to group e (offs are cumulative ends); rows
    past the last end belong to none."""
    r = torch.arange(rows, device=offs.device).unsqueeze(1)
    ends = offs.to(torch.int64).unsqueeze(0)
    starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], dim=1)
    return ((r >= starts) & (r < ends)).to(dtype)


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``input`` (sorted by group) times their group's ``weight[e]`` ([in, out])."""
    m = _group_mask(offs, input.shape[0], weight.shape[0], input.dtype)
    return torch.einsum("se,si,eio->so", m, input, weight)


def grouped_mm_backward(input, weight, offs, grad_output):
    m = _group_mask(offs, input.shape[0], weight.shape[0], input.dtype)
    grad_input = torch.einsum("se,so,eio->si", m, grad_output, weight)
    grad_weight = torch.einsum("se,si,so->eio", m, input, grad_output)
    return grad_input, grad_weight


def _aten_grouped_mm(input, mat2, offs=None, bias=None, out_dtype=None):
    if offs is None or input.dim() != 2 or mat2.dim() != 3 or bias is not None:
        return NotImplemented
    out = grouped_mm(input, mat2, offs)
    return out.to(out_dtype) if out_dtype is not None else out


def weight_norm_backward(grad_w, v, g, norms, dim: int):
    """The gradients of ``w = g * v / ||v||`` (norms over every dimension but ``dim``)
    with respect to ``v`` and ``g``: torch's formula for ``_weight_norm_interface``
    (nn.utils.parametrizations.weight_norm on a CPU), whose own backward XLA lacks."""
    dims = [d for d in range(v.dim()) if d != dim]
    sums = (grad_w * v).sum(dims, keepdim=True)
    grad_v = (g / norms) * (grad_w - v * (sums / (norms * norms)))
    return grad_v, sums / norms


def median_dim(x: torch.Tensor, dim: int = -1, keepdim: bool = False):
    """``x.median(dim)``: torch's lower median is the ((n - 1) // 2 + 1)-th smallest,
    which XLA computes as a kthvalue (torch_xla runs median(dim) on the CPU)."""
    n = x.shape[dim] if x.dim() else 1
    values, indices = torch.ops.aten.kthvalue.default(x, (n - 1) // 2 + 1, dim, keepdim)
    if not x.is_floating_point() or x.dim() == 0:
        return values, indices
    # torch's median is NaN where the row holds one, at the first NaN's index
    nan = x.isnan()
    first = nan.to(torch.uint8).argmax(dim, keepdim=keepdim)
    has = nan.any(dim, keepdim=keepdim)
    return (torch.where(has, torch.full_like(values, math.nan), values),
            torch.where(has, first, indices))


def _order_key(x: torch.Tensor) -> Optional[torch.Tensor]:
    """What a floating tensor is sorted by so that XLA orders it as torch does. XLA's
    comparator is IEEE's total order, torch's is not: it put -0.0 before 0.0 (a stable
    sort of masked scores gave other indices), and a NaN with its sign bit set before
    -inf (torch's own float-to-bfloat16 cast makes such NaNs). torch puts every NaN
    last, ties zeros. None where the tensor sorts as it is."""
    if not x.is_floating_point():
        return None
    key = torch.where(x == 0, torch.zeros_like(x), x)
    return torch.where(x.isnan(), torch.full_like(x, math.nan), key)


_ORDERING = threading.local()


def _ordered(x, run):
    """``run(key)`` -> indices by ``_order_key``; ``op`` itself where the key is ``x``
    or while the key is being ordered (the op on the key comes back here)."""
    if getattr(_ORDERING, "on", False):
        return NotImplemented
    key = _order_key(x)
    if key is None:
        return NotImplemented
    _ORDERING.on = True
    try:
        return run(key)
    finally:
        _ORDERING.on = False


def sort_like_torch(x, *args, **kwargs):
    """``sort``, ``topk``, ``kthvalue`` by ``_order_key``, with the values read back
    from ``x`` at the indices found (each keeps its own sign of zero)."""
    def run(key):
        dim = kwargs.get("dim", args[0] if args else -1)   # sort.stable's are keywords
        indices = torch.sort(key, *args, **kwargs)[1]
        return (x.gather(dim, indices) if x.dim() else x.clone()), indices
    return _ordered(x, run)


def topk_like_torch(x, k, dim=-1, largest=True, sorted=True):
    def run(key):
        indices = torch.topk(key, k, dim, largest, sorted)[1]
        return (x.gather(dim, indices) if x.dim() else x.clone()), indices
    return _ordered(x, run)


def kthvalue_like_torch(x, k, dim=-1, keepdim=False):
    if x.dim() == 0:
        return NotImplemented

    def run(key):
        indices = torch.ops.aten.kthvalue.default(key, k, dim, True)[1]
        values = x.gather(dim, indices)
        return (values, indices) if keepdim else (values.squeeze(dim), indices.squeeze(dim))
    return _ordered(x, run)


def scatter_value_long_index(x, dim, index, value, reduce=None):
    """``x.scatter(dim, index, value)`` with more index entries along ``dim`` than ``x``
    has (64 edges into 24 nodes: torch's backward of ``scatter_reduce(...,
    include_self=False)`` does this): torch_xla sliced ``x`` to the index's shape and
    failed to lower. The positions the index hits take ``value``, the others keep
    ``x``."""
    if reduce is not None or index.dim() == 0 or index.shape[dim] <= x.shape[dim]:
        return NotImplemented
    hits = torch.zeros(x.shape, dtype=torch.int32).scatter_add(
        dim, index, torch.ones(index.shape, dtype=torch.int32))
    return torch.where(hits > 0, torch.full_like(x, value), x)


def median_all(x: torch.Tensor) -> torch.Tensor:
    """``x.median()``: the lower median of every element, NaN if one is NaN (torch_xla
    had no lowering: refused)."""
    return median_dim(x.reshape(-1), 0)[0]


def nanmedian_all(x: torch.Tensor) -> torch.Tensor:
    """``x.nanmedian()``: the lower median of the elements that are not NaN (NaN when
    none is), read from the sorted values at a position that depends on how many are
    NaN, which is why it is a sort and not a kthvalue."""
    flat = x.reshape(-1)
    if not x.is_floating_point():
        return median_all(x)
    nan = flat.isnan()
    m = (~nan).sum()
    ordered = torch.where(nan, torch.full_like(flat, math.inf), flat).sort().values
    at = ((m - 1) // 2).clamp(min=0).reshape(1)
    v = ordered.index_select(0, at).reshape(())
    return torch.where(m == 0, torch.full_like(v, math.nan), v)


def exp2(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x * math.log(2.0))


def hypot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sqrt(a^2 + b^2) scaled by the larger magnitude, so it neither overflows nor
    underflows where torch's does not."""
    a, b = a.abs(), b.abs()
    big, small = torch.maximum(a, b), torch.minimum(a, b)
    safe = torch.where(big == 0, torch.ones_like(big), big)
    r = small / safe
    out = big * torch.sqrt(1 + r * r)
    return torch.where(torch.isinf(big), big, out)


def fmax(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The maximum, ignoring a NaN on one side (torch.fmax)."""
    return torch.where(torch.isnan(a), b, torch.where(torch.isnan(b), a, torch.maximum(a, b)))


def fmin(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(a), b, torch.where(torch.isnan(b), a, torch.minimum(a, b)))


def signbit(x: torch.Tensor) -> torch.Tensor:
    """Negative, or negative zero (whose reciprocal is -inf)."""
    if not x.is_floating_point():
        return x < 0
    return (x < 0) | ((x == 0) & (torch.reciprocal(x) < 0))


def copysign(a: torch.Tensor, b) -> torch.Tensor:
    neg = signbit(b) if isinstance(b, torch.Tensor) else math.copysign(1.0, b) < 0
    mag = a.abs() if a.is_floating_point() else a.to(torch.get_default_dtype()).abs()
    return torch.where(neg, -mag, mag) if isinstance(neg, torch.Tensor) else (-mag if neg else mag)


def round_decimals(x: torch.Tensor, decimals: int = 0) -> torch.Tensor:
    """torch's CPU formula: round half to even at ``10**decimals``."""
    ten = 10.0 ** abs(decimals)
    return torch.round(x * ten) / ten if decimals >= 0 else torch.round(x / ten) * ten


def outermost(formula):
    """``formula`` at its outermost call only: a formula that calls its own aten op
    (to correct torch_xla's kernel) is traced through this table again, and that
    inner call must take the kernel (NotImplemented) instead of recursing."""
    inside = threading.local()

    @functools.wraps(formula)
    def run(*args, **kwargs):
        if getattr(inside, "on", False):
            return NotImplemented
        inside.on = True
        try:
            return formula(*args, **kwargs)
        finally:
            inside.on = False
    return run


def _running_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The running maximum along ``dim`` as a doubling scan (log2(n) maxima of shifted
    copies). torch_xla's cummax is a reduce-window that XLA failed to compile along a
    dimension of 17, 33, 40 or 50 (a RET_CHECK in the CPU compiler), any dtype."""
    n = x.shape[dim]
    if x.is_floating_point():
        low = -math.inf
    elif x.dtype == torch.bool:
        low = False
    else:
        low = torch.iinfo(x.dtype).min
    k = 1
    while k < n:
        pad_shape = list(x.shape)
        pad_shape[dim] = k
        shifted = torch.cat([torch.full(pad_shape, low, dtype=x.dtype, device=x.device),
                             x.narrow(dim, 0, n - k)], dim)
        x = torch.maximum(x, shifted)
        k *= 2
    return x


def cumsum_integers(x: torch.Tensor, dim: int, *, dtype=None) -> torch.Tensor:
    """torch.cumsum of a bool or narrow integer tensor adds in int64 (its result type,
    unless ``dtype``); torch_xla added in the input's type and widened the sums after,
    so they wrapped: a bool mask of 300 Trues counted 44, uint8 [200, 100] gave 44."""
    if x.is_floating_point() or x.is_complex():
        return NotImplemented
    out = dtype or torch.int64
    if x.dtype == out or (dtype is not None and (out.is_floating_point or out.is_complex)):
        return NotImplemented
    return torch.ops.aten.cumsum.default(x.to(out), dim, dtype=out)


def cumprod_integers(x: torch.Tensor, dim: int, *, dtype=None) -> torch.Tensor:
    """torch.cumprod of an integer or bool tensor (int64, as torch promotes it, unless
    ``dtype``) as a doubling scan of products of shifted copies: exact, since integer
    products do not depend on their order. torch_xla has no integer cumprod (it would
    run on the CPU: refused)."""
    if x.is_floating_point() or x.is_complex() or (dtype is not None and (
            dtype.is_floating_point or dtype.is_complex)):
        return NotImplemented
    y = x.to(dtype or torch.int64)
    if y.dim() == 0:
        return y.clone()
    dim = dim % y.dim()
    n, k = y.shape[dim], 1
    while k < n:
        pad_shape = list(y.shape)
        pad_shape[dim] = k
        shifted = torch.cat([torch.ones(pad_shape, dtype=y.dtype, device=y.device),
                             y.narrow(dim, 0, n - k)], dim)
        y = y * shifted
        k *= 2
    return y


def cummax(x: torch.Tensor, dim: int):
    """The running maximum with torch's index: the last position where it was reached
    (torch's CPU kernel takes ``x >= max``); from the first NaN on the maximum is NaN
    and the index the latest NaN's. torch_xla's index is the first position
    (``[3, 1, 3]`` gave index 0 where torch gives 2), and its maximum skips NaNs."""
    if x.dim() == 0:
        return x.clone(), torch.zeros((), dtype=torch.long, device=x.device)
    dim = dim % x.dim()
    values = _running_max(x, dim)
    shape = [1] * x.dim()
    shape[dim] = x.shape[dim]
    pos = torch.arange(x.shape[dim], device=x.device).reshape(shape).expand(x.shape)
    if x.is_floating_point():
        nan = torch.isnan(x)
        values = torch.where(torch.cumsum(nan.int(), dim) > 0,
                             torch.full_like(values, math.nan), values)
        hit = (x == values) | nan
    else:
        hit = x == values
    index = _running_max(torch.where(hit, pos, torch.full_like(pos, -1)), dim)
    return values, index


def cummin(x: torch.Tensor, dim: int):
    """The running minimum as the running maximum of the order reversed (the same
    last-index rule on ties; torch_xla's cummin runs on the CPU): ``-x`` for floats,
    ``-1 - x`` for signed integers, ``255 - x`` for uint8, ``not x`` for bools, where
    ``-x`` wraps (uint8's 255 came out as the minimum of [0, 255])."""
    if x.is_floating_point():
        flip = lambda t: -t                                    # noqa: E731
    elif x.dtype == torch.bool:
        flip = torch.logical_not
    else:   # -1 - t, torch's ~t: XLA failed to compile cummax of a bitwise not
        top = 255 if x.dtype == torch.uint8 else -1
        flip = lambda t: top - t                               # noqa: E731
    values, indices = cummax(flip(x), dim)
    return flip(values), indices


def remainder(a, b):
    """Integer ``a % b`` with the divisor's sign, from ``fmod``: torch_xla's kernel
    gave int8 an uint8 result (-7 % -2 came out 255, not -1)."""
    floating = a.is_floating_point() or isinstance(b, float) or (
        isinstance(b, torch.Tensor) and b.is_floating_point())
    if floating or a.is_complex():
        return NotImplemented
    r = torch.fmod(a, b)
    negative_b = (b < 0) if isinstance(b, torch.Tensor) else torch.tensor(b < 0)
    fix = (r != 0) & ((r < 0) != negative_b.to(r.device))
    return torch.where(fix, r + b, r)


def _integers(*xs) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) or
               isinstance(x, torch.Tensor) and not x.is_floating_point() and
               not x.is_complex() and x.dtype != torch.bool for x in xs)


#: float32 refinements an exact integer quotient needs, by the dividend's bits
_QUOTIENT_STEPS = {torch.int64: 4, torch.int32: 2}


def _exact_quotient(a: torch.Tensor, b, floor: bool) -> torch.Tensor:
    """``a // b`` or ``trunc(a / b)`` of integers, exact for every value. torch_xla
    divides integers in float32 (``100_000_007 // 3`` came out 33333336; 2**62 // 3
    off by 4.6e10), while fmod is an integer remainder: the dividend less it is a
    multiple of b, whose quotient float32 steps then find exactly (each gains ~23
    bits, and an error under 0.5 rounds away)."""
    rt = torch.result_type(a, b)
    a = a.to(rt)
    b = b.to(rt) if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=rt,
                                                                  device=a.device)
    r = torch.fmod(a, b)
    n = a - r
    q = torch.zeros_like(n)
    for _ in range(_QUOTIENT_STEPS.get(rt, 1)):
        q = q + torch.round((n - q * b).to(torch.float32) / b.to(torch.float32)).to(rt)
    if floor:
        q = q - ((r != 0) & ((r < 0) != (b < 0))).to(rt)
    return q


def _float_floor_quotient(a: torch.Tensor, b) -> torch.Tensor:
    """Floor division of floating values as torch's kernel computes it (c10's
    ``div_floor_floating``): the quotient of ``a - fmod(a, b)``, adjusted to the
    divisor's sign, floored and rounded up past .5, with IEEE's result for b = 0 and a
    signed zero, each operation in the values' own type as torch's half-precision
    kernels round them. torch_xla floors ``a / b``, which differs where that quotient
    rounds across an integer (bfloat16 -5.28125 // 1.0546875 came out -5 for torch's
    -6; by whole units at larger quotients)."""
    if not isinstance(b, torch.Tensor):
        if a.dtype in _HALF:        # a Python number: torch's kernel takes float32 then
            return _float_floor_quotient(a.float(), b).to(a.dtype)
        b = torch.tensor(b, dtype=a.dtype, device=a.device)
    rt = torch.result_type(a, b)
    a, b = a.to(rt), b.to(rt)
    mod = torch.fmod(a, b)
    div = (a - mod) / b
    div = torch.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floor = torch.floor(div)
    floor = torch.where(div - floor > 0.5, floor + 1, floor)
    floor = torch.where(div == 0, torch.copysign(torch.zeros_like(div), a / b), floor)
    return torch.where(b == 0, a / b, floor)


def _floating(a, b) -> bool:
    return any(isinstance(v, float) or isinstance(v, torch.Tensor) and
               v.is_floating_point() for v in (a, b)) and not any(
        isinstance(v, torch.Tensor) and v.is_complex() for v in (a, b))


def div_rounding(a, b, *, rounding_mode=None):
    """``torch.div(a, b, rounding_mode="trunc" | "floor")`` (and ``//``): integers
    exact (``_exact_quotient``), floor of floats as torch's kernel
    (``_float_floor_quotient``)."""
    if rounding_mode is None or not isinstance(a, torch.Tensor):
        return NotImplemented
    if _integers(a, b):
        return _exact_quotient(a, b, rounding_mode == "floor")
    if rounding_mode == "floor" and _floating(a, b):
        return _float_floor_quotient(a, b)
    return NotImplemented


def floor_divide(a, b):
    if not isinstance(a, torch.Tensor):
        return NotImplemented
    if _integers(a, b):
        return _exact_quotient(a, b, True)
    if _floating(a, b):
        return _float_floor_quotient(a, b)
    return NotImplemented


def _bits(a: torch.Tensor) -> int:
    return torch.iinfo(a.dtype).bits


def right_shift(a, b):
    """``a >> b`` of integers, an arithmetic shift as torch's (torch_xla divided by
    2**b, rounding toward zero: -1 >> 1 came out 0, not -1); by the width or more, the
    sign (torch's 0 or -1; a Python amount failed to lower)."""
    if not _integers(a, b) or not isinstance(a, torch.Tensor) or a.dtype == torch.bool:
        return NotImplemented
    top = _bits(a) - 1
    if isinstance(b, int):
        b = min(b, top) if a.is_signed() else b
        if b > top:
            return torch.zeros_like(a)
        return torch.bitwise_right_shift(a, b)
    if a.is_signed():
        return torch.bitwise_right_shift(a, b.clamp(max=top))
    return torch.where(b > top, torch.zeros_like(a),
                       torch.bitwise_right_shift(a, b.clamp(max=top)))


def left_shift(a, b):
    """``a << b`` of integers by the width or more: 0, as torch's (an int64 shifted by
    a tensor's 64 wrapped round to the value; a Python amount failed to lower)."""
    if not _integers(a, b) or not isinstance(a, torch.Tensor) or a.dtype == torch.bool:
        return NotImplemented
    top = _bits(a) - 1
    if isinstance(b, int):
        return torch.zeros_like(a) if b > top else NotImplemented
    return torch.where(b > top, torch.zeros_like(a),
                       torch.bitwise_left_shift(a, b.clamp(max=top)))


def isposinf(x: torch.Tensor) -> torch.Tensor:
    """``x == +inf`` for floating tensors (torch_xla had no lowering: refused, where
    isneginf ran); integers and bools are never infinite."""
    if x.is_complex():
        return NotImplemented
    if not x.is_floating_point():
        return torch.zeros_like(x, dtype=torch.bool)
    return x == math.inf


def clamp_promoted(x, min=None, max=None):
    """``clamp`` of an integer tensor with a float bound: torch computes it in the
    float result type (``[3, -1].clamp(min=2.5)`` is [3.0, 2.5]); torch_xla truncated
    the bound to an integer first (2.0)."""
    bounds = [v for v in (min, max) if v is not None]
    if x.is_floating_point() or x.is_complex() or not any(
            isinstance(v, float) for v in bounds):
        return NotImplemented
    rt = torch.result_type(x, next(v for v in bounds if isinstance(v, float)))
    return torch.clamp(x.to(rt), min, max)


def _float_arange(start, end, step, kw):
    """torch.arange with a floating result as torch computes it: ``ceil((end - start)
    / step)`` values, each ``start + i * step`` in double, rounded once. torch_xla gave
    ``arange(0, 1, 0.1)`` 11 values (torch: 10)."""
    nums = (start, end, step)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in nums):
        return NotImplemented
    dtype = kw.get("dtype")
    if dtype is None:
        dtype = (torch.get_default_dtype() if any(isinstance(v, float) for v in nums)
                 else torch.int64)
    if not dtype.is_floating_point or step == 0:
        return NotImplemented
    n = max(0, math.ceil((end - start) / step))
    i = torch.arange(n, dtype=torch.int64, device=kw.get("device"))
    return (start + i.to(torch.float64) * step).to(dtype)


def arange_end(end, **kw):
    return _float_arange(0, end, 1, kw)


def arange_start(start, end, **kw):
    return _float_arange(start, end, 1, kw)


def arange_step(start, end, step=1, **kw):
    return _float_arange(start, end, step, kw)


def _nan_count(x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    return torch.ops.aten.sum.dim_IntList(torch.isnan(x), dims, keepdim,
                                          dtype=torch.int32)


def _dims(x: torch.Tensor, dim) -> list:
    if dim is None:
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return [d % max(x.dim(), 1) for d in dims] or list(range(x.dim()))


def _nan_extreme(op):
    """max, min, amax and amin of a floating tensor as torch's: NaN wherever one is
    among the values reduced (torch_xla's skipped NaNs: max([1, nan, 3]) came out 3).
    Other tensors take ``_whole``'s dimensions."""
    whole = _whole(op)

    @outermost
    def run(x, dim=None, keepdim=False):
        if not x.is_floating_point() or x.numel() == 0 or x.dim() == 0:
            return whole(x, dim, keepdim)
        dims = _dims(x, dim)
        out = op(x, dims, keepdim)
        nan = torch.full((), math.nan, dtype=x.dtype, device=x.device)
        return torch.where(_nan_count(x, dims, keepdim) > 0, nan, out)
    run.__name__ = op.__name__
    return run


def _nan_extreme_all(amax):
    """``x.max()`` / ``x.min()`` (every element) with torch's NaN: ``amax`` (the
    table's ``_nan_extreme`` amax or amin) over every dimension."""
    def run(x):
        return amax(x, None, False)
    return run


def _nan_arg(op):
    """argmax / argmin of a floating tensor as torch's: the first NaN's index where
    there is one (torch_xla skipped NaNs)."""
    @outermost
    def run(x, dim=None, keepdim=False):
        if not x.is_floating_point() or x.numel() == 0 or x.dim() == 0:
            return NotImplemented
        flat = dim is None
        v = x.reshape(-1) if flat else x
        d = 0 if flat else dim % x.dim()
        k = keepdim and not flat
        first_nan = torch.argmax(torch.isnan(v).to(torch.int8), d, k)
        out = torch.where(_nan_count(v, [d], k) > 0, first_nan, op(v, d, k))
        return out.reshape([1] * x.dim()) if flat and keepdim else out
    run.__name__ = op.__name__
    return run


def _nan_extreme_dim(op):
    """``x.max(dim)`` / ``x.min(dim)``: values and indices with torch's NaN (the first
    NaN's index)."""
    @outermost
    def run(x, dim, keepdim=False):
        if not x.is_floating_point() or x.numel() == 0 or x.dim() == 0:
            return NotImplemented
        d = dim % x.dim()
        values, indices = op(x, d, keepdim)
        has = _nan_count(x, [d], keepdim) > 0
        first_nan = torch.argmax(torch.isnan(x).to(torch.int8), d, keepdim)
        nan = torch.full((), math.nan, dtype=x.dtype, device=x.device)
        return torch.where(has, nan, values), torch.where(has, first_nan, indices)
    run.__name__ = op.__name__
    return run


def logsumexp(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """torch.logsumexp as torch's kernel computes it: the maximum taken out unless it
    is infinite (a row holding +inf is inf, not NaN; a row of -inf is -inf); over an
    empty dimension -inf (XLA's maximum of nothing failed to compile). Integer tensors
    as floats, as torch promotes them."""
    if not (x.is_floating_point() or x.is_complex()):
        return logsumexp(x.to(torch.get_default_dtype()), dim, keepdim)
    if x.is_complex() or x.dtype in _HALF:
        return NotImplemented                     # (half: opmath's own formula)
    dims = _dims(x, dim)
    if x.numel() == 0:
        shape = [1 if d in dims else n for d, n in enumerate(x.shape)
                 if keepdim or d not in dims]
        return torch.full(shape, -math.inf, dtype=x.dtype, device=x.device)
    m = torch.ops.aten.amax.default(x, dims, True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    out = (x - m).exp().sum(dims, keepdim=keepdim).log()
    return out + (m if keepdim else m.squeeze(dims))


def _complex_mean(op, other):
    """A mean of a complex tensor: its sum over the count (torch_xla's failed: "Invalid
    type for NanValue (C64)"); other dtypes go to ``other``."""
    def run(x, *args, **kwargs):
        if not x.is_complex() or kwargs.get("dtype") is not None:
            return other(x, *args, **kwargs)
        dims = _dims(x, args[0] if args else kwargs.get("dim"))
        keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
        count = math.prod(x.shape[d] for d in dims)
        return torch.ops.aten.sum.dim_IntList(x, dims, keepdim) / count
    return run


def _masked_put(inplace: bool):
    """``t[mask] = v`` (and ``+=``) with a boolean mask over t's leading dimensions and
    a value of one element or of the remaining dimensions' shape: the result's shape
    does not depend on the mask, so it is ``torch.where(mask, v, t)``. torch's
    ``index_put`` goes through ``nonzero``, which a trace cannot run (a refusal blaming
    a missing lowering, where ``masked_fill`` of the same worked). Values given per
    selected element (``t[mask] = a[mask]``) do depend on it and stay refused."""
    def run(t, indices, values, accumulate=False):
        if len(indices) != 1 or not isinstance(indices[0], torch.Tensor) or \
                indices[0].dtype not in (torch.bool, torch.uint8) or \
                not isinstance(values, torch.Tensor):
            return NotImplemented
        m = indices[0].bool()
        rest = tuple(t.shape[m.dim():])
        if tuple(m.shape) != tuple(t.shape[:m.dim()]):
            return NotImplemented
        try:
            if torch.broadcast_shapes(values.shape, rest) != rest:
                return NotImplemented
        except RuntimeError:
            return NotImplemented
        m = m.reshape(tuple(m.shape) + (1,) * len(rest))
        v = values.to(t.dtype)
        out = torch.where(m, t + v if accumulate else v, t)
        return t.copy_(out) if inplace else out
    return run


def heaviside(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """torch's kernel, ``values`` where ``x == 0``, else ``x > 0``: torch's
    decomposition failed to lower for integers and bools (an untyped error about a
    shift of mismatched types)."""
    return torch.where(x == 0, values.to(x.dtype), (x > 0).to(x.dtype))


def sign_of_bool(x: torch.Tensor) -> torch.Tensor:
    """``sign``/``sgn`` of a bool tensor is itself, a bool (torch_xla returned uint8)."""
    return x.clone() if x.dtype == torch.bool else NotImplemented


def logcumsumexp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Each prefix's logsumexp, from an [n, n] lower-triangular mask: exact where a
    running ``log(cumsum(exp(x - max)))`` would underflow, at O(n^2) memory."""
    if x.dim() == 0:
        return x.clone()                       # one prefix: the value itself
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    table = torch.where(keep, x.unsqueeze(-2), torch.full_like(x.unsqueeze(-2), -math.inf))
    return torch.logsumexp(table, dim=-1).movedim(-1, dim)


def embedding_renorm_(weight: torch.Tensor, indices: torch.Tensor, max_norm: float,
                      norm_type: float) -> torch.Tensor:
    """nn.Embedding(max_norm=): the rows ``indices`` names whose norm exceeds
    ``max_norm`` are scaled to it, in place (torch's ``max_norm / (norm + 1e-7)``)."""
    rows = weight.shape[0]
    used = torch.zeros(rows, dtype=weight.dtype, device=weight.device).index_fill(
        0, indices.reshape(-1), 1.0) > 0
    norms = torch.linalg.vector_norm(weight, norm_type, dim=1)
    scale = torch.where(used & (norms > max_norm), max_norm / (norms + 1e-7),
                        torch.ones_like(norms))
    return weight.mul_(scale.unsqueeze(1))


def cholesky_ex(a: torch.Tensor, upper: bool = False, check_errors: bool = False):
    info = torch.zeros(a.shape[:-2], dtype=torch.int32, device=a.device)
    return torch.ops.aten.cholesky.default(a, upper), info


def solve_triangular(a: torch.Tensor, b: torch.Tensor, *, upper: bool, left: bool = True,
                     unitriangular: bool = False) -> torch.Tensor:
    """``linalg.solve_triangular`` as XLA's ``triangular_solve`` (X A = B is the
    transposed system A^T X^T = B^T)."""
    solve = torch.ops.aten.triangular_solve.default
    if left:
        return solve(b, a, upper, False, unitriangular)[0]
    return solve(b.mT, a, upper, True, unitriangular)[0].mT


def searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None,
                 sorter=None):
    """torch's binary search, step for step on every value at once: ``bit_length(n)``
    rounds of a gather and a comparison (O(values x log boundaries), static shapes).
    The same steps give torch's places for NaN: a NaN value past every boundary, and
    values among the NaNs that sorting put at the end where torch's search lands."""
    if sorter is not None:
        sorted_sequence = sorted_sequence.gather(-1, sorter)
    right = right or side == "right"
    n = sorted_sequence.shape[-1]
    start = torch.zeros(values.shape, dtype=torch.int64, device=values.device)
    end = torch.full(values.shape, n, dtype=torch.int64, device=values.device)
    for _ in range(n.bit_length()):
        mid = (start + end) // 2
        at = mid.clamp(max=max(n - 1, 0))
        # 1-d: one set of boundaries for every value; else one row per leading index
        b = sorted_sequence[at] if sorted_sequence.dim() == 1 else \
            sorted_sequence.gather(-1, at)
        past = ~(b > values) if right else ~(b >= values)
        busy = start < end
        start = torch.where(busy & past, mid + 1, start)
        end = torch.where(busy & ~past, mid, end)
    return start.to(torch.int32 if out_int32 else torch.int64)


def _round_to(x: float, dtype: torch.dtype):
    """``x`` rounded to ``dtype`` as torch converts a number (to nearest, ties to even;
    bfloat16 through float32, as c10 does); None for other dtypes."""
    try:
        if dtype == torch.float64:
            return x
        if dtype == torch.float16:
            return struct.unpack("e", struct.pack("e", x))[0]
        f32 = struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)
    if dtype == torch.float32:
        return f32
    if dtype == torch.bfloat16:
        bits = struct.unpack("I", struct.pack("f", f32))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return struct.unpack("f", struct.pack("I", bits))[0]
    return None


def _compare_scalar(op):
    """A comparison of a tensor with a Python float. torch rounds the number to the
    tensor's dtype first (to the default dtype for an integer tensor); torch_xla
    compares in double, so ``t == 0.4`` was False where t holds float32(0.4), and
    Rprop with ``etas=(0.4, ...)`` never zeroed its gradients. The rounded number
    compares the same in both. Likewise a Python int beyond an integer tensor's range
    is cast to its dtype, as torch's kernel casts it: a uint8 ``t < 300`` compares with
    44 in torch, and XLA compared with 300."""
    def compare(self, other):
        if type(other) is int and self.dtype not in (torch.bool, torch.int64) and not (
                self.is_floating_point() or self.is_complex()):
            info = torch.iinfo(self.dtype)
            if info.min <= other <= info.max:
                return NotImplemented
            other &= (1 << info.bits) - 1
            return op(self, other - (1 << info.bits) if other > info.max else other)
        if not isinstance(other, float) or math.isnan(other) or math.isinf(other):
            return NotImplemented
        dtype = self.dtype if self.is_floating_point() else torch.get_default_dtype()
        rounded = _round_to(other, dtype)
        if rounded is None or rounded == other:
            return NotImplemented         # exact already (and so on the second pass)
        return op(self, rounded)
    compare.__name__ = op.__name__
    return compare


def _scaled_sum(self: torch.Tensor, product, beta, alpha) -> torch.Tensor:
    """``beta * self + alpha * product()`` as torch's kernels compute it: in float32 for
    16-bit floats, rounded once; ``self`` ignored when beta is 0 (its NaNs too);
    for integer tensors beta and alpha truncated to integers, as torch's kernels
    convert them (alpha=0.2 is 0)."""
    if not (self.is_floating_point() or self.is_complex()):
        beta, alpha = int(beta), int(alpha)
    low = self.dtype in (torch.bfloat16, torch.float16)
    out = product(torch.float32 if low else None)
    if alpha != 1:
        out = out * alpha
    if beta != 0:
        base = self.float() if low else self
        out = out + (base if beta == 1 else base * beta)
    return out.to(self.dtype)


def _cast(t: torch.Tensor, dtype):
    return t if dtype is None else t.to(dtype)


def addmm(self, mat1, mat2, *, beta=1, alpha=1):
    """``addmm`` with ``beta``/``alpha`` other than 1, which torch_xla runs on the CPU
    (Muon's Newton-Schulz iteration, Hugging Face's Conv1D under some configs)."""
    if beta == 1 and alpha == 1:
        return NotImplemented
    return _scaled_sum(self, lambda d: torch.mm(_cast(mat1, d), _cast(mat2, d)), beta, alpha)


def addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    """``addbmm`` (a sum of batched products), which torch_xla runs on the CPU."""
    return _scaled_sum(self, lambda d: torch.bmm(_cast(batch1, d), _cast(batch2, d)).sum(0),
                       beta, alpha)


def scatter_reduce(self: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor,
                   reduce: str, *, include_self: bool = True) -> torch.Tensor:
    """``scatter_reduce`` where torch_xla lowers only ``include_self=True`` and not
    "mean" (graph libraries aggregate with ``include_self=False``): the positions no
    index names keep ``self``; the others start from the reduction's identity (or from
    ``self``) and take XLA's sum, prod, amax or amin; a mean divides by the count."""
    count = torch.zeros_like(self).scatter_add(dim, index, torch.ones_like(src))
    touched = count > 0
    if reduce in ("sum", "mean"):
        base = self if include_self else torch.where(touched, torch.zeros_like(self), self)
        total = base.scatter_add(dim, index, src)
        if reduce == "sum":
            return total
        n = count + 1 if include_self else count.clamp_min(1)
        mean = total / n if self.is_floating_point() else torch.div(total, n,
                                                                    rounding_mode="floor")
        return torch.where(touched, mean.to(self.dtype), self)
    if include_self:
        return NotImplemented
    if reduce == "prod":
        identity = 1
    elif self.is_floating_point():
        identity = -math.inf if reduce == "amax" else math.inf
    elif self.dtype == torch.bool:
        identity = reduce != "amax"
    else:
        info = torch.iinfo(self.dtype)
        identity = info.min if reduce == "amax" else info.max
    base = torch.where(touched, torch.full_like(self, identity), self)
    return torch.ops.aten.scatter_reduce.two(base, dim, index, src, reduce, include_self=True)


def batch_norm_backward(grad_out, input, weight, running_mean, running_var,
                        save_mean, save_invstd, train, eps, output_mask):
    """torch's decomposition of a batch norm's backward where XLA's kernel cannot serve:
    - in eval mode (frozen with ``.eval()`` while the rest trains): torch_xla's kernel
      expects the batch statistics a training forward saves and fails without them;
    - in half precision or mixed (a convolution's bfloat16 output under autocast into
      float32 statistics): XLA's BatchNormGrad refuses mixed precision at compile time,
      and torch's kernel computes in float32 (the decomposition does, then rounds)."""
    floats = {t.dtype for t in (grad_out, input, weight, save_mean, save_invstd)
              if t is not None}
    if train and len(floats) == 1 and input.dtype not in (torch.float16, torch.bfloat16):
        return NotImplemented                 # XLA's own kernel
    from torch._decomp.decompositions import native_batch_norm_backward
    return native_batch_norm_backward(grad_out, input, weight, running_mean, running_var,
                                      save_mean, save_invstd, train, eps, output_mask)


def _broadcasting(op):
    """``op`` of two tensors of different shapes, broadcast first as torch does:
    torch_xla's ``clamp_min``/``clamp_max`` with a tensor bound required equal shapes
    (``x.clamp(min=b)`` with x [5, 1] and b [5] failed to replay: "Shapes must be
    equal rank")."""
    def run(a, b):
        if a.shape == b.shape:
            return NotImplemented
        return op(*torch.broadcast_tensors(a, b))
    return run


_SCALAR_NAMES = {torch.int8: "Char", torch.uint8: "Byte", torch.int16: "Short",
                 torch.int32: "Int", torch.int64: "Long", torch.bool: "Bool",
                 torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
                 torch.float64: "Double"}


def _long_targets(target, byte: bool = False) -> None:
    """torch's CPU kernels of the classification losses take int64 class indices (and
    ``nll_loss`` of a 1-D or 2-D input uint8 ones); their shape functions do not check,
    so an int32 target trained here and raised on the CPU: raised here as torch does."""
    if target.dtype != torch.int64 and not (byte and target.dtype == torch.uint8):
        name = _SCALAR_NAMES.get(target.dtype, str(target.dtype))
        raise RuntimeError(f"expected scalar type Long but found {name}")


def nll_loss_unbatched(x, target, weight, reduction, ignore_index):
    """``nll_loss`` of one example (``x`` [C], a 0-dim target: ``F.cross_entropy`` of a
    single sample) as a batch of one: torch_xla's kernel for it crashed the process
    (a segfault when the op was first dispatched). uint8 targets become int64, as
    torch's kernel reads them."""
    _long_targets(target, byte=True)
    if target.dtype == torch.uint8:
        return torch.ops.aten.nll_loss_forward.default(x, target.long(), weight, reduction,
                                                       ignore_index)
    if x.dim() != 1:
        return NotImplemented
    out, total = torch.ops.aten.nll_loss_forward.default(
        x.unsqueeze(0), target.unsqueeze(0), weight, reduction, ignore_index)
    return (out.squeeze(0) if reduction == 0 else out), total


def nll_loss_backward_unbatched(grad, x, target, weight, reduction, ignore_index, total):
    """The backward of ``nll_loss_unbatched``, through the batched kernel."""
    if target.dtype == torch.uint8:
        return torch.ops.aten.nll_loss_backward.default(grad, x, target.long(), weight,
                                                        reduction, ignore_index, total)
    if x.dim() != 1:
        return NotImplemented
    return torch.ops.aten.nll_loss_backward.default(
        grad.unsqueeze(0) if reduction == 0 else grad, x.unsqueeze(0),
        target.unsqueeze(0), weight, reduction, ignore_index, total).squeeze(0)


def nll_loss2d_long(x, target, weight, reduction, ignore_index):
    """``nll_loss2d`` takes int64 targets only, as torch's kernel does."""
    _long_targets(target)
    return NotImplemented


def index_select_checked(x, dim, index):
    """torch refuses an index that is not int32 or int64; torch_xla cast a uint8 one."""
    if index.dtype not in (torch.int32, torch.int64):
        raise IndexError("index_select(): Expected dtype int32 or int64 for index")
    return NotImplemented


def as_strided(x, size, stride, storage_offset=None):
    """``as_strided`` of a view (``x[1:].unfold(...)``, ``x.T.unfold(...)``, an unfold
    of an unfold: torch's unfold is an as_strided of its input's strides and offset).
    torch reads the storage under the view; torch_xla reads the view as if it were its
    own storage from offset 0, which gave other numbers (by up to 2.7). The storage
    addresses the result reads are static, so they are looked up among the addresses
    the view itself covers and gathered from it; an address outside the view (storage
    the program does not have) is refused."""
    offset = x.storage_offset() if storage_offset is None else int(storage_offset)
    want = _addresses(size, stride, offset)
    if x.is_contiguous() and x.storage_offset() == 0 and \
            (want.size == 0 or (want.min() >= 0 and want.max() < x.numel())):
        return NotImplemented                  # XLA's own reads these right
    have = _addresses(x.shape, x.stride(), x.storage_offset()).reshape(-1)
    order = np.argsort(have, kind="stable")
    pos = np.searchsorted(have[order], want.reshape(-1))
    pos = np.minimum(pos, max(len(have) - 1, 0))
    if want.size and (len(have) == 0 or (have[order][pos] != want.reshape(-1)).any()):
        raise ShapeError(
            f"as_strided{tuple(size)} with strides {tuple(stride)} reads storage outside "
            f"the {tuple(x.shape)} tensor it is called on (a view of a larger tensor): "
            "a program has no storage under its tensors; call it on the whole tensor, "
            "or .contiguous() first")
    index = torch.tensor(order[pos] if want.size else np.zeros(0, dtype=np.int64))
    return x.reshape(-1)[index.to(x.device)].reshape(tuple(size))


def _addresses(size, stride, offset: int) -> np.ndarray:
    """The storage address of every element of a ``size`` tensor with ``stride``."""
    out = np.full(tuple(size), offset, dtype=np.int64)
    for d, (n, st) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        out = out + (np.arange(n, dtype=np.int64) * st).reshape(shape)
    return out


def aminmax(x, *, dim=None, keepdim=False):
    """torch.aminmax: XLA has no kernel, and torch's decomposition passes dim=None on to
    amin/amax, which torch_xla reads as no dimension: the two 0-dim results of a whole
    tensor came back with the input's shape."""
    if dim is not None:
        return x.amin(dim, keepdim), x.amax(dim, keepdim)
    lo, hi = x.amin(), x.amax()
    if keepdim:
        lo, hi = lo.reshape([1] * x.dim()), hi.reshape([1] * x.dim())
    return lo, hi


def _whole(op):
    """``op`` (a reduction with a list of dimensions) over every dimension where it is
    given none: torch reads an empty list (or None, or amax's default) as all of them
    (``x.amax()``, ``x.sum(())``), torch_xla as none, and returned the input unreduced.
    Dimension 0 or -1 of a 0-dim tensor is the tensor itself, which torch_xla refuses."""
    def reduce(x, dim=None, *args, **kwargs):
        if x.dim() == 0 and all(d in (0, -1) for d in (dim or ())):
            return op(x.reshape(1), [0], *args, **kwargs).reshape(())
        if (dim is not None and len(dim)) or x.dim() == 0:
            return NotImplemented
        return op(x, list(range(x.dim())), *args, **kwargs)
    return reduce


_HALF = (torch.bfloat16, torch.float16)


def _wide(op, reduce=None):
    """A sum, mean or cumulative sum of a bfloat16 or float16 tensor accumulated in
    float32 and rounded once, as torch's CPU kernels do (and JAX's reductions): XLA on
    the CPU adds in the tensor's own precision, 15 ulps off torch over 20 elements.
    ``reduce`` handles the other dtypes (``_whole``'s dimensions), else XLA's kernel."""
    def run(x, *args, **kwargs):
        if x.dtype in _HALF and kwargs.get("dtype") is None:
            return op(x.float(), *args, **kwargs).to(x.dtype)
        return NotImplemented if reduce is None else reduce(x, *args, **kwargs)
    return run


def nansum(x, dim=None, keepdim=False, *, dtype=None):
    """torch.nansum (and nanmean, which torch computes from it): a sum with NaNs as
    zeros; torch_xla runs it on the CPU, so programs refused it."""
    clean = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    return torch.ops.aten.sum.dim_IntList(clean, dim, keepdim, dtype=dtype)


def count_nonzero(x, dim=None):
    """torch.count_nonzero, an int64 count as torch's: with a dimension, torch_xla's
    gives floats in a tensor whose shape it records wrongly ([0] for a count over
    dimension 0 of a vector)."""
    dims = [] if dim is None else [dim] if isinstance(dim, int) else list(dim)
    return torch.ops.aten.sum.dim_IntList(x != 0, dims, dtype=torch.int64)


def linalg_svd(A, full_matrices=False, compute_uv=True, *, driver=None):
    """The SVD of a batch, one matrix at a time: torch_xla's batched SVD gives outputs
    whose shapes it records wrongly (S of 4 5x6 matrices as [5], Vh as [6, 4, 5]), so
    the next op reads them along the wrong dimensions (a batched nuclear norm was 8.8
    off). One matrix's SVD is right."""
    if A.dim() <= 2:
        return NotImplemented
    batch, (m, n) = list(A.shape[:-2]), A.shape[-2:]
    flat = A.reshape(-1, m, n)
    parts = [torch.ops.aten._linalg_svd.default(flat[i], full_matrices, compute_uv,
                                                driver=driver)
             for i in range(flat.shape[0])]

    def stacked(k):
        if not compute_uv and k != 1:
            return parts[0][k]                 # empty, as torch gives it
        return torch.stack([p[k] for p in parts]).reshape(batch + list(parts[0][k].shape))
    return stacked(0), stacked(1), stacked(2)


def efficient_zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    """The zeros some derivatives return (``torch.sgn``'s on real inputs): a plain
    zero tensor, which XLA has (torch's is a lazily allocated one)."""
    return torch.zeros(size, dtype=dtype, device=device)


def angle(x):
    """torch.angle of a real tensor: pi where it is negative, else 0 (NaN stays)."""
    if x.is_complex() or not x.is_floating_point():
        return NotImplemented
    out = torch.where(x < 0, torch.full_like(x, math.pi), torch.zeros_like(x))
    return torch.where(torch.isnan(x), x, out)


def roll(x, shifts, dims=()):
    """torch.roll of an empty tensor is an empty tensor; torch_xla's takes the shift
    modulo the dimension's size, and a size of 0 killed the client (SIGFPE)."""
    return x.clone() if x.numel() == 0 else NotImplemented


def _of_floats(op):
    """``op`` of an integer tensor on its values as floats, as torch promotes them
    (torch_xla failed to lower erfc and erfinv of int64: an untyped error; logsumexp
    of integers: "Expected element type ... floating")."""
    def run(x, *args, **kwargs):
        if x.is_floating_point() or x.is_complex():
            return NotImplemented
        return op(x.to(torch.get_default_dtype()), *args, **kwargs)
    return run


@outermost
def integer_pow(a, b):
    """Integer ``a ** b`` with negative exponents as torch's kernel: 1 for a base of 1,
    +-1 for -1 (by the exponent's parity), else 0. XLA gave (-1) ** -3 as 0."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or \
            a.is_floating_point() or b.is_floating_point() or a.is_complex() or \
            b.is_complex() or a.dtype == torch.bool or b.dtype == torch.bool:
        return NotImplemented
    r = torch.ops.aten.pow.Tensor_Tensor(a, b)
    one = torch.ones_like(r)
    negative = torch.where(a == 1, one, torch.where(a == -1, torch.where(
        b % 2 == 0, one, -one), torch.zeros_like(r)))
    return torch.where(b < 0, negative, r)


def _never(x):
    """isnan / isinf / isposinf / isneginf of an integer or bool tensor: all False, as
    torch's (torch_xla failed to lower isnan of a bool tensor, and its isneginf of one
    gave True where the value was True)."""
    if x.is_floating_point() or x.is_complex():
        return NotImplemented
    return torch.zeros_like(x, dtype=torch.bool)


def nan_to_num(x, nan=None, posinf=None, neginf=None):
    """torch.nan_to_num of a floating tensor as torch's kernel: infinities become the
    dtype's largest finite values unless given, and each replacement is converted to
    the dtype as torch converts it (through float32 for the half types, so a value out
    of float16's range becomes an infinity). torch_xla's kernel gave bfloat16 infinities
    back unreplaced, and failed to compile a float16 replacement out of range."""
    if not x.is_floating_point():
        return NotImplemented
    info = torch.finfo(x.dtype)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32

    def value(v, default: float) -> torch.Tensor:
        v = default if v is None else v
        return torch.full((), v, dtype=wide, device=x.device).to(x.dtype)
    inf = torch.full((), math.inf, dtype=x.dtype, device=x.device)
    out = torch.where(x == inf, value(posinf, info.max), x)
    out = torch.where(x == -inf, value(neginf, info.min), out)
    return torch.where(x != x, value(nan, 0.0), out)


def _float64_log(base: float):
    """log2 / log10 of float64 tensors as log(x) / log(base) in double (torch_xla's
    kernels divide by a float32 ln(base): 1e-8 off)."""
    def run(x):
        if x.dtype != torch.float64:
            return NotImplemented
        return torch.log(x) / math.log(base)
    return run


def hardsigmoid_backward(grad, x):
    """F.hardsigmoid's gradient as torch's CPU kernel computes it: 1/6 rounded to
    float32 in every dtype (torch's decomposition multiplies float64 by the exact 1/6,
    1e-8 away from torch)."""
    if grad.dtype != torch.float64:
        return NotImplemented
    inside = (x > -3.0) & (x < 3.0)
    return torch.where(inside, grad * float(np.float32(1.0 / 6.0)), torch.zeros_like(grad))


def _no_check(*args, **kwargs) -> None:
    return None


def linspace(start, end, steps, *, dtype=None, layout=None, device=None,
             pin_memory=None):
    """``torch.linspace`` by its CPU kernel's formula, for number or 0-dim tensor ends:
    the ends in the result's type (truncated for an integer type, whose step is a
    double), the step their difference over ``steps - 1``, and each value taken from
    the nearer end (``start + step * i`` in the first half, ``end - step * (steps - 1
    - i)`` in the second), each operation rounded to the result's type. torch_xla's
    kernel made every linspace float32 whatever the dtype (a bfloat16 or int64 one
    came back float32, a float64 one lost its precision), by a formula 7 of 16 float32
    values off torch's, and tensor ends came back float64. torch's vectorized loop
    adds the step to each lane's base instead, which shows in float32 in about 1 value
    in 77 and in the half types by an ulp or two of the largest value."""
    from torch._decomp import decomposition_table
    dtype = dtype or (torch.get_default_dtype() if not any(
        isinstance(v, torch.Tensor) and v.is_complex() for v in (start, end))
        else None)
    if dtype is None or dtype.is_complex or steps < 1:
        return decomposition_table[torch.ops.aten.linspace.default](
            start, end, steps, dtype=dtype, layout=layout, device=device,
            pin_memory=pin_memory)
    integer = not dtype.is_floating_point
    comp = torch.float64 if integer or dtype == torch.float64 else torch.float32

    def r(t):               # rounded to the result's floating type
        return t.to(dtype).to(comp) if dtype in _HALF else t

    def end_value(v):
        t = v.to(device) if isinstance(v, torch.Tensor) else torch.tensor(
            v, dtype=torch.float64 if isinstance(v, float) else None, device=device)
        if integer:
            return t.to(torch.int64).to(comp)
        return r(t.to(comp))
    s, e = end_value(start), end_value(end)
    idx = torch.arange(steps, dtype=comp, device=device)
    if steps == 1:
        return s.expand(1).to(dtype)
    step = r((e - s) / (steps - 1))
    low = r(s + r(step * idx))
    high = r(e - r(step * (steps - 1 - idx)))
    return torch.where(idx < steps // 2, low, high).to(dtype)


def _by_torch(op, *, half: bool = True, float64: bool = False) -> Callable:
    """``op`` by torch's own decomposition when its floating tensors are all one half
    type (``half``) or its first is float64 (``float64``); XLA's kernel otherwise.

    float64: torch_xla's kernels of gelu, threshold, layer norm and logit compute with
    float32 constants (gelu's 1/sqrt(2), threshold's value, layer norm's and logit's
    eps), 1e-9 to 4e-8 off where float64 is good to 1e-16.

    Half types: torch_xla's layer and group norms compute bfloat16 and float16 with a
    rounding at each step: a float16 layer norm, forward and backward, came out twice
    torch's distance from the exact result, a group norm 1.8x, and their gradients
    (torch's decompositions, which torch_xla has no kernel for) as far, from the
    statistics the forward saved. torch's decompositions compute in float32 and equal
    its kernels (group norm in every element; layer norm's input gradient in all but 1
    in 1,000, its weight and bias gradients 3-5x closer to exact than torch's own
    kernel, which sums them in the half type)."""
    from torch._decomp import decomposition_table
    decomp = decomposition_table[op]

    def run(*args, **kwargs):
        if float64 and args[0].dtype == torch.float64:
            return decomp(*args, **kwargs)
        if not half:
            return NotImplemented
        floats = {t.dtype for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.is_floating_point()}
        if len(floats) != 1 or floats.pop() not in _HALF:
            return NotImplemented
        return decomp(*args, **kwargs)
    return run


def table() -> Dict[object, Callable]:
    """The decompositions for the ops that exist in this process (a library's custom
    ops exist once it is imported): ops torch_xla lacks, or lowers with other numbers
    than torch."""
    from torch._decomp import decomposition_table

    from . import dft, pooling, resample, special
    aten = torch.ops.aten
    out: Dict[object, Callable] = {**resample.table(), **pooling.table()}
    amax, amin = _nan_extreme(aten.amax.default), _nan_extreme(aten.amin.default)
    out.update({
        aten.histc.default: histc,
        **{getattr(aten.linspace, ov): linspace
           for ov in ("default", "Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor")},
        aten.native_layer_norm.default: _by_torch(aten.native_layer_norm.default,
                                                  float64=True),
        aten.native_group_norm.default: _by_torch(aten.native_group_norm.default),
        # torch_xla's logspace was 41 of 50 float32 values off torch's: torch's formula
        aten.logspace.default: decomposition_table[aten.logspace.default],
        aten._weight_norm_interface_backward.default: weight_norm_backward,
        aten.median.dim: median_dim,
        aten.median.default: median_all,
        aten.scatter.value: scatter_value_long_index,
        aten.sort.default: sort_like_torch,
        aten.sort.stable: sort_like_torch,
        aten.topk.default: topk_like_torch,
        aten.kthvalue.default: kthvalue_like_torch,
        aten.nanmedian.default: nanmedian_all,
        aten.exp2.default: exp2,
        aten.hypot.default: hypot,
        aten.fmax.default: fmax,
        aten.fmin.default: fmin,
        aten.signbit.default: signbit,
        aten.copysign.Tensor: copysign,
        aten.copysign.Scalar: copysign,
        aten.round.decimals: round_decimals,
        aten.cummin.default: cummin,
        aten.cumprod.default: cumprod_integers,
        aten.remainder.Tensor: remainder,
        aten.remainder.Scalar: remainder,
        aten.heaviside.default: heaviside,
        aten.sign.default: sign_of_bool,
        aten.sgn.default: sign_of_bool,
        aten.cummax.default: cummax,
        aten.logcumsumexp.default: logcumsumexp,
        aten.embedding_renorm_.default: embedding_renorm_,
        aten.linalg_cholesky_ex.default: cholesky_ex,
        aten.linalg_solve_triangular.default: solve_triangular,
        aten._linalg_check_errors.default: _no_check,
        aten.native_batch_norm_backward.default: batch_norm_backward,
        aten.searchsorted.Tensor: searchsorted,
        aten._efficientzerotensor.default: efficient_zeros,
        aten.as_strided.default: as_strided,
        aten.nll_loss_forward.default: nll_loss_unbatched,
        aten.nll_loss_backward.default: nll_loss_backward_unbatched,
        aten.nll_loss2d_forward.default: nll_loss2d_long,
        aten.index_select.default: index_select_checked,
        **{op: _broadcasting(op) for op in (aten.clamp_min.Tensor, aten.clamp_max.Tensor)},
        aten.aminmax.default: aminmax,
        aten._linalg_svd.default: linalg_svd,
        aten.amax.default: amax,
        aten.amin.default: amin,
        aten.max.default: _nan_extreme_all(amax),
        aten.min.default: _nan_extreme_all(amin),
        aten.max.dim: _nan_extreme_dim(aten.max.dim),
        aten.min.dim: _nan_extreme_dim(aten.min.dim),
        aten.argmax.default: _nan_arg(aten.argmax.default),
        aten.argmin.default: _nan_arg(aten.argmin.default),
        aten.sum.dim_IntList: _wide(aten.sum.dim_IntList, _whole(aten.sum.dim_IntList)),
        aten.mean.dim: _complex_mean(aten.mean.dim, _wide(aten.mean.dim,
                                                          _whole(aten.mean.dim))),
        aten.mean.default: _complex_mean(aten.mean.default, _wide(aten.mean.default)),
        aten.sum.default: _wide(aten.sum.default),
        aten.cumsum.default: _wide(aten.cumsum.default, cumsum_integers),
        aten.div.Tensor_mode: div_rounding,
        aten.div.Scalar_mode: div_rounding,
        aten.floor_divide.default: floor_divide,
        aten.floor_divide.Scalar: floor_divide,
        aten.__rshift__.Scalar: right_shift,
        aten.__rshift__.Tensor: right_shift,
        aten.clamp.default: clamp_promoted,
        aten.index_put.default: _masked_put(False),
        aten.index_put_.default: _masked_put(True),
        aten.arange.default: arange_end,
        aten.arange.start: arange_start,
        aten.arange.start_step: arange_step,
        aten.nansum.default: nansum,
        aten.count_nonzero.default: count_nonzero,
        aten.count_nonzero.dim_IntList: count_nonzero,
        aten.angle.default: angle,
        aten.roll.default: roll,
        **{op: _never for op in (aten.isnan.default, aten.isinf.default,
                                 aten.isneginf.default)},
        aten.isposinf.default: isposinf,
        aten.__lshift__.Scalar: left_shift,
        aten.__lshift__.Tensor: left_shift,
        aten.erfc.default: _of_floats(aten.erfc.default),
        aten.erfinv.default: _of_floats(aten.erfinv.default),
        aten.logsumexp.default: logsumexp,
        aten.pow.Tensor_Tensor: integer_pow,
        **{op: _by_torch(op, half=False, float64=True) for op in (
            aten.gelu.default, aten.gelu_backward.default, aten.threshold.default,
            aten.threshold_backward.default,
            aten.logit.default, aten.logit_backward.default)},
        aten.hardsigmoid_backward.default: hardsigmoid_backward,
        aten.nan_to_num.default: nan_to_num,
        aten.log2.default: _float64_log(2.0),
        aten.log10.default: _float64_log(10.0),
        aten.scatter_reduce.two: scatter_reduce,
        aten.addmm.default: addmm,
        **{getattr(aten, name).Scalar: _compare_scalar(getattr(aten, name).Scalar)
           for name in ("eq", "ne", "lt", "le", "gt", "ge")},
        aten.addbmm.default: addbmm,
        aten.lgamma.default: special.lgamma,
        aten.digamma.default: special.digamma,
        aten.polygamma.default: special.polygamma,
        aten._fft_c2c.default: dft.fft_c2c,
        aten._fft_r2c.default: dft.fft_r2c,
        aten._fft_c2r.default: dft.fft_c2r,
    })
    if hasattr(torch.ops.aten, "_grouped_mm"):
        out[torch.ops.aten._grouped_mm.default] = _aten_grouped_mm
    try:
        hf = torch.ops.transformers
        out[hf.grouped_mm_fallback.default] = grouped_mm
        out[hf.grouped_mm_fallback_backward.default] = grouped_mm_backward
    except (AttributeError, RuntimeError):
        pass                                   # transformers not imported
    return out


# ----------------------------------------------------------------- above autograd
# Ops whose *backward* XLA lacks (grid_sampler_2d_backward, _cdist_backward,
# linalg_lu_solve, the margin losses') or whose torch kernel reads values
# (linalg.solve's LU, matrix_exp's choice of degree), or that XLA lacks and whose
# backward is best left to autograd (householder_product): these public
# functions are replaced while a program is traced, so autograd differentiates a formula
# of ops XLA has (torch_paths.traceable applies them).

def grid_sample(input, grid, mode="bilinear", padding_mode="zeros", align_corners=None):
    """F.grid_sample on 4-d inputs by the formulas of torch's CPU kernel
    (aten/src/ATen/native/cpu/GridSamplerKernel.cpp, the vectorized kernel torch runs
    for float and double), the same operations in the same order, differentiated by
    autograd.

    A grid point maps to the pixel position ``(g + 1) * ((size - 1) / 2)`` with
    ``align_corners``, else ``(g + 1) * (size / 2) - 0.5`` (``_grid_unnormalize``);
    border padding clips it to ``[0, size - 1]``, reflection folds it first
    (``_grid_compute_coordinates``). Bilinear takes ``floor`` and the weights ``nw = (1 -
    dy) * (1 - dx)``, ``ne = (1 - dy) * dx``..., nearest rounds half to even, bicubic
    weighs 4x4 taps (each clipped or folded) by the cubic convolution coefficients (A =
    -0.75). torch's Python decomposition, used before, unnormalized as ``g * mul +
    ofs``: at points on a pixel centre or a half pixel, which an identity affine grid (a
    spatial transformer's initialization) is full of, its floor and round fell on the
    other side, so the grid's gradient (and nearest's output) were another function.

    The grid's gradient is torch's: through the clip and the fold with torch's
    convention at their bounds (zero at exactly 0 and at size - 1), for bicubic through
    the kernel's own derivative of the coefficients, and zero for nearest. The kernel's
    AVX2/AVX-512 builds fuse the multiply-adds of its weighted sums, which are rounded
    twice here (an ulp); the one in the unnormalization, which decides floor and round,
    is reproduced exactly. Float16/bfloat16 inputs are computed in float32."""
    if input.dim() != 4 or grid.dim() != 4 or grid.shape[-1] != 2:
        return NotImplemented
    modes = ("bilinear", "nearest", "bicubic")
    if (mode not in modes or padding_mode not in ("zeros", "border", "reflection")
            or input.dtype != grid.dtype or not input.dtype.is_floating_point
            or grid.shape[0] != input.shape[0]):
        return NotImplemented                 # torch's own error
    dtype = input.dtype
    if dtype not in (torch.float32, torch.float64):
        out = grid_sample(input.float(), grid.float(), mode, padding_mode, align_corners)
        return out.to(dtype)
    ac = bool(align_corners)
    n, c, h, w = input.shape
    oh, ow = grid.shape[1:3]
    flat = input.reshape(n, c, h * w)

    def read(ix, iy):
        """input[:, :, iy, ix] at integer-valued coordinates [n, oh, ow], 0 outside."""
        inside = (ix > -1) & (ix < w) & (iy > -1) & (iy < h)
        at = (torch.where(inside, iy, 0).to(torch.int64) * w
              + torch.where(inside, ix, 0).to(torch.int64))
        vals = flat.gather(2, at.reshape(n, 1, oh * ow).expand(n, c, oh * ow))
        return torch.where(inside.unsqueeze(1), vals.reshape(n, c, oh, ow), 0)

    gx, gy = grid[..., 0], grid[..., 1]
    if mode == "bicubic":
        x, y = _grid_unnormalize(gx, w, ac), _grid_unnormalize(gy, h, ac)
        ix, iy = x.floor(), y.floor()
        cx, cy = _grid_cubic_coefficients(x - ix), _grid_cubic_coefficients(y - iy)
        ix, iy = ix.detach(), iy.detach()
        out = None
        for j in range(4):                   # rows, then columns within a row
            yy = _grid_compute_coordinates(iy + (j - 1), h, padding_mode, ac)
            row = None
            for i in range(4):
                xx = _grid_compute_coordinates(ix + (i - 1), w, padding_mode, ac)
                term = read(xx, yy) * cx[i].unsqueeze(1)
                row = term if row is None else row + term
            term = row * cy[j].unsqueeze(1)
            out = term if out is None else out + term
        return out
    x = _grid_compute_coordinates(_grid_unnormalize(gx, w, ac), w, padding_mode, ac)
    y = _grid_compute_coordinates(_grid_unnormalize(gy, h, ac), h, padding_mode, ac)
    if mode == "nearest":
        out = read(x.round(), y.round())      # half to even, as the kernel's round
        if grid.requires_grad:                # torch's zero gradient for the grid
            none = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
            out = out + torch.where(none, x + y, 0).unsqueeze(1)
        return out
    x_w, y_n = x.floor(), y.floor()
    dx, dy = x - x_w, y - y_n
    ex, sy = 1 - dx, 1 - dy
    x_w, y_n = x_w.detach(), y_n.detach()
    nw, ne, sw, se = (t.unsqueeze(1) for t in (sy * ex, sy * dx, dy * ex, dy * dx))
    return (read(x_w, y_n) * nw + read(x_w + 1, y_n) * ne + read(x_w, y_n + 1) * sw
            + read(x_w + 1, y_n + 1) * se)


def _cpu_kernels_fuse_multiply_add() -> bool:
    """Whether torch's vectorized CPU kernels round ``a * b + c`` once: its AVX2 and
    AVX-512 builds do (the compiler contracts them into fused multiply-adds), the
    DEFAULT build an x86 CPU without AVX2 or ``ATEN_CPU_CAPABILITY=default`` selects
    rounds twice. ARM builds are taken to contract (FMA is part of the ISA)."""
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64", "x86", "i386", "i686"):
        return True
    return torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def affine_grid(theta, size, align_corners=None):
    """F.affine_grid (4-d) as torch's CPU kernel computes it (AffineGridGenerator.cpp):
    each axis is ``linspace(-1, 1, n)``, whose values torch computes as ``-1 + step * i``
    in the first half and ``1 - step * (n - 1 - i)`` in the second (one rounding in its
    AVX2 builds), times ``(n - 1) / n`` without ``align_corners``; then ``base @
    theta^T``. torch's decomposition, used before, made the same points an ulp or two
    away (``linspace(-a, a)``), and an identity grid's points, each on a pixel centre,
    then crossed grid_sample's floor: a spatial transformer trained from its identity
    initialization took another gradient for theta (its bias 86% off after 3 steps)."""
    if len(size) != 4 or theta.dim() != 3 or theta.shape[1:] != (2, 3) or \
            theta.dtype != torch.float32:
        return NotImplemented               # float64: torch's decomposition, an ulp off
    n, _, h, w = size
    if theta.shape[0] != n:
        return NotImplemented

    def axis(k: int) -> torch.Tensor:
        if k <= 1:
            return torch.zeros(1, dtype=theta.dtype, device=theta.device)
        step = float(np.float32(2) / np.float32(k - 1))
        i = torch.arange(k, dtype=torch.float64, device=theta.device)
        if _cpu_kernels_fuse_multiply_add():
            lo, hi = (-1 + step * i).to(theta.dtype), (1 - step * (k - 1 - i)).to(theta.dtype)
        else:
            lo = -1 + (step * i).to(theta.dtype)
            hi = 1 - (step * (k - 1 - i)).to(theta.dtype)
        r = torch.where(i < k // 2, lo, hi)
        return r if align_corners else r * (k - 1) / k

    x, y = axis(w).view(1, 1, w), axis(h).view(1, h, 1)
    t = theta.view(n, 2, 3, 1, 1)
    gx = x * t[:, 0, 0] + y * t[:, 0, 1] + t[:, 0, 2]
    gy = x * t[:, 1, 0] + y * t[:, 1, 1] + t[:, 1, 2]
    return torch.stack([gx, gy], -1)


def _grid_unnormalize(g: torch.Tensor, size: int, align_corners: bool) -> torch.Tensor:
    """Grid values to pixel positions as torch's CPU kernel: ``(g + 1) * ((size - 1) /
    2)`` with ``align_corners``, else ``(g + 1) * (size / 2) - 0.5``, which its AVX2 and
    AVX-512 builds compute as one fused multiply-add. Both roundings are made explicit
    (the product in float64, where it is exact, then one rounding to float32) so that
    XLA's own contraction cannot change them: at grid points on pixel centres and half
    pixels the difference decides floor and round. Float64 grids: the plain formula."""
    t = g + 1
    if align_corners:
        return t * ((size - 1) / 2)
    if g.dtype == torch.float64:
        return t * (size / 2) - 0.5
    if _cpu_kernels_fuse_multiply_add():
        return (t.to(torch.float64) * (size / 2) - 0.5).to(g.dtype)
    return (t.to(torch.float64) * (size / 2)).to(g.dtype) - 0.5


def _grid_clip(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` clipped to [0, size - 1] (NaN to 0), as the kernel's clip_coordinates; its
    gradient passes only strictly inside (the kernel counts the bounds as outside)."""
    top = size - 1
    outside = torch.where(x >= top, torch.full_like(x, top), torch.zeros_like(x))
    return torch.where((x > 0) & (x < top), x, outside.detach())


def _grid_reflect(x: torch.Tensor, size: int, align_corners: bool) -> torch.Tensor:
    """The kernel's reflect_coordinates: ``x`` folded into [low, low + span] (0 to
    size - 1 with ``align_corners``, else -0.5 to size - 0.5), gradient +-1."""
    if align_corners:
        if size <= 1:
            return torch.zeros_like(x).detach()
        low, period = 0.0, 2.0 * (size - 1)
        a = x.abs()
    else:
        low, period = -0.5, 2.0 * size
        a = (x - low).abs()
    extra = a - (a / period).trunc() * period
    back = period - extra
    folded = torch.where(extra > back, back, extra)
    return folded + low if low else folded


def _grid_compute_coordinates(x: torch.Tensor, size: int, padding_mode: str,
                              align_corners: bool) -> torch.Tensor:
    if padding_mode == "border":
        return _grid_clip(x, size)
    if padding_mode == "reflection":
        return _grid_clip(_grid_reflect(x, size, align_corners), size)
    return x


def _grid_cubic_coefficients(t: torch.Tensor):
    """The kernel's cubic convolution weights of the taps at -1, 0, 1, 2 for the
    fraction ``t``, by its Horner forms (A = -0.75); their derivative with respect to
    ``t`` is the kernel's get_cubic_coefficients_grad, not autograd's of the Horner
    forms (which rounds differently: the grid's gradient sums 16 taps that cancel)."""
    a = -0.75
    u = t.detach()

    def far(v):                               # 1 < |v| < 2
        return ((a * v - 5 * a) * v + 8 * a) * v - 4 * a

    def near(v):                              # |v| <= 1
        return ((a + 2) * v - (a + 3)) * v * v + 1

    values = (far(u + 1), near(u), near(1 - u), far(2 - u))
    v0, v1, v2, v3 = -1 - u, 0 - u, 1 - u, 2 - u
    slopes = (-((-3 * a * v0 - 10 * a) * v0 - 8 * a),
              -((-3 * (a + 2) * v1 - 2 * (a + 3)) * v1),
              -((3 * (a + 2) * v2 - 2 * (a + 3)) * v2),
              -((3 * a * v3 - 10 * a) * v3 + 8 * a))
    moved = t - u                             # 0, with derivative 1
    return [value + slope * moved for value, slope in zip(values, slopes)]


def _safe_root(s: torch.Tensor, p: float) -> torch.Tensor:
    """s ** (1/p) with a zero gradient at 0, as torch's cdist backward gives."""
    pos = s > 0
    root = torch.where(pos, s, torch.ones_like(s)) ** (1.0 / p)
    return torch.where(pos, root, torch.zeros_like(s))


def cdist(x1, x2, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary"):
    """torch.cdist by its own formulas: for p=2 the matmul expansion where torch uses
    it (more than 25 rows on either side, or asked), else the differences."""
    rows1, rows2 = x1.shape[-2], x2.shape[-2]
    mm = p == 2 and (compute_mode == "use_mm_for_euclid_dist" or (
        compute_mode == "use_mm_for_euclid_dist_if_necessary" and (rows1 > 25 or rows2 > 25)))
    if mm:
        d2 = (x1.pow(2).sum(-1, keepdim=True) - 2 * x1 @ x2.mT
              + x2.pow(2).sum(-1).unsqueeze(-2)).clamp_min(0)
        return _safe_root(d2, 2.0)
    return _pnorm((x1.unsqueeze(-2) - x2.unsqueeze(-3)).abs(), p)


def pdist(input, p=2.0):
    """F.pdist: the distances of every pair of rows i < j, row by row, from their
    differences as torch's kernel computes them (XLA lacks its backward: a
    uniformity loss could not train)."""
    i, j = torch.triu_indices(input.shape[0], input.shape[0], 1)
    return _pnorm((input[i] - input[j]).abs(), p)


def _pnorm(diff, p):
    """The p-norm over the last dimension of absolute differences, with a zero
    gradient at distance 0 as torch's distance kernels."""
    if p == 0:
        return (diff != 0).sum(-1).to(diff.dtype)
    if p == math.inf:
        return diff.amax(-1)
    if p == 1:
        return diff.sum(-1)
    return _safe_root(diff.pow(p).sum(-1), p)


def solve(A, B, *, left=True, out=None):
    """torch.linalg.solve as the inverse times B (torch factors A with an LU that XLA
    does not have, and checks for singular A by reading a value)."""
    if out is not None:
        return NotImplemented
    vector = B.dim() == 1 or (B.dim() == A.dim() - 1 and B.shape == A.shape[:-1])
    inv = torch.linalg.inv(A)
    if left:
        return (inv @ B.unsqueeze(-1)).squeeze(-1) if vector else inv @ B
    return (B.unsqueeze(-2) @ inv).squeeze(-2) if vector else B @ inv


class _SlogDet(torch.autograd.Function):
    """slogdet with the gradient of log|det A|, inv(A)^T (torch's goes through the LU
    factors, which XLA does not have)."""

    @staticmethod
    def forward(ctx, A):
        sign, logabs, _, _ = torch.ops.aten._linalg_slogdet.default(A)
        ctx.save_for_backward(A)
        ctx.mark_non_differentiable(sign)
        return sign, logabs

    @staticmethod
    def backward(ctx, _grad_sign, grad_logabs):
        A, = ctx.saved_tensors
        return grad_logabs[..., None, None] * torch.linalg.inv(A).mT


def slogdet(A, *, out=None):
    if out is not None or A.is_complex():
        return NotImplemented
    from torch.return_types import slogdet as result
    return result(_SlogDet.apply(A))


def det(A, *, out=None):
    if out is not None or A.is_complex():
        return NotImplemented
    sign, logabs = _SlogDet.apply(A)
    return sign * torch.exp(logabs)


def logdet(A):
    if A.is_complex():
        return NotImplemented
    sign, logabs = _SlogDet.apply(A)
    return torch.where(sign < 0, torch.full_like(logabs, math.nan), logabs)


def rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False):
    """Evaluation-mode RReLU is a leaky ReLU with the mean slope (training draws a
    slope per element, left to torch)."""
    if training:
        return NotImplemented
    import torch.nn.functional as F
    return F.leaky_relu(input, (lower + upper) / 2, inplace)


def matrix_exp(A, *, out=None):
    """exp(A) by scaling and squaring: A / 2^12, a degree-10 Taylor polynomial, 12
    squarings. torch picks the degree and scaling from the norm, a value this formula
    cannot read; a fixed scaling this deep loses I + small in float32, so it carries
    exp(X) - I instead ((I + F)^2 - I = 2F + F^2) and adds I at the end: float32
    within 2e-6 of float64 for norms up to ~60, as torch's own float32. The gradient
    comes from autograd through the matmuls."""
    if out is not None:
        return NotImplemented
    s, degree = 12, 10
    X = A / (2.0 ** s)
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
    P = eye                                   # sum_j X^j / (j + 1)!, by Horner
    for k in range(degree, 1, -1):
        P = eye + (X @ P) / k
    F = X @ P                                 # exp(X) - I
    for _ in range(s):
        F = 2 * F + F @ F
    return eye + F


def householder_product(A, tau, *, out=None):
    """Q = H_1 ... H_k with H_i = I - tau_i v_i v_i^H (v_i: column i of A below the
    diagonal, 1 on it), its first n columns: k rank-one updates (the orthogonal
    parametrization's "householder" map)."""
    if out is not None:
        return NotImplemented
    m, n = A.shape[-2], A.shape[-1]
    rows = torch.arange(m, device=A.device)
    Q = torch.eye(m, n, dtype=A.dtype, device=A.device).expand(*A.shape[:-2], m, n)
    for i in reversed(range(tau.shape[-1])):
        v = torch.where(rows > i, A[..., :, i], (rows == i).to(A.dtype))
        t = tau[..., i, None, None]
        Q = Q - t * v.unsqueeze(-1) * (v.conj().unsqueeze(-2) @ Q)
    return Q


_REDUCTION = {"none": 0, "mean": 1, "sum": 2}


def multi_margin_loss(input, target, p=1, margin=1.0, weight=None, size_average=None,
                      reduce=None, reduction="mean"):
    """torch's decomposition, differentiated by autograd (XLA lacks the backward)."""
    _long_targets(target)
    if size_average is not None or reduce is not None or reduction not in _REDUCTION:
        return NotImplemented
    from torch._decomp.decompositions import multi_margin_loss as decomposed
    return decomposed(input, target, p, margin, weight, _REDUCTION[reduction])


def multilabel_margin_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    """sum over target classes j and other classes k of max(0, 1 - x[j] + x[k]) / C,
    the targets being each row's prefix before the first -1 (torch's own decomposition
    of this loss gives other numbers than its kernel)."""
    _long_targets(target)
    if size_average is not None or reduce is not None or reduction not in _REDUCTION:
        return NotImplemented
    vector = input.dim() == 1
    x, t = (input.unsqueeze(0), target.unsqueeze(0)) if vector else (input, target)
    valid = (t < 0).to(x.dtype).cumsum(-1) == 0              # before the first -1
    tgt = t.clamp_min(0)
    chosen = torch.zeros_like(x).scatter_add(-1, tgt, valid.to(x.dtype)) > 0
    x_t = x.gather(-1, tgt)
    margins = (1 - x_t.unsqueeze(-1) + x.unsqueeze(-2)).clamp_min(0)      # [N, j, k]
    mask = valid.unsqueeze(-1) & ~chosen.unsqueeze(-2)
    loss = (margins * mask).sum((-1, -2)) / x.shape[-1]
    loss = loss[0] if vector else loss
    return {"none": loss, "mean": loss.mean(), "sum": loss.sum()}[reduction]


def quantile(input, q, dim=None, keepdim=False, *, interpolation="linear", out=None):
    """torch.quantile from a sort: the rank q * (n - 1) between two order statistics
    (torch's kernel checks q's range by reading it); a row with a NaN gives NaN."""
    if out is not None or interpolation not in ("linear", "lower", "higher", "nearest",
                                                "midpoint"):
        return NotImplemented
    scalar_q = not isinstance(q, torch.Tensor) or q.dim() == 0
    x = input.reshape(-1) if dim is None else input
    d = 0 if dim is None else dim % max(x.dim(), 1)
    srt = x.sort(d).values.movedim(d, -1)                        # [..., n]
    n = srt.shape[-1]
    qs = torch.as_tensor(q, dtype=srt.dtype, device=srt.device).reshape(-1)
    rank = qs * (n - 1)
    lo = rank.floor().long().clamp(0, n - 1)
    hi = rank.ceil().long().clamp(0, n - 1)
    if interpolation == "nearest":
        lo = hi = rank.round().long().clamp(0, n - 1)
    a, b = srt[..., lo], srt[..., hi]                            # [..., len(q)]
    if interpolation in ("linear", "nearest"):
        frac = (rank - lo.to(rank.dtype)) if interpolation == "linear" else torch.zeros_like(rank)
        res = torch.lerp(a, b, frac.expand_as(a))
    elif interpolation == "lower":
        res = a
    elif interpolation == "higher":
        res = b
    else:
        res = (a + b) / 2
    res = torch.where(torch.isnan(srt[..., -1:]), torch.full_like(res, math.nan), res)
    res = res.movedim(-1, 0)                                     # [len(q), ...]
    if keepdim:
        res = res.unsqueeze(d + 1) if dim is not None else res.reshape(
            (len(qs),) + (1,) * input.dim())
    return res[0] if scalar_q else res


def gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    """F.gaussian_nll_loss without its check that no variance is negative (a value
    read); the variance is clamped to ``eps`` as torch does."""
    if isinstance(var, (int, float)):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = var * torch.ones_like(input)
    if var.size() != input.size():
        if input.size()[:-1] == var.size():
            var = var.unsqueeze(-1)
        elif not (input.size()[:-1] == var.size()[:-1] and var.size(-1) == 1):
            return NotImplemented                 # torch's own error
    if reduction not in ("none", "mean", "sum"):
        return NotImplemented
    var = var.clone()
    with torch.no_grad():
        var.clamp_(min=eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    return {"none": loss, "mean": loss.mean(), "sum": loss.sum()}[reduction]


def embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2.0,
                  scale_grad_by_freq=False, mode="mean", sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=None):
    """F.embedding_bag (torch_xla has no ``_embedding_bag``) as a lookup and a
    reduction per bag: a bag is a row of a 2-d ``input``, or the run of a 1-d ``input``
    between two ``offsets``, reduced by a scatter over each position's bag (its number
    a cumulative sum of the offsets' marks: O(ids + bags), static shapes).
    ``padding_idx`` entries count in no bag; an empty bag gives zeros; a sparse
    gradient is dense, as for ``nn.Embedding(sparse=True)``. Offsets count from the
    first one: a batch cut into parts (MultiIsland's halves, a pipeline's
    micro-batches) keeps its offsets, which torch would refuse in a part that does not
    start at 0. Half-precision bags add up in float32 and round once, as torch's
    kernel does (a mean divides the rounded sum, as torch's does)."""
    import torch.nn.functional as F
    if mode not in ("sum", "mean", "max"):
        raise ValueError(f"embedding_bag: mode must be 'sum', 'mean' or 'max', not {mode!r}")
    if per_sample_weights is not None and mode != "sum":
        raise NotImplementedError(
            "embedding_bag: per_sample_weights was not None. per_sample_weights is only "
            f"supported for mode='sum' (got mode='{mode}'). Please open a feature request "
            "on GitHub.")
    if input.dim() == 1 and offsets is None:
        raise ValueError("offsets has to be a 1D Tensor but got None (a 1-d input is "
                         "cut into bags at offsets; a 2-d input is one bag a row)")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]      # as F.embedding_bag counts it (-1: the last row)
    emb = F.embedding(input, weight, None, max_norm, norm_type, scale_grad_by_freq)
    dtype = emb.dtype
    if dtype in (torch.float16, torch.bfloat16):
        emb = emb.float()
    keep = (input != padding_idx) if padding_idx is not None else torch.ones_like(
        input, dtype=torch.bool)
    if per_sample_weights is not None:
        emb = emb * per_sample_weights.to(emb.dtype).unsqueeze(-1)
    if input.dim() == 2:
        if offsets is not None:
            raise ValueError("embedding_bag: if input is 2-D, offsets has to be None, as "
                             "input is treated is a mini-batch of fixed length sequences.")
        if mode == "max":
            out = emb.masked_fill(~keep.unsqueeze(-1), float("-inf")).amax(-2)
            out = torch.where(keep.any(-1, keepdim=True), out, torch.zeros_like(out))
        else:
            out = (emb * keep.unsqueeze(-1).to(emb.dtype)).sum(-2).to(dtype)
            if mode == "mean":
                out = out / keep.sum(-1, keepdim=True).clamp(min=1).to(dtype)
        return out.to(dtype)
    n, dim = input.shape[0], emb.shape[-1]
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    if bags <= 0:
        return emb.new_zeros(0, dim).to(dtype)
    offs = offsets.to(torch.int64)
    offs = offs - offs[:1]
    at = torch.arange(n, device=input.device)
    # bag of each position: how many bag starts lie at or before it, less one
    marks = torch.zeros(n + 1, dtype=torch.int64, device=input.device).index_add(
        0, offs[:bags].clamp(0, n), torch.ones(bags, dtype=torch.int64, device=input.device))
    bag = marks.cumsum(0)[:n] - 1
    inside = keep & (bag >= 0)
    if include_last_offset:
        inside = inside & (at < offs[bags])
    bag = bag.clamp(0, max(bags - 1, 0))
    counts = torch.zeros(bags, dtype=emb.dtype, device=input.device).index_add(
        0, bag, inside.to(emb.dtype))
    if mode == "max":
        vals = emb.masked_fill(~inside.unsqueeze(-1), float("-inf"))
        out = torch.full((bags, dim), float("-inf"), dtype=emb.dtype,
                         device=input.device).scatter_reduce(
            0, bag.unsqueeze(-1).expand(n, dim), vals, "amax", include_self=True)
        out = torch.where((counts > 0).unsqueeze(-1), out, torch.zeros_like(out))
        return out.to(dtype)
    out = torch.zeros(bags, dim, dtype=emb.dtype, device=input.device).index_add(
        0, bag, emb * inside.unsqueeze(-1).to(emb.dtype)).to(dtype)
    if mode == "mean":         # the sum rounded, then divided: torch's rounding
        out = out / counts.clamp(min=1).unsqueeze(-1).to(dtype)
    return out


def masked_setitem(self, index, value):
    """``x[mask] = v`` with a boolean mask over x's leading dimensions and a value
    that broadcasts to one masked element (a learnable mask token: BEiT's and
    wav2vec2's ``hidden[mask] = self.mask_embed``), as ``where`` written into x: the
    same numbers, and a backward with static shapes (torch's is ``grad[mask]``, whose
    length is the mask's count of True). Other indexing goes torch's way."""
    if not (isinstance(index, torch.Tensor) and index.dtype == torch.bool and
            0 < index.dim() <= self.dim() and index.shape == self.shape[:index.dim()]):
        return NotImplemented
    rest = self.shape[index.dim():]
    if isinstance(value, torch.Tensor):
        if value.dim() > len(rest) or value.is_complex() != self.is_complex():
            return NotImplemented
        try:
            torch.broadcast_shapes(value.shape, rest)
        except RuntimeError:
            return NotImplemented
        value = value.to(self.dtype)
    elif not isinstance(value, (bool, int, float)):
        return NotImplemented
    else:
        value = torch.tensor(value, dtype=self.dtype, device=self.device)
    mask = index.reshape(index.shape + (1,) * len(rest))
    self.copy_(torch.where(mask, value, self))
    return None


def above_autograd() -> Dict[Callable, Callable]:
    """{public torch function: formula}, applied while a program is traced."""
    import torch.nn.functional as F

    from . import covariance, ctc
    return {
        F.grid_sample: grid_sample,
        F.affine_grid: affine_grid,
        torch.cdist: cdist,
        F.pdist: pdist, torch.pdist: pdist,
        # a user's as_strided of a view: the gather, differentiated by autograd (the
        # aten op's own backward scatters into the view's storage, which XLA gets wrong)
        torch.as_strided: as_strided, torch.Tensor.as_strided: as_strided,
        torch.cov: covariance.cov, torch.Tensor.cov: covariance.cov,
        torch.corrcoef: covariance.corrcoef, torch.Tensor.corrcoef: covariance.corrcoef,
        torch.linalg.solve: solve,
        torch.linalg.slogdet: slogdet, torch.slogdet: slogdet, torch.Tensor.slogdet: slogdet,
        torch.linalg.det: det, torch.det: det, torch.Tensor.det: det,
        torch.logdet: logdet, torch.Tensor.logdet: logdet,
        F.rrelu: rrelu,
        torch.linalg.matrix_exp: matrix_exp, torch.matrix_exp: matrix_exp,
        torch.Tensor.matrix_exp: matrix_exp,
        torch.linalg.householder_product: householder_product,
        torch.orgqr: householder_product, torch.Tensor.orgqr: householder_product,
        F.multi_margin_loss: multi_margin_loss,
        F.multilabel_margin_loss: multilabel_margin_loss,
        F.ctc_loss: ctc.ctc_loss,
        torch.quantile: quantile, torch.Tensor.quantile: quantile,
        F.gaussian_nll_loss: gaussian_nll_loss,
        F.embedding_bag: embedding_bag,
        torch.Tensor.__setitem__: masked_setitem,
    }
