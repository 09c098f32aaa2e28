"""Profiling plumbing shared by every process: span recording and clock alignment.

Each process (client, coordinator, worker agents, executors) owns a ``Recorder``. It
records nothing until a profile session is open (``pw.profile()``): call sites test
``recorder.on`` (one attribute read) before taking a time, so profiling off costs
nothing measurable. Times are the process's *trace clock*: ``time.perf_counter_ns()``
(monotonic), plus ``PATHWAYS_CLOCK_SKEW_S`` seconds in server processes, a test knob
that makes a process's clock disagree with the client's the way another machine's
would.

Clocks are aligned NTP-style: the client (or the coordinator, for its worker agents)
sends a ``Profile`` request at t1, the server reads its clock on arrival (t2) and when
it answers (t3), the reply lands at t4. Then ``offset = ((t2 - t1) + (t3 - t4)) / 2``
(server minus client) with an error of at most half the round trip ``(t4 - t1) - (t3 -
t2)``; of a few samples the one with the smallest round trip is kept. Samples taken when
a profile starts and when it stops give two offsets, and spans in between are corrected
by interpolating between them (clock drift over long profiles).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Callable, Iterable, List, NamedTuple, Optional, Sequence, Tuple

SKEW_ENV = "PATHWAYS_CLOCK_SKEW_S"
MAX_EVENTS = 250_000          # per process and session; ~11 MB of spans on the wire


class Span(NamedTuple):
    cat: str
    name: str
    start_ns: int
    dur_ns: int
    thread: str
    program: str = ""
    buffer_ids: Tuple[int, ...] = ()
    bytes: int = 0
    peer: str = ""
    transfer_id: int = 0
    detail: str = ""


def skew_from_env() -> int:
    """The trace-clock skew (ns) a server process applies, from PATHWAYS_CLOCK_SKEW_S."""
    try:
        return int(float(os.environ.get(SKEW_ENV, "0") or 0) * 1e9)
    except ValueError:
        return 0


class Recorder:
    """The spans of one process, kept only while at least one profile session is open.

    Example (a call site)::

        t0 = rec.now() if rec.on else 0
        work()
        if t0:
            rec.add("execute", "layer", t0, program="layer")
    """

    def __init__(self, skew_ns: int = 0) -> None:
        self.on = False
        self.skew_ns = skew_ns
        self.dropped = 0
        self._events: List[Span] = []
        self._base = 0                  # absolute index of _events[0]
        self._sessions: dict = {}       # session -> absolute index of its first span
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def now(self) -> int:
        return time.perf_counter_ns() + self.skew_ns

    def add(self, cat: str, name: str, start_ns: int, end_ns: int = 0, *, program: str = "",
            buffer_ids: Sequence[int] = (), nbytes: int = 0, peer: str = "",
            transfer_id: int = 0, detail: str = "", thread: Optional[str] = None) -> None:
        """Record a span from ``start_ns`` to ``end_ns`` (default: now)."""
        if not self.on or not start_ns:
            return
        end = end_ns or self.now()
        if len(self._events) >= MAX_EVENTS:
            self.dropped += 1
            return
        # list.append is atomic under the GIL: no lock on the recording path.
        self._events.append(Span(cat, name, start_ns, max(0, end - start_ns),
                                 thread or threading.current_thread().name, program,
                                 tuple(buffer_ids), nbytes, peer, transfer_id, detail))

    def start(self) -> int:
        with self._lock:
            session = next(self._ids)
            if not self._sessions:
                self._base += len(self._events)
                self._events = []
                self.dropped = 0
            self._sessions[session] = self._base + len(self._events)
            self.on = True
            return session

    def active(self, session: int) -> bool:
        """Whether ``session`` (a number start returned) is open."""
        return session in self._sessions

    def stop(self, session: int) -> Tuple[List[Span], int]:
        """Close a session; returns its spans and how many were dropped."""
        with self._lock:
            first = self._sessions.pop(session, None)
            if first is None:
                return [], 0
            spans = self._events[max(0, first - self._base):]
            dropped = self.dropped
            if not self._sessions:
                self.on = False
                self._base += len(self._events)
                self._events = []
            return spans, dropped


#: The client's recorder (the reference clock of every profile: no skew).
CLIENT = Recorder()


# ---------------------------------------------------------------------- wire form
def to_process_trace(pb, process: str, spans: Iterable[Span], dropped: int = 0,
                     pid: Optional[int] = None):
    msg = pb.ProcessTrace(process=process, pid=os.getpid() if pid is None else pid,
                          dropped=dropped)
    add = msg.events.add
    for s in spans:
        add(cat=s.cat, name=s.name, start_ns=s.start_ns, dur_ns=s.dur_ns, thread=s.thread,
            program=s.program, buffer_ids=s.buffer_ids, bytes=s.bytes, peer=s.peer,
            transfer_id=s.transfer_id, detail=s.detail)
    return msg


def from_process_trace(msg) -> List[Span]:
    return [Span(e.cat, e.name, e.start_ns, e.dur_ns, e.thread, e.program,
                 tuple(e.buffer_ids), e.bytes, e.peer, e.transfer_id, e.detail)
            for e in msg.events]


def serve_profile(pb, rec: Recorder, request, process: str, collect_more=None):
    """The body of every service's ``Profile`` RPC. ``collect_more(session)`` (STOP
    only) returns further ProcessTraces, already on this process's clock."""
    t2 = rec.now()
    reply = pb.ProfileReply(recv_ns=t2)
    if request.action == pb.ProfileRequest.START:
        reply.session = rec.start()
    elif request.action == pb.ProfileRequest.STOP:
        spans, dropped = rec.stop(request.session)
        reply.processes.append(to_process_trace(pb, process, spans, dropped))
        if collect_more is not None:
            reply.processes.extend(collect_more(request.session))
    reply.reply_ns = rec.now()
    return reply


