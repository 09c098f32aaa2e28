"""Unit tests of the gang scheduler (pure logic)."""

import threading
from types import SimpleNamespace

from pathways_torch.coordinator.scheduler import GangScheduler


def sl(sid, island, hosts=None):
    hosts = hosts or [f"{sid}-host"]
    return SimpleNamespace(slice_id=sid, island=island,
                           placements=lambda: [(w, ()) for w in hosts])


def test_positions_per_island_and_sequences_per_slice():
    g = GangScheduler()
    a, b, c = sl("a", 0), sl("b", 0), sl("c", 1)
    assert g.schedule([a, b]) == ([1, 1], [1, 1])
    assert g.schedule([a, c]) == ([2, 1], [2, 1])
    assert g.schedule([b]) == ([3], [2])
    g.forget("a")
    assert g.schedule([a]) == ([4], [1])


def test_concurrent_submissions_get_one_total_order():
    g = GangScheduler()
    a, b = sl("a", 0), sl("b", 0)
    got = []
    lock = threading.Lock()

    def worker():
        for _ in range(500):
            pos, seq = g.schedule([a, b])
            with lock:
                got.append((pos[0], seq[0], seq[1]))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got.sort()
    assert [p for p, _, _ in got] == list(range(1, 2001))
    assert all(p == s1 == s2 for p, s1, s2 in got)     # both slices saw every gang in order


def test_each_host_numbers_the_gangs_on_it_in_one_order():
    """Two slices that span the same two hosts: every host sees them alternate in the
    same relative order, whatever the submission; a one-host slice counts on its host."""
    g = GangScheduler()
    a, b = sl("a", 0, ["h0", "h1"]), sl("b", 0, ["h0", "h1"])
    c = sl("c", 0, ["h1"])
    assert g.schedule_hosts([a])[2] == [[1, 1]]
    assert g.schedule_hosts([b, c])[2] == [[2, 2], [3]]
    assert g.schedule_hosts([a, b])[2] == [[3, 4], [4, 5]]
