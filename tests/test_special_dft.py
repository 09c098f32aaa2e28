"""special.py (lgamma, digamma, polygamma) and dft.py (torch.fft's primitives) against
torch's own CPU ops, with no cluster: pure formulas.

Values at many points (negatives, both sides of the poles 0 ... -20, tiny and huge
magnitudes; mpmath, a dependency of torch's sympy, where torch's own float64 is the less
accurate side), low precision, gradients (through lgamma is digamma, and so on), every
torch.fft function with each normalization, and that each formula traces on fake
tensors without the op it replaces. Tolerances are stated at each check; ``-s`` prints
the worst errors measured.
"""

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from types import SimpleNamespace

from pathways_torch.client import dft, special

_aten = torch.ops.aten
F = SimpleNamespace(
    lgamma=special.lgamma, digamma=special.digamma, polygamma=special.polygamma,
    fft_c2c=dft.fft_c2c, fft_r2c=dft.fft_r2c, fft_c2r=dft.fft_c2r,
    DECOMPOSITIONS={_aten.lgamma.default: special.lgamma,
                    _aten.digamma.default: special.digamma,
                    _aten.polygamma.default: special.polygamma,
                    _aten._fft_c2c.default: dft.fft_c2c,
                    _aten._fft_r2c.default: dft.fft_r2c,
                    _aten._fft_c2r.default: dft.fft_c2r})

FORBIDDEN_TARGETS = {
    "aten.lgamma.default",
    "aten.digamma.default",
    "aten.polygamma.default",
    "aten._fft_c2c.default",
    "aten._fft_r2c.default",
    "aten._fft_c2r.default",
}


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def special_points(dtype=torch.float64):
    pts = []
    # regular grid over negatives and positives
    # (exact integers stay exact: no 1-ulp-off-a-pole artifacts)
    pts.append(torch.arange(-600, 601, dtype=torch.float64) / 20)
    pts.append(torch.arange(0, 301, dtype=torch.float64) / 100)
    # around the poles 0, -1, ..., -20 (both sides) and the x-axis
    offs = torch.tensor([1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.25, 0.49], dtype=torch.float64)
    poles = -torch.arange(0, 21, dtype=torch.float64)
    pts.append((poles[:, None] + offs[None, :]).flatten())
    pts.append((poles[:, None] - offs[None, :]).flatten())
    # tiny, medium and large magnitudes
    mags = torch.logspace(-30, 6, 145, dtype=torch.float64)
    pts.append(mags)
    pts.append(-mags[mags < 1e4] - 0.37)  # negative, away from integers
    pts.append(torch.tensor([1.0, 2.0, 1.4616321449683622, 0.5, 1.5, 1e6, 999999.5,
                             -0.5, -1.5, -2.4570247, -123.456, -9999.3], dtype=torch.float64))
    x = torch.cat(pts).to(dtype)
    return x


def nonpole(x):
    return ~((x <= 0) & (x == torch.floor(x)))


def err_stats(ours, ref, rtol_floor=1e-5):
    """max over finite points of |ours-ref| / max(1, |ref|)  (i.e. abs below 1, rel above)
    and plain max abs / max rel."""
    ours = ours.double()
    ref = ref.double()
    fin = torch.isfinite(ref)
    d = (ours - ref).abs()[fin]
    r = ref.abs()[fin]
    mixed = (d / torch.clamp(r, min=1.0)).max().item()
    return mixed


def check_special_values(ours, ref):
    """Non-finite values must match exactly (inf sign, nan)."""
    nf = ~torch.isfinite(ref)
    assert torch.equal(torch.isnan(ours[nf]), torch.isnan(ref[nf])), (
        ours[nf], ref[nf])
    infs = torch.isinf(ref)
    assert torch.equal(ours[infs], ref[infs])
    # ours must not produce non-finite where torch is finite
    assert torch.isfinite(ours[torch.isfinite(ref)]).all()


REPORT = {}


