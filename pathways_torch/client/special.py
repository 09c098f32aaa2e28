"""lgamma, digamma and polygamma as formulas of elementwise ops, which XLA compiles.

torch_xla has no lowering for torch.lgamma, torch.digamma or torch.polygamma (XLA's own
client library computes them from elementwise ops, but torch_xla does not call it), and
torch.distributions needs them: the log-probabilities of Gamma, Beta, Dirichlet,
StudentT, Poisson and the KL terms between them. These are XLA's formulas (Lanczos,
g = 7, nine coefficients, with reflection below 1/2; polygamma by shifting x up and an
asymptotic series, reflected through the n-th derivative of cot(pi x)), computed in at
least float32. Registered as decompositions, so the gradient is torch's own formula
(digamma for lgamma, polygamma(1) for digamma) computed by these in turn.

Measured against torch on the CPU (float32; |error| / max(1, |value|)): lgamma 4.6e-6
(at zero crossings next to negative poles, where the reflection cancels terms near 13;
1e-6 elsewhere), digamma 1.1e-6, polygamma n <= 20 1e-6; float64 within 1e-14 of
mpmath. Values at the poles are torch's (lgamma +inf; digamma(+0) = -inf, nan at
negative integers), except trigamma at a negative integer: +inf where torch gives a
huge finite number.

Example::

    table = {torch.ops.aten.lgamma.default: special.lgamma}
"""

from __future__ import annotations

import math

import torch

# ---------------------------------------------------------------------------
# Lanczos approximation, g = 7, 9 coefficients (same constants as XLA's
# xla/hlo/builder/lib/math.cc).
# ---------------------------------------------------------------------------
_LANCZOS_G = 7.0
_LANCZOS_BASE = 0.99999999999980993227684700473478
_LANCZOS_COEFFS = (
    676.520368121885098567009190444019,
    -1259.13921672240287047156078755283,
    771.3234287776530788486528258894,
    -176.61502916214059906584551354,
    12.507343278686904814458936853,
    -0.13857109526572011689554707,
    9.984369578019570859563e-6,
    1.50563273514931155834e-7,
)
_LOG_PI = math.log(math.pi)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_LOG_G_PLUS_HALF = math.log(_LANCZOS_G + 0.5)
_EULER_GAMMA = 0.57721566490153286060651209008240243
# below this |x| the tiny-argument expansions are used (avoids subnormal
# sin(pi*x) / loss of precision); error of the expansions is O(x^2) there.
_TINY = 2.0 ** -40


