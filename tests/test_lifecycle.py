"""Start-up, release of buffers, shutdown and its guarantees, with real processes."""

import os
import time

import pytest
import torch

import pathways_torch as pw

from procs import alive, descendants


def test_api_before_init():
    assert not pw.is_initialized()
    for call in (pw.devices, lambda: pw.slice((1,))):
        with pytest.raises(pw.NotInitializedError, match=r"pw.init\(\)"):
            call()

    @pw.program
    def f(x):
        return x

    with pytest.raises(pw.NotInitializedError):
        f(torch.ones(1))


def test_devices_release_shutdown_and_no_orphans():
    pw.init(devices_per_host=4, timeout=120)
    try:
        devs = pw.devices()
        assert [(d.island, d.host, d.index) for d in devs] == [(0, 0, i) for i in range(4)]
        assert {d.kind for d in devs} == {os.environ.get("PJRT_DEVICE", "CPU")}

        s = pw.slice((2,))
        assert sum(d.state == "in_use" for d in pw.devices()) == 2
        start = s.stats().num_buffers

        @pw.program
        def inc(x):
            return x + 1

        # 1,000 Arrays created and dropped: the worker's buffer count comes back.
        x = pw.put(torch.zeros(4, 4), s)
        for _ in range(500):
            y = inc(x)
            z = pw.put(torch.ones(2), s)
            del y, z
        pw.wait([x])
        deadline = time.monotonic() + 10
        while s.stats().num_buffers != start + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.stats().num_buffers == start + 1      # only x is left
        del x
        deadline = time.monotonic() + 10
        while s.stats().num_buffers != start and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.stats().num_buffers == start

        # Releasing a slice frees its devices and kills its Arrays.
        a = pw.put(torch.ones(2), s)
        s.release()
        assert all(d.state == "free" for d in pw.devices())
        with pytest.raises(pw.ClusterShutdownError, match="released"):
            a.torch()

        s2 = pw.slice((4,))
        b = inc(pw.put(torch.ones(4), s2))
        b.wait()
        procs = descendants(os.getpid())
        assert len(procs) >= 4      # coordinator, worker agent, zygote, executor
    finally:
        pw.shutdown()
    assert not pw.is_initialized()
    left = [p for p in procs if alive(p)]
    assert left == [], f"processes outlived pw.shutdown(): {left}"
    with pytest.raises(pw.ClusterShutdownError):
        b.torch()
    with pytest.raises(pw.NotInitializedError):
        pw.slice((1,))


def test_init_twice_and_again_after_shutdown():
    pw.init(devices_per_host=1, timeout=120)
    try:
        with pytest.raises(pw.PathwaysError, match="already"):
            pw.init()
        s = pw.slice((1,))
        assert pw.put(torch.arange(3.), s).torch().tolist() == [0., 1., 2.]
    finally:
        pw.shutdown()
    pw.shutdown()                                    # idempotent


_HOLDS_SEMAPHORES = """
import multiprocessing, sys, time
q = multiprocessing.get_context("forkserver").Queue()   # named semaphores, a tracker
print(" ".join(s._semlock.name for s in (q._rlock, q._wlock, q._sem)), flush=True)
time.sleep(60)
"""


def test_killing_a_worker_group_leaves_no_named_semaphores():
    """A DataLoader's queues under a fork server hold named semaphores that only
    multiprocessing's resource tracker unlinks, after the processes using them died;
    killing the tracker with the worker's group left ~11 /dev/shm files per loader."""
    import subprocess
    import sys

    from pathways_torch._proc import kill_group

    p = subprocess.Popen([sys.executable, "-c", _HOLDS_SEMAPHORES], start_new_session=True,
                         stdout=subprocess.PIPE, text=True)
    try:
        files = ["/dev/shm/sem." + n.lstrip("/") for n in p.stdout.readline().split()]
        assert len(files) == 3 and all(os.path.exists(f) for f in files), files
        kill_group(p.pid)
        p.wait(10)
        deadline = time.monotonic() + 10
        while any(map(os.path.exists, files)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(os.path.exists, files)), files
        while time.monotonic() < deadline:          # the tracker exits by itself
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("a process of the killed group is still running")
    finally:
        try:
            os.killpg(p.pid, 9)
        except ProcessLookupError:
            pass
        p.stdout.close()
