"""Numerical equality of programs against plain torch on the CPU (real cluster).

Tolerances: elementwise ops and reductions over one shard are exact up to float32
rounding (rtol 1e-6); sharded contractions sum partial products in another order
(rtol 1e-5, atol 1e-4 on values of order 10).
"""

import itertools

import torch

import pathways_torch as pw
from pathways_torch import P

MATMUL_TOL = dict(rtol=1e-5, atol=1e-4)


def close(got, want, **tol):
    tol = tol or dict(rtol=1e-6, atol=1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **tol)


def test_quickstart_layer(mesh42):
    torch.manual_seed(0)
    xc, wc = torch.randn(64, 128), torch.randn(128, 256)
    x = pw.put(xc, mesh42, P("data", None))
    w = pw.put(wc, mesh42, P(None, "model"))

    @pw.program
    def layer(x, w):
        return torch.relu(x @ w)

    y = layer(x, w)
    assert y.shape == (64, 256) and y.dtype == torch.float32
    assert y.sharding == P("data", "model")   # XLA's propagation, known before fetching
    close(y.torch(), torch.relu(xc @ wc), **MATMUL_TOL)


def test_elementwise_ops(mesh42):
    torch.manual_seed(1)
    a, b = torch.randn(16, 32), torch.rand(16, 32) + 0.5
    A, B = pw.put(a, mesh42, P("data", "model")), pw.put(b, mesh42, P("data"))

    @pw.program
    def elementwise(a, b):
        return (torch.sin(a) * b + torch.exp(-a.abs()) / b - torch.sqrt(b)
                + torch.where(a > 0, a, 0.5 * a) + a.clamp(-0.5, 0.5) ** 2)

    close(elementwise(A, B).torch(), torch.sin(a) * b + torch.exp(-a.abs()) / b
          - torch.sqrt(b) + torch.where(a > 0, a, 0.5 * a) + a.clamp(-0.5, 0.5) ** 2,
          rtol=1e-5, atol=1e-6)


def test_dtypes_travel(mesh42):
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.int64):
        t = (torch.arange(32).reshape(8, 4) - 7).to(dtype)
        a = pw.put(t, mesh42, P("data"))
        assert a.torch().dtype == dtype and torch.equal(a.torch(), t)

    @pw.program
    def double(x):
        return x * 2

    t = torch.arange(8, dtype=torch.int32)
    assert torch.equal(double(pw.put(t, mesh42)).torch(), t * 2)


SPECS_X = [P(), P("data"), P(None, "data"), P("model"), P(None, "model"), P("data", "model"),
           P("model", "data"), P(("data", "model"))]
SPECS_W = [P(), P("data"), P(None, "model"), P("data", "model"), P("model", "data"),
           P(None, ("data", "model"))]


def test_matmul_under_every_sharding_combination(mesh42):
    torch.manual_seed(2)
    xc, wc = torch.randn(64, 128), torch.randn(128, 256)

    @pw.program
    def matmul(x, w):
        return x @ w

    want = xc @ wc
    for sx, sw in itertools.product(SPECS_X, SPECS_W):
        y = matmul(pw.put(xc, mesh42, sx), pw.put(wc, mesh42, sw))
        assert y.shape == (64, 256)
        got = y.torch()
        assert torch.allclose(got, want, **MATMUL_TOL), f"x {sx} w {sw}"


def test_reductions(mesh42):
    torch.manual_seed(3)
    xc = torch.randn(32, 64)
    x = pw.put(xc, mesh42, P("data", "model"))

    @pw.program
    def reductions(x):
        return {"sum": x.sum(), "mean0": x.mean(0), "max1": x.max(1).values,
                "lse": torch.logsumexp(x, dim=1), "norm": x.norm(),
                "argmax": x.argmax(1), "softmax": torch.softmax(x, -1)}

    got = reductions(x)
    want = {"sum": xc.sum(), "mean0": xc.mean(0), "max1": xc.max(1).values,
            "lse": torch.logsumexp(xc, dim=1), "norm": xc.norm(), "argmax": xc.argmax(1),
            "softmax": torch.softmax(xc, -1)}
    for k in want:
        close(got[k].torch(), want[k], rtol=1e-5, atol=1e-5)


def test_mlp_forward(mesh42):
    torch.manual_seed(4)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                              torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 10))
    xc = torch.randn(64, 32)
    params = {k: v.detach() for k, v in mlp.named_parameters()}
    specs = {"0.weight": P("model"), "0.bias": P("model"), "2.weight": P(None, "model"),
             "2.bias": P(), "4.weight": P(), "4.bias": P()}
    P_ = {k: pw.put(v, mesh42, specs[k]) for k, v in params.items()}

    @pw.program
    def forward(params, x):
        return torch.func.functional_call(mlp, params, (x,))

    got = forward(P_, pw.put(xc, mesh42, P("data"))).torch()
    with torch.no_grad():
        close(got, mlp(xc), rtol=1e-5, atol=1e-5)


def test_pytree_in_and_out_with_static_args(mesh42):
    torch.manual_seed(5)
    a, b, c = torch.randn(8, 4), torch.randn(8, 4), torch.randn(4)
    tree = {"pair": (pw.put(a, mesh42, P("data")), pw.put(b, mesh42)), "list": [c]}

    @pw.program
    def f(tree, scale, mode):
        x, y = tree["pair"]
        (z,) = tree["list"]
        out = x * scale + y if mode == "affine" else x - y
        return {"out": out, "parts": [out.sum(), (out + z,)], "mode": mode}

    r = f(tree, 3.0, "affine")
    assert r["mode"] == "affine"
    close(r["out"].torch(), a * 3.0 + b)
    close(r["parts"][0].torch(), (a * 3.0 + b).sum(), rtol=1e-5, atol=1e-5)
    close(r["parts"][1][0].torch(), a * 3.0 + b + c)
    r2 = f(tree, 3.0, "diff")                     # another static value: another trace
    close(r2["out"].torch(), a - b)
    r3 = f(tree, 0.5, "affine")
    close(r3["out"].torch(), a * 0.5 + b)
    assert len(f._traces) == 3


def test_chain_of_50_calls(mesh42):
    torch.manual_seed(6)
    hc, wc = torch.randn(32, 16), torch.randn(16, 16) / 4

    @pw.program
    def step(h, w):
        return torch.tanh(h @ w) + h * 0.5

    h, w = pw.put(hc, mesh42, P("data")), pw.put(wc, mesh42, P(None, "model"))
    for _ in range(50):
        h = step(h, w)
        hc = torch.tanh(hc @ wc) + hc * 0.5
    close(h.torch(), hc, rtol=1e-4, atol=1e-5)


def test_out_specs_and_tensor_arguments(mesh42):
    torch.manual_seed(7)
    xc = torch.randn(16, 8)

    @pw.program(out_specs=P(None, "model"))
    def twice(x, bias):
        return x * 2 + bias

    bias = torch.randn(8)                         # a plain tensor: put implicitly
    y = twice(pw.put(xc, mesh42, P("data")), bias)
    assert y.sharding == P(None, "model")
    close(y.torch(), xc * 2 + bias)
    z = y.to(mesh42, P("data", "model"))          # reshard on the same slice
    assert z.sharding == P("data", "model")
    close(z.torch(), xc * 2 + bias)
    assert float(pw.put(torch.tensor(2.5), mesh42)) == 2.5
