"""The gang scheduler: one total order per island (FIFO), as in the paper's section 4.4.

Every gang submission (a recorded graph's ops, spanning one or more slices) gets one
position in the order of each island it touches, and each touched slice gets the
next number of its own sequence. Executors run gang ops in slice-sequence order, so
every executor of an island sees the island's gangs in the same relative order.
Pure logic (no gRPC), unit-tested on its own.
"""

from __future__ import annotations

import collections
import threading
from typing import Dict, List, Sequence, Tuple


class GangScheduler:
    """Besides the island positions, each host has its own gang sequence: every slice
    of a submission takes the next number on each of its hosts (a slice that spans
    hosts, one on each). Numbers are given under one lock, so every host's sequence is
    the island order restricted to that host, and a host's share arbiter that grants
    gang ops in its sequence keeps the collectives of slices sharing hosts from
    deadlocking (issue 14)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._island_pos: Dict[int, int] = collections.defaultdict(int)
        self._slice_seq: Dict[str, int] = collections.defaultdict(int)
        self._host_seq: Dict[str, int] = collections.defaultdict(int)

    def schedule(self, slices: Sequence) -> Tuple[List[int], List[int]]:
        """Positions (per slice: its island's position) and slice sequence numbers."""
        positions, seqs, _ = self.schedule_hosts(slices)
        return positions, seqs

    def schedule_hosts(self, slices: Sequence
                       ) -> Tuple[List[int], List[int], List[List[int]]]:
        """``schedule`` plus, per slice, each of its hosts' gang sequence number."""
        with self._lock:
            pos = {}
            for isl in sorted({s.island for s in slices}):
                self._island_pos[isl] += 1
                pos[isl] = self._island_pos[isl]
            seqs, host_seqs = [], []
            for s in slices:
                self._slice_seq[s.slice_id] += 1
                seqs.append(self._slice_seq[s.slice_id])
                mine = []
                for wid, _ in s.placements():
                    self._host_seq[wid] += 1
                    mine.append(self._host_seq[wid])
                host_seqs.append(mine)
            return [pos[s.island] for s in slices], seqs, host_seqs

    def forget(self, slice_id: str) -> None:
        with self._lock:
            self._slice_seq.pop(slice_id, None)
