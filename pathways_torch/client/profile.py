"""``pw.profile()``: one timeline of the client, the coordinator, every worker agent and
every executor, on the client's clock.

Inside ``with pw.profile() as prof:`` every process records spans: the client its
dispatches (program calls, transfers, graph submissions), traces, compiles, puts and
blocking waits and fetches; the coordinator its slice allocations, gang scheduling and
sessions; each worker agent the executors it starts and stops; each executor how long
each op waited in its queue, every execution (with its program's name), compile, put,
fetch and transfer (bytes and peer). Leaving the block waits until every op already
dispatched has run (a barrier on each slice), collects the spans over gRPC (protobuf,
never pickle) and maps every process's clock onto the client's (NTP-style, see
``pathways_torch.tracing``).

While a profile is open, executors run each program to completion before starting the
next (``wait=True``) so that an execution's span is its device time; this serialises
the host work of an op with the device work of the previous one (see
docs/architecture.md for the cost). Outside a profile nothing is recorded.

Example::

    with pw.profile() as prof:
        y = layer(x, w)
        z = g(y.to(other_slice))
        z.torch()
    prof.export("trace.json")        # open in https://ui.perfetto.dev or chrome://tracing
    prof.utilization()               # {"island 0 host 0 device 0": 0.42, ...}
    prof.plot("util.png")            # one row per executor, grouped by host
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import warnings
from typing import Dict, List, NamedTuple, Sequence, Tuple

from .. import tracing
from ..errors import PathwaysError
from ..rpc import pathways_pb2 as pb

CLOCK_SAMPLES = 3      # clock readings per process at start and at stop (best one kept)


class Event(NamedTuple):
    """One span of a profile; times in seconds since the profile started, on the
    client's clock (other processes' clocks already corrected)."""

    pid: int                 # the process's number in the trace (see Profile.processes)
    process: str
    cat: str                 # "dispatch", "queue", "execute", "compile", "put", "fetch",
                             # "wait", "transfer", "gang", "rpc", "session", "trace", ...
    name: str                # the program's name for executions and dispatches
    start_s: float
    dur_s: float
    thread: str
    program: str = ""
    buffer_ids: Tuple[int, ...] = ()
    bytes: int = 0
    peer: str = ""
    transfer_id: int = 0
    detail: str = ""

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s

    def args(self) -> dict:
        out = {}
        for key in ("program", "buffer_ids", "bytes", "peer", "detail"):
            v = getattr(self, key)
            if v:
                out[key] = list(v) if key == "buffer_ids" else v
        if self.transfer_id:
            out["transfer_id"] = f"{self.transfer_id:x}"
        return out


@dataclasses.dataclass
class ProcessInfo:
    """A process that contributed spans, and how its clock was mapped onto the client's."""

    pid: int                 # its number in the trace (1: the client)
    name: str                # "client", "coordinator", "worker island I host H",
                             # "executor island I host H slice S"
    kind: str                # "client", "coordinator", "worker" or "executor"
    os_pid: int
    island: int = -1
    host: int = -1
    slice_id: str = ""
    devices: Tuple[Tuple[int, int, int], ...] = ()   # an executor's (island, host, index)
    clock_offset_ns: float = 0.0   # its clock minus the client's, at the profile's end
    clock_error_ns: float = 0.0    # bound on the error of the corrected times
    dropped: int = 0               # spans over the per-process cap, not kept

    @property
    def label(self) -> str:
        return f"{self.name} (pid {self.os_pid})"


class _Link:
    """A process profiled over gRPC: ``call(action, session)`` sends a ProfileRequest."""

    def __init__(self, call, kind: str, slice_=None) -> None:
        self.call = call
        self.kind = kind
        self.slice = slice_
        self.session = 0
        self.first: List[tracing.ClockSample] = []

    def samples(self) -> List[tracing.ClockSample]:
        return tracing.sample_clock(lambda: self.call(pb.ProfileRequest.CLOCK, 0),
                                    tracing.CLIENT.now, CLOCK_SAMPLES)

    def start(self) -> None:
        self.first = self.samples()
        self.session = self.call(pb.ProfileRequest.START, 0).session

    def stop(self):
        last = self.samples()
        rep = self.call(pb.ProfileRequest.STOP, self.session)
        return list(rep.processes), tracing.ClockMap(self.first, last)


