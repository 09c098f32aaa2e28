"""Sharded dataflow across hosts and islands (real processes): transfers, resharding,
gang order, parallel vs sequential dispatch, recorded graphs, error propagation.

One cluster for the module: 2 islands x 2 hosts x 4 CPU devices = 4 worker processes.
Transfers copy bytes exactly, so results equal plain torch up to the programs' own
float32 rounding (rtol 1e-5).
"""

import os
import random
import signal
import threading
import time

import pytest
import torch

import pathways_torch as pw
from pathways_torch import P


@pytest.fixture(scope="module")
def cluster():
    pw.init(islands=2, hosts_per_island=2, devices_per_host=4, timeout=120)
    try:
        yield
    finally:
        pw.shutdown()


@pytest.fixture()
def slices(cluster):
    made = []

    def make(*args, **kw):
        s = pw.slice(*args, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.release()


@pw.program
def affine(x):
    return x * 2 + 1


@pw.program
def colsum(x):
    return x.sum(0)


def test_devices_report_islands_and_hosts(cluster):
    devs = pw.devices()
    assert sorted({(d.island, d.host) for d in devs}) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(d.index for d in devs if (d.island, d.host) == (1, 1)) == [0, 1, 2, 3]


def test_resource_manager_balances_and_honours_islands(slices):
    placed = [slices((2,)) for _ in range(4)]
    assert sorted((s.island, s.host) for s in placed) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for s in placed:
        s.release()
    assert slices((1,), island=1).island == 1


def test_cross_host_and_cross_island_chain(slices):
    a = slices((2,), island=0)
    b = slices((2,), island=0)
    c = slices((2,), island=1)
    assert a.host != b.host and c.island == 1
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    w = torch.randn(6, 6) / 3

    @pw.program
    def layer(h, w):
        return torch.tanh(h @ w)

    h = pw.put(x, a, P("data"))
    want = x
    for hop, s in enumerate([b, c, a, c, b] * 2):
        h = layer(h.to(s, P("data")), pw.put(w, s))
        want = torch.tanh(want @ w)
        assert h.slice is s
    torch.testing.assert_close(h.torch(), want, rtol=1e-5, atol=1e-6)
    assert c.stats().bytes_received > 0 and a.stats().bytes_sent > 0


@pytest.mark.parametrize("src_spec,dst_shape,dst_spec", [
    (P("data"), (4,), P()),                      # sharded on 2 -> replicated on 4
    (P(), (4,), P("data")),                      # replicated -> sharded on 4
    (P("data"), (2, 2), P("model", "data")),     # other axes, other dims
    (P(None, "data"), (1,), P()),                # onto a single device
    (P(("data",)), (2, 2), P(("data", "model"))),
])
def test_resharding_between_slices(slices, src_spec, dst_shape, dst_spec):
    a = slices((2,), island=0)
    axes = ("data",) if len(dst_shape) == 1 else ("data", "model")
    b = slices(dst_shape, axis_names=axes, island=1)
    x = torch.arange(64.).reshape(8, 8)
    y = pw.put(x, a, src_spec).to(b, dst_spec)
    assert y.sharding == dst_spec and y.slice is b
    assert torch.equal(y.torch(), x)
    assert torch.equal(affine(y).torch(), x * 2 + 1)      # usable by a program there


def _transfer_paths(trace, src, dst) -> set:
    """How the bytes of the client's transfers from slice ``src`` to ``dst`` went, as the
    sending and receiving executors recorded them: {"shared memory"} or {"socket"}."""
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    tids = {e["args"]["transfer_id"] for e in events
            if e["cat"] == "dispatch" and e["name"] == "transfer"
            and e["args"].get("detail") == f"{src.id} -> {dst.id}"}
    assert tids, "the profile holds no such transfer"
    ends = [e for e in events if e["cat"] == "transfer" and e["name"] in ("send", "recv")
            and e["args"].get("transfer_id") in tids]
    assert sorted(e["name"] for e in ends) == sorted(["recv", "send"] * len(tids)), ends
    return {e["args"]["detail"] for e in ends}


def test_same_host_moves_skip_the_network(slices):
    s1, s2, s3 = slices((1,), island=0), slices((1,), island=0), slices((1,), island=0)
    src, dst = (s1, s3) if (s1.host == s3.host) else (s1, s2)
    assert (src.island, src.host) == (dst.island, dst.host)
    far = slices((1,), island=1)                          # another host: the control
    x = torch.randn(1000, 100)
    y = affine(pw.put(x, src)).wait()
    # The bytes counters (Slice.stats().bytes_sent / bytes_received) count a same-host
    # move too (its bytes go through /dev/shm, still "sent"), so they cannot tell the
    # paths apart: the executors' own record of each transfer's path does.
    with pw.profile() as prof:
        near, away = y.to(dst), y.to(far)
        pw.wait([near, away])
    trace = prof.trace()
    assert _transfer_paths(trace, src, dst) == {"shared memory"}    # never on a socket
    assert _transfer_paths(trace, src, far) == {"socket"}           # the network path
    torch.testing.assert_close(near.torch(), x * 2 + 1)
    torch.testing.assert_close(away.torch(), x * 2 + 1)


def test_puts_and_moves_leave_the_scripts_random_numbers_alone(slices):
    """Transfer ids come from the OS, not from Python's global ``random``: the script's
    own draws are the ones it gets under plain torch, and a script that reseeds
    before each batch does not repeat ids (two transfers in flight under one id would
    take each other's bytes)."""
    a, b = slices((1,), island=0), slices((1,), island=1)
    big = torch.randn(512, 256)      # over PUT_MIN_BYTES: its bytes go on the data plane
    random.seed(0)
    expected = [random.random() for _ in range(2)]
    random.seed(0)
    first = random.random()
    moved = pw.put(big, a).to(b)
    assert [first, random.random()] == expected
    torch.testing.assert_close(moved.torch(), big, rtol=0, atol=0)
    moves = []
    for k in range(4):
        random.seed(0)              # as a script seeding its augmentations each batch
        moves.append(pw.put(big + k, a).to(b))
    for k, m in enumerate(moves):
        torch.testing.assert_close(m.torch(), big + k, rtol=0, atol=0)


def test_program_inputs_from_other_slices_move_to_its_slice(slices):
    a, b = slices((2,), island=0), slices((2,), island=1)
    x, w = torch.randn(4, 3), torch.randn(3, 5)

    @pw.program
    def mm(x, w):
        return x @ w

    y = mm(pw.put(x, b, P("data")), pw.put(w, a))         # runs on b, w moves a -> b
    assert y.slice is b
    torch.testing.assert_close(y.torch(), x @ w, rtol=1e-5, atol=1e-6)


def test_errors_flow_along_the_dataflow_through_three_hops(slices):
    a, b, c, d = (slices((1,), island=i % 2) for i in range(4))

    @pw.program(out_specs=P())
    def explode(x):
        # 1 TiB cannot be allocated: the execution fails, and so do both its outputs
        return torch.ones(2 ** 38, device=x.device) * x.sum(), x * 3

    @pw.program
    def head(x):
        return x[:4] + 1

    huge, bad = explode(pw.put(torch.ones(8), a))
    y = head(head(head(bad).to(b)).to(c)).to(d)                # three hops after a
    for arr in (y, head(y)):
        with pytest.raises(pw.ProgramError, match="explode") as info:
            arr.torch()
        assert info.value.program == "explode"
    for what in ([y], y, {"out": (head(y), [y])}):     # one Array or any nesting of them
        with pytest.raises(pw.ProgramError, match="explode"):
            pw.wait(what)
    with pytest.raises(TypeError, match="pw.wait takes pw.Arrays"):
        pw.wait([pw.put(torch.ones(2), a), torch.ones(2)])
    # the cluster stays usable, on the same slices
    torch.testing.assert_close(head(pw.put(torch.ones(6), a).to(d)).torch(), torch.full((4,), 2.0))


def test_sequential_dispatch_gives_the_same_results(slices):
    a, b = slices((2,), island=0), slices((2,), island=1)
    x = torch.randn(6, 4)
    with pw.dispatch_mode("sequential"):
        y = affine(affine(pw.put(x, a)).to(b))
    torch.testing.assert_close(y.torch(), (x * 2 + 1) * 2 + 1)
    with pytest.raises(ValueError):
        pw.dispatch_mode("eager").__enter__()


def test_parallel_dispatch_returns_before_the_first_program_completes(slices):
    """Structural, no clock: the chain's first program waits for bytes from a "gate"
    slice whose executor the test has stopped (SIGSTOP), so no program of the chain can
    run until the test lets it. Dispatching all 100 programs must return meanwhile, with
    none of them executed; the chain then runs to torch's result. How much sooner
    dispatch returns is bench/fig7_parallel_dispatch.py's measurement (parallel vs
    sequential dispatch); in sequential mode this dispatch would block on the gate."""
    a, b = slices((1,), island=0), slices((1,), island=1)
    gate = slices((1,), island=0)
    torch.manual_seed(1)
    w = torch.linalg.qr(torch.randn(64, 64))[0]    # orthogonal: 420 rounds of tanh stay tame
    x = torch.randn(64, 64)

    @pw.program
    def heavy(h, w, rounds):                     # rounds: static, so each is its own program
        for _ in range(rounds):
            h = torch.tanh(h @ w)
        return h

    wa, wb = pw.put(w, a), pw.put(w, b)
    xg = pw.put(x, gate).wait()                  # on the gate slice, before it is shut
    for r in (4, 24):                            # trace + compile before the gate shuts
        heavy(xg.to(a), wa, r).wait(), heavy(xg.to(b), wb, r).wait()
    ran = a.stats().executed, b.stats().executed
    gate_pid = gate.stats().pid
    chain, done = [], threading.Event()

    def dispatch():
        h = heavy(xg.to(a), wa, 24)              # the first program: its input is gated
        for k in range(99):
            h = heavy(h, wa, 4) if k % 2 == 0 else heavy(h.to(b), wb, 4).to(a)
        chain.append(h)
        done.set()

    os.kill(gate_pid, signal.SIGSTOP)
    try:
        t = threading.Thread(target=dispatch, name="dispatch", daemon=True)
        t.start()
        # Short: a stopped process answers no keepalive ping, and its peers give up on
        # it after about 2 s. Dispatching 100 programs takes milliseconds.
        returned = done.wait(1.5)
        executed = a.stats(sync=False).executed, b.stats(sync=False).executed
    finally:
        os.kill(gate_pid, signal.SIGCONT)
    assert returned, "dispatch did not return while the chain's first input was held"
    assert executed == ran, f"programs ran with their first input held: {ran} -> {executed}"
    t.join(60)
    (h,) = chain
    want = x
    for _ in range(24 + 4 * 99):
        want = torch.tanh(want @ w)
    torch.testing.assert_close(h.torch(), want, rtol=1e-4, atol=1e-5)
    assert (a.stats().executed - ran[0], b.stats().executed - ran[1]) == (51, 49)


def test_gang_order_is_the_same_on_every_host_of_an_island(slices):
    s0, s1 = slices((2,), island=0), slices((2,), island=0)
    assert s0.host != s1.host
    x0, x1 = pw.put(torch.ones(4), s0), pw.put(torch.ones(4), s1)
    before0, before1 = len(s0.stats().gang_positions), len(s1.stats().gang_positions)
    errors = []

    def client_thread():
        try:
            for _ in range(100):
                with pw.graph():                 # one program spanning both hosts
                    affine(x0)
                    affine(x1)
        except Exception as e:                   # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=client_thread) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    pw.wait([affine(x0), affine(x1)])
    order0 = s0.stats().gang_positions[before0:]
    order1 = s1.stats().gang_positions[before1:]
    assert len(order0) == 200 and order0 == order1
    assert order0 == sorted(order0)


def test_recorded_graph_is_one_unit_per_worker(slices):
    a, b, c = slices((2,), island=0), slices((2,), island=1), slices((2,), island=0)
    x = torch.randn(8, 4)
    gangs = [len(s.stats().gang_positions) for s in (a, b, c)]
    with pw.graph() as g:
        h = pw.put(x, a, P("data"))
        for _ in range(10):
            h = affine(h)
        h = colsum(h.to(b))
        for _ in range(10):
            h = affine(h)
        out = affine(h.to(c))
        with pytest.raises(pw.PathwaysError, match="not been submitted"):
            out.torch()
    want = x
    for _ in range(10):
        want = want * 2 + 1
    want = want.sum(0)
    for _ in range(11):
        want = want * 2 + 1
    torch.testing.assert_close(out.torch(), want, rtol=1e-5, atol=1e-3)
    assert [len(s.stats().gang_positions) for s in (a, b, c)] == [n + 1 for n in gangs]
    assert set(g.positions) == {a.id, b.id, c.id}
    with pytest.raises(pw.PathwaysError, match="nest"):
        with pw.graph():
            with pw.graph():
                pass


def test_arrays_dropped_inside_a_graph_are_released_after_it(slices):
    a = slices((1,), island=1)
    start = a.stats().num_buffers
    with pw.graph():
        for _ in range(20):
            affine(pw.put(torch.ones(3), a))     # dropped before the graph is submitted
    deadline = time.monotonic() + 10
    while a.stats().num_buffers != start and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.stats().num_buffers == start


def test_an_array_of_a_graph_block_that_raised_says_it_will_never_come(slices):
    """A block that raised submits nothing; its Arrays said to leave the block, which
    was already left."""
    a = slices((1,), island=1)
    with pytest.raises(KeyError):
        with pw.graph():
            y = affine(pw.put(torch.ones(3), a))
            raise KeyError("bad batch")
    with pytest.raises(pw.PathwaysError, match=r"block that raised KeyError.*never will "
                                               r"be: run the block again"):
        y.torch()
    assert torch.equal(affine(pw.put(torch.ones(3), a)).torch(), torch.full((3,), 3.0))


def test_graphs_that_feed_each_other(slices):
    a = slices((2,), island=0)
    y = pw.put(torch.zeros(4), a)
    for _ in range(5):                   # each graph reads the previous one's output and
        with pw.graph():                 # drops it while the graph is still recorded
            for _ in range(8):
                y = affine(y)
    want = torch.zeros(4)
    for _ in range(40):
        want = want * 2 + 1
    torch.testing.assert_close(y.torch(), want)


def test_after_a_wait_over_several_slices_completion_arrives_unasked(slices):
    """Once a pw.wait over several slices has used their streams, each batch of work
    sent to them ends with a watermark request: their executors say when the work is
    done before anyone waits, so the next wait reads local state (no round trip).
    Values, and the order of later ops (their sequence numbers), stay exact."""
    a, b = slices((2,), island=0), slices((2,), island=1)
    pw.wait([pw.put(torch.zeros(2), a), pw.put(torch.zeros(2), b)])
    assert a._conn.watching and b._conn.watching
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    for step in range(3):
        ya, yb = affine(pw.put(xs[0], a)), affine(pw.put(xs[1], b, P("data", None)))
        deadline = time.monotonic() + 30
        while not all(y._conn.known([y._id], y._seq) for y in (ya, yb)):
            assert time.monotonic() < deadline, "no watermark arrived without a wait"
            time.sleep(0.01)
        pw.wait([ya, yb])
        torch.testing.assert_close(ya.torch(), xs[0] * 2 + 1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(yb.torch(), xs[1] * 2 + 1, rtol=1e-5, atol=1e-6)
    # a single-slice wait and a transfer after the unasked watermarks
    moved = affine(ya.to(b))
    moved.wait()
    torch.testing.assert_close(moved.torch(), (xs[0] * 2 + 1) * 2 + 1, rtol=1e-5, atol=1e-5)


def test_shm_files_of_a_writer_killed_mid_transfer_are_removed_by_the_next_agent():
    import subprocess
    from pathways_torch.worker import dataplane
    if dataplane.SHM_DIR is None:
        pytest.skip("no /dev/shm on this machine")
    dead = subprocess.Popen(["true"])
    dead.wait()                                      # a pid no process has now
    tag = os.urandom(4).hex()
    paths = {k: os.path.join(dataplane.SHM_DIR, f"pw-{pid}-1-{tag}{k}")
             for k, pid in (("orphan", dead.pid), ("fresh", dead.pid),
                            ("alive", os.getpid()))}
    for p in paths.values():
        with open(p, "wb") as f:
            f.write(b"x" * 8)
    old = time.time() - 120
    os.utime(paths["orphan"], (old, old))
    os.utime(paths["alive"], (old, old))
    try:
        assert dataplane.remove_orphan_shm(older_than_s=60.0) >= 1
        assert not os.path.exists(paths["orphan"])
        assert os.path.exists(paths["fresh"])        # its reader may be about to map it
        assert os.path.exists(paths["alive"])        # its writer still runs
    finally:
        for p in paths.values():
            if os.path.exists(p):
                os.unlink(p)
