"""The resource manager's bookkeeping: which physical device backs which virtual slice.

Pure logic (no gRPC), so it is unit-tested on its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from typing import Dict, List, Optional, Sequence, Tuple


class AllocationError(Exception):
    """A slice request cannot be met; ``code`` is "exhausted" or "invalid"."""

    def __init__(self, message: str, code: str = "exhausted") -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
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
        return sum(len(v) for v in self.owner.values())


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


class ResourceManager:
    """Maps a slice's virtual devices onto physical devices of one host.

    On backends without cross-process collectives (CPU XLA), a slice's SPMD program must
    live in one process, so a slice never spans hosts. Among the hosts that fit, the
    least-loaded one is chosen (most free devices), which spreads slices over hosts and
    islands as the paper's simple load-balancing heuristic does.

    ``per_device`` is how many slices may share one physical device (the paper's virtual
    devices; 1, the default, makes slices exclusive). Shared devices time-multiplex their
    slices' programs under the host's proportional-share arbiter; the least-used devices
    are handed out first, so sharing starts only when no free device is left.
    """

    def __init__(self, per_device: int = 1) -> None:
        if per_device < 1:
            raise ValueError("per_device must be >= 1")
        self.per_device = per_device
        self._lock = threading.Lock()
        self.hosts: Dict[str, Host] = {}
        self.slices: Dict[str, SliceRecord] = {}
        self._ids = itertools.count(1)

    def add_host(self, island: int, host: int, num_devices: int, kind: str,
                 address: str, pid: int) -> Host:
        with self._lock:
            for wid, h in list(self.hosts.items()):
                if (h.island, h.host) == (island, host):
                    if not h.lost:
                        raise AllocationError(
                            f"island {island} host {host} is already registered", "invalid")
                    del self.hosts[wid]         # a replacement for a lost host
            wid = f"i{island}h{host}w{next(self._ids)}"
            h = Host(wid, island, host, num_devices, kind, address, pid)
            h.owner = {d: [] for d in range(num_devices)}
            self.hosts[wid] = h
            return h

    def reserve(self, client_id: str, mesh_shape: Sequence[int], axis_names: Sequence[str],
                island: Optional[int]) -> SliceRecord:
        size = math.prod(mesh_shape)
        if size < 1 or any(int(s) < 1 for s in mesh_shape):
            raise AllocationError(f"mesh shape {tuple(mesh_shape)} must be positive", "invalid")
        with self._lock:
            hosts = [h for h in self.hosts.values() if not h.lost]
            if island is not None:
                if island not in {h.island for h in self.hosts.values()}:
                    islands = sorted({h.island for h in self.hosts.values()})
                    raise AllocationError(
                        f"island {island} does not exist; islands are {islands}", "invalid")
                hosts = [h for h in hosts if h.island == island]
                if not hosts:
                    raise AllocationError(
                        f"every host of island {island} is lost (its worker died or cannot "
                        "reach the coordinator); use another island, or restart the worker "
                        "and it registers again", "exhausted")
            if not hosts:
                raise AllocationError("no worker has registered yet", "exhausted")
            biggest = max(h.num_devices for h in hosts)
            if size > biggest:
                raise AllocationError(
                    f"a slice of mesh shape {tuple(mesh_shape)} needs {size} devices, but a "
                    f"slice lives on one host and hosts here have at most {biggest}; ask for "
                    f"at most {biggest} devices (or start hosts with more devices)",
                    "exhausted")
            cap = self.per_device
            fitting = [h for h in hosts if len(h.available(cap)) >= size]
            if not fitting:
                shared = f" (each shared by up to {cap} slices)" if cap > 1 else ""
                raise AllocationError(
                    f"a slice of mesh shape {tuple(mesh_shape)} needs {size} free devices"
                    f"{shared} on one host; free now: {self._free_text(hosts)}. Release a "
                    f"slice (slice.release()) or ask for fewer devices", "exhausted")
            # Least-loaded first: most free devices, fewest slices, lowest (island, host).
            h = sorted(fitting, key=lambda h: (-len(h.free()), h.load(), h.island,
                                               h.host))[0]
            devices = tuple(sorted(h.available(cap)[:size]))
            sid = f"s{next(self._ids)}"
            for d in devices:
                h.owner[d].append(sid)
            rec = SliceRecord(sid, client_id, h.island, h.host, devices, tuple(mesh_shape),
                              tuple(axis_names), h.worker_id)
            self.slices[sid] = rec
            return rec

    def release(self, slice_id: str) -> Optional[SliceRecord]:
        with self._lock:
            rec = self.slices.pop(slice_id, None)
            if rec is None:
                return None
            h = self.hosts.get(rec.worker_id)
            if h is not None:
                for d in rec.devices:
                    if slice_id in h.owner.get(d, ()):
                        h.owner[d].remove(slice_id)
            return rec

    def mark_lost(self, worker_id: str) -> List[SliceRecord]:
        """The worker is gone: its devices show as lost and its slices are dropped."""
        with self._lock:
            h = self.hosts.get(worker_id)
            if h is None:
                return []
            h.lost = True
            gone = [r for r in self.slices.values() if r.worker_id == worker_id]
            for r in gone:
                del self.slices[r.slice_id]
            h.owner = {d: [] for d in range(h.num_devices)}
            return gone

    def slices_of(self, client_id: str) -> List[SliceRecord]:
        with self._lock:
            return [s for s in self.slices.values() if s.client_id == client_id]

    def device_table(self) -> List[dict]:
        with self._lock:
            rows = []
            for h in sorted(self.hosts.values(), key=lambda h: (h.island, h.host)):
                for d in range(h.num_devices):
                    sids = h.owner.get(d, [])
                    state = "lost" if h.lost else ("in_use" if sids else "free")
                    rows.append(dict(island=h.island, host=h.host, index=d, kind=h.kind,
                                     state=state, slice_id=",".join(sids)))
            return rows

    @staticmethod
    def _free_text(hosts: Sequence[Host]) -> str:
        return ", ".join(
            f"island {h.island} host {h.host}: {len(h.free())} of {h.num_devices}"
            for h in sorted(hosts, key=lambda h: (h.island, h.host)))
