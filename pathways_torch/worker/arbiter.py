"""Proportional-share time-multiplexing of a host's shared devices (paper section 4.4).

When the coordinator lets several slices share devices (``--devices-shared-by N``), the
host agent runs a ``ShareArbiter``: each executor on the host asks it for a grant before
it runs a program, runs it to completion, and reports the device time it took. The
arbiter grants one program at a time, always to the waiting client with the least
*virtual time* (its device time so far divided by its share), the stride / weighted-fair
queueing rule, so over a busy period client i receives ``share_i / sum(shares)`` of the
device time. A client that was idle re-enters at the current virtual time and so cannot
bank credit.

The protocol is tiny and local (a Unix socket per host): the executor sends
``b"H" + json`` once, then ``b"R"`` per program; the arbiter answers ``b"G"``; the
executor sends ``b"D" + float64 seconds`` when the program is done.

Example (as the executor uses it)::

    arb = ArbiterClient(path, client_id="c1", share=2.0)
    with arb.grant() as timer:
        run_program_and_wait()
"""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Dict, List, Optional


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

    def pick(self, waiters: List[tuple]) -> tuple:
        """``waiters`` are (client, arrival order, ...); the least virtual time wins."""
        w = min(waiters, key=lambda w: (self.vtime.get(w[0], 0.0), w[1]))
        self.now = self.vtime.get(w[0], 0.0)
        return w

    def done(self, client: str, share: float, seconds: float) -> None:
        self.vtime[client] = self.vtime.get(client, 0.0) + seconds / share
        self.busy[client] = self.busy.get(client, 0.0) + seconds


class ShareArbiter:
    """Serves grants on a Unix socket; one program runs on the host's devices at a time."""

    def __init__(self) -> None:
        self.path = os.path.join(tempfile.mkdtemp(prefix="pathways-arb-"), "arbiter.sock")
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(self.path)
        self._srv.listen(64)
        self._cond = threading.Condition()
        self._queue = FairQueue()
        self._waiters: List[tuple] = []      # (client, order, event)
        self._running = False
        self._order = 0
        self._closed = False
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
        try:
            if f.read(1) != b"H":
                return
            hello = json.loads(f.readline())
            client, share = str(hello["client"]), max(float(hello["share"]), 1e-6)
            while True:
                op = f.read(1)
                if op != b"R":
                    return
                ev = threading.Event()
                with self._cond:
                    self._order += 1
                    self._queue.arrive(client, any(w[0] == client for w in self._waiters))
                    self._waiters.append((client, self._order, ev))
                    self._dispatch()
                ev.wait()
                conn.sendall(b"G")
                op, raw = f.read(1), f.read(8)
                seconds = struct.unpack("<d", raw)[0] if op == b"D" and len(raw) == 8 else 0.0
                with self._cond:
                    self._queue.done(client, share, seconds)
                    self._running = False
                    self._dispatch()
                if op != b"D":
                    return
        except (OSError, ValueError, KeyError):
            pass
        finally:
            f.close()
            conn.close()

    def _dispatch(self) -> None:
        """Grant the next waiter if the devices are idle (holding ``_cond``)."""
        if self._running or not self._waiters:
            return
        w = self._queue.pick(self._waiters)
        self._waiters.remove(w)
        self._running = True
        w[2].set()

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
    def grant(self):
        """Wait for the devices; the body's wall time is reported as device time."""
        self._sock.sendall(b"R")
        if self._sock.recv(1) != b"G":
            raise OSError("the host's share arbiter went away")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.busy_seconds += dt
            self._sock.sendall(b"D" + struct.pack("<d", dt))

    def close(self) -> None:
        self._sock.close()


def connect(path: Optional[str], client: str, share: float) -> Optional[ArbiterClient]:
    return ArbiterClient(path, client, share) if path and share > 0 else None