def mp_reference(name, x64, n=None):
    """High-precision reference (mpmath: torch needs sympy, which needs it)."""
    import mpmath
    mpmath.mp.dps = 40
    out = []
    for v in x64.tolist():
        if not math.isfinite(v) or (v <= 0 and v == math.floor(v)):
            out.append(float("nan"))  # poles / non-finite: compared via torch
            continue
        v = mpmath.mpf(v)
        if name == "lgamma":
            out.append(float(mpmath.log(abs(mpmath.gamma(v)))) if abs(v) < 1e4 else float(mpmath.loggamma(v).real))
        elif name == "digamma":
            out.append(float(mpmath.digamma(v)))
        else:
            out.append(float(mpmath.polygamma(n, v)))
    return torch.tensor(out, dtype=torch.float64)


def record(name, val):
    REPORT[name] = max(val, REPORT.get(name, 0.0))
    print(f"\n[measure] {name}: {val:.3e}")


# ---------------------------------------------------------------------------
# lgamma / digamma / polygamma values
# ---------------------------------------------------------------------------
EDGE = torch.tensor([0.0, -0.0, -1.0, -2.0, -50.0, 1e-45, -1e-45, 1e-38,
                     float("inf"), float("-inf"), float("nan"), 3e38, -3e38, 2.0 ** 24 + 2])


