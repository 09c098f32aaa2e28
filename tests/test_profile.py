"""pw.profile(): spans from the client, the coordinator, every worker agent and every
executor, their clocks mapped onto the client's, written as a Chrome / Perfetto trace.

One module cluster: 2 islands x 1 host x 3 CPU devices. Its processes run with
PATHWAYS_CLOCK_SKEW_S=5, so their trace clocks are 5 s ahead of the client's, as on
another machine: a span that was not corrected lands 5 s off. All processes share the
machine's monotonic clock, so the true offset is exactly 5 s and every estimate must be
within its own error bound (half the best round trip) of it.
"""

import json
import os
import random
import re

import pytest
import torch

import pathways_torch as pw
from pathways_torch import P, tracing
from pathways_torch.client.profile import busy_time

SKEW_S = 5


@pytest.fixture(scope="module")
def cluster():
    os.environ[tracing.SKEW_ENV] = str(SKEW_S)
    try:
        pw.init(islands=2, devices_per_host=3, timeout=120)
    finally:
        os.environ.pop(tracing.SKEW_ENV, None)
    try:
        yield
    finally:
        pw.shutdown()


@pw.program
def affine(x):
    return x * 2 + 1


@pw.program
def colsum(x):
    return x.sum(0)


# ---------------------------------------------------------------------- pure logic
def test_clock_offset_arithmetic():
    rng = random.Random(0)
    skew = 5_000_000_000                      # remote = local + skew
    samples = []
    t = 1_000_000
    for _ in range(20):
        up, work, down = rng.randint(50, 5000), rng.randint(0, 300), rng.randint(50, 5000)
        t1 = t
        t2 = t1 + up + skew
        t3 = t2 + work
        t4 = t1 + up + work + down
        samples.append(tracing.ClockSample(t1, t2, t3, t4))
        t = t4 + 10_000
    for s in samples:
        assert s.delay == (s.t4 - s.t1) - (s.t3 - s.t2) >= 0
        assert abs(s.offset - skew) <= s.delay / 2
    best = tracing.best_sample(samples)
    assert best.delay == min(s.delay for s in samples)
    clock = tracing.ClockMap(samples)
    assert abs(clock.to_local(10**10) - (10**10 - skew)) <= clock.error_ns

    # Two groups (profile start and stop) with a drifting clock: interpolated in between.
    a = tracing.ClockSample(0, 100 + 1000, 100 + 1000, 200)          # offset 1000 at 1100
    b = tracing.ClockSample(10**9, 10**9 + 100 + 3000, 10**9 + 100 + 3000, 10**9 + 200)
    drift = tracing.ClockMap([a], [b])
    assert drift.offset_at(1100) == 1000 and drift.offset_at(10**9 + 3100) == 3000
    mid = (1100 + 10**9 + 3100) / 2
    assert drift.offset_at(mid) == pytest.approx(2000)
    assert drift.offset_at(-5) == 1000 and drift.offset_at(10**12) == 3000
    assert tracing.ClockMap.identity().to_local(123) == 123
    with pytest.raises(ValueError):
        tracing.ClockMap([])


def test_busy_time_is_the_clipped_union():
    assert busy_time([], 0, 1) == 0
    assert busy_time([(0.1, 0.3), (0.2, 0.4), (0.5, 0.6)], 0, 1) == pytest.approx(0.4)
    assert busy_time([(-1, 0.5), (0.9, 2)], 0, 1) == pytest.approx(0.6)
    assert busy_time([(0.2, 0.2), (0.4, 0.3)], 0, 1) == 0


def test_recorder_records_only_inside_sessions():
    rec = tracing.Recorder()
    rec.add("execute", "f", rec.now())
    assert not rec.on and rec._events == []
    s1 = rec.start()
    rec.add("execute", "a", rec.now())
    s2 = rec.start()
    rec.add("execute", "b", rec.now())
    spans2, _ = rec.stop(s2)
    assert [s.name for s in spans2] == ["b"] and rec.on
    spans1, _ = rec.stop(s1)
    assert [s.name for s in spans1] == ["a", "b"]
    assert not rec.on and rec._events == []
    assert rec.stop(s1) == ([], 0)


# ---------------------------------------------------------------------- real cluster
def _x_events(trace, pid=None, cat=None):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and
            (pid is None or e["pid"] == pid) and (cat is None or e["cat"] == cat)]


