"""torch.fft's three primitives as DFT matmuls, which XLA compiles.

torch_xla has no lowering for ``_fft_c2c``, ``_fft_r2c`` or ``_fft_c2r``, which every
``torch.fft`` function (and ``torch.stft``) reduces to. Each transformed dimension is
one real matmul of the stacked real and imaginary parts against a ``[[C, S], [-S, C]]``
block of the n x n DFT matrix (angles from exact integer ``(t * k) % n``): O(n^2) per
dimension instead of O(n log n), right for the sizes models transform (FNet's hidden
size, a spectral layer's few dozen modes); the backward is the same primitives. The
normalization code is ATen's (0: none, 1: 1/sqrt(N), 2: 1/N over the signal's sizes).
c2r ignores the imaginary parts of the DC and Nyquist bins and the bins past n // 2, as
torch's CPU kernel does. Float32 within 1.3e-5 of torch (values and gradients 2.5e-5)
for n <= 64 on unit-scale inputs.

On a TPU, float32 matmuls default to bfloat16 passes: set XLA's matmul precision to
highest for FFT-heavy programs.

Example::

    table = {torch.ops.aten._fft_r2c.default: dft.fft_r2c}
"""

from __future__ import annotations

import math

import torch

# ---------------------------------------------------------------------------
# FFT primitives as O(n^2) DFT matmuls on (real, imag) pairs.
# ---------------------------------------------------------------------------
_REAL_OF_COMPLEX = {
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
    torch.complex32: torch.float16,
}
_COMPLEX_OF_REAL = {
    torch.float32: torch.complex64,
    torch.float64: torch.complex128,
    torch.float16: torch.complex32,
}


def _wrap_dims(dim, ndim):
    return [int(d) % ndim if ndim > 0 else int(d) for d in dim]


def _norm_scale(normalization, n):
    if normalization == 0:
        return 1.0
    if normalization == 1:
        return 1.0 / math.sqrt(n)
    if normalization == 2:
        return 1.0 / n
    raise RuntimeError(f"Invalid normalization mode: {normalization}")


def _trig(n_in, n_out, n, dtype, device):
    """cos and sin of theta[t, k] = 2*pi*((t*k) mod n)/n, each [n_in, n_out]. The angle
    is reduced in integers to [0, pi/4] (a multiple of pi/(2n)) by the circle's
    symmetries before the float one is made, so the quarter points are exact (sin(pi)
    is 0, not float32's -8.7e-8: an rfft's Nyquist and DC bins have no imaginary part,
    as torch's, and a complex parameter's Nyquist bin gets no gradient) and no angle
    is further than pi/4 from 0 (its float error ~8x smaller than at 2*pi)."""
    t = torch.arange(n_in, dtype=torch.int64, device=device)
    k = torch.arange(n_out, dtype=torch.int64, device=device)
    b = 4 * torch.remainder(t.unsqueeze(1) * k.unsqueeze(0), n)   # theta = pi*b/(2n)
    neg_sin = b > 2 * n                                            # theta -> 2pi - theta
    b = torch.where(neg_sin, 4 * n - b, b)
    neg_cos = b > n                                                # theta -> pi - theta
    b = torch.where(neg_cos, 2 * n - b, b)
    swap = 2 * b > n                                               # theta -> pi/2 - theta
    b = torch.where(swap, n - b, b)
    theta = b.to(dtype) * (math.pi / (2 * n))
    c, s = torch.cos(theta), torch.sin(theta)
    c, s = torch.where(swap, s, c), torch.where(swap, c, s)
    return torch.where(neg_cos, -c, c), torch.where(neg_sin, -s, s)


def _dft_dim(re, im, d, n_out, sign, scale):
    """Complex DFT along dim d (length n of the input, n_out output bins):
    Y[k] = scale * sum_t X[t] exp(sign * 2 pi i t k / n), n = input length.
    re / im may be None (= zero)."""
    ref = re if re is not None else im
    n = ref.shape[d]
    c, s = _trig(n, n_out, n, ref.dtype, ref.device)
    c = c * scale
    s = s * (sign * scale)
    if im is None:
        a = torch.movedim(re, d, -1)
        out_re = torch.matmul(a, c)
        out_im = torch.matmul(a, s)
    else:
        if re is None:
            re = torch.zeros_like(im)
        a = torch.cat([torch.movedim(re, d, -1), torch.movedim(im, d, -1)], dim=-1)
        # [A B] @ [[C S], [-S C]] = [AC - BS, AS + BC]
        w = torch.cat([torch.cat([c, s], dim=1), torch.cat([-s, c], dim=1)], dim=0)
        out = torch.matmul(a, w)
        out_re, out_im = out[..., :n_out], out[..., n_out:]
    return torch.movedim(out_re, -1, d), torch.movedim(out_im, -1, d)


