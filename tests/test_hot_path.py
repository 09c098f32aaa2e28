"""The dispatch hot path (docs/architecture.md, Decision 20) against plain torch:
cached launches of one-device programs, recorded graphs run fused from their second
submission and launched from a cached executable from their third, and the client's
fast path for repeat calls. Each path is shown to be taken (executor counters), and
its values equal torch's on the CPU within 1e-5 (XLA and torch order a reduction
differently, fused or not; fused, XLA may also fold constants across programs)."""

import pytest
import torch

import pathways_torch as pw
from pathways_torch import P


def test_switches_turn_fusion_and_cached_launches_off(monkeypatch):
    """(First: the module's shared cluster starts after it.) PATHWAYS_FUSE=0 and PATHWAYS_CACHED_LAUNCH=0 on the workers: the same values,
    neither path taken (a baseline for benchmarks and a way around a torch_xla bug)."""
    monkeypatch.setenv("PATHWAYS_FUSE", "0")
    monkeypatch.setenv("PATHWAYS_CACHED_LAUNCH", "0")
    pw.init(devices_per_host=1, timeout=120)
    try:
        s = pw.slice((1,))
        y = pw.put(torch.zeros(4), s)
        for _ in range(3):
            with pw.graph():
                for _ in range(4):
                    y = bump(y)
        assert torch.equal(y.torch(), torch.full((4,), 12.0))
        st = s.stats()
        assert st.fused_launches == 0 and st.cached_launches == 0
    finally:
        pw.shutdown()


def test_an_evicted_cached_executable_is_traced_again(monkeypatch):
    """torch_xla's compilation cache is an LRU (XLA_COMPILATION_CACHE_SIZE): with room
    for 2 executables, 4 programs called in turn evict each other's, and every call
    and every fused graph still gives torch's values (traced again, then cached)."""
    monkeypatch.setenv("XLA_COMPILATION_CACHE_SIZE", "2")
    pw.init(devices_per_host=1, timeout=120)
    try:
        s = pw.slice((1,))
        progs = [pw.program(lambda y, k=k: y * 2 + k, name=f"lru{k}") for k in range(4)]
        y, want = pw.put(torch.ones(4), s), torch.ones(4)
        for r in range(3):
            for k, p in enumerate(progs):
                y, want = p(y), want * 2 + k
            with pw.graph():
                for k, p in enumerate(progs):
                    y = p(y)
            for k in range(4):
                want = want * 2 + k
            torch.testing.assert_close(y.torch(), want, rtol=1e-6, atol=0,
                                       msg=f"round {r}")
            y, want = pw.put(torch.ones(4), s), torch.ones(4)
    finally:
        pw.shutdown()


@pytest.fixture(scope="module")
def slices():
    pw.init(devices_per_host=6, timeout=120)
    try:
        yield pw.slice((1,)), pw.slice((1,)), pw.slice((2,), axis_names=("d",))
    finally:
        pw.shutdown()


@pw.program
def affine(x, w, b):
    return torch.tanh(x @ w + b), (x * 2).sum()


@pw.program
def bump(y):
    return y + 1


@pw.program
def scale(s, y):                       # a 0-dim input: not a graph parameter, traced
    return y * s


def ref_affine(x, w, b):
    return torch.tanh(x @ w + b), (x * 2).sum()


def test_repeat_calls_launch_cached_executables_and_match_torch(slices):
    s = slices[0]
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g),
               torch.randn(8, generator=g))
    xa, wa, ba = pw.put(x, s), pw.put(w, s), pw.put(b, s)
    before = s.stats().cached_launches
    for _ in range(5):
        h, tot = affine(xa, wa, ba)
        want_h, want_t = ref_affine(x, w, b)
        torch.testing.assert_close(h.torch(), want_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tot.torch(), want_t, rtol=1e-5, atol=1e-5)
        xa, x = h, want_h                       # feed the output back, as a loop does
    assert s.stats().cached_launches - before >= 4
    # scalars 0 and 1 become constants when traced: such programs are traced per call
    y = pw.put(torch.arange(4.0), s)
    for v in (0.0, 1.0, 3.0):
        assert torch.equal(scale(pw.put(torch.tensor(v), s), y).torch(),
                           torch.arange(4.0) * v)


def test_fast_path_respects_shapes_donation_and_release(slices):
    s = slices[0]
    for shape in ((4,), (2, 3), (4,)):
        a = pw.put(torch.ones(shape), s)
        assert torch.equal(bump(a).torch(), torch.full(shape, 2.0))
    donor = pw.program(lambda y: y * 3, donate_argnums=(0,))
    a = pw.put(torch.ones(3), s)
    bump(a)
    out = donor(a)
    with pytest.raises(pw.PlacementError, match="donated"):
        bump(a)
    assert torch.equal(out.torch(), torch.full((3,), 3.0))
    t = pw.slice((1,))
    c = pw.put(torch.ones(2), t)
    bump(c).wait()
    t.release()
    with pytest.raises(pw.ClusterShutdownError):
        bump(c)


