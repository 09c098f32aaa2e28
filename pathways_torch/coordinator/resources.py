"""The resource manager's bookkeeping: which physical device backs which virtual slice.

Pure logic (no gRPC), so it is unit-tested on its own. Every operation costs O(log N) or
less in the number of hosts N (issue 12): hosts are found by (island, host) in a dict,
slices by host and by client in sets, and placement reads indexes instead of scanning:
for each island (and for the whole cluster) one heap per count of free devices, keyed
by (load, island, host). A host's entries go stale when it changes (a stamp), and stale
entries are dropped when they reach the top, so a change costs one push per index.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import math
import threading
from typing import Dict, List, Optional, Sequence, Set, Tuple

#: Hosts listed one by one in an error message; past it, a summary.
_LIST_HOSTS = 8


class AllocationError(Exception):
    """A slice request cannot be met; ``code`` is "exhausted" or "invalid"."""

    def __init__(self, message: str, code: str = "exhausted") -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(eq=False)
class Host:
    worker_id: str
    island: int
    host: int
    num_devices: int
    kind: str
    address: str
    pid: int
    lost: bool = False
    # device index -> the slices on it (more than one only when devices are shared)
    owner: Dict[int, List[str]] = dataclasses.field(default_factory=dict)
    slices: Set[str] = dataclasses.field(default_factory=set)
    n_free: int = 0         # devices no slice uses
    n_load: int = 0         # (slice, device) pairs
    #: Bumped on every change: index entries and cached replies with another stamp are
    #: stale.
    stamp: int = 0

    def free(self) -> List[int]:
        """Devices no slice uses."""
        if self.lost:
            return []
        return [d for d in range(self.num_devices) if not self.owner.get(d)]

    def available(self, per_device: int) -> List[int]:
        """Devices that can take one more slice, least used first."""
        if self.lost:
            return []
        ds = [d for d in range(self.num_devices) if len(self.owner.get(d, ())) < per_device]
        return sorted(ds, key=lambda d: (len(self.owner.get(d, ())), d))

    def load(self) -> int:
        return self.n_load


@dataclasses.dataclass
class SliceRecord:
    slice_id: str
    client_id: str
    island: int
    host: int
    devices: Tuple[int, ...]
    mesh_shape: Tuple[int, ...]
    axis_names: Tuple[str, ...]
    worker_id: str
    executor_address: str = ""
    #: A slice that spans hosts: (worker id, host, devices) of each member, host-major;
    #: member 0 is also worker_id/host/devices above. Empty for a one-host slice.
    members: Tuple[Tuple[str, int, Tuple[int, ...]], ...] = ()

    def placements(self) -> List[Tuple[str, Tuple[int, ...]]]:
        """(worker id, devices) of every host the slice uses."""
        if self.members:
            return [(w, d) for w, _, d in self.members]
        return [(self.worker_id, self.devices)]


class _FreeIndex:
    """Hosts by free-device count, least loaded first within a count (lazy heaps)."""

    def __init__(self) -> None:
        self._heaps: Dict[int, list] = collections.defaultdict(list)
        self._sizes: collections.Counter = collections.Counter()   # live hosts' num_devices
        self._tie = itertools.count()     # entries never compare Hosts

    def push(self, h: Host) -> None:
        heapq.heappush(self._heaps[h.n_free],
                       (h.n_load, h.island, h.host, next(self._tie), h.stamp, h))

    def best(self, size: int) -> Optional[Host]:
        """The host with the most free devices (at least ``size``), then least load,
        then lowest (island, host)."""
        top = max(self._sizes) if self._sizes else 0
        for free in range(top, size - 1, -1):
            heap = self._heaps.get(free)
            while heap:
                *_, stamp, h = heap[0]
                if stamp == h.stamp and not h.lost:
                    return h
                heapq.heappop(heap)
        return None

    def compact(self, live: int) -> None:
        """Drop stale entries when they outnumber the live ones."""
        total = sum(len(h) for h in self._heaps.values())
        if total > 4 * live + 64:
            for heap in self._heaps.values():
                heap[:] = [e for e in heap if e[4] == e[5].stamp and not e[5].lost]
                heapq.heapify(heap)

    def add_size(self, n: int) -> None:
        self._sizes[n] += 1

    def drop_size(self, n: int) -> None:
        self._sizes[n] -= 1
        if self._sizes[n] <= 0:
            del self._sizes[n]

    def biggest(self) -> int:
        return max(self._sizes) if self._sizes else 0


class ResourceManager:
    """Maps a slice's virtual devices onto physical devices.

    A slice that fits on one host gets one host: among the hosts that fit, the
    least-loaded one (most free devices), which spreads slices over hosts and islands
    as the paper's simple load-balancing heuristic does. A bigger slice spans hosts of
    one island (issue 14): the fewest hosts that each give the same number of devices,
    least loaded first, ordered by host number, so devices are host-major and the
    mesh's outer axis is the one that crosses hosts. That placement scans the island's
    hosts (such slices are few and big).

    ``per_device`` is how many slices may share one physical device (the paper's virtual
    devices; 1, the default, makes slices exclusive). Shared devices time-multiplex their
    slices' programs under the host's proportional-share arbiter; the least-used devices
    are handed out first, so sharing starts only when no free device is left. Placement
    on shared devices scans the hosts (such clusters are small); exclusive placement
    reads the indexes.
    """

    def __init__(self, per_device: int = 1) -> None:
        if per_device < 1:
            raise ValueError("per_device must be >= 1")
        self.per_device = per_device
        self._lock = threading.Lock()
        self.hosts: Dict[str, Host] = {}
        self.slices: Dict[str, SliceRecord] = {}
        self._ids = itertools.count(1)
        self._by_place: Dict[Tuple[int, int], str] = {}
        self._order: List[Tuple[int, int, str]] = []      # (island, host, wid), sorted
        self._of_client: Dict[str, Set[str]] = collections.defaultdict(set)
        self._island_hosts: collections.Counter = collections.Counter()   # all, lost too
        self._island_live: collections.Counter = collections.Counter()
        self._index: Dict[Optional[int], _FreeIndex] = collections.defaultdict(_FreeIndex)
        self.live_hosts = 0

    # ------------------------------------------------------------------ hosts
    def add_host(self, island: int, host: int, num_devices: int, kind: str,
                 address: str, pid: int) -> Host:
        with self._lock:
            old = self._by_place.get((island, host))
            if old is not None:
                h = self.hosts[old]
                if not h.lost:
                    raise AllocationError(
                        f"island {island} host {host} is already registered", "invalid")
                self._forget_host(h)            # a replacement for a lost host
            wid = f"i{island}h{host}w{next(self._ids)}"
            h = Host(wid, island, host, num_devices, kind, address, pid)
            h.owner = {d: [] for d in range(num_devices)}
            h.n_free = num_devices
            self.hosts[wid] = h
            self._by_place[(island, host)] = wid
            bisect.insort(self._order, (island, host, wid))
            self._island_hosts[island] += 1
            self._island_live[island] += 1
            self.live_hosts += 1
            for key in (island, None):
                self._index[key].add_size(num_devices)
            self._touch(h)
            return h

    def _forget_host(self, h: Host) -> None:
        del self.hosts[h.worker_id]
        del self._by_place[(h.island, h.host)]
        i = bisect.bisect_left(self._order, (h.island, h.host, h.worker_id))
        del self._order[i]
        self._island_hosts[h.island] -= 1

    def _touch(self, h: Host) -> None:
        """``h`` changed: new index entries (the old ones go stale)."""
        h.stamp += 1
        if not h.lost:
            for key in (h.island, None):
                self._index[key].push(h)

    def mark_lost(self, worker_id: str) -> List[SliceRecord]:
        """The worker is gone: its devices show as lost and its slices are dropped."""
        with self._lock:
            h = self.hosts.get(worker_id)
            if h is None or h.lost:
                return []
            h.lost = True
            gone = [self.slices.pop(sid) for sid in sorted(h.slices)]
            for r in gone:
                self._of_client[r.client_id].discard(r.slice_id)
                self._unplace(r, skip=h)    # a slice that spans hosts dies whole
            h.slices.clear()
            h.owner = {d: [] for d in range(h.num_devices)}
            h.n_free, h.n_load = h.num_devices, 0
            self._island_live[h.island] -= 1
            self.live_hosts -= 1
            for key in (h.island, None):
                self._index[key].drop_size(h.num_devices)
            self._touch(h)
            return gone

    # ------------------------------------------------------------------ slices
    def reserve(self, client_id: str, mesh_shape: Sequence[int], axis_names: Sequence[str],
                island: Optional[int], hosts: Optional[int] = None) -> SliceRecord:
        """A slice for ``client_id``; ``hosts``: spread over exactly that many hosts."""
        size = math.prod(mesh_shape)
        if size < 1 or any(int(s) < 1 for s in mesh_shape):
            raise AllocationError(f"mesh shape {tuple(mesh_shape)} must be positive", "invalid")
        with self._lock:
            if island is not None:
                if not self._island_hosts.get(island):
                    islands = sorted(i for i, n in self._island_hosts.items() if n)
                    raise AllocationError(
                        f"island {island} does not exist; islands are {islands}", "invalid")
                if not self._island_live.get(island):
                    raise AllocationError(
                        f"every host of island {island} is lost (its worker died or cannot "
                        "reach the coordinator); use another island, or restart the worker "
                        "and it registers again", "exhausted")
            if not self.live_hosts:
                raise AllocationError("no worker has registered yet", "exhausted")
            index = self._index[island]
            biggest = index.biggest()
            if size > biggest or (hosts or 1) > 1:
                return self._reserve_hosts(client_id, tuple(mesh_shape),
                                           tuple(axis_names), island, size, hosts, biggest)
            cap = self.per_device
            h = index.best(size) if cap == 1 else self._scan(size, island)
            if h is None:
                shared = f" (each shared by up to {cap} slices)" if cap > 1 else ""
                raise AllocationError(
                    f"a slice of mesh shape {tuple(mesh_shape)} needs {size} free devices"
                    f"{shared} on one host; free now: {self._free_text(island)}. Release a "
                    f"slice (slice.release()) or ask for fewer devices", "exhausted")
            devices = tuple(sorted(h.available(cap)[:size]))
            sid = f"s{next(self._ids)}"
            for d in devices:
                if not h.owner[d]:
                    h.n_free -= 1
                h.owner[d].append(sid)
            h.n_load += len(devices)
            h.slices.add(sid)
            rec = SliceRecord(sid, client_id, h.island, h.host, devices, tuple(mesh_shape),
                              tuple(axis_names), h.worker_id)
            self.slices[sid] = rec
            self._of_client[client_id].add(sid)
            self._touch(h)
            index.compact(self.live_hosts)
            return rec

    def _scan(self, size: int, island: Optional[int]) -> Optional[Host]:
        """Shared devices: the least-loaded host with ``size`` devices that have room."""
        cap = self.per_device
        fitting = [h for h in self.hosts.values() if not h.lost
                   and (island is None or h.island == island)
                   and len(h.available(cap)) >= size]
        if not fitting:
            return None
        return min(fitting, key=lambda h: (-h.n_free, h.n_load, h.island, h.host))

    def release(self, slice_id: str) -> Optional[SliceRecord]:
        with self._lock:
            rec = self.slices.pop(slice_id, None)
            if rec is None:
                return None
            self._of_client[rec.client_id].discard(slice_id)
            if not self._of_client[rec.client_id]:
                del self._of_client[rec.client_id]
            self._unplace(rec)
            return rec

    def _unplace(self, rec: SliceRecord, skip: Optional[Host] = None) -> None:
        """Give back the devices ``rec`` holds on every host but ``skip``."""
        for wid, devices in rec.placements():
            h = self.hosts.get(wid)
            if h is None or h is skip:
                continue
            for d in devices:
                if rec.slice_id in h.owner.get(d, ()):
                    h.owner[d].remove(rec.slice_id)
                    h.n_load -= 1
                    if not h.owner[d]:
                        h.n_free += 1
            h.slices.discard(rec.slice_id)
            self._touch(h)

    def _reserve_hosts(self, client_id: str, mesh_shape: Tuple[int, ...],
                       axis_names: Tuple[str, ...], island: Optional[int],
                       size: int, hosts: Optional[int] = None,
                       biggest: int = 0) -> SliceRecord:
        """A slice over several hosts of one island (lock held): the fewest hosts that
        each give ``size / hosts`` devices."""
        cap = self.per_device
        islands = [island] if island is not None else sorted(
            i for i, n in self._island_live.items() if n > 0)
        best = None
        for i in islands:
            live = [self.hosts[w] for j, _, w in self._order
                    if j == i and not self.hosts[w].lost]
            room = sorted(((len(h.available(cap)), h) for h in live),
                          key=lambda t: (-t[0], t[1].n_load, t[1].host))
            for n in ([hosts] if hosts and hosts <= len(room) else
                      [] if hosts else range(2, len(room) + 1)):
                if size % n or room[n - 1][0] < size // n:
                    continue
                if best is None or n < len(best[1]):
                    best = (size // n, sorted((h for _, h in room[:n]),
                                              key=lambda h: h.host))
                break
        if best is None:
            where = f"island {island}" if island is not None else "any island"
            if hosts:
                need = f"{size} devices over {hosts} hosts"
            else:
                need = (f"{size} devices, more than one host has (hosts here have at most "
                        f"{biggest}), so it spans hosts")
            raise AllocationError(
                f"a slice of mesh shape {mesh_shape} needs {need}, and {where} has no set "
                f"of hosts that each give an equal share of them (a slice spans the hosts "
                f"of one island, the same number of devices on each); free now: "
                f"{self._free_text(island)}. Release slices, ask for at most {biggest} "
                "devices (one host), or for a multiple of a host's devices", "exhausted")
        per_host, hosts = best
        sid = f"s{next(self._ids)}"
        members = []
        for h in hosts:
            devices = tuple(sorted(h.available(cap)[:per_host]))
            for d in devices:
                if not h.owner[d]:
                    h.n_free -= 1
                h.owner[d].append(sid)
            h.n_load += per_host
            h.slices.add(sid)
            self._touch(h)
            members.append((h.worker_id, h.host, devices))
        first = hosts[0]
        rec = SliceRecord(sid, client_id, first.island, first.host, members[0][2],
                          mesh_shape, axis_names, first.worker_id, members=tuple(members))
        self.slices[sid] = rec
        self._of_client[client_id].add(sid)
        self._index[island].compact(self.live_hosts)
        return rec

    def slices_of(self, client_id: str) -> List[SliceRecord]:
        with self._lock:
            return [self.slices[s] for s in sorted(self._of_client.get(client_id, ()))]

    # ------------------------------------------------------------------ listing
    def hosts_in_order(self, island: Optional[int] = None) -> List[Host]:
        """Hosts by (island, host); with ``island``, that island's only."""
        with self._lock:
            if island is None:
                return [self.hosts[w] for _, _, w in self._order]
            lo = bisect.bisect_left(self._order, (island,))
            hi = bisect.bisect_left(self._order, (island + 1,))
            return [self.hosts[w] for _, _, w in self._order[lo:hi]]

    def device_table(self, island: Optional[int] = None) -> List[dict]:
        rows = []
        for h in self.hosts_in_order(island):
            rows.extend(host_rows(h))
        return rows

    def _free_text(self, island: Optional[int]) -> str:
        hosts = [self.hosts[w] for i, _, w in self._order
                 if island is None or i == island]
        live = [h for h in hosts if not h.lost]
        if len(live) <= _LIST_HOSTS:
            return ", ".join(f"island {h.island} host {h.host}: {len(h.free())} of "
                             f"{h.num_devices}" for h in live)
        counts = collections.Counter(len(h.available(self.per_device)) for h in live)
        return f"{len(live)} hosts; " + ", ".join(
            f"{n} with {free} free" for free, n in sorted(counts.items(), reverse=True))


def host_rows(h: Host) -> List[dict]:
    """The rows of ``pw.devices()`` for one host."""
    rows = []
    for d in range(h.num_devices):
        sids = h.owner.get(d, [])
        state = "lost" if h.lost else ("in_use" if sids else "free")
        rows.append(dict(island=h.island, host=h.host, index=d, kind=h.kind,
                         state=state, slice_id=",".join(sids)))
    return rows
