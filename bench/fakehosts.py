"""Fake hosts that speak the real protocol to the real coordinator (issue 12, part 5).

One asyncio process (grpc.aio) holds N fake hosts. Each opens the coordinator's
``RegisterWorker`` stream as a worker agent does (a ``register`` message, then a beat
every ``heartbeat_s``, reading the coordinator's answers; as UDP datagrams when the
coordinator offers them, from one socket shared by the fleet, after the first answer
comes back that way), and can be told to close its
stream (a crashed host: the coordinator must notice at once), to go silent with its
connection open (a hung host: it must be noticed within ``lost_after_s``) or to come
back on a fresh stream. Each host has its own connection, as real hosts do. One fake
worker agent (the ``Worker`` service) answers ``StartExecutor`` for every host at once,
pointing at one fake executor (the ``Executor`` service) shared by every slice, which
answers ``Dispatch`` barriers, ``Wait`` and ``Stats`` at once, so a real client can run
against the cluster.

The pieces, for ``bench/scale.py`` and ``tests/test_scale.py``:

- ``Coordinator``: the real coordinator as a subprocess (``python -m
  pathways_torch.coordinator``), its port, CPU, RSS and threads from /proc; stopped with
  SIGTERM, then SIGKILL.
- ``Fleet``: the fake hosts, agent and executor inside an event loop (async API).
- ``FleetThread``: a ``Fleet`` on an event loop in a thread of this process (sync API).
- ``FleetProcess``: the same sync API, the ``Fleet`` in a subprocess of its own
  (``python bench/fakehosts.py``, JSON lines on stdin/stdout), so that timing in the
  caller's process does not share a GIL with thousands of streams.
- ``Session``: a client session stream (open, then beats) held from a thread, for
  calling ``AllocateSlice``/``Schedule`` with raw stubs.

The harness binds port 0 everywhere and speaks plain text on loopback (no TLS); it
sends the cluster token if ``PATHWAYS_TOKEN`` is set.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

import grpc

from pathways_torch.rpc import beats, grpc_util
from pathways_torch.rpc import pathways_pb2 as pb
from pathways_torch.rpc import pathways_pb2_grpc as pbg

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")
ISLAND_SIZE = 64


class HarnessError(RuntimeError):
    """Something in the harness (not a measurement) went wrong."""


def _metadata():
    t = grpc_util.token()
    return ((grpc_util.TOKEN_KEY, t),) if t else None


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# ---------------------------------------------------------------------------- /proc

def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK_TCK


def proc_status(pid: int) -> dict:
    """RSS (MiB) and threads of ``pid`` from /proc/<pid>/status."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_mib"] = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    return out


def proc_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


# ---------------------------------------------------------------------------- coordinator

_HELP_CACHE: Dict[str, str] = {}