@pw.program
def mix(params, xs, bias=None):
    return {"y": xs[0] @ params["w1"] - xs[1] @ params["w2"] + bias,
            "n": params["w2"].sum()}, [xs[1] * 2]


def test_calls_with_dicts_and_lists_take_the_fast_path_and_match_torch(slices,
                                                                       monkeypatch):
    """Arrays in dicts, lists and keyword arguments (a model's parameters): repeat calls
    skip the general path, in the order torch's pytree flattens them (a dict's
    insertion order, here not sorted); anything else in them goes the general way."""
    s = slices[0]
    g = torch.Generator().manual_seed(1)
    w1, w2, x0, x1, b = (torch.randn(4, 4, generator=g) for _ in range(5))

    def want(p, xs, bias):
        return ({"y": xs[0] @ p["w1"] - xs[1] @ p["w2"] + bias, "n": p["w2"].sum()},
                [xs[1] * 2])

    general = []
    slow = mix._slow_call
    monkeypatch.setattr(mix, "_slow_call", lambda a, k: general.append(1) or slow(a, k))

    def check(params, xs, bias, expected):
        out, rest = mix(params, xs, bias=bias)
        torch.testing.assert_close(out["y"].torch(), expected[0]["y"], rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(out["n"].torch(), expected[0]["n"], rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(rest[0].torch(), expected[1][0])

    arrays = {k: pw.put(v, s) for k, v in dict(w1=w1, w2=w2, x0=x0, x1=x1, b=b).items()}
    params = {"w2": arrays["w2"], "w1": arrays["w1"]}          # not sorted
    xs = [arrays["x0"], arrays["x1"]]
    for _ in range(3):
        check(params, xs, arrays["b"], want({"w1": w1, "w2": w2}, [x0, x1], b))
    assert len(general) == 1                   # only the first call traced and keyed
    check({"w1": arrays["w1"], "w2": arrays["w2"]}, xs, arrays["b"],   # another order
          want({"w1": w1, "w2": w2}, [x0, x1], b))
    check(params, [arrays["x0"], x1], arrays["b"],                     # a CPU tensor
          want({"w1": w1, "w2": w2}, [x0, x1], b))
    check(params, (arrays["x1"], arrays["x0"]), arrays["b"],           # a tuple
          want({"w1": w1, "w2": w2}, [x1, x0], b))
    assert len(general) == 4
    check(params, [arrays["x1"], arrays["x0"]], arrays["b"],           # fast again
          want({"w1": w1, "w2": w2}, [x1, x0], b))
    assert len(general) == 4
    donor = pw.program(lambda d: {k: v * 3 for k, v in d.items()}, donate_argnums=(0,))
    donor(params)
    with pytest.raises(pw.PlacementError, match="donated"):
        mix(params, xs, bias=arrays["b"])


@pw.program
def sgd(params, grads, lr, hyper):
    for n, p in params.items():                 # in place: written back to the Arrays
        p.sub_(lr * grads[n] * hyper["scale"])
    return (params["w"] * 2).sum()


@pw.program
def noisy(x):
    return x + torch.rand_like(x)


def test_updates_in_place_statics_tensors_and_random_calls_take_the_fast_path(slices,
                                                                            monkeypatch):
    """What an optimizer step passes: parameters updated in place (donated, written
    back), a CPU learning-rate tensor (put on every call), static hyperparameters (in
    the key: another value traces again). And a call that draws random numbers draws a
    new seed each time. All as plain torch computes them."""
    s = slices[0]
    general = []
    for prog in (sgd, noisy):
        slow = prog._slow_call
        monkeypatch.setattr(prog, "_slow_call",
                            lambda a, k, slow=slow: general.append(1) or slow(a, k))
    g = torch.Generator().manual_seed(2)
    w, b, gw, gb = (torch.randn(3, 3, generator=g) for _ in range(4))
    params = {"w": pw.put(w, s), "b": pw.put(b, s)}
    grads = {"w": pw.put(gw, s), "b": pw.put(gb, s)}
    ids = {n: a for n, a in params.items()}
    for lr, scale in ((0.1, 1.0), (0.2, 1.0), (0.3, 1.0), (0.1, 0.5), (0.1, 0.5)):
        out = sgd(params, grads, torch.tensor(lr), {"scale": scale})
        w, b = w - lr * gw * scale, b - lr * gb * scale
        torch.testing.assert_close(params["w"].torch(), w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(params["b"].torch(), b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.torch(), (w * 2).sum(), rtol=1e-5, atol=1e-5)
    assert all(params[n] is ids[n] for n in params)     # the same Arrays, updated
    assert len(general) == 2                 # a new static value traced once more
    x = pw.put(torch.zeros(64), s)
    draws = [noisy(x).torch() for _ in range(3)]
    assert len(general) == 3
    assert not torch.equal(draws[1], draws[2])  # a new seed on the fast path too
    assert all(((d >= 0) & (d < 1)).all() for d in draws)


def chain_graph(s, other, xa, wa, ba, k):
    """A recorded graph: a chain, an output used twice, an input used twice, a move to
    another slice in the middle (which ends a fused run) and two outputs."""
    with pw.graph():
        h, tot = affine(xa, wa, ba)
        for _ in range(k):
            h = bump(h)
        h2, _ = affine(h, wa, ba)
        moved = bump(h2.to(other))
        last, tot2 = affine(h2, wa, ba)
    return tot, h, last, tot2, moved


def torch_chain(x, w, b, k):
    h, tot = ref_affine(x, w, b)
    for _ in range(k):
        h = h + 1
    h2, _ = ref_affine(h, w, b)
    last, tot2 = ref_affine(h2, w, b)
    return tot, h, last, tot2, h2 + 1


def test_recorded_graphs_fuse_from_their_second_submission_and_match_torch(slices):
    s, other = slices[0], slices[1]
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(8, 8, generator=g) / 3, torch.randn(8, generator=g)
    wa, ba = pw.put(w, s), pw.put(b, s)
    st0 = s.stats()
    for r in range(4):
        x = torch.randn(8, 8, generator=g)
        got = chain_graph(s, other, pw.put(x, s), wa, ba, 6)
        want = torch_chain(x, w, b, 6)
        for k, (a, e) in enumerate(zip(got, want)):
            torch.testing.assert_close(a.torch(), e, rtol=1e-5, atol=1e-5,
                                       msg=f"submission {r}, output {k}")
    st = s.stats()
    # submissions 2-4 ran fused: two runs each (the move splits the graph)
    assert st.fused_launches - st0.fused_launches == 6
    assert st.fused_programs - st0.fused_programs == 3 * 9
    assert st.cached_launches > st0.cached_launches


def test_fused_runs_on_a_sharded_slice_are_traced_and_match_torch(slices):
    s = slices[2]
    x = torch.randn(8, 4)
    a = pw.put(x, s, P("d"))
    before = s.stats().fused_launches
    for r in range(3):
        with pw.graph():
            y = a
            for _ in range(5):
                y = bump(y)
        want = x
        for _ in range(5):
            want = want + 1
        # fused, XLA may fold the five "+ 1" into one "+ 5": a rounding apart
        torch.testing.assert_close(y.torch(), want, rtol=1e-6, atol=0,
                                   msg=f"submission {r}")
    assert s.stats().fused_launches - before == 2


@pw.program
def odd_outputs(x, unused):
    return x, torch.arange(3.0), x.t() * 2


@pw.program
def unused_scalar(x, unused):
    return x * 2


def test_cached_launches_keep_identity_constant_and_unused_cases(slices):
    """An unused input is no parameter of the compiled graph: the launch leaves it out
    (a pipeline stage's backward does not read the recomputed forward). An unused 0-dim
    input cannot be told from a folded scalar 0 or 1, so that program is traced."""
    s = slices[0]
    x = torch.randn(4, 2)
    xa, ua = pw.put(x, s), pw.put(torch.ones(5), s)
    before = s.stats().cached_launches
    for _ in range(3):
        same, const, twice = odd_outputs(xa, ua)
        assert torch.equal(same.torch(), x) and torch.equal(const.torch(), torch.arange(3.0))
        assert torch.equal(twice.torch(), x.t() * 2)
        assert same._id != xa._id          # an output is a buffer of its own
    assert s.stats().cached_launches - before == 3
    before = s.stats().cached_launches
    for v in (0.0, 1.0, 5.0):
        assert torch.equal(unused_scalar(xa, pw.put(torch.tensor(v), s)).torch(), x * 2)
    assert s.stats().cached_launches == before


@pw.program
def sgd_step(w, g, lr, step):
    w.sub_(lr * g)                        # in place: w is donated and written back
    step.add_(1)
    return (w * w).sum()


def test_donating_calls_launch_cached_and_match_torch(slices):
    """A program that updates its inputs in place donates them (its executable aliases
    them with outputs) and launches cached; 0-dim inputs (a learning rate, a step count)
    are graph parameters whatever their value, 0 and 1 included."""
    s = slices[0]
    g = torch.Generator().manual_seed(3)
    w_cpu, step_cpu = torch.randn(8, generator=g), torch.tensor(0.0)
    w, step = pw.put(w_cpu, s), pw.put(step_cpu, s)
    before = s.stats().cached_launches
    for lr_value in (1.0, 0.0, 0.5, 1.0, 0.25):
        grad = torch.randn(8, generator=g)
        got = sgd_step(w, pw.put(grad, s), pw.put(torch.tensor(lr_value), s), step)
        w_cpu = w_cpu - lr_value * grad
        step_cpu = step_cpu + 1
        torch.testing.assert_close(got.torch(), (w_cpu * w_cpu).sum(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w.torch(), w_cpu, rtol=1e-6, atol=1e-6)
        assert step.item() == step_cpu.item()
    assert s.stats().cached_launches - before == 5
