"""Memory budgets: back-pressure instead of failure, and clear errors for what can never fit.

One embedded cluster with a small budget (128 MiB for 4 devices: 32 MiB per device), so
nothing here can make the kernel's OOM killer act.
"""

import gc
import os
import threading
import time

import pytest
import torch

import pathways_torch as pw
from pathways_torch import P

MIB = 1 << 20
BUDGET = 32 * MIB          # per device


@pytest.fixture(scope="module")
def s():
    old = os.environ.get("PATHWAYS_BACKPRESSURE_TIMEOUT")
    os.environ["PATHWAYS_BACKPRESSURE_TIMEOUT"] = "4"     # inherited by the workers
    pw.init(devices_per_host=4, memory_budget="128M", timeout=120)
    try:
        yield pw.slice((1,))
    finally:
        pw.shutdown()
        if old is None:
            os.environ.pop("PATHWAYS_BACKPRESSURE_TIMEOUT")
        else:
            os.environ["PATHWAYS_BACKPRESSURE_TIMEOUT"] = old


@pw.program
def scale(x, k: float):
    return x * k


def test_the_slice_reports_its_share_of_the_budget(s):
    assert s.memory_budget == BUDGET
    assert s.stats().memory_budget == BUDGET


def test_a_put_larger_than_the_budget_fails_at_once_saying_what_is_free(s):
    t0 = time.monotonic()
    with pytest.raises(pw.OutOfMemoryError, match=r"asks 36\.0 MiB per device.*budget of "
                       r"32\.0 MiB.*32\.0 MiB free now"):
        pw.put(torch.zeros(9 * MIB // 4 * 4), s)
    assert time.monotonic() - t0 < 5          # refused in the client, nothing was sent
    # Sharded over two devices, the same tensor fits: 18 MiB per device.
    with pw.slice((2,)) as s2:
        x = pw.put(torch.ones(9 * MIB // 4 * 4), s2, P("data"))
        assert bool((x.torch() == 1.0).all())


def test_an_output_larger_than_the_budget_fails_with_how_much_was_asked(s):
    @pw.program
    def grow(x):
        return x.repeat(10)                   # 40 MiB from 4 MiB

    x = pw.put(torch.ones(MIB), s)
    with pytest.raises(pw.OutOfMemoryError, match=r"needs 40\.00 MiB per device.*"
                       r"32\.00 MiB per device"):
        grow(x).torch()
    assert scale(x, 3.0).torch()[0].item() == 3.0      # the executor is fine


def empty(s):
    """Collect Arrays kept alive by reference cycles (earlier tests' tracebacks)."""
    gc.collect()
    assert s.stats().device_bytes == 0


def test_outputs_that_do_not_fit_yet_wait_for_releases(s):
    empty(s)
    x = pw.put(torch.arange(2 * MIB, dtype=torch.float32), s)      # 8 MiB
    ys = [scale(x, float(k)) for k in (1, 2, 3)]                  # 32 MiB held: full
    waits = s.stats().backpressure_waits
    y4 = scale(x, 4.0)                     # needs 8 MiB more: waits for a release

    def drop_one():
        time.sleep(1.0)
        ys[0] = None                       # the release goes onto the stream behind y4

    threading.Thread(target=drop_one).start()
    want = torch.arange(2 * MIB, dtype=torch.float32) * 4
    assert torch.equal(y4.torch(), want)
    st = s.stats()
    assert st.backpressure_waits == waits + 1
    assert st.device_bytes <= BUDGET
    assert torch.equal(ys[2].torch(), want * 3 / 4)
    ys.clear()
    del y4, x
    assert s.stats().device_bytes == 0         # everything was freed


def test_waiting_past_the_deadline_fails_with_a_clear_error_and_loses_nothing(s):
    empty(s)
    x = pw.put(torch.ones(2 * MIB), s)                 # 8 MiB
    held = [scale(x, float(k)) for k in (1, 2, 3)]     # full, and never dropped
    y = scale(x, 5.0)
    with pytest.raises(pw.OutOfMemoryError, match=r"waited \d+ s for releases.*"
                       r"0\.00 MiB of the 32\.00 MiB per-device budget.*is free"):
        y.torch()
    assert [h.torch()[0].item() for h in held] == [1.0, 2.0, 3.0]   # nothing was lost
    del held, y
    assert scale(x, 6.0).torch()[0].item() == 6.0


def test_failures_reach_a_wait_over_several_slices(s):
    """pw.wait over several slices learns completion from the executors' watermarks:
    a failure from before the subscription (noted when it starts) and one after it
    both raise, and the slices stay usable. The failures: outputs that found no room
    within the back-pressure timeout (4 s here)."""
    empty(s)
    with pw.slice((1,)) as other:
        x = pw.put(torch.arange(2 * MIB, dtype=torch.float32), s)     # 8 MiB
        ys = [scale(x, float(k)) for k in (1, 2, 3)]                 # 32 MiB held: full
        early = scale(x, 9.0)                 # fails before any watermark exists
        ok = scale(pw.put(torch.ones(4), other), 2.0)
        pw.wait([ok, ys[0]])                  # subscribes both streams
        assert s._conn.watching and other._conn.watching
        with pytest.raises(pw.OutOfMemoryError):
            pw.wait([ok, early])
        late = scale(x, 8.0)
        with pytest.raises(pw.OutOfMemoryError):
            pw.wait([ys[1], late, ok])
        del ys, early, late
        y = scale(x, 4.0)
        pw.wait([ok, y])
        assert ok.torch().tolist() == [2.0] * 4
        assert y.torch()[1].item() == 4.0