def coordinator_flags() -> str:
    """The coordinator's ``--help`` text (cached): which flags this tree has."""
    if "help" not in _HELP_CACHE:
        r = subprocess.run([sys.executable, "-m", "pathways_torch.coordinator", "--help"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        _HELP_CACHE["help"] = r.stdout
    return _HELP_CACHE["help"]


class Coordinator:
    """The real coordinator in a subprocess on 127.0.0.1, port 0.

    ``flags`` maps option names without dashes ("heartbeat_s", "max_hosts") to values
    (None: left out). With ``drop_unknown``, flags this tree's coordinator does not
    have are left out and listed in ``dropped``; otherwise an unknown flag makes the
    start fail with the coordinator's own message.
    """

    def __init__(self, flags: Optional[dict] = None, drop_unknown: bool = False,
                 timeout: float = 60.0, env: Optional[dict] = None) -> None:
        argv = [sys.executable, "-m", "pathways_torch.coordinator", "--host", "127.0.0.1",
                "--port", "0", "--parent-pid", str(os.getpid())]
        self.dropped: List[str] = []
        self.flags = {}
        for name, value in (flags or {}).items():
            if value is None:
                continue
            opt = "--" + name.replace("_", "-")
            if drop_unknown and opt not in coordinator_flags():
                self.dropped.append(opt)
                continue
            self.flags[name] = value
            argv += [opt, str(value)]
        self._log = tempfile.NamedTemporaryFile(prefix="pathways-scale-coordinator-",
                                                suffix=".log", delete=False)
        self.log_path = self._log.name
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True,
                                     env=dict(os.environ, **(env or {})))
        self.pid = self.proc.pid
        self.port = 0
        try:
            lines: "queue.Queue" = queue.Queue()
            threading.Thread(target=self._drain, args=(lines,), daemon=True).start()
            deadline = time.monotonic() + timeout
            while not self.port:
                try:
                    line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    raise HarnessError(f"the coordinator did not print its port within "
                                       f"{timeout:.0f} s:\n{_tail(self.log_path)}") from None
                if line is None:
                    raise HarnessError(f"the coordinator exited ({self.proc.wait()}) "
                                       f"before serving:\n{_tail(self.log_path)}")
                if line.startswith("PATHWAYS_COORDINATOR_PORT="):
                    self.port = int(line.split("=", 1)[1])
        except BaseException:
            self.stop()
            raise
        self.address = f"127.0.0.1:{self.port}"

    def _drain(self, lines) -> None:
        for line in self.proc.stdout:
            lines.put(line.strip())
        lines.put(None)

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)

    def status(self) -> dict:
        return dict(proc_status(self.pid), fds=proc_fds(self.pid))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        return _tail(self.log_path, n)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; removes the log file."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()
        if not os.environ.get("PATHWAYS_KEEP_LOGS"):
            try:
                os.unlink(self.log_path)
            except OSError:
                pass

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------- fake services

class FakeAgent(pbg.WorkerServicer):
    """One worker agent for every fake host: executors start at once, all the same."""

    def __init__(self, fleet: "Fleet") -> None:
        self.fleet = fleet

    async def StartExecutor(self, request, context):
        self.fleet.counts["start_executor"] += 1
        return pb.StartExecutorReply(address=self.fleet.executor_address, pid=os.getpid(),
                                     data_address="127.0.0.1:9", memory_budget=1 << 30)

    async def StopExecutor(self, request, context):
        self.fleet.counts["stop_executor"] += 1
        return pb.Empty()

    async def ExecutorReady(self, request, context):
        return pb.Empty()

    async def Profile(self, request, context):
        now = time.monotonic_ns()
        return pb.ProfileReply(recv_ns=now, reply_ns=time.monotonic_ns(),
                               session=1 if request.action == pb.ProfileRequest.START else 0)


def _barriers(ops):
    for op in ops:
        kind = op.WhichOneof("kind")
        if kind == "barrier":
            yield op.barrier.token
        elif kind == "gang":
            yield from _barriers(op.gang.ops)


class FakeExecutor(pbg.ExecutorServicer):
    """One executor for every slice: barriers answered, every buffer ready at once."""

    def __init__(self, fleet: "Fleet") -> None:
        self.fleet = fleet

    async def Dispatch(self, request_iterator, context):
        counts = self.fleet.counts
        counts["dispatch_streams"] += 1
        seq = 0
        async for batch in request_iterator:
            counts["op_batches"] += 1
            counts["ops"] += len(batch.ops)
            asked = False
            for op in batch.ops:
                if op.WhichOneof("kind") != "release":
                    seq += 1
                asked = asked or op.WhichOneof("kind") == "watch"
            for token in _barriers(batch.ops):
                counts["barriers"] += 1
                yield pb.DispatchEvent(barrier=token)
            if asked:                   # every op completes at once: one watermark
                counts["watermarks"] += 1
                yield pb.DispatchEvent(done_seq=seq)

    async def Wait(self, request, context):
        n = len(request.buffer_ids)
        self.fleet.counts["waits"] += 1
        return pb.WaitReply(failed=[False] * n, errors=[pb.BufferError()] * n)

    async def Stats(self, request, context):
        self.fleet.counts["stats"] += 1
        return pb.StatsReply(num_devices=1, memory_budget=1 << 30, pid=os.getpid())


