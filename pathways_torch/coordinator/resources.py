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
    # device index -> slice id (None when free)
    owner: Dict[int, Optional[str]] = dataclasses.field(default_factory=dict)

    def free(self) -> List[int]:
        if self.lost:
            return []
        return [d for d in range(self.num_devices) if self.owner.get(d) is None]


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
    """Maps virtual devices one-to-one onto free physical devices, a slice per host.

    On backends without cross-process collectives (CPU XLA), a slice's SPMD program must
    live in one process, so a slice never spans hosts. Among the hosts that fit, the
    least-loaded one is chosen (most free devices), which spreads slices over hosts and
    islands as the paper's simple load-balancing heuristic does.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hosts: Dict[str, Host] = {}
        self.slices: Dict[str, SliceRecord] = {}
        self._ids = itertools.count(1)

    def add_host(self, island: int, host: int, num_devices: int, kind: str,
                 address: str, pid: int) -> Host:
        with self._lock:
            for h in self.hosts.values():
                if (h.island, h.host) == (island, host) and not h.lost:
                    raise AllocationError(
                        f"island {island} host {host} is already registered", "invalid")
            wid = f"i{island}h{host}w{next(self._ids)}"
            h = Host(wid, island, host, num_devices, kind, address, pid)
            h.owner = {d: None for d in range(num_devices)}
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
                if island not in {h.island for h in hosts}:
                    islands = sorted({h.island for h in hosts})
                    raise AllocationError(
                        f"island {island} does not exist; islands are {islands}", "invalid")
                hosts = [h for h in hosts if h.island == island]
            if not hosts:
                raise AllocationError("no worker has registered yet", "exhausted")
            biggest = max(h.num_devices for h in hosts)
            if size > biggest:
                raise AllocationError(
                    f"a slice of mesh shape {tuple(mesh_shape)} needs {size} devices, but a "
                    f"slice lives on one host and hosts here have at most {biggest}; ask for "
                    f"at most {biggest} devices (or start hosts with more devices)",
                    "exhausted")
            fitting = [h for h in hosts if len(h.free()) >= size]
            if not fitting:
                raise AllocationError(
                    f"a slice of mesh shape {tuple(mesh_shape)} needs {size} free devices on "
                    f"one host; free now: {self._free_text(hosts)}. Release a slice "
                    f"(slice.release()) or ask for fewer devices", "exhausted")
            # Least-loaded first: most free devices, then lowest (island, host).
            h = sorted(fitting, key=lambda h: (-len(h.free()), h.island, h.host))[0]
            devices = tuple(h.free()[:size])
            sid = f"s{next(self._ids)}"
            for d in devices:
                h.owner[d] = sid
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
                    if h.owner.get(d) == slice_id:
                        h.owner[d] = None
            return rec

    def slices_of(self, client_id: str) -> List[SliceRecord]:
        with self._lock:
            return [s for s in self.slices.values() if s.client_id == client_id]

    def device_table(self) -> List[dict]:
        with self._lock:
            rows = []
            for h in sorted(self.hosts.values(), key=lambda h: (h.island, h.host)):
                for d in range(h.num_devices):
                    sid = h.owner.get(d)
                    state = "lost" if h.lost else ("in_use" if sid else "free")
                    rows.append(dict(island=h.island, host=h.host, index=d, kind=h.kind,
                                     state=state, slice_id=sid or ""))
            return rows

    @staticmethod
    def _free_text(hosts: Sequence[Host]) -> str:
        return ", ".join(
            f"island {h.island} host {h.host}: {len(h.free())} of {h.num_devices}"
            for h in sorted(hosts, key=lambda h: (h.island, h.host)))