# ---------------------------------------------------------------------- clocks (pure)
class ClockSample(NamedTuple):
    """One request/reply: t1 sent and t4 received on the local clock; t2 received and
    t3 answered on the remote clock."""
    t1: int
    t2: int
    t3: int
    t4: int

    @property
    def offset(self) -> float:
        """Remote clock minus local clock (exact when the two legs take equal time)."""
        return ((self.t2 - self.t1) + (self.t3 - self.t4)) / 2

    @property
    def delay(self) -> int:
        """The round trip less the remote's processing time; |error of offset| <= delay/2."""
        return (self.t4 - self.t1) - (self.t3 - self.t2)

    @property
    def remote_mid(self) -> float:
        return (self.t2 + self.t3) / 2


def best_sample(samples: Sequence[ClockSample]) -> ClockSample:
    """The sample with the smallest round trip (the tightest bound on the offset)."""
    if not samples:
        raise ValueError("no clock samples")
    return min(samples, key=lambda s: s.delay)


class ClockMap:
    """Maps a remote process's trace clock onto the local one.

    Built from the best sample of each group (one group at profile start, one at stop):
    one group gives a constant offset, two give an offset interpolated linearly in
    remote time (and held constant outside them).
    """

    def __init__(self, *groups: Sequence[ClockSample]) -> None:
        anchors = sorted((s.remote_mid, s.offset, s.delay)
                         for s in (best_sample(g) for g in groups if g))
        if not anchors:
            raise ValueError("no clock samples")
        self.anchors = anchors

    @classmethod
    def identity(cls) -> "ClockMap":
        return cls([ClockSample(0, 0, 0, 0)])

    @property
    def error_ns(self) -> float:
        """Bound on the error of the mapped times: half the largest kept round trip."""
        return max(a[2] for a in self.anchors) / 2

    def offset_at(self, remote_ns: float) -> float:
        (r1, o1, _), (r2, o2, _) = self.anchors[0], self.anchors[-1]
        if r2 <= r1 or remote_ns <= r1:
            return o1
        if remote_ns >= r2:
            return o2
        return o1 + (o2 - o1) * (remote_ns - r1) / (r2 - r1)

    def to_local(self, remote_ns: float) -> float:
        return remote_ns - self.offset_at(remote_ns)


def sample_clock(call: Callable[[], object], now: Callable[[], int],
                 n: int = 3) -> List[ClockSample]:
    """``n`` samples: ``call()`` sends a CLOCK request and returns the ProfileReply."""
    out = []
    for _ in range(n):
        t1 = now()
        rep = call()
        t4 = now()
        out.append(ClockSample(t1, rep.recv_ns, rep.reply_ns, t4))
    return out


def sample_from_reply(t1: int, rep, t4: int) -> ClockSample:
    return ClockSample(t1, rep.recv_ns, rep.reply_ns, t4)


def shift_trace(msg, clock: ClockMap) -> None:
    """Put a ProcessTrace's spans onto the local clock, in place (and say so in its
    clock_offset_ns / clock_error_ns)."""
    msg.clock_offset_ns = clock.anchors[-1][1]
    msg.clock_error_ns = clock.error_ns
    for e in msg.events:
        start = clock.to_local(e.start_ns)
        end = clock.to_local(e.start_ns + e.dur_ns)
        e.start_ns = int(round(start))
        e.dur_ns = max(0, int(round(end - start)))