class Profile:
    """The spans of one ``with pw.profile():`` block. Read it after the block."""

    def __init__(self) -> None:
        self.events: List[Event] = []
        self.processes: List[ProcessInfo] = []
        self.start_ns = 0               # the client's trace clock (perf_counter_ns)
        self.stop_ns = 0
        self.problems: List[str] = []   # processes that could not be profiled, and why
        self._links: Dict[str, _Link] = {}
        self._collected: list = []      # (link, [pb.ProcessTrace], ClockMap)
        self._lock = threading.RLock()
        self._state = None
        self._client_session = 0
        self._devices: list = []
        self._open = False

    # ------------------------------------------------------------------ the block
    def __enter__(self) -> "Profile":
        from . import runtime
        state = runtime.get_state()
        with state.lock:
            if state.profile is not None:
                raise PathwaysError("pw.profile() blocks do not nest; leave the open one "
                                    "first")
            if self._state is not None:
                raise PathwaysError("this profile was already used; start a new one with "
                                    "pw.profile()")
            state.profile = self
        self._state = state
        self._open = True
        self._client_session = tracing.CLIENT.start()
        timeout = min(state.timeout, 60.0)
        coord = _Link(lambda action, session: state.stub.Profile(
            pb.ProfileRequest(action=action, session=session), timeout=timeout),
            "coordinator")
        self._start_link("coordinator", coord)
        with state.lock:
            slices = list(state.slices)
        for s in slices:
            self._attach(s)
        self.start_ns = tracing.CLIENT.now()     # the window: the block, not the set-up
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        state = self._state
        try:
            with self._lock:
                links = dict(self._links)
            # Every op dispatched so far has run (and recorded) once its barrier returns.
            for key, link in links.items():
                if link.slice is not None and not link.slice.released:
                    try:
                        link.slice._conn.barrier()
                    except PathwaysError as e:
                        self.problems.append(f"{link.slice!r}: {e}")
            self.stop_ns = tracing.CLIENT.now()
            for key in list(links):
                self._stop_link(key)
            try:
                self._devices = [(d.island, d.host, d.index) for d in state.devices()]
            except Exception:       # the cluster is gone: utilization lists used devices
                self._devices = []
        finally:
            spans, dropped = tracing.CLIENT.stop(self._client_session)
            with state.lock:
                if state.profile is self:
                    state.profile = None
            self._open = False
            self._build(spans, dropped)
        if self.problems and exc_type is None:
            warnings.warn("pw.profile: some processes could not be profiled: " +
                          "; ".join(self.problems), RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ slices come and go
    def _attach(self, s) -> None:
        """Profile a slice's executor (at the start, or when it is created inside)."""
        conn = s._conn
        link = _Link(lambda action, session: conn.stub.Profile(
            pb.ProfileRequest(action=action, session=session),
            timeout=min(conn.timeout, 60.0)), "executor", s)
        self._start_link(s.id, link)

    def _detach(self, s) -> None:
        """Collect a slice's spans before it is released inside the block."""
        with self._lock:
            link = self._links.get(s.id)
        if link is None or not self._open:
            return
        try:
            s._conn.barrier()
        except PathwaysError as e:
            self.problems.append(f"{s!r}: {e}")
        self._stop_link(s.id)

    def _start_link(self, key: str, link: _Link) -> None:
        with self._lock:
            if key in self._links or not self._open:
                return
            self._links[key] = link
        try:
            link.start()
        except Exception as e:
            with self._lock:
                self._links.pop(key, None)
            self.problems.append(f"{key}: could not start profiling: {_why(e)}")

    def _stop_link(self, key: str) -> None:
        with self._lock:
            link = self._links.pop(key, None)
        if link is None:
            return
        try:
            traces, clock = link.stop()
        except Exception as e:
            self.problems.append(f"{key}: could not collect the spans: {_why(e)}")
            return
        with self._lock:
            self._collected.append((link, traces, clock))

    # ------------------------------------------------------------------ assembling
    def _build(self, client_spans, client_dropped: int) -> None:
        import os
        procs: List[Tuple[ProcessInfo, list, tracing.ClockMap]] = []
        client = ProcessInfo(1, "client", "client", os.getpid(), dropped=client_dropped)
        procs.append((client, client_spans, tracing.ClockMap.identity()))
        rest = []
        for link, traces, clock in self._collected:
            for k, t in enumerate(traces):
                info = ProcessInfo(0, t.process, link.kind, t.pid, dropped=t.dropped)
                if link.kind == "executor":
                    s = link.slice
                    info.island, info.host, info.slice_id = s.island, s.host, s.id
                    info.devices = tuple((d.island, d.host, d.index) for d in s.devices)
                elif k > 0:         # behind the coordinator: a worker agent
                    info.kind = "worker"
                    m = re.search(r"island (\d+) host (\d+)", t.process)
                    if m:
                        info.island, info.host = int(m.group(1)), int(m.group(2))
                # A forwarded trace is on its forwarder's clock already: add both.
                info.clock_offset_ns = clock.anchors[-1][1] + t.clock_offset_ns
                info.clock_error_ns = clock.error_ns + t.clock_error_ns
                rest.append((info, tracing.from_process_trace(t), clock))
        order = {"coordinator": 0, "worker": 1, "executor": 2}
        rest.sort(key=lambda r: (order[r[0].kind], r[0].island, r[0].host, r[0].slice_id))
        procs.extend(rest)
        events = []
        for pid, (info, spans, clock) in enumerate(procs, start=1):
            info.pid = pid
            for sp in spans:
                start = clock.to_local(sp.start_ns)
                end = clock.to_local(sp.start_ns + sp.dur_ns)
                events.append(Event(pid, info.name, sp.cat, sp.name,
                                    (start - self.start_ns) / 1e9,
                                    max(0.0, (end - start) / 1e9), sp.thread, sp.program,
                                    sp.buffer_ids, sp.bytes, sp.peer, sp.transfer_id,
                                    sp.detail))
        events.sort(key=lambda e: (e.start_s, -e.dur_s))
        self.processes = [p for p, _, _ in procs]
        self.events = events

    # ------------------------------------------------------------------ results
    @property
    def wall_s(self) -> float:
        """The profiled window: from entering the block to the last op's completion."""
        return max(0.0, (self.stop_ns - self.start_ns) / 1e9)

    def trace(self) -> dict:
        """The profile as a Chrome trace-event document (JSON object format)."""
        out: list = []
        for p in self.processes:
            out.append({"ph": "M", "name": "process_name", "pid": p.pid, "tid": 0,
                        "args": {"name": p.label}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": p.pid, "tid": 0,
                        "args": {"sort_index": p.pid}})
        tids: Dict[Tuple[int, str], int] = {}
        for e in self.events:
            if (e.pid, e.thread) not in tids:
                tid = tids[(e.pid, e.thread)] = len(tids) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": e.pid, "tid": tid,
                            "args": {"name": e.thread}})
        flows = _Flows(self)
        for n, e in enumerate(self.events):
            ts, dur = e.start_s * 1e6, e.dur_s * 1e6
            tid = tids[(e.pid, e.thread)]
            if e.cat == "queue":
                # Queue spans overlap each other: async slices, one per queued op.
                common = {"cat": "queue", "name": e.name, "id": f"q{n}", "pid": e.pid,
                          "tid": tid}
                out.append(dict(common, ph="b", ts=ts, args=e.args()))
                out.append(dict(common, ph="e", ts=ts + dur))
                continue
            out.append({"ph": "X", "cat": e.cat, "name": e.name, "ts": ts, "dur": dur,
                        "pid": e.pid, "tid": tid, "args": e.args()})
            flows.add(e, ts + dur / 2, tid, out)
        return {
            "traceEvents": out,
            "displayTimeUnit": "ms",
            "otherData": {
                "wall_s": self.wall_s,
                "clock_offsets_ns": {p.label: p.clock_offset_ns for p in self.processes},
                "clock_errors_ns": {p.label: p.clock_error_ns for p in self.processes},
                "problems": list(self.problems),
            },
        }

    def export(self, path: str) -> str:
        """Write the Chrome / Perfetto trace (JSON) to ``path``; returns ``path``."""
        with open(path, "w") as f:
            json.dump(self.trace(), f)
        return path

    def utilization(self) -> Dict[str, float]:
        """Busy time over wall time per device, ``"island I host H device D"`` ->
        fraction in [0, 1]: a device is busy while an execution of a slice holding it
        runs (every device of the slice, as SPMD runs on all of them); devices of the
        cluster that ran nothing give 0."""
        wall = self.wall_s
        busy: Dict[Tuple[int, int, int], list] = {d: [] for d in self._devices}
        by_pid = {p.pid: p for p in self.processes}
        spans: Dict[int, list] = {}
        for e in self.events:
            if e.cat == "execute" and by_pid[e.pid].kind == "executor":
                spans.setdefault(e.pid, []).append((e.start_s, e.end_s))
        for p in self.processes:
            if p.kind == "executor":
                for d in p.devices:
                    busy.setdefault(d, []).extend(spans.get(p.pid, []))
        return {f"island {i} host {h} device {d}":
                (busy_time(iv, 0.0, wall) / wall if wall > 0 else 0.0)
                for (i, h, d), iv in sorted(busy.items())}

    def plot(self, path: str) -> str:
        """Draw a timeline (PNG, or any format matplotlib infers from ``path``): the
        client and coordinator, then each host's agent and executors; executions (and the
        client's dispatches) are bars coloured by program, transfers black bars below
        them, the rest (puts, fetches, compiles, RPCs) grey bars at the bottom."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        rows = [p for p in self.processes if p.kind in ("client", "coordinator")]
        rows += sorted((p for p in self.processes if p.kind in ("worker", "executor")),
                       key=lambda p: (p.island, p.host, p.kind != "worker", p.slice_id))
        util = self._slice_utilization()
        programs = sorted({e.program or e.name for e in self.events if e.cat == "execute"})
        palette = _palette(len(programs))
        color = dict(zip(programs, palette))
        fig = Figure(figsize=(12, 1.2 + 0.45 * len(rows)))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        labels = []
        for y, p in enumerate(rows):
            if p.kind == "executor":
                labels.append(f"i{p.island} h{p.host} {p.slice_id} "
                              f"({100 * util.get(p.pid, 0.0):.0f}% busy)")
            elif p.kind == "worker":
                labels.append(f"i{p.island} h{p.host} agent")
            else:
                labels.append(p.name)
            mine = [e for e in self.events if e.pid == p.pid]
            # top band: executions (executors) and program dispatches (client), coloured
            # by program; then transfers (black); then everything else (grey)
            main = [e for e in mine if e.cat == "execute" or
                    (e.cat == "dispatch" and (e.program or e.name) in color)]
            xfer = [e for e in mine if e.cat == "transfer"]
            other = [e for e in mine if e.cat not in ("queue", "transfer") and
                     e not in main]
            for band, spans, colors in (
                    ((y - 0.42, 0.5), main, [color[e.program or e.name] for e in main]),
                    ((y + 0.1, 0.14), xfer, "black"),
                    ((y + 0.27, 0.14), other, "0.65")):
                if spans:
                    ax.broken_barh([(e.start_s * 1e3, max(e.dur_s * 1e3, 2e-3))
                                    for e in spans], band, facecolors=colors)
            if y and (rows[y - 1].island, rows[y - 1].host) != (p.island, p.host):
                ax.axhline(y - 0.5, color="0.85", linewidth=0.8)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlim(0, max(self.wall_s * 1e3, 1e-3))
        ax.set_xlabel("ms since the profile started (client clock)")
        ax.set_title(f"pw.profile: {len(rows)} processes, {self.wall_s * 1e3:.1f} ms")
        handles = [Patch(color=color[p], label=p) for p in programs[:20]]
        handles.append(Patch(color="black", label="transfer"))
        handles.append(Patch(color="0.65", label="other: put, fetch, wait, compile, rpc"))
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return path

    def _slice_utilization(self) -> Dict[int, float]:
        wall = self.wall_s
        spans: Dict[int, list] = {}
        for e in self.events:
            if e.cat == "execute":
                spans.setdefault(e.pid, []).append((e.start_s, e.end_s))
        return {pid: busy_time(iv, 0.0, wall) / wall if wall > 0 else 0.0
                for pid, iv in spans.items()}

    def __repr__(self) -> str:
        return (f"Profile({len(self.events)} events from {len(self.processes)} processes, "
                f"{self.wall_s * 1e3:.1f} ms)")


class _Flows:
    """Arrows in the trace: a client dispatch to its execution, a send to its receipt."""

    def __init__(self, prof: Profile) -> None:
        self.slice_of = {p.pid: p.slice_id for p in prof.processes}
        self.starts: Dict[tuple, int] = {}
        ends = set()
        for e in prof.events:
            key = self._key(e)
            if key is not None and key[0] == "end":
                ends.add(key[1])
        self.ends = ends
        self.ids = iter(range(1, 1 << 62))
        self.open: Dict[tuple, int] = {}

    def _key(self, e: Event):
        if e.cat == "dispatch" and e.program and e.buffer_ids:
            return ("start", ("exec", e.detail, e.buffer_ids[0]))
        if e.cat == "execute" and e.buffer_ids and self.slice_of.get(e.pid):
            return ("end", ("exec", self.slice_of[e.pid], e.buffer_ids[0]))
        if e.cat == "transfer" and e.transfer_id and e.name == "send":
            return ("start", ("xfer", e.transfer_id))
        if e.cat == "transfer" and e.transfer_id and e.name == "recv to device":
            return ("end", ("xfer", e.transfer_id))
        return None

    def add(self, e: Event, ts: float, tid: int, out: list) -> None:
        key = self._key(e)
        if key is None:
            return
        side, k = key
        if side == "start" and k in self.ends:
            fid = self.open[k] = next(self.ids)
            out.append({"ph": "s", "cat": "flow", "name": k[0], "id": fid, "ts": ts,
                        "pid": e.pid, "tid": tid})
        elif side == "end" and k in self.open:
            out.append({"ph": "f", "bp": "e", "cat": "flow", "name": k[0],
                        "id": self.open.pop(k), "ts": ts, "pid": e.pid, "tid": tid})


def busy_time(intervals: Sequence[Tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi] (pure)."""
    total, cur_start, cur_end = 0.0, None, None
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _palette(n: int) -> list:
    from matplotlib import colormaps
    cmap = colormaps["tab20" if n > 10 else "tab10"]
    return [cmap(i % cmap.N) for i in range(n)]


def _why(e: Exception) -> str:
    details = getattr(e, "details", None)
    return details() if callable(details) else f"{type(e).__name__}: {e}"


def profile() -> Profile:
    """Profile the block: spans from the client, the coordinator, every worker agent and
    every executor, on the client's clock.

    Example::

        with pw.profile() as prof:
            y = layer(x, w)
            y.torch()
        prof.export("trace.json")    # Chrome / Perfetto
        print(prof.utilization())    # busy / wall per device
        prof.plot("util.png")
    """
    return Profile()
