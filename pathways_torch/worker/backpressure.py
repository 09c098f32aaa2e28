"""The executor's memory budget: an op whose outputs do not fit waits for releases
(which may overtake ops that do not use their buffers), then fails with a typed "oom"
error that says what to do (docs/architecture.md, Decision 11).

Example::

    err = service._room_for(nbytes, spec, "the transfer into buffer 7", {7})
"""

from __future__ import annotations

import logging
import queue
import time

from ..sharding import spec_from_proto
from .memory import gib

log = logging.getLogger("pathways.executor")


def _buffer_ids(op) -> list:
    """Every buffer id an op reads or writes."""
    which = op.WhichOneof("kind")
    if which == "execute":
        return list(op.execute.inputs) + list(op.execute.outputs)
    if which in ("put", "recv", "send"):
        return [getattr(op, which).buffer_id]
    if which == "save":
        return list(op.save.buffer_ids) + [op.save.status_id]
    if which == "load":
        return list(op.load.buffer_ids)
    if which == "batch":
        return list(op.batch.outputs)
    if which == "gang":
        return [b for inner in op.gang.ops for b in _buffer_ids(inner)]
    return []


class BackPressure:
    """Releases and the per-device memory budget (a mixin of ExecutorService)."""

    def _cap(self) -> int:
        """Bytes the slice's devices could hold together (one buffer's upper bound)."""
        return self.budget * len(self.mesh.device_ids)

    def _free(self) -> int:
        return max(0, self.budget - self.store.device_bytes)

    def _room_for(self, nbytes: int, spec_msg, what: str, keep: set):
        """None when a buffer of ``nbytes`` with ``spec_msg`` fits (after waiting for
        releases), else the "oom" error: at once when it exceeds the whole budget."""
        per_device = nbytes // self._shards(spec_from_proto(spec_msg))
        if per_device > self.budget:
            return self._err(
                "oom", f"{what} needs {gib(per_device)} per device, more than the whole "
                f"{gib(self.budget)} per-device budget of {self.where} "
                f"({gib(self._free())} free now); shard it over more devices or raise the "
                "budget (pw.init(memory_budget=...))")
        return self._make_room(per_device, what, keep)

    def _make_room(self, need: int, what: str, keep: set, program: str = ""):
        """Wait until ``need`` more bytes per device fit in the budget; None when they do.

        Releases travel on the same ordered stream as the ops, so while this op waits,
        the ops behind it are taken off the queue and their releases applied early:
        a release may overtake ops that do not touch its buffer (and that buffer must
        exist already). Past the back-pressure timeout the op fails with an "oom" error
        that says how much was asked and what is free.
        """
        store = self.store
        if need <= 0 or store.device_bytes + need <= self.budget:
            return None
        t0 = time.monotonic()
        deadline = t0 + self.backpressure_timeout
        while store.device_bytes + need > self.budget:
            self._apply_early_releases(keep)
            if store.device_bytes + need <= self.budget:
                break
            left = deadline - time.monotonic()
            if left <= 0 or (self._ahead and self._ahead[-1] is None):
                return self._err(
                    "oom", f"{what} needs {gib(need)} per device and waited "
                    f"{time.monotonic() - t0:.0f} s for releases, but only "
                    f"{gib(self._free())} of the {gib(self.budget)} per-device budget of "
                    f"{self.where} is free; drop Arrays you no longer need (del x), or "
                    "raise the budget (pw.init(memory_budget=...))", program)
            try:
                self._ahead.append(self._queue.get(timeout=min(left, 0.05)))
            except queue.Empty:
                pass
        self.backpressure_waits += 1
        self.backpressure_seconds += time.monotonic() - t0
        return None

    def _apply_early_releases(self, keep: set) -> None:
        """Apply the releases among the queued ops whose buffers exist and that no op
        before them (or the waiting op, ``keep``) uses."""
        while True:                     # take in what has arrived
            try:
                self._ahead.append(self._queue.get_nowait())
            except queue.Empty:
                break
        used = set(keep)
        for item in self._ahead:
            if item is None or item[0] != "op":
                continue
            op = item[1]
            if op.WhichOneof("kind") == "release":
                ids = op.release.buffer_ids
                now = [b for b in ids if b not in used and b in self.store.entries]
                if now:
                    self._release(now)
                    done = set(now)
                    rest = [b for b in ids if b not in done]
                    del ids[:]
                    ids.extend(rest)
            else:
                used.update(_buffer_ids(op))

    def _release(self, ids) -> None:
        """Free buffers; bytes still due for a dropped transfer are dropped on arrival."""
        for b in ids:
            e = self.store.get(b)
            if e is not None and e.pending is not None:
                with self._sending_lock:
                    r = e.pending
                    if r is not None and r.transfer_id not in self._sending:
                        self._discard_recv(r)
        self.store.release(ids)
