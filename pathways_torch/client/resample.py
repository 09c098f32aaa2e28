"""torch's interpolation (``F.interpolate``) as gathers and weighted sums, for every
mode, forward and backward. torch_xla lacks some of them (the forward of bicubic, the
backwards, which it lowers with a TPU custom call and runs on the CPU elsewhere: a
U-Net's or an FPN's upsampling), and the 2-d forwards it has give other numbers than
torch: they ignore a ``scale_factor`` whose inverse is not the ratio of the sizes (8 to
13 pixels by 1.7), and on the CPU bilinear is wrong at some sizes (8 to 24 pixels, 12 to
20: errors of 0.9 on values in [0.5, 1.5]).

Each mode is separable: output position ``o`` along one dimension reads a few input
positions (taps) with fixed weights, which torch's CPU kernels compute from the sizes,
``align_corners`` and the scale the user gave. ``taps`` reproduces those index and
weight formulas (in float32 for nearest, and for linear and cubic in the input's own
precision: double for float64, float otherwise, as torch computes them), so the forward
is a sum of ``index_select``s and the backward, its transpose, a sum of ``index_add``s:
both are ops XLA lowers, and the numbers are torch's.

Example::

    y = resample.forward("bicubic", x, (12, 12), align_corners=False, scales=(None, None))
    dx = resample.backward("bicubic", dy, x.shape, align_corners=False, scales=(None, None))
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

_A = -0.75                                   # torch's bicubic convolution parameter


def _scale(n_in: int, n_out: int, align_corners: bool, scale: Optional[float],
           real: type) -> np.floating:
    """torch's ``area_pixel_compute_scale`` in the kernel's ``real`` type."""
    if align_corners:
        return real(real(n_in - 1) / real(n_out - 1)) if n_out > 1 else real(0)
    if scale is not None and scale > 0:
        return real(1.0 / scale)
    return real(n_in) / real(n_out)


def _cubic_weights(t: np.float32) -> List[float]:
    def near(x):                              # |x| <= 1
        return ((_A + 2) * x - (_A + 3)) * x * x + 1

    def far(x):                               # 1 < |x| < 2
        return ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A
    t = float(t)
    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def taps(mode: str, n_in: int, n_out: int, align_corners: bool = False,
         scale: Optional[float] = None,
         real: type = np.float32) -> List[Tuple[List[int], List[float]]]:
    """[(index, weight)] per tap: output ``o`` is ``sum(w[o] * x[idx[o]])``; ``real`` is
    the type torch's linear and cubic kernels compute in (``np.float64`` for float64
    inputs)."""
    if mode in ("nearest", "nearest-exact"):
        if mode == "nearest" and n_out == n_in:
            idx = list(range(n_out))
        elif mode == "nearest" and n_out == 2 * n_in:
            idx = [o >> 1 for o in range(n_out)]
        else:
            s = np.float32(1.0 / scale) if scale is not None and scale > 0 \
                else np.float32(n_in) / np.float32(n_out)
            off = np.float32(0.5) if mode == "nearest-exact" else np.float32(0)
            idx = [min(int(math.floor(np.float32((np.float32(o) + off) * s))), n_in - 1)
                   for o in range(n_out)]
        return [(idx, [1.0] * n_out)]
    s = _scale(n_in, n_out, align_corners, scale, real)
    cubic = mode == "cubic"

    def source(o: int) -> real:
        if align_corners:
            return real(s * real(o))
        x = real(s * real(real(o) + real(0.5)) - real(0.5))
        return x if cubic or x >= 0 else real(0)

    if mode == "linear":
        i0s, i1s, w0, w1 = [], [], [], []
        for o in range(n_out):
            x = source(o)
            i0 = min(int(x), n_in - 1)
            lam = float(min(max(real(x - real(i0)), real(0)), real(1)))
            i0s.append(i0)
            i1s.append(i0 + (1 if i0 < n_in - 1 else 0))
            w0.append(1.0 - lam)
            w1.append(lam)
        return [(i0s, w0), (i1s, w1)]
    if mode == "cubic":
        out = [([], []) for _ in range(4)]
        for o in range(n_out):
            x = source(o)
            i = int(math.floor(x))
            ws = _cubic_weights(real(x - real(i)))
            for k in range(4):
                out[k][0].append(min(max(i - 1 + k, 0), n_in - 1))
                out[k][1].append(ws[k])
        return out
    raise ValueError(f"unknown interpolation mode {mode!r}")


def _real(t: torch.Tensor) -> type:
    return np.float64 if t.dtype == torch.float64 else np.float32


def _along(x: torch.Tensor, dim: int, n: int, index: List[int], weight: List[float],
           like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    shape = [1] * x.dim()
    shape[dim] = n
    i = torch.tensor(index, dtype=torch.long, device=like.device)
    w = torch.tensor(weight, dtype=like.dtype, device=like.device).reshape(shape)
    return i, w


def forward(mode: str, x: torch.Tensor, output_size: Sequence[int], align_corners: bool,
            scales: Sequence[Optional[float]]) -> torch.Tensor:
    """``x`` ([N, C, *spatial]) resampled to ``output_size`` as torch's CPU does."""
    if mode not in ("nearest", "nearest-exact") and not x.is_floating_point():
        from ..errors import TraceError
        raise TraceError(
            f"F.interpolate(mode={'bilinear' if mode == 'linear' else mode!r}) of a "
            f"{x.dtype} tensor: torch computes it with fixed-point weights that this "
            "formula does not reproduce. Interpolate x.float() and round it "
            "(.round().clamp(0, 255).to(torch.uint8): within 1 of torch's), or use "
            "mode='nearest'")
    k = len(output_size)
    for d, (n_out, sc) in enumerate(zip(output_size, scales)):
        dim = x.dim() - k + d
        parts = []
        for index, weight in taps(mode, x.shape[dim], n_out, align_corners, sc,
                                  _real(x)):
            i, w = _along(x, dim, n_out, index, weight, x)
            parts.append(x.index_select(dim, i) * w)
        x = sum(parts[1:], parts[0])
    return x


