"""The executor's object store: device buffers (or their failures) keyed by buffer id."""

from __future__ import annotations

import threading
from typing import Dict, Optional


# More buffers than this between two watermarks: wait for all device work instead.
_MAX_LAUNCHED = 4096


class Entry:
    __slots__ = ("tensor", "error", "nbytes", "origin", "pending", "shards", "readers",
                 "donated", "done")

    def __init__(self, tensor=None, error=None, nbytes: int = 0, origin: str = "",
                 pending=None, shards: int = 1, done: bool = False) -> None:
        self.shards = shards      # how many pieces each device's share is (1: replicated)
        self.readers = 0          # fetches and sends copying it off the device right now
        self.donated = False      # its device buffer now belongs to a program's output
        self.done = done          # known computed (worker/ready.py), not just launched
        self.tensor = tensor      # a torch_xla tensor (possibly still being computed)
        self.error = error        # a pb.BufferError when the buffer could not be produced
        self.nbytes = nbytes
        self.origin = origin      # the program that produced it ("" for a put)
        self.pending = pending    # a RecvOp whose bytes have not been taken in yet


class ObjectStore:
    """Buffers by id, plus the count of ordered ops processed so far.

    Readers (Fetch, Wait) run on gRPC threads and wait on the condition until the op
    that produces their buffer has been processed by the execution thread.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.entries: Dict[int, Entry] = {}
        self.processed = 0          # ordered (non-release) ops processed, in stream order
        self.device_bytes = 0       # bytes on each device (a sharded buffer counts 1/shards)
        self._done_out_of_order: set = set()
        self.bytes = 0
        self.noting = False         # a watermark subscriber wants ``take_noted``
        # The op counts readers wait for: ``advance`` wakes them only when one is reached
        # (waking every reader on every op cost ~20 µs of CPU an op while a Wait was
        # pending: docs/architecture.md, Decision 20).
        self._wanted: list = []
        self._noted: list = []      # ids put failed or pending since the last take
        # ids put with a device tensor since the last take (while noting): the buffers
        # a watermark waits for; None when there were too many, or ones from before
        # noting began, to list (the watermark then waits for all device work)
        self._launched: Optional[list] = None

    def start_noting(self) -> None:
        """Note from now on, starting with the buffers already failed or pending."""
        with self.cond:
            self.noting = True
            self._noted = [b for b, e in self.entries.items()
                           if e.error is not None or e.pending is not None]
            self._launched = None

    def stop_noting(self) -> None:
        with self.cond:
            self.noting, self._noted, self._launched = False, [], None

    def take_noted(self) -> tuple:
        """What a completion watermark must look at, put since the last call (only
        while ``noting``): (ids of buffers put with an error or a pending transfer,
        ids of buffers put with a device tensor, or None for "all device work")."""
        with self.cond:
            out, self._noted = self._noted, []
            launched, self._launched = self._launched, []
            return out, launched

    def put(self, buffer_id: int, entry: Entry) -> None:
        with self.cond:
            old = self.entries.get(buffer_id)
            if old is not None:
                self.bytes -= old.nbytes
                self.device_bytes -= old.nbytes // old.shards
            self.entries[buffer_id] = entry
            if self.noting:
                if entry.error is not None or entry.pending is not None:
                    self._noted.append(buffer_id)
                elif self._launched is not None and entry.tensor is not None:
                    self._launched.append(buffer_id)
                    if len(self._launched) > _MAX_LAUNCHED:
                        self._launched = None
            self.bytes += entry.nbytes
            self.device_bytes += entry.nbytes // entry.shards

    def get(self, buffer_id: int) -> Optional[Entry]:
        return self.entries.get(buffer_id)

    def release(self, ids) -> None:
        with self.cond:
            for i in ids:
                e = self.entries.pop(i, None)
                if e is not None:
                    self.bytes -= e.nbytes
                    self.device_bytes -= e.nbytes // e.shards

    def advance(self, index: int) -> None:
        """Mark stream op ``index`` (1-based) processed; ``processed`` counts the prefix."""
        with self.cond:
            if index == self.processed + 1:
                self.processed = index
                while self.processed + 1 in self._done_out_of_order:
                    self.processed += 1
                    self._done_out_of_order.discard(self.processed)
                if self._wanted and self.processed >= min(self._wanted):
                    self.cond.notify_all()
            elif index > self.processed:
                self._done_out_of_order.add(index)

    def begin_read(self, entry: Entry) -> bool:
        """Hold ``entry`` against donation while a reader copies it; False if donated."""
        with self.cond:
            if entry.donated:
                return False
            entry.readers += 1
            return True

    def end_read(self, entry: Entry) -> None:
        with self.cond:
            entry.readers -= 1
            self.cond.notify_all()

    def donate(self, entry: Entry) -> None:
        """Wait until no reader holds ``entry``, then mark it donated."""
        with self.cond:
            self.cond.wait_for(lambda: entry.readers == 0)
            entry.donated = True

    def wait_for(self, buffer_id: int, after_seq: int, timeout: float) -> Optional[Entry]:
        """Wait until the buffer exists or the op sequence passed ``after_seq``.

        Returns the entry, or None if it is unknown once its producer should have run.
        Raises TimeoutError past ``timeout`` seconds.
        """
        with self.cond:
            e = self.entries.get(buffer_id)
            if e is not None or self.processed >= after_seq:
                return e
            # the op that creates the buffer (its after_seq) puts it before it advances
            self._wanted.append(after_seq)
            try:
                ok = self.cond.wait_for(
                    lambda: buffer_id in self.entries or self.processed >= after_seq,
                    timeout)
            finally:
                self._wanted.remove(after_seq)
            if not ok:
                raise TimeoutError
            return self.entries.get(buffer_id)