# ---------------------------------------------------------------------------- fake hosts

class FakeHost:
    """One host's session stream: register, then a beat every heartbeat_s."""

    def __init__(self, fleet: "Fleet", index: int, island: int, host: int,
                 num_devices: int) -> None:
        self.fleet = fleet
        self.index, self.island, self.host = index, island, host
        self.num_devices = num_devices
        self.state = "new"          # new, up, silent, closed, ended, failed
        self.channel = None
        self.call = None
        self.worker_id = ""
        self.heartbeat_s = 1.0
        self.lost_after_s = 0.0
        self.beat = 0
        self.last_beat = 0.0        # time.monotonic() of the last beat sent
        self.error: Optional[dict] = None
        self._sent: Dict[int, float] = {}
        self._tasks: List[asyncio.Task] = []
        self.beat_id, self.beat_key = 0, b""     # datagram beats, when offered
        self.udp_ok = False
        self.phase = 0.0

    async def register(self, timeout: float) -> None:
        """Open a fresh stream and wait for the first event; sets state/error."""
        self.error = None
        if self.channel is None:
            self.channel = self.fleet.host_channel()
        stub = pbg.CoordinatorStub(self.channel)
        self.call = call = stub.RegisterWorker(metadata=_metadata())
        self.beat = 0
        try:
            await call.write(pb.WorkerUp(register=pb.RegisterWorkerRequest(
                island=self.island, host=self.host, num_devices=self.num_devices,
                kind="CPU", address=self.fleet.agent_address, pid=os.getpid())))
            # On a timeout wait_for cancels the read, which cancels the call.
            ev = await asyncio.wait_for(call.read(), timeout)
            if ev is grpc.aio.EOF:
                code = await call.code()
                raise HarnessError(f"stream ended before the first event "
                                   f"({code.name}: {await call.details()})")
        except grpc.aio.AioRpcError as e:
            self.state = "failed"
            self.error = {"code": e.code().name, "details": e.details()}
            return
        except asyncio.TimeoutError:
            self.state = "failed"
            self.error = {"code": "TIMEOUT",
                          "details": f"no first event within {timeout:g} s"}
            return
        except Exception as e:      # noqa: BLE001 (recorded, the fleet goes on)
            self.state = "failed"
            self.error = {"code": type(e).__name__, "details": str(e)}
            return
        self.worker_id = ev.worker_id
        self.heartbeat_s = ev.heartbeat_s or 1.0
        self.lost_after_s = ev.lost_after_s
        self.fleet.forget_beats(self)
        self.udp_ok = False
        if ev.beat_port and self.fleet.udp is not None:
            self.beat_id, self.beat_key = ev.beat_id, ev.beat_key
            self.phase = ev.beat_phase_s
            self.fleet.beat_hosts[ev.beat_id] = self
            self.fleet.beat_port = ev.beat_port
        self.state = "up"
        self.last_beat = time.monotonic()
        self._tasks = [asyncio.ensure_future(self._beats(call)),
                       asyncio.ensure_future(self._answers(call))]

    async def _beats(self, call) -> None:
        # Never cancelled while inside call.write (that would cancel the call): the
        # loop checks the state after each sleep instead.
        try:
            while self.state == "up" and self.call is call:
                # on multiples of heartbeat_s on the wall clock, as the real agent beats
                await asyncio.sleep(grpc_util.until_beat(self.heartbeat_s, self.phase))
                if self.state != "up" or self.call is not call:
                    return
                self.beat += 1
                now = time.monotonic()
                self._sent[self.beat] = now
                if len(self._sent) > 64:        # answers that never came
                    self._sent.pop(min(self._sent))
                self.last_beat = now
                if self.beat_id:
                    self.fleet.send_beat(self)
                if not self.udp_ok:
                    await call.write(pb.WorkerUp(beat=self.beat))
                self.fleet.beats_sent += 1
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError) as e:
            self._ended(call, e)

    async def _answers(self, call) -> None:
        try:
            while True:
                ev = await call.read()
                if ev is grpc.aio.EOF:
                    self._ended(call, None, f"ended by the coordinator "
                                f"({(await call.code()).name}: {await call.details()})")
                    return
                if self.state != "up" or self.call is not call:
                    return          # silent: stop reading (the call stays open)
                if ev.beat:
                    self.answered(ev.beat)
        except grpc.aio.AioRpcError as e:
            self._ended(call, e)

    def answered(self, beat: int) -> None:
        t = self._sent.pop(beat, None)
        if t is not None:
            self.fleet.rtts.append(time.monotonic() - t)
            self.fleet.beats_answered += 1

    def _ended(self, call, e, text: str = "") -> None:
        if self.call is not call:
            return
        if e is not None:
            if e.code() == grpc.StatusCode.CANCELLED and self.state == "closed":
                return
            text = f"{e.code().name}: {e.details()}"
        if self.state in ("up", "silent"):
            self.state = "ended"
            self.error = {"code": "ENDED", "details": text}

    def close(self) -> None:
        """Cancel the stream (a crashed host): the coordinator should notice at once."""
        self.state = "closed"
        if self.call is not None:
            self.call.cancel()

    def go_silent(self) -> None:
        """Stop beating and reading, keep the connection and the stream open."""
        if self.state == "up":
            self.state = "silent"

    async def resume(self, timeout: float) -> None:
        """Come back: drop the old stream, register again on a fresh one."""
        old, self.call = self.call, None
        if old is not None:
            old.cancel()
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        await self.register(timeout)

    async def shutdown(self) -> None:
        self.state = "closed"
        if self.call is not None:
            self.call.cancel()
        for t in self._tasks:
            t.cancel()
        if self.channel is not None:
            await self.channel.close()
            self.channel = None