def backward(mode: str, grad: torch.Tensor, input_size: Sequence[int], align_corners: bool,
             scales: Sequence[Optional[float]]) -> torch.Tensor:
    """The gradient of ``forward`` with respect to its input of ``input_size``: each
    output's gradient added back to the taps it read, with their weights."""
    k = len(scales)
    spatial_in = list(input_size)[-k:]
    for d in reversed(range(k)):
        dim = grad.dim() - k + d
        n_out, n_in = grad.shape[dim], spatial_in[d]
        shape = list(grad.shape)
        shape[dim] = n_in
        out = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
        for index, weight in taps(mode, n_in, n_out, align_corners, scales[d],
                                  _real(grad)):
            i, w = _along(grad, dim, n_out, index, weight, grad)
            out = out.index_add(dim, i, grad * w)
        grad = out
    return grad


_MODES = {                                   # aten name: (mode, takes align_corners)
    "upsample_nearest2d": ("nearest", False),
    "upsample_bilinear2d": ("linear", True),
    "upsample_nearest1d": ("nearest", False),
    "upsample_nearest3d": ("nearest", False),
    "_upsample_nearest_exact1d": ("nearest-exact", False),
    "_upsample_nearest_exact2d": ("nearest-exact", False),
    "_upsample_nearest_exact3d": ("nearest-exact", False),
    "upsample_linear1d": ("linear", True),
    "upsample_trilinear3d": ("linear", True),
    "upsample_bicubic2d": ("cubic", True),
}


def table() -> dict:
    """{aten op: formula} for the upsampling ops and their backwards."""
    aten = torch.ops.aten
    out = {}
    for name, (mode, has_ac) in _MODES.items():
        def fwd(x, output_size, *rest, _mode=mode, _ac=has_ac):
            ac, scales = (rest[0], rest[1:]) if _ac else (False, rest)
            return forward(_mode, x, output_size, ac, _padded(scales, len(output_size)))

        def bwd(grad, output_size, input_size, *rest, _mode=mode, _ac=has_ac):
            ac, scales = (rest[0], rest[1:]) if _ac else (False, rest)
            return backward(_mode, grad, input_size, ac, _padded(scales, len(output_size)))
        out[getattr(aten, name).default] = fwd
        out[getattr(aten, name + "_backward").default] = bwd
    return out


def _padded(scales: Sequence[Optional[float]], k: int) -> Tuple[Optional[float], ...]:
    return tuple(scales) + (None,) * (k - len(scales))
