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
    with pytest.raises(AllocationError, match="no set of hosts that each give"):
        rm.reserve("c", (16,), ("d",), None)
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


def test_indexed_placement_equals_the_scan_it_replaced():
    """The free-device heaps pick what sorting every host picked (issue 12, part 2):
    most free devices, then least load, then lowest (island, host), over a random mix
    of hosts of several sizes, reservations, releases, losses and replacements."""
    import random
    rng = random.Random(0)
    rm = ResourceManager()
    for i in range(3):
        for h in range(12):
            rm.add_host(i, h, rng.choice((2, 4, 8)), "cpu", f"a{i}.{h}", 1)

    def by_scan(size, island):
        fits = [h for h in rm.hosts.values() if not h.lost and len(h.free()) >= size
                and (island is None or h.island == island)]
        if not fits:
            return None
        return min(fits, key=lambda h: (-len(h.free()), h.load(), h.island, h.host))

    live = []
    for step in range(3000):
        r = rng.random()
        if r < 0.55:
            size, island = rng.choice((1, 1, 2, 4, 8)), rng.choice((None, 0, 1, 2))
            want = by_scan(size, island)
            try:
                rec = rm.reserve("c", [size], ["d"], island)
            except AllocationError:
                assert want is None, step
                continue
            if rec.members:         # bigger than any live host: spans hosts
                assert want is None and size > max(
                    h.num_devices for h in rm.hosts.values() if not h.lost
                    and island in (None, h.island))
                live.append(rec.slice_id)
                continue
            assert want is not None and (rec.island, rec.host) == (want.island, want.host)
            live.append(rec.slice_id)
        elif r < 0.95 and live:
            rm.release(live.pop(rng.randrange(len(live))))
        else:
            h = rng.choice([h for h in rm.hosts.values()])
            if h.lost:
                rm.add_host(h.island, h.host, h.num_devices, "cpu", "again", 2)
            else:
                gone = {r.slice_id for r in rm.mark_lost(h.worker_id)}
                live = [s for s in live if s not in gone]
    assert sum(len(s) for s in rm._of_client.values()) == len(rm.slices) == len(live)


def test_big_clusters_get_a_summary_not_a_list_of_every_host():
    rm = ResourceManager()
    for h in range(100):
        rm.add_host(0, h, 2, "cpu", f"a{h}", 1)
    for _ in range(100):
        rm.reserve("c", [2], ["d"], None)
    with pytest.raises(AllocationError, match=r"free now: 100 hosts; 100 with 0 free"):
        rm.reserve("c", [1], ["d"], None)
    assert [r["host"] for r in rm.device_table(0)][:4] == [0, 0, 1, 1]
    assert rm.device_table(1) == []


def test_a_slice_bigger_than_a_host_spans_hosts_of_one_island_host_major():
    rm = make(islands=2, hosts=4, devices=2)
    s = rm.reserve("c", (4, 2), ("data", "model"), 1)
    assert [(h, d) for _, h, d in s.members] == [(0, (0, 1)), (1, (0, 1)), (2, (0, 1)),
                                                 (3, (0, 1))]
    assert s.island == 1 and (s.host, s.devices) == (0, (0, 1))
    # the fewest hosts that each give an equal share, least loaded first
    t = rm.reserve("c", (4,), ("d",), 0)
    assert [h for _, h, _ in t.members] == [0, 1]
    u = rm.reserve("c", (4,), ("d",), 0)
    assert [h for _, h, _ in u.members] == [2, 3]
    with pytest.raises(AllocationError, match="no set of hosts.*island 0"):
        rm.reserve("c", (4,), ("d",), 0)
    rm.release(t.slice_id)
    assert {r["state"] for r in rm.device_table(0) if r["host"] < 2} == {"free"}
    with pytest.raises(AllocationError, match="multiple of a host's devices"):
        rm.reserve("c", (3,), ("d",), 0)        # 3 = 2 + 1 is not an equal share


def test_a_lost_member_frees_the_whole_slice_on_every_host():
    rm = make(islands=1, hosts=2, devices=2)
    s = rm.reserve("c", (2, 2), ("data", "model"), 0)
    gone = rm.mark_lost(s.members[1][0])
    assert [r.slice_id for r in gone] == [s.slice_id]
    assert not rm.slices and not rm.slices_of("c")
    host0 = [r for r in rm.device_table() if r["host"] == 0]
    assert {r["state"] for r in host0} == {"free"}
    assert rm.reserve("c", (2,), ("d",), 0).host == 0


def test_shared_devices_take_slices_that_span_hosts():
    rm = ResourceManager(per_device=2)
    for h in range(2):
        rm.add_host(0, h, 2, "CPU", f"a{h}", 1)
    a = rm.reserve("c1", (2, 2), ("data", "model"), 0)
    b = rm.reserve("c2", (2, 2), ("data", "model"), 0)
    assert [m[1] for m in a.members] == [m[1] for m in b.members] == [0, 1]
    with pytest.raises(AllocationError):
        rm.reserve("c3", (4,), ("d",), 0)
    rm.release(a.slice_id)
    assert rm.reserve("c3", (4,), ("d",), 0).members


def test_hosts_asks_for_exactly_that_many_hosts():
    rm = make(islands=1, hosts=3, devices=4)
    one = rm.reserve("c", (4,), ("d",), 0)
    assert not one.members
    two = rm.reserve("c", (4,), ("d",), 0, hosts=2)
    assert [(h, len(d)) for _, h, d in two.members] == [(1, 2), (2, 2)]
    with pytest.raises(AllocationError, match="over 3 hosts"):
        rm.reserve("c", (6,), ("d",), 0, hosts=3)
