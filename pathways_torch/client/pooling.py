"""Average pooling (``F.avg_pool1d/2d/3d``) as strided slices and sums, for the options
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

Example::

    y = pooling.avg_pool(x, [2, 2], [2, 2], [0, 0], True, True, None, k=2)
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch


def _expand(v: Sequence[int], k: int) -> List[int]:
    v = list(v) if isinstance(v, (list, tuple)) else [int(v)]
    return v * k if len(v) == 1 else v


class _Plan:
    """The geometry of one pooling: per spatial dimension its output size, the padded
    length (``left`` zeros before the input), and the divisor of every output."""

    def __init__(self, spatial: Sequence[int], kernel, stride, padding, ceil_mode: bool,
                 count_include_pad: bool, divisor_override: Optional[int]) -> None:
        k = len(spatial)
        self.kernel = _expand(kernel, k)
        self.stride = _expand(stride, k) if stride else list(self.kernel)
        self.left = _expand(padding, k)
        self.outs, self.lengths = [], []
        divisor = np.ones((), dtype=np.int64)
        for n, kk, s, p in zip(spatial, self.kernel, self.stride, self.left):
            o = (n + 2 * p - kk + (s - 1 if ceil_mode else 0)) // s + 1
            if ceil_mode and (o - 1) * s >= n + p:
                o -= 1                         # the last window must start inside
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


def table() -> dict:
    """{aten op: formula} for average pooling in 2 and 3 dimensions (1-d pooling is
    2-d pooling in torch) and their backwards."""
    aten = torch.ops.aten
    out = {}
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