def _split_complex(x):
    if x.is_conj():
        x = x.resolve_conj()
    xr = torch.view_as_real(x)
    return xr[..., 0], xr[..., 1]


def _to_complex(re, im):
    return torch.view_as_complex(torch.stack([re, im], dim=-1))


def _real_work_dtype(dtype):
    # complex32/half: compute in float32, cast back at the end
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def fft_c2c(self, dim, normalization, forward):
    """aten._fft_c2c.default: complex -> complex DFT over `dim`."""
    if len(dim) == 0:
        return self.clone()
    dims = _wrap_dims(dim, self.dim())
    re, im = _split_complex(self)
    odt = re.dtype
    wdt = _real_work_dtype(odt)
    re, im = re.to(wdt), im.to(wdt)
    sign = -1.0 if forward else 1.0
    for d in dims:
        n = re.shape[d]
        re, im = _dft_dim(re, im, d, n, sign, _norm_scale(normalization, n))
    return _to_complex(re.to(odt), im.to(odt))


def fft_r2c(self, dim, normalization, onesided):
    """aten._fft_r2c.default: real -> complex forward DFT over `dim`;
    onesided keeps bins 0..n//2 of the last dim in `dim`."""
    odt = self.dtype
    wdt = _real_work_dtype(odt)
    x = self.to(wdt)
    dims = _wrap_dims(dim, x.dim())
    last = dims[-1]
    n_last = x.shape[last]
    n_out = n_last // 2 + 1 if onesided else n_last
    re, im = _dft_dim(x, None, last, n_out, -1.0, _norm_scale(normalization, n_last))
    for d in dims[:-1]:
        n = re.shape[d]
        re, im = _dft_dim(re, im, d, n, -1.0, _norm_scale(normalization, n))
    return _to_complex(re.to(odt), im.to(odt))


def fft_c2r(self, dim, normalization, last_dim_size):
    """aten._fft_c2r.default: complex (one-sided along the last of `dim`) ->
    real inverse DFT; output has last_dim_size points along the last dim.
    Imaginary parts of the DC and (even n) Nyquist bins are ignored, and bins
    beyond n//2 (if present) are ignored, as in pocketfft/MKL."""
    dims = _wrap_dims(dim, self.dim())
    re, im = _split_complex(self)
    odt = re.dtype
    wdt = _real_work_dtype(odt)
    re, im = re.to(wdt), im.to(wdt)
    # inverse c2c over all but the last transformed dim
    for d in dims[:-1]:
        n = re.shape[d]
        re, im = _dft_dim(re, im, d, n, 1.0, _norm_scale(normalization, n))
    last = dims[-1]
    n = int(last_dim_size)
    m = re.shape[last]
    scale = _norm_scale(normalization, n)
    # x[t] = sum_k w_k (Re X_k cos(theta_kt) - Im X_k sin(theta_kt))
    k = torch.arange(m, dtype=torch.int64, device=re.device)
    w_cos = torch.where(
        (k == 0) | (2 * k == n),
        torch.ones((), dtype=wdt, device=re.device),
        torch.full((), 2.0, dtype=wdt, device=re.device),
    )
    w_cos = torch.where(2 * k > n, torch.zeros_like(w_cos), w_cos)
    w_sin = torch.where((k == 0) | (2 * k >= n), torch.zeros_like(w_cos), w_cos)
    c, s = _trig(m, n, n, wdt, re.device)  # [m (bins), n (time)]
    c = c * (w_cos * scale).unsqueeze(1)
    s = s * (w_sin * scale).unsqueeze(1)
    a = torch.cat([torch.movedim(re, last, -1), torch.movedim(im, last, -1)], dim=-1)
    w = torch.cat([c, -s], dim=0)  # [2m, n]
    out = torch.matmul(a, w)
    return torch.movedim(out, -1, last).to(odt)
