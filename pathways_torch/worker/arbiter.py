"""Proportional-share time-multiplexing of a host's shared devices (paper section 4.4).

When the coordinator lets several slices share devices (``--devices-shared-by N``), the
host agent runs a ``ShareArbiter``: each executor on the host asks it for a grant before
it runs a program, runs it to completion, and reports the device time it took. The
arbiter grants one program at a time, always to the waiting client with the least
*virtual time* (its device time so far divided by its share), the stride / weighted-fair
queueing rule, so over a busy period client i receives ``share_i / sum(shares)`` of the
device time. A client that was idle re-enters at the current virtual time and so cannot
bank credit.

An executor has one program in hand at a time, so between two of its programs a busy
client is briefly not waiting; granting the devices to whoever waits at that instant
would drift towards round-robin. So an executor says, with each completion, whether more
work is queued behind it, and the arbiter *anticipates*: it holds the devices for an owed
client that has more work for up to ``ANTICIPATE_S``, the time that client's executor
needs to come back with its next request.

Gang ops come first, in the host's gang sequence (issue 14). The scheduler numbers the
gang ops of every host in one total order (``ScheduleReply.host_seqs``), and the
arbiter grants a gang op only when it is the host's next one: a slice that spans hosts
runs collectives that block until every host has joined, so two such slices sharing
hosts deadlock if one host runs A then B and another B then A. Ungrouped programs
fill the gaps by fair share. A number that never comes (its client died between
scheduling and sending) is skipped after ``SKIP_S``, with a warning. Setting
``PATHWAYS_DEBUG_UNORDERED_GANGS=1`` in a worker's environment ignores the order (for
the test that shows the order is what prevents the deadlock).

The protocol is tiny and local (a Unix socket per host): the executor sends
``b"H" + json`` once, then ``b"R" + uint64 host gang sequence (0: none)`` per program or
gang op; the arbiter answers ``b"G"``; the executor sends ``b"D" + float64 seconds + one
byte (more work queued)`` when done.

Example (as the executor uses it)::

    arb = ArbiterClient(path, client_id="c1", share=2.0)
    with arb.grant() as timer:
        run_program_and_wait()
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Dict, List, Optional

from .._proc import remove_orphan_folders


class FairQueue:
    """The pure scheduling rule: who runs next, and the accounting after a run."""

    def __init__(self) -> None:
        self.vtime: Dict[str, float] = {}
        self.now = 0.0                 # the system's virtual time: that of the last grant
        self.busy: Dict[str, float] = {}

    def arrive(self, client: str, waiting: bool) -> None:
        """A client asks while none of its requests is queued: no credit for idling."""
        if not waiting:
            self.vtime[client] = max(self.vtime.get(client, 0.0), self.now)

    def best(self, waiters: List[tuple]) -> tuple:
        """``waiters`` are (client, arrival order, ...); the least virtual time wins."""
        return min(waiters, key=lambda w: (self.vtime.get(w[0], 0.0), w[1]))

    def grant(self, client: str) -> None:
        self.now = self.vtime.get(client, 0.0)

    def owed(self, client: str, than: str) -> bool:
        """Whether ``client`` is behind ``than`` (so it should run first)."""
        return self.vtime.get(client, 0.0) < self.vtime.get(than, 0.0)

    def done(self, client: str, share: float, seconds: float) -> None:
        self.vtime[client] = self.vtime.get(client, 0.0) + seconds / share
        self.busy[client] = self.busy.get(client, 0.0) + seconds


ANTICIPATE_S = 0.2
SKIP_S = 5.0
UNORDERED_ENV = "PATHWAYS_DEBUG_UNORDERED_GANGS"
log = logging.getLogger("pathways.arbiter")


_FOLDER_PREFIX = "pathways-arb-"


class ShareArbiter:
    """Serves grants on a Unix socket; one program runs on the host's devices at a time."""

    def __init__(self) -> None:
        prefix = f"{_FOLDER_PREFIX}{os.getpid()}-"
        folder = tempfile.mkdtemp(prefix=prefix)
        if len(folder) > 90:        # a Unix socket's path holds at most 107 bytes
            os.rmdir(folder)
            folder = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        # A worker killed by a batch system leaves its folder; it cannot remove it.
        remove_orphan_folders(os.path.dirname(folder), _FOLDER_PREFIX)
        self.path = os.path.join(folder, "arbiter.sock")
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(self.path)
        self._srv.listen(64)
        self._cond = threading.Condition()
        self._queue = FairQueue()
        self._waiters: List[tuple] = []      # (client, order, event)
        self._gangs: Dict[int, tuple] = {}   # host gang seq -> (client, event, since)
        self._next_gang = 1
        self._ordered = os.environ.get(UNORDERED_ENV, "") != "1"
        self._running = False
        self._order = 0
        self._closed = False
        self._last_done: Dict[str, float] = {}   # client -> when its last program ended
        self._timer: Optional[threading.Timer] = None
        threading.Thread(target=self._accept, name="arbiter", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        client, granted, gang = None, False, 0
        try:
            if f.read(1) != b"H":
                return
            hello = json.loads(f.readline())
            client, share = str(hello["client"]), max(float(hello["share"]), 1e-6)
            while f.read(1) == b"R":
                raw = f.read(8)
                if len(raw) != 8:
                    return
                (gang,) = struct.unpack("<Q", raw)
                gang = gang if self._ordered else 0
                ev = threading.Event()
                if gang:
                    with self._cond:
                        self._gangs[gang] = (client, ev, time.monotonic())
                        self._dispatch()
                    ev.wait()
                    granted = True
                    conn.sendall(b"G")
                    op, raw = f.read(1), f.read(9)
                    if op != b"D" or len(raw) != 9:
                        return
                    seconds, _ = struct.unpack("<d?", raw)
                    with self._cond:
                        self._queue.done(client, share, seconds)
                        granted = self._running = False
                        self._next_gang = max(self._next_gang, gang + 1)
                        self._dispatch()
                    continue
                with self._cond:
                    self._order += 1
                    # backlogged (said "more") or queued: not a return from idling
                    busy = client in self._last_done or any(
                        w[0] == client for w in self._waiters)
                    self._queue.arrive(client, busy)
                    self._waiters.append((client, self._order, ev))
                    self._dispatch()
                ev.wait()
                granted = True
                conn.sendall(b"G")
                op, raw = f.read(1), f.read(9)
                if op != b"D" or len(raw) != 9:
                    return
                seconds, more = struct.unpack("<d?", raw)
                with self._cond:
                    self._queue.done(client, share, seconds)
                    granted = self._running = False
                    if more:
                        self._last_done[client] = time.monotonic()
                    else:
                        self._last_done.pop(client, None)
                    self._dispatch()
        except (OSError, ValueError, KeyError):
            pass
        finally:
            f.close()
            conn.close()
            # The executor is gone (its slice was released, or it died): never leave
            # the devices granted to it, nor anyone waiting for it.
            with self._cond:
                if granted:
                    self._running = False
                    if gang:        # its gang op is over, done or not
                        self._next_gang = max(self._next_gang, gang + 1)
                for k in [k for k, g in self._gangs.items() if g[0] == client]:
                    del self._gangs[k]
                if client is not None:
                    self._last_done.pop(client, None)
                self._dispatch()

    def _dispatch(self) -> None:
        """Grant the next waiter if the devices are idle (holding ``_cond``): the
        host's next gang op first, then by fair share."""
        if self._running:
            return
        if self._gangs:
            g = self._gangs.pop(self._next_gang, None)
            if g is None:
                first = min(self._gangs)
                waited = time.monotonic() - self._gangs[first][2]
                if waited >= SKIP_S:
                    log.warning("gang ops %d-%d of this host never came (a client that "
                                "died after scheduling?); going on with %d",
                                self._next_gang, first - 1, first)
                    self._next_gang = first
                    g = self._gangs.pop(first)
                elif self._timer is None:
                    self._timer = threading.Timer(SKIP_S - waited, self._retry)
                    self._timer.daemon = True
                    self._timer.start()
            if g is not None:
                self._running = True
                g[1].set()
                return
        if not self._waiters:
            return
        w = self._queue.best(self._waiters)
        now = time.monotonic()
        waiting = {x[0] for x in self._waiters}
        for client, t in self._last_done.items():
            if (client not in waiting and now - t < ANTICIPATE_S
                    and self._queue.owed(client, w[0])):
                if self._timer is None:         # look again when the wait runs out
                    self._timer = threading.Timer(t + ANTICIPATE_S - now, self._retry)
                    self._timer.daemon = True
                    self._timer.start()
                return
        self._waiters.remove(w)
        self._queue.grant(w[0])
        self._running = True
        w[2].set()

    def _retry(self) -> None:
        with self._cond:
            self._timer = None
            self._dispatch()

    def busy(self) -> Dict[str, float]:
        with self._cond:
            return dict(self._queue.busy)

    def close(self) -> None:
        self._closed = True
        try:
            self._srv.close()
            os.unlink(self.path)
            os.rmdir(os.path.dirname(self.path))
        except OSError:
            pass


class ArbiterClient:
    """An executor's link to its host's arbiter."""

    def __init__(self, path: str, client: str, share: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._sock.sendall(b"H" + json.dumps({"client": client, "share": share}).encode()
                           + b"\n")
        self.busy_seconds = 0.0

    @contextmanager
    def grant(self, more=lambda: False, gang: int = 0):
        """Wait for the devices; the body's wall time is reported as device time, and
        ``more()`` says at the end whether another program is queued behind it.
        ``gang``: the host's gang sequence number of a gang op (granted in that order)."""
        self._sock.sendall(b"R" + struct.pack("<Q", gang))
        if self._sock.recv(1) != b"G":
            raise OSError("the host's share arbiter went away")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.busy_seconds += dt
            self._sock.sendall(b"D" + struct.pack("<d?", dt, bool(more())))

    def close(self) -> None:
        self._sock.close()


def connect(path: Optional[str], client: str, share: float) -> Optional[ArbiterClient]:
    return ArbiterClient(path, client, share) if path and share > 0 else None