def test_profile_trace_has_every_process(cluster, tmp_path):
    a = pw.slice((2,), island=0)
    b = pw.slice((2,), island=1)
    x = pw.put(torch.randn(64, 32), a, P("data"))
    warm = affine(x)
    colsum(warm.to(b, P())).torch()              # compile outside the profile
    warm_ids = {warm._id}

    with pw.profile() as prof:
        y = affine(x)
        y = affine(y)
        z = colsum(y.to(b, P()))                 # island 0 -> island 1, worker to worker
        with pw.graph():
            g1 = affine(x)
            g2 = affine(g1)
        # a slice made and released inside the block, on each island (agents start
        # executors; the coordinator allocates; the executors are profiled while alive)
        for island in (0, 1):
            with pw.slice((1,), island=island) as c:
                w = affine(pw.put(torch.ones(8, 4), c))
                assert torch.equal(w.torch(), torch.full((8, 4), 3.0))
        got = z.torch()
        g2.wait()
    torch.testing.assert_close(got, (x.torch() * 4 + 3).sum(0), rtol=1e-5, atol=1e-4)
    assert prof.problems == []

    path = prof.export(str(tmp_path / "trace.json"))
    with open(path) as f:
        trace = json.load(f)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    kinds = {pid: re.sub(r" \(pid \d+\)$", "", n) for pid, n in names.items()}
    expected = {"client", "coordinator", "worker island 0 host 0", "worker island 1 host 0",
                f"executor island 0 host 0 slice {a.id}",
                f"executor island 1 host 0 slice {b.id}"}
    assert expected <= set(kinds.values())
    executors = [pid for pid, k in kinds.items() if k.startswith("executor")]
    assert len(executors) == 4                   # a, b and the two made inside
    # every process contributed spans, and they are distinct OS processes
    for pid in names:
        assert _x_events(trace, pid), f"no events from {names[pid]}"
    os_pids = [int(re.search(r"pid (\d+)\)$", n).group(1)) for n in names.values()]
    assert len(set(os_pids)) == len(names) == 8
    pid_of = {k: pid for pid, k in kinds.items()}
    pa = pid_of[f"executor island 0 host 0 slice {a.id}"]
    pb_ = pid_of[f"executor island 1 host 0 slice {b.id}"]

    # executions carry their program's name; the coordinator and agents their RPCs
    assert {e["args"]["program"] for e in _x_events(trace, pa, "execute")} == {"affine"}
    assert {e["args"]["program"] for e in _x_events(trace, pb_, "execute")} == {"colsum"}
    assert len(_x_events(trace, pa, "execute")) == 4
    assert _x_events(trace, pa, "gang")
    coord = {e["name"] for e in _x_events(trace, pid_of["coordinator"])}
    assert {"AllocateSlice", "ReleaseSlice", "Schedule"} <= coord
    for island in (0, 1):
        agent = _x_events(trace, pid_of[f"worker island {island} host 0"])
        assert {"StartExecutor", "StopExecutor"} <= {e["name"] for e in agent}
    assert any(e["ph"] == "b" and e["cat"] == "queue" and e["pid"] == pa
               for e in trace["traceEvents"])

    # the transfer: dispatched by the client, sent by a, received and taken in by b
    (xfer,) = [e for e in _x_events(trace, 1, "dispatch") if e["name"] == "transfer"]
    tid = xfer["args"]["transfer_id"]
    nbytes = 64 * 32 * 4
    send = [e for e in _x_events(trace, pa, "transfer") if e["name"] == "send"]
    assert [(e["args"]["transfer_id"], e["args"]["bytes"]) for e in send] == [(tid, nbytes)]
    recv = {e["name"]: e for e in _x_events(trace, pb_, "transfer")
            if e["args"].get("transfer_id") == tid}
    assert set(recv) == {"recv", "recv to device"} and recv["recv"]["args"]["bytes"] == nbytes

    # Clocks: each process's offset is the injected skew, within its own error bound;
    # corrected spans then lie in the window and after their cause.
    err_ms = {p.pid: p.clock_error_ns / 1e6 + 1.0 for p in prof.processes}
    for p in prof.processes[1:]:
        assert abs(p.clock_offset_ns - SKEW_S * 1e9) <= p.clock_error_ns + 1e3, p
    wall_ms = prof.wall_s * 1e3
    for e in _x_events(trace):
        if e["cat"] in ("execute", "dispatch", "gang"):
            tol = err_ms[e["pid"]]
            assert -tol <= e["ts"] / 1e3 and (e["ts"] + e["dur"]) / 1e3 <= wall_ms + tol, e
    ex = sorted(_x_events(trace, pa, "execute"), key=lambda e: e["ts"])
    for prev, nxt in zip(ex, ex[1:]):          # one execution thread: in order, no overlap
        assert nxt["ts"] >= prev["ts"] + prev["dur"] - 1
    outs = [e["args"]["buffer_ids"][0] for e in ex]
    assert outs == sorted(outs)                 # in the order the client dispatched them
    dispatch = {e["args"]["buffer_ids"][0]: e for e in _x_events(trace, 1, "dispatch")
                if e["args"].get("detail") == a.id and e["args"].get("program")}
    for e in ex:
        d = dispatch[e["args"]["buffer_ids"][0]]
        assert e["ts"] >= d["ts"] - err_ms[pa] * 1e3, (d, e)
    assert not warm_ids & set(outs)             # work from before the block is not in it

    util = prof.utilization()
    assert len(util) == 6                       # every device of the cluster
    for s in (a, b):
        for d in s.devices:
            v = util[f"island {d.island} host {d.host} device {d.index}"]
            assert 0 < v <= 1
    png = tmp_path / "util.png"
    prof.plot(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    a.release()
    b.release()


def test_profiling_off_records_nothing(cluster):
    s = pw.slice((1,), island=0)
    try:
        x = pw.put(torch.ones(4), s)
        affine(affine(x)).torch()
        assert not tracing.CLIENT.on and tracing.CLIENT._events == []
        with pytest.raises(pw.PathwaysError, match="do not nest"):
            with pw.profile():
                with pw.profile():
                    pass
        with pw.profile() as prof:
            pass
        assert not [e for e in prof.events if e.cat in ("execute", "dispatch")]
        affine(x).torch()
        assert not tracing.CLIENT.on and tracing.CLIENT._events == []
    finally:
        s.release()