class Fleet:
    """N fake hosts, one fake agent and one fake executor, in one event loop.

    ``conn_per_host`` (default) gives every host its own TCP connection to the
    coordinator, as separate machines have; False multiplexes all on one. At most
    ``concurrency`` registrations are in flight at once.
    """

    def __init__(self, coordinator: str, conn_per_host: bool = True,
                 concurrency: int = 128) -> None:
        self.coordinator = coordinator
        self.conn_per_host = conn_per_host
        self.concurrency = concurrency
        self.hosts: Dict[int, FakeHost] = {}
        self.counts: collections.Counter = collections.Counter()
        self.rtts: collections.deque = collections.deque(maxlen=50000)
        self.beats_sent = self.beats_answered = 0
        self._shared = None
        self._servers: list = []
        self.agent_address = self.executor_address = ""
        self.udp = None                 # the fleet's one beat socket (a transport)
        self.beat_port = 0
        self.beat_hosts: Dict[int, FakeHost] = {}      # beat id -> host

    async def start(self) -> dict:
        agent = grpc.aio.server(options=grpc_util.SERVER_OPTIONS)
        pbg.add_WorkerServicer_to_server(FakeAgent(self), agent)
        aport = grpc_util.add_port(agent, "127.0.0.1:0")
        executor = grpc.aio.server(options=grpc_util.SERVER_OPTIONS)
        pbg.add_ExecutorServicer_to_server(FakeExecutor(self), executor)
        eport = grpc_util.add_port(executor, "127.0.0.1:0")
        self._servers = [agent, executor]
        await agent.start()
        await executor.start()
        self.agent_address = f"127.0.0.1:{aport}"
        self.executor_address = f"127.0.0.1:{eport}"
        self._control = grpc.aio.insecure_channel(self.coordinator, options=grpc_util.OPTIONS)
        self.stub = pbg.CoordinatorStub(self._control)
        fleet = self

        class Answers(asyncio.DatagramProtocol):
            def datagram_received(self, data, addr):
                fleet._answer(data)

        self.udp, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            Answers, local_addr=("127.0.0.1", 0))
        self.udp.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF,
                                                     beats.RCVBUF)
        return self.info()

    def send_beat(self, h: FakeHost) -> None:
        self.udp.sendto(beats.pack(beats.BEAT, h.beat_id, h.beat, h.beat_key),
                        (beats.host_of(self.coordinator), self.beat_port))

    def _answer(self, data: bytes) -> None:
        got = beats.unpack(data, lambda i: getattr(self.beat_hosts.get(i), "beat_key", None))
        if got is None or got[0] != beats.ANSWER:
            return
        h = self.beat_hosts[got[1]]
        if h.state != "up":
            return                  # silent: it does not read
        h.udp_ok = True
        h.answered(got[2])

    def forget_beats(self, h: FakeHost) -> None:
        if h.beat_id and self.beat_hosts.get(h.beat_id) is h:
            del self.beat_hosts[h.beat_id]
        h.beat_id, h.phase = 0, 0.0

    def info(self) -> dict:
        return {"pid": os.getpid(), "agent_address": self.agent_address,
                "executor_address": self.executor_address, "coordinator": self.coordinator}

    def host_channel(self):
        if not self.conn_per_host:
            if self._shared is None:
                self._shared = grpc.aio.insecure_channel(self.coordinator,
                                                         options=grpc_util.OPTIONS)
            return self._shared
        # A local subchannel pool: a connection of its own, not the process-wide one.
        return grpc.aio.insecure_channel(
            self.coordinator,
            options=grpc_util.OPTIONS + [("grpc.use_local_subchannel_pool", 1)])

    # ------------------------------------------------------------------ registration
    async def register(self, n: int, devices: int = 4, island_size: int = ISLAND_SIZE,
                       first: int = 0, timeout: float = 60.0, confirm: bool = True) -> dict:
        """Register hosts first..first+n-1 (island i // island_size, host i % island_size)
        and, with ``confirm``, wait until ListDevices counts every live one.

        Returns register_s (from the first registration until ListDevices shows them
        all), first_events_s (until the last first event came back), the number that
        registered, and the failures by code with one example each.
        """
        sem = asyncio.Semaphore(self.concurrency)
        new = []
        for i in range(first, first + n):
            if i in self.hosts and self.hosts[i].state in ("up", "silent"):
                raise HarnessError(f"fake host {i} is already registered")
            h = FakeHost(self, i, i // island_size, i % island_size, devices)
            self.hosts[i] = h
            new.append(h)

        async def one(h):
            async with sem:
                await h.register(timeout)

        t0 = time.monotonic()
        await asyncio.gather(*(one(h) for h in new))
        t_events = time.monotonic() - t0
        ok = [h for h in new if h.state == "up"]
        errors: dict = {}
        for h in new:
            if h.error is not None:
                e = errors.setdefault(h.error["code"], {"count": 0, "example": h.error,
                                                        "hosts": []})
                e["count"] += 1
                if len(e["hosts"]) < 16:
                    e["hosts"].append(h.index)
        out = {"hosts": n, "registered": len(ok), "first_events_s": t_events,
               "errors": errors}
        if confirm and ok:
            want = sum(1 for h in self.hosts.values() if h.state == "up")
            deadline = t0 + timeout
            while True:
                rep = await self.stub.ListDevices(pb.ListDevicesRequest(), timeout=30,
                                                  metadata=_metadata())
                if rep.registered_workers >= want:
                    out["register_s"] = time.monotonic() - t0
                    break
                if time.monotonic() > deadline:
                    out["confirm_error"] = (f"ListDevices shows {rep.registered_workers} "
                                            f"of {want} hosts registered after {timeout:g} s")
                    break
                await asyncio.sleep(0.01)
            out["listed_workers"] = rep.registered_workers
            out["listed_devices"] = len(rep.devices)
        if ok:
            out["heartbeat_s"] = ok[0].heartbeat_s
            out["lost_after_s"] = ok[0].lost_after_s
        return out

    # ------------------------------------------------------------------ faults
    def _host(self, i: int) -> FakeHost:
        if i not in self.hosts:
            raise HarnessError(f"no fake host {i}")
        return self.hosts[i]

    async def close_host(self, i: int) -> dict:
        self._host(i).close()
        return {"t": time.monotonic()}

    async def silence(self, i: int) -> dict:
        self._host(i).go_silent()
        return {"t": time.monotonic()}

    async def resume(self, i: int, timeout: float = 30.0) -> dict:
        h = self._host(i)
        await h.resume(timeout)
        return {"state": h.state, "error": h.error, "worker_id": h.worker_id}

    async def host_state(self, i: int) -> dict:
        h = self._host(i)
        return {"index": i, "island": h.island, "host": h.host, "state": h.state,
                "error": h.error, "worker_id": h.worker_id, "beat": h.beat}

    async def notice(self, indices: List[int], how: str, timeout: float = 30.0,
                     poll_s: float = 0.02) -> dict:
        """Close or silence the hosts ``indices`` at once, then poll ListDevices (per
        island) until each one's devices show "lost". Returns, per host, seconds from
        the fault (and, for silence, from its last beat) to the coordinator's "lost"."""
        hosts = [self._host(i) for i in indices]
        t0 = time.monotonic()
        for h in hosts:
            if how == "close":
                h.close()
            elif how == "silent":
                h.go_silent()
            else:
                raise HarnessError(f"how must be 'close' or 'silent', not {how!r}")
        last_beats = {h.index: h.last_beat for h in hosts}
        left = {h.index: h for h in hosts}
        found: Dict[int, float] = {}
        while left:
            now = time.monotonic()
            if now - t0 > timeout:
                break
            for island in sorted({h.island for h in left.values()}):
                rep = await self.stub.ListDevices(
                    pb.ListDevicesRequest(island=island, has_island=True), timeout=30,
                    metadata=_metadata())
                t = time.monotonic()
                states = collections.defaultdict(list)
                for d in rep.devices:
                    states[(d.island, d.host)].append(d.state)
                for i, h in list(left.items()):
                    s = states.get((h.island, h.host))
                    if h.island == island and s and all(x == "lost" for x in s):
                        found[i] = t
                        del left[i]
            await asyncio.sleep(poll_s)
        return {"how": how, "hosts": list(indices),
                "seconds": [found[i] - t0 if i in found else None for i in indices],
                "since_last_beat_s": [found[i] - last_beats[i] if i in found else None
                                      for i in indices],
                "not_noticed": sorted(left), "timeout_s": timeout}

    # ------------------------------------------------------------------ inspection
    async def list_devices(self, island: Optional[int] = None) -> dict:
        req = (pb.ListDevicesRequest() if island is None
               else pb.ListDevicesRequest(island=island, has_island=True))
        rep = await self.stub.ListDevices(req, timeout=30, metadata=_metadata())
        return {"registered_workers": rep.registered_workers,
                "devices": [[d.island, d.host, d.index, d.kind, d.state, d.slice_id]
                            for d in rep.devices]}

    async def stats(self, reset: bool = False) -> dict:
        """Counters of the fake services, beats sent/answered, beat round trips (ms),
        hosts by state. ``reset`` starts a new window for the beats and round trips."""
        rtts = sorted(self.rtts)

        def q(p):
            return rtts[min(len(rtts) - 1, int(p * len(rtts)))] * 1e3 if rtts else None
        out = {"counts": dict(self.counts), "beats_sent": self.beats_sent,
               "beats_answered": self.beats_answered, "beat_rtt_ms_p50": q(0.5),
               "beat_rtt_ms_p99": q(0.99), "beat_rtt_ms_max": q(1.0),
               "hosts": dict(collections.Counter(h.state for h in self.hosts.values()))}
        if reset:
            self.rtts.clear()
            self.beats_sent = self.beats_answered = 0
        return out

    async def stop(self) -> None:
        await asyncio.gather(*(h.shutdown() for h in self.hosts.values()),
                             return_exceptions=True)
        if self._shared is not None:
            await self._shared.close()
        await self._control.close()
        for s in self._servers:
            await s.stop(0.2)
        if self.udp is not None:
            self.udp.close()


# ---------------------------------------------------------------------------- sync forms

class _SyncFleet:
    """The sync API of FleetThread and FleetProcess: each method runs one Fleet call."""

    def do(self, cmd: str, wait_s: Optional[float] = None, **kw):
        raise NotImplementedError

    def register(self, n: int, devices: int = 4, island_size: int = ISLAND_SIZE,
                 first: int = 0, timeout: float = 60.0, confirm: bool = True) -> dict:
        return self.do("register", timeout + 60, n=n, devices=devices,
                       island_size=island_size, first=first, timeout=timeout,
                       confirm=confirm)

    def close_host(self, i: int) -> dict:
        return self.do("close_host", 30, i=i)

    def silence(self, i: int) -> dict:
        return self.do("silence", 30, i=i)

    def resume(self, i: int, timeout: float = 30.0) -> dict:
        return self.do("resume", timeout + 30, i=i, timeout=timeout)

    def host_state(self, i: int) -> dict:
        return self.do("host_state", 30, i=i)

    def notice(self, indices: List[int], how: str, timeout: float = 30.0) -> dict:
        return self.do("notice", timeout + 60, indices=list(indices), how=how,
                       timeout=timeout)

    def list_devices(self, island: Optional[int] = None) -> dict:
        return self.do("list_devices", 60, island=island)

    def stats(self, reset: bool = False) -> dict:
        return self.do("stats", 30, reset=reset)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class FleetThread(_SyncFleet):
    """A Fleet on an event loop in a daemon thread of this process."""

    def __init__(self, coordinator: str, **kw) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="fakehosts", daemon=True)
        self.thread.start()
        self.fleet = Fleet(coordinator, **kw)
        try:
            self.info = self._call(self.fleet.start(), 60)
        except BaseException:
            self.stop()
            raise
        self.pid = os.getpid()

    def cpu_s(self) -> float:
        """CPU seconds of this whole process (the fleet shares it)."""
        return proc_cpu_s(os.getpid())

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _call(self, coro, timeout: Optional[float]):
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def do(self, cmd: str, wait_s: Optional[float] = None, **kw):
        return self._call(getattr(self.fleet, cmd)(**kw), wait_s)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        if self.thread.is_alive():
            try:
                if getattr(self.fleet, "_servers", None):
                    self._call(self.fleet.stop(), 30)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


