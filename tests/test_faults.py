"""Faults with real processes and real signals: a worker killed with SIGKILL."""

import os
import signal
import time

import pytest
import torch

import pathways_torch as pw
from pathways_torch.client import runtime


@pytest.fixture()
def two_islands(monkeypatch):
    # a killed worker stays lost here (tests/test_elastic.py has the restarts)
    monkeypatch.setenv("PATHWAYS_RESTART_WORKERS", "0")
    pw.init(islands=2, devices_per_host=2, timeout=60)
    try:
        yield runtime._state.cluster
    finally:
        pw.shutdown()


def worker_pid(cluster, island):
    for p in cluster.procs:
        if "pathways_torch.worker" in p.args and p.args[p.args.index("--island") + 1] == \
                str(island):
            return p.pid
    raise AssertionError("no such worker")


def test_a_killed_worker_fails_its_arrays_fast_and_the_other_island_goes_on(two_islands):
    a = pw.slice((2,), island=0)
    b = pw.slice((2,), island=1)

    @pw.program
    def double(x):
        return x * 2

    xa = double(pw.put(torch.ones(4), a))
    xb = double(pw.put(torch.ones(4), b))
    assert xa.torch().tolist() == [2.0] * 4
    os.kill(worker_pid(two_islands, 0), signal.SIGKILL)
    t_kill = time.monotonic()
    # Detection timed from the kill itself: its executors die with it (parent-death
    # signals), and the next blocking call raises. Calls that still got an answer in the
    # moment before the executors were gone are retried, as a user's would be. The bound
    # is generous for a loaded 2-core machine; the README's figure (0.08 s) is measured
    # by bench/faults.py (worker_lost_s), the same loop.
    while True:
        try:
            double(xa).torch()
        except pw.WorkerLostError as e:
            lost = e
            break
        assert time.monotonic() - t_kill < 5.0, "no WorkerLostError within 5 s of SIGKILL"
        time.sleep(0.01)
    detected = time.monotonic() - t_kill
    assert "island 0 host 0" in str(lost), lost
    assert detected < 5.0, f"the loss was noticed {detected:.2f} s after SIGKILL"
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        states = {(d.island, d.state) for d in pw.devices()}
        if (0, "lost") in states:
            break
        time.sleep(0.1)
    assert {d.state for d in pw.devices() if d.island == 0} == {"lost"}
    with pytest.raises(pw.ResourceExhaustedError, match="island 0 is lost"):
        pw.slice((2,), island=0)                  # lost devices are not handed out
    assert double(xb).torch().tolist() == [4.0] * 4   # island 1 is untouched


@pw.program
def slow(x):
    """Seconds of work: 40 dependent 1024x1024 matmuls (a contraction, so stable)."""
    for _ in range(40):
        x = torch.tanh(x @ x) * 0.5 + 0.01
    return x


def test_a_transfer_from_a_killed_worker_fails_fast_naming_the_sender(two_islands):
    a = pw.slice((2,), island=0)
    b = pw.slice((2,), island=1)
    x = pw.put(torch.randn(1024, 1024) / 32, b)
    y = slow(x).to(a)             # island 0 waits for island 1's bytes
    os.kill(worker_pid(two_islands, 1), signal.SIGKILL)      # ... which never come
    t0 = time.monotonic()
    with pytest.raises(pw.WorkerLostError, match="from island 1 host 0 cannot arrive"):
        y.torch()
    assert time.monotonic() - t0 < 5.0
    assert pw.put(torch.ones(2), a).torch().tolist() == [1.0, 1.0]   # island 0 goes on


def test_every_blocking_call_has_a_settable_deadline(two_islands):
    s = pw.slice((2,), island=0)
    x = pw.put(torch.randn(1024, 1024) / 32, s)
    y = slow(slow(x))
    t0 = time.monotonic()
    with pytest.raises(pw.TimeoutError, match="timeout="):
        y.torch(timeout=0.2)
    with pytest.raises(pw.TimeoutError):
        pw.wait([y], timeout=0.2)
    assert time.monotonic() - t0 < 5.0
    ref = x.torch()
    for _ in range(80):
        ref = torch.tanh(ref @ ref) * 0.5 + 0.01
    torch.testing.assert_close(y.torch(), ref, rtol=1e-4, atol=1e-5)   # still computed
