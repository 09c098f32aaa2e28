"""Unit tests of the gang scheduler (pure logic)."""

import threading
from types import SimpleNamespace

from pathways_torch.coordinator.scheduler import GangScheduler


def sl(sid, island):
    return SimpleNamespace(slice_id=sid, island=island)


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
