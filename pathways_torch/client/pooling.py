"""Pooling that torch_xla does not compute, by formulas of ops XLA lowers.

**Average pooling** (``F.avg_pool1d/2d/3d``) as strided slices and sums, for the options
torch_xla does not compute: ``divisor_override``, and ``ceil_mode`` with
``count_include_pad``. For those torch_xla's forward ignores the divisor (a 2x2
pool with ``divisor_override=2`` came out halved) and its backward runs on the CPU,
which a trace cannot do (capture refused ``nn.AvgPool2d(2, ceil_mode=True)`` on an
odd-sized feature map).

A window's sum is the sum of its input positions in torch's order (row by row), and
its divisor comes from the sizes alone, as in torch's CPU kernel: the window clipped to
the padded input when padding counts, to the input when it does not, or the override.
So the forward is a few strided slices of the zero-padded input added up and divided,
and the backward places each output's gradient over divisor back on its window (its
transpose): ops XLA lowers, with torch's numbers.

**Adaptive pooling** (``F.adaptive_avg_pool1d/2d/3d``, ``F.adaptive_max_pool1d/2d/3d``,
``F.interpolate(mode="area")``) to a size that does not divide the input (VGG's
``AdaptiveAvgPool2d((7, 7))`` on small images): torch_xla runs those on the CPU, and
has no 3-d adaptive max pooling at all. Output ``i`` of ``n`` over ``N`` inputs reads
torch's window ``[floor(i N / n), ceil((i + 1) N / n))``: the average is a matmul per
dimension with those windows' weights; the max gathers every window, takes the first
maximum's flat index (torch's ``indices``) and reads the input there, so the backward
adds each gradient at its index, as torch's does.

**Dilated max pooling** (``F.max_pool2d/3d(dilation=...)``), which torch_xla runs on
the CPU: the same gathered windows, padding never the maximum.

Example::

    y = pooling.avg_pool(x, [2, 2], [2, 2], [0, 0], True, True, None, k=2)
    out, idx = pooling.adaptive_max_pool(x, [5, 7])
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .lowerings import outermost


def _expand(v: Sequence[int], k: int) -> List[int]:
    v = list(v) if isinstance(v, (list, tuple)) else [int(v)]
    return v * k if len(v) == 1 else v


def _geometry(k: int, kernel, stride, padding) -> Tuple[List[int], List[int], List[int]]:
    """(kernel, stride, padding) per spatial dimension; no stride means the kernel's."""
    kernel = _expand(kernel, k)
    return kernel, (_expand(stride, k) if stride else list(kernel)), _expand(padding, k)