def _compute_dtype(x):
    """(working dtype, output dtype): bf16/f16 are upcast to f32, ints to default float."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return torch.float32, x.dtype
    if x.dtype in (torch.float32, torch.float64):
        return x.dtype, x.dtype
    if x.dtype.is_floating_point:  # e.g. float8: compute in f32, cast back
        return torch.float32, x.dtype
    d = torch.get_default_dtype()  # integer / bool inputs promote like torch
    return d, d


def _is_nonpos_integer(x):
    # True at 0, -0, negative integers and -inf (floor(-inf) == -inf).
    return (x <= 0) & (x == torch.floor(x))


def _reduced_frac(x):
    """x - round-half-up(x), in [-0.5, 0.5) (exact for finite x)."""
    return x - torch.floor(x + 0.5)


def _sin_cot_pi(x):
    """(|sin(pi x)|, cot(pi x)) with full relative precision, for x not an
    integer.  At integers a harmless substitute point (x = 1/4) is used so that
    neither values nor gradients become inf/nan; callers override poles.

    cos(pi r) is evaluated as sin(pi (1/2 - |r|)) so cot is relatively exact
    near half-integers (cos(fl(pi/2)) would leave an absolute error of ~eps)."""
    r = _reduced_frac(x)
    r = torch.where(r == 0, torch.full_like(r, 0.25), r)
    a = torch.abs(r)
    sin_a = torch.sin(math.pi * a)               # = |sin(pi x)|
    cos_a = torch.sin(math.pi * (0.5 - a))       # = cos(pi a) = cos(pi r)
    cot = torch.sign(r) * cos_a / sin_a
    return sin_a, cot


def lgamma(self):
    """log|Gamma(x)|  (aten.lgamma.default)."""
    wdt, odt = _compute_dtype(self)
    x = self.to(wdt)

    need_reflect = x < 0.5
    z = torch.where(need_reflect, -x, x - 1.0)

    acc = torch.full_like(x, _LANCZOS_BASE)
    for i, c in enumerate(_LANCZOS_COEFFS):
        acc = acc + c / (z + (i + 1.0))

    t = z + (_LANCZOS_G + 0.5)
    # log(t) = log(g + 0.5) + log1p(z / (g + 0.5))
    log_t = _LOG_G_PLUS_HALF + torch.log1p(z / (_LANCZOS_G + 0.5))
    # (z + 1/2) * log(t) - t, arranged so that it does not overflow
    log_y = _LOG_SQRT_2PI + (z + 0.5 - t / log_t) * log_t + torch.log(acc)

    # Reflection: lgamma(x) = log(pi) - lgamma(1-x) - log|sin(pi x)|,
    # with |sin(pi x)| = sin(pi * r), r = min(frac|x|, 1 - frac|x|) in [0, 0.5].
    # (evaluated on a substitute point where it is not used, so that the
    # discarded branch cannot inject inf/nan into gradients)
    ax = torch.abs(x)
    tiny = ax < _TINY
    xr = torch.where(need_reflect & ~tiny, x, torch.full_like(x, -0.25))
    axr = torch.abs(xr)
    frac = axr - torch.floor(axr)
    r = torch.where(frac > 0.5, 1.0 - frac, frac)
    at_int = r == 0  # x is an integer (a pole when x <= 0)
    r_safe = torch.where(at_int, torch.full_like(r, 0.25), r)  # keeps grads finite
    log_sin = torch.log(torch.sin(math.pi * r_safe))
    reflection = torch.where(
        at_int, torch.full_like(x, math.inf), _LOG_PI - log_sin - log_y
    )
    result = torch.where(need_reflect, reflection, log_y)

    # tiny |x|: lgamma(x) = -log|x| - gamma*x + O(x^2)   (+inf at +-0)
    safe_ax = torch.where(tiny, ax, torch.ones_like(ax))
    result = torch.where(tiny, -torch.log(safe_ax) - _EULER_GAMMA * x, result)

    # lgamma(+-inf) = +inf (log_y is nan there); nan propagates by itself.
    result = torch.where(torch.isinf(x), torch.full_like(x, math.inf), result)
    return result.to(odt)


def digamma(self):
    """psi(x) = d/dx lgamma(x)  (aten.digamma.default).

    torch conventions reproduced: digamma(+0) = -inf, digamma(-0) = +inf,
    digamma(negative integer) = nan, digamma(-inf) = nan, digamma(+inf) = +inf.
    """
    wdt, odt = _compute_dtype(self)
    x = self.to(wdt)

    need_reflect = x < 0.5
    z = torch.where(need_reflect, -x, x - 1.0)

    num = torch.zeros_like(x)
    den = torch.full_like(x, _LANCZOS_BASE)
    for i, c in enumerate(_LANCZOS_COEFFS):
        zi = z + (i + 1.0)
        num = num - c / (zi * zi)
        den = den + c / zi

    t = z + (_LANCZOS_G + 0.5)
    log_t = _LOG_G_PLUS_HALF + torch.log1p(z / (_LANCZOS_G + 0.5))
    y = log_t + num / den - _LANCZOS_G / t

    # digamma(x) = digamma(1 - x) - pi * cot(pi x), cot evaluated on the
    # reduced argument (period 1) for precision.
    ax = torch.abs(x)
    tiny = ax < _TINY
    xr = torch.where(need_reflect & ~tiny, x, torch.full_like(x, -0.25))
    _, cot = _sin_cot_pi(xr)
    reflection = y - math.pi * cot
    result = torch.where(need_reflect, reflection, y)

    # tiny |x| (x != 0): digamma(x) = -1/x - gamma + O(x)
    safe_x = torch.where(tiny, x, torch.ones_like(x))
    result = torch.where(tiny, -1.0 / safe_x - _EULER_GAMMA, result)

    # poles: nan at negative integers / -inf, copysign(inf, -x) at +-0.
    result = torch.where(
        _is_nonpos_integer(x), torch.full_like(x, math.nan), result
    )
    safe_x0 = torch.where(x == 0, x, torch.ones_like(x))
    result = torch.where(x == 0, -1.0 / safe_x0, result)  # -1/(+0) = -inf, -1/(-0) = +inf
    return result.to(odt)


# Bernoulli numbers B_2 .. B_16
_BERNOULLI = (
    1.0 / 6,
    -1.0 / 30,
    1.0 / 42,
    -1.0 / 30,
    5.0 / 66,
    -691.0 / 2730,
    7.0 / 6,
    -3617.0 / 510,
)


def _cot_derivative_poly(n):
    """Coefficients (ascending powers of c) of P_n with
    d^n/dx^n cot(pi x) = pi^n * P_n(cot(pi x)).
    P_0 = c, P_{k+1}(c) = -(1 + c^2) P_k'(c).  All nonzero coefficients of P_n
    share the sign (-1)^n and P_n has only powers of parity n+1."""
    p = [0.0, 1.0]
    for _ in range(n):
        dp = [i * p[i] for i in range(1, len(p))] or [0.0]
        q = [0.0] * (len(dp) + 2)
        for i, a in enumerate(dp):
            q[i] -= a
            q[i + 2] -= a
        p = q
    while len(p) > 1 and p[-1] == 0.0:
        p.pop()
    return p


def _polygamma_pos(n, x, n_shift):
    """psi^(n)(x) for x > 0 (n >= 1): recurrence up by n_shift, then the
    asymptotic expansion.  The factorials are folded into the powers
    ((c/x)^(n+1) with c = n!^(1/(n+1))) so that intermediates stay near the
    magnitude of the result and do not underflow/overflow early in float32."""
    sign = -1.0 if n % 2 == 0 else 1.0  # (-1)^(n+1)
    c_shift = math.exp(math.lgamma(n + 1) / (n + 1))  # n!^(1/(n+1))
    acc = torch.zeros_like(x)
    for k in range(n_shift):
        acc = acc + torch.pow(c_shift / (x + float(k)), n + 1)
    w = x + float(n_shift)
    iw = 1.0 / w
    iw2 = iw * iw
    # psi^(n)(w) ~ (-1)^(n+1) (n-1)!/w^n [1 + n/(2w)
    #               + sum_{k>=1} B_2k (2k+n-1)! / ((2k)! (n-1)!) w^-(2k)]
    fn1 = math.factorial(n - 1)
    coeffs = [
        b * (math.factorial(2 * k + n - 1) / fn1) / math.factorial(2 * k)
        for k, b in enumerate(_BERNOULLI, start=1)
    ]
    series = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        series = series * iw2 + c
    series = series * iw2
    c_asym = math.exp(math.lgamma(n) / n)  # (n-1)!^(1/n)
    asym = torch.pow(c_asym * iw, n) * (1.0 + (0.5 * n) * iw + series)
    return sign * (acc + asym)


def polygamma(n, self):
    """n-th derivative of digamma (aten.polygamma.default, n a Python int).

    Valid for all real x and any n >= 1 (reflection formula for x < 0);
    n == 0 is digamma.  Values at the poles follow torch:
      non-positive integers (incl. -0): (-1)^(n+1) * inf   (torch's float
        trigamma returns a huge *finite* value such as 1.29e15 at x=-1 for
        float32 because it evaluates sin(pi*x) unreduced; we return +inf),
      n == 1: psi1(+inf) = 0, psi1(-inf) = nan;
      n >= 2: psi_n(+inf) = nan, psi_n(-inf) = (-1)^(n+1) * inf.
    """
    n = int(n)
    if n < 0:
        raise RuntimeError("polygamma(n, x) does not support negative n.")
    if n == 0:
        return digamma(self)
    wdt, odt = _compute_dtype(self)
    x = self.to(wdt)
    n_shift = 10 + 2 * n

    need_reflect = x < 0
    xp = torch.where(need_reflect, 1.0 - x, x)  # > 0 (or nan)
    pos = _polygamma_pos(n, xp, n_shift)

    # psi^(n)(x) = (-1)^n psi^(n)(1-x) - pi^(n+1) P_n(cot(pi x))
    xr = torch.where(need_reflect, x, torch.full_like(x, -0.25))  # grad-safe
    s, c = _sin_cot_pi(xr)
    if n == 1:
        refl_term = (math.pi ** 2) / (s * s)  # -pi^2 P_1(cot) = pi^2 / sin^2
    else:
        p = _cot_derivative_poly(n)
        # P_n has only powers of parity (n+1): Horner in u = c^2
        start = (n + 1) % 2
        ev = p[start::2]
        u = c * c
        q = torch.full_like(x, ev[-1])
        for a in reversed(ev[:-1]):
            q = q * u + a
        if start == 1:
            q = q * c
        refl_term = -(math.pi ** (n + 1)) * q
    reflected = (1.0 if n % 2 == 0 else -1.0) * pos + refl_term
    result = torch.where(need_reflect, reflected, pos)

    pole_val = math.inf if n % 2 == 1 else -math.inf
    result = torch.where(
        _is_nonpos_integer(x), torch.full_like(x, pole_val), result
    )
    if n == 1:
        result = torch.where(x == math.inf, torch.zeros_like(x), result)
        result = torch.where(x == -math.inf, torch.full_like(x, math.nan), result)
    else:
        result = torch.where(x == math.inf, torch.full_like(x, math.nan), result)
    return result.to(odt)