class FleetProcess(_SyncFleet):
    """A Fleet in its own process (``python bench/fakehosts.py``), driven over pipes."""

    def __init__(self, coordinator: str, conn_per_host: bool = True,
                 concurrency: int = 128, timeout: float = 60.0) -> None:
        argv = [sys.executable, str(pathlib.Path(__file__).resolve()),
                "--coordinator", coordinator, "--parent-pid", str(os.getpid()),
                "--concurrency", str(concurrency)]
        if not conn_per_host:
            argv.append("--shared-connection")
        self._log = tempfile.NamedTemporaryFile(prefix="pathways-scale-fleet-",
                                                suffix=".log", delete=False)
        self.log_path = self._log.name
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.pid = self.proc.pid
        self._lines: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._drain, daemon=True).start()
        try:
            self.info = self._read(timeout)["ready"]
        except BaseException:
            self.stop()
            raise

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read(self, timeout: Optional[float]) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise HarnessError(f"the fake hosts' process did not answer within {timeout} s"
                               f"\n{_tail(self.log_path)}") from None
        if line is None:
            raise HarnessError(f"the fake hosts' process exited ({self.proc.wait()}):\n"
                               f"{_tail(self.log_path)}")
        return json.loads(line)

    def do(self, cmd: str, wait_s: Optional[float] = None, **kw):
        with self._lock:
            if self.proc.poll() is not None:
                raise HarnessError(f"the fake hosts' process exited ({self.proc.returncode})"
                                   f":\n{_tail(self.log_path)}")
            self.proc.stdin.write(json.dumps({"cmd": cmd, "args": kw}) + "\n")
            self.proc.stdin.flush()
            msg = self._read(wait_s)
        if "error" in msg:
            raise HarnessError(f"fake hosts: {cmd} failed: {msg['error']}")
        return msg["result"]

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)

    def log_tail(self, n: int = 3000) -> str:
        return _tail(self.log_path, n)

    def stop(self) -> None:
        """Ask it to quit (it closes every stream and server), then SIGKILL after 15 s."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if not os.environ.get("PATHWAYS_KEEP_LOGS"):
            try:
                os.unlink(self.log_path)
            except OSError:
                pass


# ---------------------------------------------------------------------------- client session

class Session:
    """A client session held open from a thread (open, then a beat every heartbeat_s),
    for raw ``AllocateSlice``/``ReleaseSlice``/``Schedule`` calls with ``stub``."""

    def __init__(self, address: str, name: str = "scale", timeout: float = 30.0) -> None:
        self.channel = grpc_util.channel(address)
        self.stub = pbg.CoordinatorStub(self.channel)
        self._stop = threading.Event()
        self._opened = threading.Event()
        self.heartbeat_s = 1.0
        self.lost_slices: List[str] = []
        self.call = self.stub.OpenSession(self._requests(name))
        timer = threading.Timer(timeout, self.call.cancel)
        timer.daemon = True
        timer.start()
        try:
            first = next(self.call)
        except grpc.RpcError as e:
            self.close()
            raise HarnessError(f"OpenSession failed: {e.code().name}: {e.details()}") \
                from None
        finally:
            timer.cancel()
        self.client_id = first.client_id
        self.heartbeat_s = first.heartbeat_s or 1.0
        self._opened.set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self, name: str):
        yield pb.SessionUp(open=pb.OpenSessionRequest(name=name, pid=os.getpid(),
                                                      share=1.0))
        self._opened.wait()
        n = 0
        while not self._stop.wait(self.heartbeat_s):
            n += 1
            yield pb.SessionUp(beat=n)

    def _read(self) -> None:
        try:
            for ev in self.call:
                self.lost_slices.extend(ev.lost_slices)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._opened.set()
        self.call.cancel()
        self.channel.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------- subprocess main

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="fake hosts, driven by JSON lines on stdin")
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--parent-pid", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--shared-connection", action="store_true")
    args = ap.parse_args(argv)
    if args.parent_pid:
        from pathways_torch import _proc
        _proc.die_with_parent(args.parent_pid)
    out = sys.stdout
    sys.stdout = sys.stderr             # only protocol lines on the pipe
    fleet = FleetThread(args.coordinator, conn_per_host=not args.shared_connection,
                        concurrency=args.concurrency)
    try:
        out.write(json.dumps({"ready": fleet.info}) + "\n")
        out.flush()
        for line in sys.stdin:
            msg = json.loads(line)
            if msg.get("cmd") == "quit":
                break
            try:
                reply = {"result": fleet.do(msg["cmd"], None, **msg.get("args", {}))}
            except Exception as e:      # noqa: BLE001 (the caller decides)
                reply = {"error": f"{type(e).__name__}: {e}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        fleet.stop()


if __name__ == "__main__":
    main()
