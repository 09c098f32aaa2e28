"""Unit tests of the resource manager's slice placement (pure logic)."""

import pytest

from pathways_torch.coordinator.resources import AllocationError, ResourceManager


def make(islands=2, hosts=2, devices=4):
    rm = ResourceManager()
    for i in range(islands):
        for h in range(hosts):
            rm.add_host(i, h, devices, "CPU", f"127.0.0.1:{1000 + 10 * i + h}", 1)
    return rm


def test_one_to_one_and_release():
    rm = make(1, 1, 8)
    a = rm.reserve("c1", (4, 2), ("d", "m"), None)
    assert len(a.devices) == 8 and len(set(a.devices)) == 8
    with pytest.raises(AllocationError, match="free now: island 0 host 0: 0 of 8"):
        rm.reserve("c1", (1,), ("d",), None)
    rm.release(a.slice_id)
    b = rm.reserve("c1", (2,), ("d",), None)
    assert len(b.devices) == 2


def test_least_loaded_spreads_over_hosts_and_islands():
    rm = make()
    placed = {(s.island, s.host) for s in (rm.reserve("c", (2,), ("d",), None)
                                           for _ in range(4))}
    assert len(placed) == 4


def test_island_choice_and_errors():
    rm = make()
    s = rm.reserve("c", (4,), ("d",), 1)
    assert s.island == 1
    with pytest.raises(AllocationError, match="at most 4"):
        rm.reserve("c", (8,), ("d",), None)
    with pytest.raises(AllocationError, match="island 7 does not exist"):
        rm.reserve("c", (1,), ("d",), 7)
    with pytest.raises(AllocationError, match="must be positive"):
        rm.reserve("c", (0,), ("d",), None)


def test_duplicate_host_is_rejected():
    rm = make(1, 1, 2)
    with pytest.raises(AllocationError, match="already registered"):
        rm.add_host(0, 0, 2, "CPU", "x", 1)


def test_slices_of_client_and_table():
    rm = make(1, 1, 4)
    rm.reserve("a", (2,), ("d",), None)
    rm.reserve("b", (1,), ("d",), None)
    assert len(rm.slices_of("a")) == 1
    states = [r["state"] for r in rm.device_table()]
    assert states.count("in_use") == 3 and states.count("free") == 1


def test_shared_devices_fill_free_ones_first_then_the_least_used():
    rm = ResourceManager(per_device=2)
    rm.add_host(0, 0, 4, "cpu", "a", 1)
    a = rm.reserve("c1", [2], ["x"], None)
    b = rm.reserve("c2", [2], ["x"], None)
    assert set(a.devices) & set(b.devices) == set()        # free devices first
    c = rm.reserve("c3", [2], ["x"], None)                  # now devices are shared
    assert c.devices == (0, 1)
    with pytest.raises(AllocationError, match="shared by up to 2"):
        rm.reserve("c4", [3], ["x"], None)                  # only 2 devices have room
    d = rm.reserve("c4", [2], ["x"], None)
    assert d.devices == (2, 3)
    assert all(len(r["slice_id"].split(",")) == 2 for r in rm.device_table())
    rm.release(c.slice_id)
    assert rm.reserve("c5", [2], ["x"], None).devices == (0, 1)


def test_a_lost_host_drops_its_slices_and_a_replacement_takes_its_place():
    rm = ResourceManager()
    h = rm.add_host(0, 0, 2, "cpu", "a", 1)
    rec = rm.reserve("c1", [2], ["x"], None)
    with pytest.raises(AllocationError, match="already registered"):
        rm.add_host(0, 0, 2, "cpu", "b", 2)
    assert [r.slice_id for r in rm.mark_lost(h.worker_id)] == [rec.slice_id]
    assert [r["state"] for r in rm.device_table()] == ["lost", "lost"]
    with pytest.raises(AllocationError):
        rm.reserve("c1", [1], ["x"], None)
    rm.add_host(0, 0, 2, "cpu", "b", 2)
    assert [r["state"] for r in rm.device_table()] == ["free", "free"]
    assert rm.reserve("c1", [2], ["x"], None).devices == (0, 1)