@pytest.mark.parametrize("name,ours_f,ref_f", [
    ("lgamma", F.lgamma, torch.lgamma),
    ("digamma", F.digamma, torch.digamma),
])
def test_lgamma_digamma_values(name, ours_f, ref_f):
    x32 = special_points(torch.float32)
    ours32 = ours_f(x32)
    assert ours32.dtype == torch.float32
    ref_true = ref_f(x32.double())           # torch float64 on the same f32 inputs
    ref32 = ref_f(x32)                       # torch float32
    check_special_values(ours32, ref32)
    e_true = err_stats(ours32, ref_true)
    e_t32 = err_stats(ours32, ref32)
    e_torch_self = err_stats(ref32, ref_true)
    record(f"{name} f32 vs torch f64 (abs<1, rel>1)", e_true)
    record(f"{name} f32 vs torch f32 (abs<1, rel>1)", e_t32)
    record(f"[info] torch's own {name} f32 vs f64", e_torch_self)
    assert e_true < 1e-5
    assert e_t32 < 1e-5

    x64 = special_points(torch.float64)
    ours64 = ours_f(x64)
    ref64 = ref_f(x64)
    check_special_values(ours64, ref64)
    e64 = err_stats(ours64, ref64)
    record(f"{name} f64 vs torch f64 (abs<1, rel>1)", e64)
    # torch's own f64 digamma loses ~1e-10 (relative) within 1e-6 of negative
    # poles (tan(pi*r) with unreduced r); ours is checked against mpmath below.
    assert e64 < 1e-9
    mp = mp_reference(name, x64)
    if mp is not None:
        e_mp = err_stats(ours64, mp)
        record(f"{name} f64 vs mpmath (abs<1, rel>1)", e_mp)
        record(f"[info] torch's own {name} f64 vs mpmath", err_stats(ref64, mp))
        assert e_mp < 1e-13

    # edge values: exact special-value conventions in f32 and f64
    for dt in (torch.float32, torch.float64):
        e = EDGE.to(dt)
        o, r = ours_f(e), ref_f(e)
        check_special_values(o, r)
        fin = torch.isfinite(r)
        torch.testing.assert_close(o[fin], r[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,ours_f,ref_f", [
    ("lgamma", F.lgamma, torch.lgamma),
    ("digamma", F.digamma, torch.digamma),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(name, ours_f, ref_f, dtype):
    x = special_points(torch.float32)
    x = x[(x.abs() < 6e4)].to(dtype)
    o = ours_f(x)
    assert o.dtype == dtype
    r = ref_f(x)
    # both computed at >= f32 and rounded: allow 1 ulp of the output format
    fin = torch.isfinite(r)
    eps = torch.finfo(dtype).eps
    d = (o.double() - r.double()).abs()[fin]
    assert (d <= eps * torch.clamp(r.double().abs()[fin], min=1.0) * 1.01).all()
    check_special_values(o, r)


def test_int_input_promotes():
    x = torch.arange(-3, 6)
    for of, rf in [(F.lgamma, torch.lgamma), (F.digamma, torch.digamma)]:
        o, r = of(x), rf(x)
        assert o.dtype == r.dtype
        check_special_values(o, r)
        fin = torch.isfinite(r)
        torch.testing.assert_close(o[fin], r[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3])
def test_polygamma_values(n):
    # all reals for every n (reflection through derivatives of cot)
    for dt, tol in ((torch.float32, 1e-5), (torch.float64, 1e-11)):
        x = special_points(dt)
        x = x[nonpole(x)]
        o = F.polygamma(n, x)
        ref = torch.polygamma(n, x.double())
        fin = torch.isfinite(ref) & (ref.abs() < torch.finfo(dt).max / 10)
        e = err_stats(o[fin], ref[fin])
        record(f"polygamma n={n} {dt} vs torch f64 (abs<1, rel>1)", e)
        # torch's f64 polygamma itself is off by up to ~4e-9 (relative) near
        # negative poles, so the tight f64 check is against mpmath.
        assert e < (tol if dt == torch.float32 else 1e-8)
        mp = mp_reference("polygamma", x.double(), n)
        if mp is not None:
            fmp = torch.isfinite(mp) & (mp.abs() < torch.finfo(dt).max / 10)
            e_mp = err_stats(o[fmp], mp[fmp])
            record(f"polygamma n={n} {dt} vs mpmath (abs<1, rel>1)", e_mp)
            if dt == torch.float64:
                record(f"[info] torch's own polygamma n={n} f64 vs mpmath",
                       err_stats(ref[fmp], mp[fmp]))
            assert e_mp < tol
        assert torch.isfinite(o[fin]).all()
        if dt == torch.float32:
            r32 = torch.polygamma(n, x)
            f32 = torch.isfinite(r32) & fin
            # torch's own float32 trigamma is inaccurate near negative poles (it
            # evaluates sin(pi*x) unreduced); only compare x > -0.5 there.
            f32 = f32 & (x > -0.5) if n == 1 else f32
            e32 = err_stats(o[f32], r32[f32])
            record(f"polygamma n={n} f32 vs torch f32 (abs<1, rel>1)", e32)
            assert e32 < 1e-5
            record(f"[info] torch's own polygamma n={n} f32 vs f64 (all x)",
                   err_stats(r32[fin], ref[fin]))


@pytest.mark.parametrize("n", [8, 15, 20])
def test_polygamma_high_order(n):
    x = torch.tensor([1e-3, 0.1, 0.5, 1.0, 2.5, 7.0, 13.3, 50.0, 1e3, 1e5, 1e6,
                      -0.3, -2.7, -10.25], dtype=torch.float64)
    for dt, tol in ((torch.float64, 1e-13), (torch.float32, 3e-6)):
        xd = x.to(dt)
        o = F.polygamma(n, xd).double()
        mp = mp_reference("polygamma", xd.double(), n)
        ok = (mp.abs() < torch.finfo(dt).max) & (mp.abs() > torch.finfo(dt).tiny)
        e = ((o - mp).abs() / mp.abs())[ok].max().item()
        record(f"polygamma n={n} {dt} vs mpmath (relative, normal-range values)", e)
        assert e < tol


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_polygamma_edges(n):
    for dt in (torch.float32, torch.float64):
        e = torch.tensor([0.0, -0.0, -3.0, 1e-30, float("inf"), float("-inf"),
                          float("nan"), 1e6], dtype=dt)
        o, r = F.polygamma(n, e), torch.polygamma(n, e)
        # exact poles: ours gives (-1)^(n+1) inf; torch's trigamma gives a huge
        # finite number at negative integers (e.g. 1.29e15 at -1 in f32).
        if n == 1:
            keep = e != -3.0
            assert o[~keep].item() == math.inf and r[~keep].item() > 1e13
            o, r = o[keep], r[keep]
        check_special_values(o, r)
        fin = torch.isfinite(r)
        torch.testing.assert_close(o[fin], r[fin], rtol=1e-5, atol=0)


def test_polygamma_n0_is_digamma():
    x = special_points(torch.float32)
    torch.testing.assert_close(F.polygamma(0, x), F.digamma(x), equal_nan=True)


# ---------------------------------------------------------------------------
# gradients through the formulas
# ---------------------------------------------------------------------------
def grad_points():
    x = torch.cat([
        torch.linspace(-9.9, 12.0, 401, dtype=torch.float64),
        torch.tensor([1e-3, 0.01, 0.1, 0.7, 1.4616, 3.3, 50.0, 1e3, 1e5, -0.3,
                      -2.001, -1.999, -5.5, -7.25]),
    ])
    return x[nonpole(x) & ((x - torch.round(x)).abs() > 1e-3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grad_lgamma_is_digamma(dtype):
    x = grad_points().to(dtype).requires_grad_()
    (g,) = torch.autograd.grad(F.lgamma(x).sum(), x)
    ref = torch.digamma(x.detach().double())
    e = err_stats(g, ref)
    record(f"d/dx lgamma formula vs torch.digamma {dtype} (abs<1, rel>1)", e)
    assert e < (2e-4 if dtype == torch.float32 else 1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grad_digamma_is_trigamma(dtype):
    x = grad_points().to(dtype).requires_grad_()
    (g,) = torch.autograd.grad(F.digamma(x).sum(), x)
    ref = torch.polygamma(1, x.detach().double())
    e = err_stats(g, ref)
    record(f"d/dx digamma formula vs torch.polygamma(1) {dtype} (abs<1, rel>1)", e)
    assert e < (2e-4 if dtype == torch.float32 else 1e-9)


def test_grad_polygamma_is_next():
    x = grad_points().double().requires_grad_()
    (g,) = torch.autograd.grad(F.polygamma(1, x).sum(), x)
    ref = torch.polygamma(2, x.detach())
    e = err_stats(g, ref)
    record("d/dx polygamma(1) formula vs torch.polygamma(2) f64", e)
    assert e < 1e-9


def test_grad_finite_at_tiny_and_large():
    x = torch.tensor([1e-30, 1e-20, 1e-10, 1e6, 2.5e-3, -1e-10], requires_grad=True)
    for f in (F.lgamma, F.digamma, lambda t: F.polygamma(1, t)):
        (g,) = torch.autograd.grad(f(x).sum(), x)
        assert not torch.isnan(g).any()


# ---------------------------------------------------------------------------
# FFT
# ---------------------------------------------------------------------------
NORMS = [None, "ortho", "forward", "backward"]


def fft_formulas_ctx():
    """Run torch.fft.* with the three ATen FFT ops replaced by our formulas."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_fft_c2c", F.fft_c2c, "CPU")
    lib.impl("_fft_r2c", F.fft_r2c, "CPU")
    lib.impl("_fft_c2r", F.fft_c2r, "CPU")
    return lib


class _Patched:
    """Replace the CPU kernels of the ATen FFT ops by the formulas (autograd
    still uses torch's derivative formulas) -- used for forward values only."""

    def __enter__(self):
        self.lib = fft_formulas_ctx()
        return self

    def __exit__(self, *a):
        self.lib._destroy()


def decomposed(f):
    """f traced with make_fx + our decomposition table (real tensors), so the
    resulting graph contains only the formula ops; autograd then goes through
    the formulas themselves."""
    def run(*args):
        gm = make_fx(lambda *a: f(*a), decomposition_table=F.DECOMPOSITIONS)(*args)
        targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert not (targets & FORBIDDEN_TARGETS), targets
        return gm(*args)
    return run


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    c = lambda *s: torch.randn(*s, dtype=torch.complex64, generator=g)  # noqa: E731
    cases = []
    for norm in NORMS:          # each function once, the normalizations in turn below
        cases += [
            ("fft c", lambda t, norm=norm: torch.fft.fft(t, norm=norm), c(3, 64)),
            ("fft r", lambda t, norm=norm: torch.fft.fft(t, norm=norm), r(5, 17)),
            ("fft n=20 dim0", lambda t, norm=norm: torch.fft.fft(t, n=20, dim=0, norm=norm), c(13, 4)),
            ("ifft c", lambda t, norm=norm: torch.fft.ifft(t, norm=norm), c(2, 33)),
            ("ifft r", lambda t, norm=norm: torch.fft.ifft(t, norm=norm), r(2, 31)),
            ("fft2", lambda t, norm=norm: torch.fft.fft2(t, norm=norm), c(2, 12, 9)),
            ("ifft2", lambda t, norm=norm: torch.fft.ifft2(t, norm=norm), c(2, 12, 9)),
            ("fftn (0,2)", lambda t, norm=norm: torch.fft.fftn(t, dim=(0, 2), norm=norm), c(6, 3, 10)),
            ("fftn all", lambda t, norm=norm: torch.fft.fftn(t, norm=norm), c(4, 5, 6)),
            ("ifftn (2,0)", lambda t, norm=norm: torch.fft.ifftn(t, dim=(2, 0), norm=norm), c(6, 3, 10)),
            ("rfft even", lambda t, norm=norm: torch.fft.rfft(t, norm=norm), r(3, 64)),
            ("rfft odd", lambda t, norm=norm: torch.fft.rfft(t, norm=norm), r(3, 63)),
            ("rfft dim0", lambda t, norm=norm: torch.fft.rfft(t, dim=0, norm=norm), r(7, 4)),
            ("irfft even", lambda t, norm=norm: torch.fft.irfft(t, norm=norm), c(3, 33)),
            ("irfft odd n", lambda t, norm=norm: torch.fft.irfft(t, n=63, norm=norm), c(3, 32)),
            ("irfft n=11 pad", lambda t, norm=norm: torch.fft.irfft(t, n=11, norm=norm), c(2, 4)),
            ("irfft n=8 trunc", lambda t, norm=norm: torch.fft.irfft(t, n=8, norm=norm), c(2, 9)),
            ("rfft2", lambda t, norm=norm: torch.fft.rfft2(t, norm=norm), r(2, 16, 15)),
            ("irfft2 even", lambda t, norm=norm: torch.fft.irfft2(t, norm=norm), c(2, 16, 9)),
            ("irfft2 odd", lambda t, norm=norm: torch.fft.irfft2(t, s=(15, 17), norm=norm), c(2, 15, 9)),
            ("rfftn dim(2,0)", lambda t, norm=norm: torch.fft.rfftn(t, dim=(2, 0), norm=norm), r(6, 3, 10)),
            ("irfftn dim(0,2)", lambda t, norm=norm: torch.fft.irfftn(t, s=(6, 9), dim=(0, 2), norm=norm), c(6, 3, 5)),
            ("hfft", lambda t, norm=norm: torch.fft.hfft(t, norm=norm), c(3, 9)),
            ("ihfft", lambda t, norm=norm: torch.fft.ihfft(t, norm=norm), r(3, 10)),
            ("fftshift-free 1d n=1", lambda t, norm=norm: torch.fft.fft(t, norm=norm), c(3, 1)),
        ]
    per_norm = len(cases) // len(NORMS)
    return [cases[k % len(NORMS) * per_norm + k] for k in range(per_norm)]


CASES = _cases()


@pytest.mark.parametrize("idx", range(len(CASES)), ids=[f"{c[0]}-{NORMS[i % len(NORMS)]}"
                                                         for i, c in enumerate(CASES)])
def test_fft_values(idx):
    name, f, t = CASES[idx]
    ref = f(t)
    ours = decomposed(f)(t)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    e = (ours - ref).abs().max().item()
    record("fft-family f32 max abs err (unit-scale inputs, n<=64)", e)
    assert e < 1e-4, (name, e)
    # f64 too
    t64 = t.to(torch.complex128 if t.is_complex() else torch.float64)
    ref64 = f(t64)
    ours64 = decomposed(f)(t64)
    assert ours64.dtype == ref64.dtype
    e64 = (ours64 - ref64).abs().max().item()
    record("fft-family f64 max abs err", e64)
    assert e64 < 1e-11, (name, e64)


def test_direct_op_calls():
    """Call the formulas with the ATen-op arguments directly (incl. negative dims,
    the onesided=False r2c, and c2r ignoring imag of DC/Nyquist bins)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 10, generator=g)
    for dims_ in ([2], [0, 2], [2, 0], [-1], [1, -1], [0, 1, 2]):
        dims = [d % 3 for d in dims_]  # torch's kernels need wrapped dims; ours accept both
        for norm in (0, 1, 2):
            for onesided in (True, False):
                r = torch.ops.aten._fft_r2c(x, dims, norm, onesided)
                o = F.fft_r2c(x, dims_, norm, onesided)
                torch.testing.assert_close(o, r, atol=1e-4, rtol=0)
            for fwd in (True, False):
                xc = torch.randn(4, 6, 10, dtype=torch.complex64, generator=g)
                torch.testing.assert_close(F.fft_c2c(xc, dims_, norm, fwd),
                                           torch.ops.aten._fft_c2c(xc, dims, norm, fwd),
                                           atol=1e-4, rtol=0)
            # c2r with arbitrary (non-Hermitian) input: imag of DC/Nyquist ignored
            for n_last in (9, 10):
                ld = dims[-1] % 3
                sz = [4, 6, 10]
                sz[ld] = n_last // 2 + 1
                xc = torch.randn(*sz, dtype=torch.complex64, generator=g)
                szo = list(sz)
                szo[ld] = n_last
                r = torch.ops.aten._fft_c2r(xc, dims, norm, n_last)
                o = F.fft_c2r(xc, dims_, norm, n_last)
                assert o.shape == r.shape == torch.Size(szo)
                torch.testing.assert_close(o, r, atol=1e-4, rtol=0)
    # empty dim list
    xc = torch.randn(3, 4, dtype=torch.complex64)
    torch.testing.assert_close(F.fft_c2c(xc, [], 0, True), xc)


def _grad_cases():
    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    c = lambda *s: torch.randn(*s, dtype=torch.complex128, generator=g)  # noqa: E731
    w = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    cases = []
    for norm in (None, "ortho", "forward"):
        W1 = w(3, 9)
        W2 = w(3, 10)
        W3 = w(2, 8, 5)
        W4 = w(2, 8, 8)
        Wc = w(3, 16)
        cases += [
            ("rfft", lambda t, norm=norm, W=W1: (torch.view_as_real(torch.fft.rfft(t, norm=norm)).pow(2).sum(-1) * W).sum(), r(3, 16)),
            ("rfft odd", lambda t, norm=norm, W=W2: (torch.fft.rfft(t, norm=norm).abs() * W).sum(), r(3, 19)),
            ("irfft even", lambda t, norm=norm, W=w(3, 16): (torch.fft.irfft(t, norm=norm) * W).sum(), c(3, 9)),
            ("irfft odd", lambda t, norm=norm, W=w(3, 17): (torch.fft.irfft(t, n=17, norm=norm) ** 2 * W).sum(), c(3, 9)),
            ("fft c", lambda t, norm=norm, W=Wc: (torch.fft.fft(t, norm=norm).real * W + torch.fft.fft(t, norm=norm).imag ** 2).sum(), c(3, 16)),
            ("fft r", lambda t, norm=norm, W=Wc: (torch.fft.fft(t, norm=norm).abs() * W).sum(), r(3, 16)),
            ("ifft", lambda t, norm=norm, W=Wc: (torch.fft.ifft(t, norm=norm).imag * W).sum(), c(3, 16)),
            ("rfft2", lambda t, norm=norm, W=W3: (torch.fft.rfft2(t, norm=norm).abs() * W).sum(), r(2, 8, 8)),
            ("irfft2", lambda t, norm=norm, W=W4: (torch.fft.irfft2(t, s=(8, 8), norm=norm) * W).sum(), c(2, 8, 5)),
        ]
    return cases


GCASES = _grad_cases()


@pytest.mark.parametrize("idx", range(len(GCASES)), ids=[f"{c[0]}-{i // 9}" for i, c in enumerate(GCASES)])
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_fft_grads(idx, dtype):
    name, f, t = GCASES[idx]
    if dtype == "f32":
        t = t.to(torch.complex64 if t.is_complex() else torch.float32)
    t1 = t.clone().requires_grad_()
    (gref,) = torch.autograd.grad(f(t1), t1)
    t2 = t.clone().requires_grad_()
    (gours,) = torch.autograd.grad(decomposed(f)(t2), t2)
    e = (gours - gref).abs().max().item()
    record(f"fft-family grad max abs err {dtype}", e)
    assert e < (1e-4 if dtype == "f32" else 1e-10), (name, e)


# ---------------------------------------------------------------------------
# tracing with make_fx on fake tensors
# ---------------------------------------------------------------------------
def _trace_fake(f, *args):
    gm = make_fx(f, decomposition_table=F.DECOMPOSITIONS, tracing_mode="fake")(*args)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not (targets & FORBIDDEN_TARGETS), targets
    # the traced graph must still compute the right thing on real inputs
    return gm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_make_fx_fake_special(dtype):
    x = torch.linspace(-5.3, 7.7, 50).to(dtype)
    for name, f, ref in [
        ("lgamma", lambda t: torch.lgamma(t), torch.lgamma),
        ("digamma", lambda t: torch.digamma(t), torch.digamma),
        ("polygamma1", lambda t: torch.polygamma(1, t), lambda t: torch.polygamma(1, t)),
        ("polygamma3", lambda t: torch.polygamma(3, t), lambda t: torch.polygamma(3, t)),
        ("direct", lambda t: F.lgamma(t) + F.digamma(t) + F.polygamma(2, t), None),
    ]:
        gm = _trace_fake(f, x)
        if ref is not None:
            torch.testing.assert_close(gm(x).float(), ref(x).float(), rtol=1e-2, atol=1e-3)


def test_make_fx_fake_grad_special():
    def f(t):
        return torch.autograd.grad(torch.lgamma(t).sum() + torch.digamma(t).sum(), t, create_graph=True)[0]
    x = torch.linspace(0.3, 7.7, 20, requires_grad=True)
    _trace_fake(f, x)


def test_make_fx_fake_fft():
    x = torch.randn(4, 16)
    xc = torch.randn(4, 16, dtype=torch.complex64)
    fs = [
        (lambda t: torch.fft.rfft(t, norm="ortho"), x),
        (lambda t: torch.fft.irfft(t, n=15), xc[:, :8].contiguous()),
        (lambda t: torch.fft.fft2(t, norm="forward"), xc),
        (lambda t: torch.fft.fftn(t), x),
        (lambda t: torch.fft.ifft(t), xc),
        (lambda t: torch.fft.irfft2(t, s=(4, 16)), xc[:, :9].contiguous()),
        (lambda t: torch.fft.hfft(t), xc),
        (lambda t: torch.fft.ihfft(t), x),
    ]
    for f, a in fs:
        gm = _trace_fake(f, a)
        torch.testing.assert_close(gm(a), f(a), atol=1e-4, rtol=0)


def test_make_fx_fake_fft_grad():
    def f(t):
        y = torch.fft.irfft(torch.fft.rfft(t) * 2.0, n=16)
        return torch.autograd.grad((y * y).sum() + torch.fft.fft(t).abs().sum(), t)[0]
    x = torch.randn(3, 16, requires_grad=True)
    gm = _trace_fake(f, x)
    torch.testing.assert_close(gm(x), f(x), atol=1e-4, rtol=0)


def test_print_report():
    print("\n==== measured worst errors (this run) ====")
    for k in sorted(REPORT):
        print(f"  {k}: {REPORT[k]:.3e}")


def test_rfft_dc_and_nyquist_have_no_imaginary_part_and_no_gradient_there():
    """torch's rfft gives exactly 0 there; float32's sin(pi) is -8.7e-8, which made a
    complex filter's Nyquist bin drift under Adam (its gradient 1e-11, Adam's step a
    whole lr) and an STFT's phase there flip by 2*pi (stop 43). The table's angles are
    reduced in integers, so the quarter points are exact."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    X = decomposed(lambda t: torch.fft.rfft(t))(x)
    assert torch.equal(X.imag[:, 0], torch.zeros(3))
    assert torch.equal(X.imag[:, 32], torch.zeros(3))
    filt = torch.randn(33, dtype=torch.complex64, generator=g).requires_grad_()
    run = decomposed(lambda t, f: torch.fft.irfft(torch.fft.rfft(t) * f, n=64).square().sum())
    run(x, filt).backward()
    assert filt.grad.imag[0].item() == 0 and filt.grad.imag[32].item() == 0
    assert filt.grad.imag[1:32].abs().min().item() > 0  # the other bins do get gradients