def _out_size(n: int, kk: int, s: int, p: int, ceil_mode: bool, dilation: int = 1) -> int:
    """torch's ``pooling_output_shape``: windows over ``n`` inputs padded by ``p``."""
    o = (n + 2 * p - dilation * (kk - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (o - 1) * s >= n + p:
        o -= 1                                 # the last window must start inside
    return o


class _Plan:
    """The geometry of one pooling: per spatial dimension its output size, the padded
    length (``left`` zeros before the input), and the divisor of every output."""

    def __init__(self, spatial: Sequence[int], kernel, stride, padding, ceil_mode: bool,
                 count_include_pad: bool, divisor_override: Optional[int]) -> None:
        self.kernel, self.stride, self.left = _geometry(len(spatial), kernel, stride,
                                                        padding)
        self.outs, self.lengths = [], []
        divisor = np.ones((), dtype=np.int64)
        for n, kk, s, p in zip(spatial, self.kernel, self.stride, self.left):
            o = _out_size(n, kk, s, p, ceil_mode)
            starts = np.arange(o) * s - p
            ends = np.minimum(starts + kk, n + p)
            size = (ends - starts) if count_include_pad else \
                (np.minimum(ends, n) - np.maximum(starts, 0))
            divisor = np.multiply.outer(divisor, size)
            self.outs.append(o)
            self.lengths.append(max((o - 1) * s + kk, n + p))
        self.divisor = (np.full(self.outs, divisor_override, dtype=np.int64)
                        if divisor_override else divisor)

    def offsets(self):
        """Every position inside a window, in torch's order (the last dimension fastest)."""
        return itertools.product(*(range(kk) for kk in self.kernel))

    def window(self, dim0: int, offset: Tuple[int, ...]) -> Tuple[slice, ...]:
        """The index of the padded input that each output reads at ``offset``."""
        return (slice(None),) * dim0 + tuple(
            slice(i, i + (o - 1) * s + 1, s)
            for i, o, s in zip(offset, self.outs, self.stride))

    def pad(self, spatial: Sequence[int]) -> List[int]:
        """F.pad's list: (left, right) per spatial dimension, the last first."""
        out: List[int] = []
        for n, p, length in reversed(list(zip(spatial, self.left, self.lengths))):
            out += [p, length - n - p]
        return out


def _needed(ceil_mode: bool, count_include_pad: bool, divisor_override) -> bool:
    return bool(divisor_override) or (ceil_mode and count_include_pad)


def avg_pool(x: torch.Tensor, kernel, stride=(), padding=0, ceil_mode: bool = False,
             count_include_pad: bool = True, divisor_override: Optional[int] = None, *,
             k: int):
    """``aten.avg_pool{k}d`` where XLA's own differs from torch; NotImplemented (XLA's
    kernel) elsewhere."""
    if not _needed(ceil_mode, count_include_pad, divisor_override):
        return NotImplemented
    spatial = list(x.shape[-k:])
    plan = _Plan(spatial, kernel, stride, padding, ceil_mode, count_include_pad,
                 divisor_override)
    xp = torch.nn.functional.pad(x, plan.pad(spatial))
    dim0 = x.dim() - k
    total = None
    for offset in plan.offsets():
        part = xp[plan.window(dim0, offset)]
        total = part if total is None else total + part
    divisor = torch.tensor(plan.divisor, dtype=x.dtype, device=x.device)
    if not x.is_floating_point():
        return torch.div(total, divisor, rounding_mode="trunc")   # torch's C++ int division
    return total / divisor


def avg_pool_backward(grad: torch.Tensor, x: torch.Tensor, kernel, stride, padding,
                      ceil_mode: bool, count_include_pad: bool,
                      divisor_override: Optional[int], *, k: int):
    """``aten.avg_pool{k}d_backward``: each output's gradient over its divisor, added
    to every input position of its window."""
    if not _needed(ceil_mode, count_include_pad, divisor_override):
        return NotImplemented
    spatial = list(x.shape[-k:])
    plan = _Plan(spatial, kernel, stride, padding, ceil_mode, count_include_pad,
                 divisor_override)
    share = grad / torch.tensor(plan.divisor, dtype=grad.dtype, device=grad.device)
    dim0 = x.dim() - k
    gp = torch.zeros(list(x.shape[:dim0]) + plan.lengths, dtype=grad.dtype,
                     device=grad.device)
    for offset in plan.offsets():
        gp = _add_strided(gp, share, dim0, offset, plan)
    index = (slice(None),) * dim0 + tuple(slice(p, p + n)
                                          for p, n in zip(plan.left, spatial))
    return gp[index]


def _add_strided(gp: torch.Tensor, share: torch.Tensor, dim0: int,
                 offset: Tuple[int, ...], plan: _Plan) -> torch.Tensor:
    """``gp`` with ``share`` added at the positions ``plan.window(offset)`` reads."""
    for d in reversed(range(len(offset))):     # spread one dimension at a time
        dim = dim0 + d
        shape = list(share.shape)
        shape[dim] = plan.lengths[d]
        index = torch.arange(plan.outs[d], device=share.device) * plan.stride[d] + offset[d]
        share = torch.zeros(shape, dtype=share.dtype, device=share.device).index_add(
            dim, index, share)
    return gp + share


# ------------------------------------------------------------------ adaptive pooling

def _bounds(n: int, N: int, i: int) -> Tuple[int, int]:
    """torch's adaptive window of output ``i`` of ``n`` over ``N`` inputs."""
    return (i * N) // n, -((-(i + 1) * N) // n)


def _uneven(x: torch.Tensor, outs: Sequence[int]) -> bool:
    return any(N % n for N, n in zip(x.shape[-len(outs):], outs))


def adaptive_avg_pool(x: torch.Tensor, output_size: Sequence[int]) -> torch.Tensor:
    """``aten._adaptive_avg_pool{k}d``: one matmul per dimension with its windows'
    weights (``1 / len``)."""
    outs = list(output_size)
    if not _uneven(x, outs):
        return NotImplemented                  # XLA's own
    k = len(outs)
    for d, n in enumerate(outs):
        dim = x.dim() - k + d
        x = torch.movedim(torch.movedim(x, dim, -1) @ _averaging(n, x.shape[dim], x).T,
                          -1, dim)
    return x


def adaptive_avg_pool_backward(grad: torch.Tensor, x: torch.Tensor, k: int) -> torch.Tensor:
    """Its backward (``k`` spatial dimensions): the gradient through the transposed
    matmuls."""
    outs = list(grad.shape[-k:])
    if not _uneven(x, outs):
        return NotImplemented
    for d, n in enumerate(outs):
        dim = grad.dim() - k + d
        grad = torch.movedim(
            torch.movedim(grad, dim, -1) @ _averaging(n, x.shape[dim], grad), -1, dim)
    return grad


def _averaging(n: int, N: int, like: torch.Tensor) -> torch.Tensor:
    """[n, N]: row i averages output i's window."""
    a = np.zeros((n, N))
    for i in range(n):
        lo, hi = _bounds(n, N, i)
        a[i, lo:hi] = 1.0 / (hi - lo)
    return torch.tensor(a, dtype=like.dtype, device=like.device)


def _flat_windows(ins: Sequence[int],
                  wins: Sequence[Sequence[Sequence[int]]]) -> Tuple[np.ndarray, np.ndarray]:
    """[*outs, P]: the flat input index of every position of every output's window
    (row-major over the spatial dimensions, as torch's ``indices``), and whether it is
    a position of the window; ``wins[d][i]`` lists the input positions output ``i``
    reads along dimension ``d`` (-1 and past the end: padding). Shorter windows and
    padding read a real position of the window and are marked invalid."""
    k = len(wins)
    outs = [len(w) for w in wins]
    flat = np.zeros(tuple(outs) + (1,) * k, dtype=np.int64)
    valid = np.ones(tuple(outs) + (1,) * k, dtype=bool)
    stride = 1
    for d in reversed(range(k)):
        K = max(len(w) for w in wins[d])
        inside = [[j for j in w if 0 <= j < ins[d]] for w in wins[d]]
        idx = np.array([[j if 0 <= j < ins[d] else inside[i][-1] for j in w]
                        + [inside[i][-1]] * (K - len(w)) for i, w in enumerate(wins[d])])
        ok = np.array([[0 <= j < ins[d] for j in w] + [False] * (K - len(w))
                       for w in wins[d]])
        shape = [1] * (2 * k)
        shape[d], shape[k + d] = outs[d], K
        flat = flat + idx.reshape(shape) * stride
        valid = valid & ok.reshape(shape)
        stride *= ins[d]
    P = int(np.prod(flat.shape[k:]))
    return flat.reshape(tuple(outs) + (P,)), valid.reshape(tuple(outs) + (P,))


def _window_max(x: torch.Tensor, ins: Sequence[int], wins) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the maximum of every window, its flat index): the first maximum, as torch's
    kernels pick, and read from the input at that index so that the backward is
    torch's (each gradient added at its index)."""
    k = len(wins)
    lead = list(x.shape[:-k])
    flat, valid = _flat_windows(ins, wins)
    xs = x.flatten(-k)
    flat_t = torch.tensor(flat, device=x.device)
    windows = xs[..., flat_t.reshape(-1)].reshape(lead + list(flat.shape))
    lowest = (float("-inf") if x.is_floating_point() else    # padding never wins
              False if x.dtype == torch.bool else torch.iinfo(x.dtype).min)
    low = torch.full((), lowest, dtype=x.dtype, device=x.device)
    windows = torch.where(torch.tensor(valid, device=x.device), windows, low)
    first = windows.argmax(-1, keepdim=True)
    index = flat_t.expand(lead + list(flat.shape)).gather(-1, first).squeeze(-1)
    out = xs.gather(-1, index.flatten(-k)).reshape(index.shape)
    return out, index


def _add_at(grad: torch.Tensor, x: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """The backward of ``_window_max``: every output's gradient added at its index."""
    xs = torch.zeros(list(x.shape[:-k]) + [int(np.prod(x.shape[-k:]))], dtype=grad.dtype,
                     device=grad.device)
    return xs.scatter_add(-1, index.flatten(-k), grad.flatten(-k)).reshape(x.shape)


@outermost
def adaptive_max_pool(x: torch.Tensor, output_size: Sequence[int], force: bool = False):
    """``aten.adaptive_max_pool{k}d``: (the maxima, their flat indices). Where the sizes
    divide, torch_xla's 2-d kernel, whose indices are int32 under int64 as max
    pooling's are (``max_pool``): widened by an addition."""
    outs = list(output_size)
    if not (force or _uneven(x, outs)):
        values, index = torch.ops.aten.adaptive_max_pool2d.default(x, outs)
        return values, index + 0
    ins = list(x.shape[-len(outs):])
    return _window_max(x, ins, [[list(range(*_bounds(n, N, i))) for i in range(n)]
                                for n, N in zip(outs, ins)])


def adaptive_max_pool_backward(grad: torch.Tensor, x: torch.Tensor, index: torch.Tensor,
                               k: int, force: bool = False):
    """Its backward (``k`` spatial dimensions)."""
    if not (force or _uneven(x, list(grad.shape[-k:]))):
        return NotImplemented
    return _add_at(grad, x, index, k)


# ------------------------------------------------------------- dilated max pooling

def _dilated(dilation, k: int) -> bool:
    return any(d != 1 for d in _expand(dilation, k))


@outermost
def max_pool(x: torch.Tensor, kernel, stride=(), padding=0, dilation=1,
             ceil_mode: bool = False, *, k: int):
    """``aten.max_pool{k}d_with_indices`` with a dilation, which torch_xla runs on the
    CPU: the windows gathered (padding never wins, as torch's -inf), their first
    maxima. Without one, torch_xla's kernel, whose indices are int32 under a tensor
    that says int64 (``return_indices=True`` fetched int32, and torch_xla refuses to
    convert them to int32 first): an addition widens them, as it widens its operands
    to the result's type."""
    if not _dilated(dilation, k):
        values, index = getattr(torch.ops.aten, f"max_pool{k}d_with_indices").default(
            x, kernel, stride, padding, dilation, ceil_mode)
        return values, index + 0
    ins = list(x.shape[-k:])
    kernel, stride, padding = _geometry(k, kernel, stride, padding)
    wins = [[[i * s - p + j * dl for j in range(kk)]
             for i in range(_out_size(n, kk, s, p, ceil_mode, dl))]
            for n, kk, s, p, dl in zip(ins, kernel, stride, padding, _expand(dilation, k))]
    return _window_max(x, ins, wins)


def max_pool_backward(grad: torch.Tensor, x: torch.Tensor, kernel, stride, padding,
                      dilation, ceil_mode: bool, index: torch.Tensor, *, k: int):
    """Its backward."""
    if not _dilated(dilation, k):
        return NotImplemented
    return _add_at(grad, x, index, k)


def table() -> dict:
    """{aten op: formula} for average pooling in 2 and 3 dimensions (1-d pooling is
    2-d pooling in torch), adaptive pooling, and their backwards."""
    aten = torch.ops.aten
    out = {
        aten._adaptive_avg_pool2d.default: adaptive_avg_pool,
        aten._adaptive_avg_pool3d.default: adaptive_avg_pool,
        aten._adaptive_avg_pool2d_backward.default:
            lambda g, x: adaptive_avg_pool_backward(g, x, 2),
        aten._adaptive_avg_pool3d_backward.default:
            lambda g, x: adaptive_avg_pool_backward(g, x, 3),
        aten.adaptive_max_pool2d.default: adaptive_max_pool,
        aten.adaptive_max_pool2d_backward.default:
            lambda g, x, i: adaptive_max_pool_backward(g, x, i, 2),
        # XLA has no 3-d adaptive max pooling, even where the sizes divide
        aten.adaptive_max_pool3d.default: lambda x, size: adaptive_max_pool(x, size, True),
        aten.adaptive_max_pool3d_backward.default:
            lambda g, x, i: adaptive_max_pool_backward(g, x, i, 3, True),
    }
    for k in (2, 3):
        out[getattr(aten, f"max_pool{k}d_with_indices").default] = \
            lambda x, *rest, _k=k: max_pool(x, *rest, k=_k)
        out[getattr(aten, f"max_pool{k}d_with_indices_backward").default] = \
            lambda g, x, *rest, _k=k: max_pool_backward(g, x, *rest, k=_k)
    for k in (2, 3):
        def fwd(x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None, _k=k):
            return avg_pool(x, kernel, stride, padding, ceil_mode, count_include_pad,
                            divisor_override, k=_k)

        def bwd(grad, x, kernel, stride, padding, ceil_mode, count_include_pad,
                divisor_override, _k=k):
            return avg_pool_backward(grad, x, kernel, stride, padding, ceil_mode,
                                     count_include_pad, divisor_override, k=_k)
        out[getattr(aten, f"avg_pool{k}d").default] = fwd
        out[getattr(aten, f"avg_pool{k}d_backward").default] = bwd
    return out
