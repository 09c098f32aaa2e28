"""The Coordinator gRPC service: worker registration, client sessions, slices.

It runs on one asyncio event loop (grpc.aio): a worker's or a client's session stream is
a coroutine, not a pool thread, so thousands of hosts cost memory, not threads, and no
host or client can starve the short calls. Read deadlines on both kinds of stream are
kept by one sweeper task (see ``_Peer``). Workers beat as UDP datagrams (``_BeatSocket``,
``rpc/beats.py``) once one has come back, on their stream until then. Explicit limits (``--max-hosts``,
``--max-sessions``) answer RESOURCE_EXHAUSTED naming the flag, never hang.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
import time
import uuid
from typing import Dict, Optional

import grpc
from google.protobuf.message import DecodeError

from .. import _proc, tracing
from ..rpc import beats, grpc_util, validate
from ..rpc import pathways_pb2 as pb
from ..rpc import pathways_pb2_grpc as pbg
from .resources import AllocationError, Host, ResourceManager, host_rows
from .scheduler import GangScheduler

log = logging.getLogger("pathways.coordinator")

HEARTBEAT_S = 2.0
LOST_AFTER_S = 4.5
#: The coordinator answers every ANSWER_EVERY-th beat: enough for the peer's read
#: deadline (``peer_deadline``), half the messages to write.
ANSWER_EVERY = 2
SESSION_GRACE_S = 60.0
MAX_HOSTS = 16384
MAX_SESSIONS = 1024
# After Shutdown, answer "shut down" this long to workers still registering.
SHUTDOWN_LINGER_S = 2.0


class _Abort(Exception):
    """Raised inside a handler: answer the call with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _check(check, *args) -> None:
    try:
        check(*args)
    except validate.InvalidMessage as e:
        raise _Abort(getattr(grpc.StatusCode, e.code), str(e)) from None


class _Undecodable:
    """What the deserializer returns for bytes that do not decode, so the handler
    answers INVALID_ARGUMENT (grpc.aio would answer UNKNOWN)."""

    def __init__(self, cls, error: Exception) -> None:
        self.message = f"the request does not decode as {cls.__name__}: {error}"


def _decoder(cls):
    def decode(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return _Undecodable(cls, e)
    return decode


async def _read(context, timeout: Optional[float] = None):
    """The next message of a request stream (``grpc.aio.EOF`` at its end)."""
    if timeout is None:
        msg = await context.read()
    else:
        msg = await asyncio.wait_for(context.read(), timeout)
    if isinstance(msg, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg.message)
    return msg


def _answers(handler):
    """Let a unary handler raise ``_Abort`` instead of awaiting ``context.abort``."""
    async def wrapped(self, request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return await handler(self, request, context)
        except _Abort as e:
            await context.abort(e.code, str(e))
    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


class _Peer:
    """One session stream (a worker's or a client's) and its read deadline."""

    __slots__ = ("key", "deadline_s", "last", "task", "reason", "kind", "context", "lock",
                 "beat_key", "beat_seq")

    def __init__(self, key: str, kind: str, deadline_s: float, context=None) -> None:
        self.key, self.kind, self.deadline_s = key, kind, deadline_s
        self.last = time.monotonic()
        self.task: Optional[asyncio.Task] = asyncio.current_task()
        self.reason = ""
        self.context = context
        self.lock = asyncio.Lock()      # one write at a time on the stream
        self.beat_key = b""             # a worker's datagram key (rpc/beats.py)
        self.beat_seq = 0               # the last datagram beat taken: replays are dropped


class _BeatSocket:
    """The coordinator's UDP socket for workers' beats (``rpc/beats.py``).

    Workers spread their datagram beats over the period (``beats.phase``); a timer
    drains every datagram waiting, about ``BATCH`` at a time (a wake-up per datagram
    would cost the event loop more than the datagram), checks each one's MAC and
    sequence number, moves its peer's read deadline, and answers every
    ``ANSWER_EVERY``-th beat (and the first two, so a worker learns at once that its
    datagrams arrive) to the address it came from.
    """

    BATCH = 128

    def __init__(self, host: str, port: int) -> None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.sock.bind((host, port))
        except OSError:                 # the gRPC port's number is taken for UDP
            self.sock.bind((host, 0))
        self.sock.setblocking(False)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, beats.RCVBUF)
        except OSError:
            pass
        self.port = self.sock.getsockname()[1]
        self.peers: Dict[int, _Peer] = {}       # beat id -> the worker's peer
        self._next_id = 0
        self.taken = self.dropped = 0

    def add(self, peer: _Peer) -> int:
        """Give ``peer`` a beat id and a key; returns the id."""
        self._next_id = self._next_id % 0xFFFFFFFF + 1
        while self._next_id in self.peers:
            self._next_id = self._next_id % 0xFFFFFFFF + 1
        peer.beat_key = beats.new_key()
        self.peers[self._next_id] = peer
        return self._next_id

    def remove(self, beat_id: int) -> None:
        self.peers.pop(beat_id, None)

    def _key(self, beat_id: int) -> Optional[bytes]:
        peer = self.peers.get(beat_id)
        return peer.beat_key if peer is not None else None

    async def run(self, heartbeat_s: float) -> None:
        """Drain the socket every BATCH beats' worth of time (10 ms to 250 ms)."""
        while True:
            rate = max(len(self.peers), 1) / heartbeat_s
            await asyncio.sleep(min(0.25, max(0.01, self.BATCH / rate)))
            self.drain()

    def drain(self) -> None:
        now = time.monotonic()
        while True:
            try:
                data, addr = self.sock.recvfrom(64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:        # an ICMP error for an answer we sent: go on
                log.debug("beat socket: %s", e)
                continue
            got = beats.unpack(data, self._key)
            if got is None or got[0] != beats.BEAT:
                self.dropped += 1
                continue
            _, beat_id, seq = got
            peer = self.peers[beat_id]
            if seq <= peer.beat_seq:
                self.dropped += 1
                continue
            peer.beat_seq, peer.last = seq, now
            self.taken += 1
            if seq <= 2 or seq % ANSWER_EVERY == 0:
                try:
                    self.sock.sendto(beats.pack(beats.ANSWER, beat_id, seq, peer.beat_key),
                                     addr)
                except OSError as e:    # a full send buffer: the next answer will do
                    log.debug("beat answer to %s: %s", addr, e)

    def close(self) -> None:
        self.sock.close()


class _Session:
    __slots__ = ("name", "share", "out", "peer")

    def __init__(self, name: str, share: float, peer: _Peer) -> None:
        self.name, self.share, self.peer = name, share, peer
        self.out: asyncio.Queue = asyncio.Queue()


def peer_deadline(heartbeat_s: float, lost_after_s: float) -> float:
    """How long a worker or client waits for the coordinator's answers before it calls
    the coordinator silent: three answer intervals, at least the coordinator's own."""
    return max(lost_after_s, 3 * ANSWER_EVERY * heartbeat_s)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


class _DeviceTable:
    """``ListDevicesReply`` bytes, kept per host and joined on demand.

    A host's rows are serialized again only when it changed (its stamp), so a reply on
    a cluster of thousands of hosts is one ``bytes.join``, not thousands of messages.
    """

    def __init__(self) -> None:
        self._cache: Dict[str, tuple] = {}      # worker_id -> (stamp, bytes)

    def host_bytes(self, h: Host) -> bytes:
        hit = self._cache.get(h.worker_id)
        if hit is not None and hit[0] == h.stamp:
            return hit[1]
        parts = []
        for row in host_rows(h):
            body = pb.DeviceInfo(**row).SerializeToString()
            parts.append(b"\x0a" + _varint(len(body)) + body)     # field 1, length-delimited
        data = b"".join(parts)
        self._cache[h.worker_id] = (h.stamp, data)
        return data

    def forget(self, worker_id: str) -> None:
        self._cache.pop(worker_id, None)

    def reply(self, rm: ResourceManager, island: Optional[int]) -> bytes:
        body = b"".join(self.host_bytes(h) for h in rm.hosts_in_order(island))
        return body + b"\x10" + _varint(rm.live_hosts)              # field 2, varint


class CoordinatorService(pbg.CoordinatorServicer):
    def __init__(self, devices_shared_by: int = 1, heartbeat_s: float = HEARTBEAT_S,
                 lost_after_s: float = LOST_AFTER_S,
                 session_grace_s: float = SESSION_GRACE_S, max_hosts: int = MAX_HOSTS,
                 max_sessions: int = MAX_SESSIONS,
                 beat_socket: Optional[_BeatSocket] = None) -> None:
        self.rm = ResourceManager(devices_shared_by)
        self.scheduler = GangScheduler()
        self.heartbeat_s, self.lost_after_s = heartbeat_s, lost_after_s
        self.session_grace_s = session_grace_s
        self.max_hosts, self.max_sessions = max_hosts, max_sessions
        self._agents: Dict[str, tuple] = {}     # worker_id -> (aio channel, stub, address)
        self._sessions: Dict[str, _Session] = {}
        self._peers: Dict[str, _Peer] = {}      # worker_id or client_id -> its stream
        self._table = _DeviceTable()
        self.beat_socket = beat_socket
        self._background: set = set()
        self.rec = tracing.Recorder(tracing.skew_from_env())
        # profile session -> {worker_id: (agent session, clock samples at start)}
        self._profiles: dict = {}
        self.stopped = asyncio.Event()  # set by Shutdown or a signal: _serve stops
        self._shutdown_reason = ""

    # ------------------------------------------------------------------ plumbing
    def _spawn(self, coro) -> None:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def sweep(self) -> None:
        """The one timer of the read deadlines: end every stream silent for too long."""
        tick = min(0.25, self.heartbeat_s / 2)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for peer in list(self._peers.values()):
                silent = now - peer.last
                if silent > peer.deadline_s and peer.task is not None and not peer.reason:
                    peer.reason = (f"silent for {silent:.1f} s (no heartbeat; the read "
                                   f"deadline is {peer.deadline_s:g} s)")
                    log.warning("%s %s is %s", peer.kind, peer.key, peer.reason)
                    peer.task.cancel()

    async def _opening(self, context, method: str, field: str, what: str):
        """The first message of a session stream: its ``field``, or the call aborted."""
        try:
            first = await _read(context, self.lost_after_s)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no {what} within {self.lost_after_s:g} s")
        if first is grpc.aio.EOF or not first.HasField(field):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the first message of {method} must carry {field}")
        return getattr(first, field)

    # ------------------------------------------------------------------ workers
    async def RegisterWorker(self, request_iterator, context):
        """A worker's session: registered while this stream lives and beats; lost when
        it breaks (a killed worker's connection closes at once) or goes silent."""
        request = await self._opening(context, "RegisterWorker", "register",
                                      "registration")
        if self._shutdown_reason:
            await context.write(pb.WorkerEvent(shutdown=True,
                                               shutdown_reason=self._shutdown_reason))
            return
        try:
            _check(validate.check_register_worker, request)
            if self.rm.live_hosts >= self.max_hosts:
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"the coordinator takes at most {self.max_hosts} hosts "
                             f"(--max-hosts) and has {self.rm.live_hosts}; start it with a "
                             "larger --max-hosts")
            try:
                h = self.rm.add_host(request.island, request.host, request.num_devices,
                                     request.kind, request.address, request.pid)
            except AllocationError as e:
                raise _Abort(grpc.StatusCode.ALREADY_EXISTS, str(e)) from None
        except _Abort as e:
            await context.abort(e.code, str(e))
        wid = h.worker_id
        ch = grpc_util.aio_channel(request.address)
        self._agents[wid] = (ch, pbg.WorkerStub(ch), request.address)
        peer = self._peers[wid] = _Peer(wid, "worker", self.lost_after_s, context)
        if self.rec.on:
            t = self.rec.now()
            self.rec.add("session", "worker registered", t, t,
                         detail=f"island {h.island} host {h.host} ({wid})")
        log.info("worker %s registered: island %d host %d, %d %s devices at %s",
                 wid, h.island, h.host, h.num_devices, h.kind, h.address)
        reason = "its connection closed"
        first = pb.WorkerEvent(worker_id=wid, heartbeat_s=self.heartbeat_s,
                               lost_after_s=peer_deadline(self.heartbeat_s,
                                                          self.lost_after_s))
        beat_id = 0
        if self.beat_socket is not None:
            beat_id = first.beat_id = self.beat_socket.add(peer)
            first.beat_port, first.beat_key = self.beat_socket.port, peer.beat_key
            first.beat_phase_s = beats.phase(beat_id, self.heartbeat_s)
        try:
            async with peer.lock:
                await context.write(first)
            while True:
                msg = await _read(context)
                if msg is grpc.aio.EOF:
                    break
                peer.last = time.monotonic()
                if msg.beat and msg.beat % ANSWER_EVERY == 0:
                    async with peer.lock:
                        await context.write(pb.WorkerEvent(beat=msg.beat))
        except asyncio.CancelledError:
            reason = peer.reason or reason
            raise
        finally:
            self._peers.pop(wid, None)
            if beat_id:
                self.beat_socket.remove(beat_id)
            self._worker_lost(wid, reason)

    def _worker_lost(self, worker_id: str, reason: str) -> None:
        agent = self._agents.pop(worker_id, None)
        if agent is not None:
            self._spawn(agent[0].close())
        self._table.forget(worker_id)
        h = self.rm.hosts.get(worker_id)
        where = f"island {h.island} host {h.host}" if h else worker_id
        gone = self.rm.mark_lost(worker_id)
        by_client: Dict[str, list] = {}
        for rec in gone:
            self.scheduler.forget(rec.slice_id)
            by_client.setdefault(rec.client_id, []).append(rec.slice_id)
            for wid, _ in rec.placements():     # the other hosts of a spanning slice
                if wid != worker_id:
                    self._spawn(self._stop_executor(wid, rec.slice_id))
        for client_id, sids in by_client.items():
            s = self._sessions.get(client_id)
            if s is not None:
                s.out.put_nowait(pb.SessionEvent(lost_slices=sids,
                                                 lost_reason=f"{where} was lost: {reason}"))
        log.warning("worker %s (%s) is gone: %s; %d slices lost", worker_id, where, reason,
                    len(gone))

    @_answers
    async def ListDevices(self, request, context):
        # The reply is bytes (see _DeviceTable and add_to_server).
        return self._table.reply(self.rm, request.island if request.has_island else None)

    @_answers
    async def Shutdown(self, request, context):
        """Tell every worker to exit, then stop (a batch job's end: every process of
        the job exits 0). Workers that register later are told the same."""
        reason = request.reason[:200] or "asked by a client"
        if not self._shutdown_reason:
            self._shutdown_reason = reason
            log.warning("shutting the cluster down: %s", reason)
            for peer in [p for p in self._peers.values() if p.kind == "worker"]:
                try:
                    async with peer.lock:
                        await peer.context.write(pb.WorkerEvent(shutdown=True,
                                                                shutdown_reason=reason))
                except Exception as e:          # a stream that is breaking anyway
                    log.info("could not tell worker %s to stop: %s", peer.key, e)
            self.stopped.set()
        return pb.Empty()

    # ------------------------------------------------------------------ clients
    async def OpenSession(self, request_iterator, context):
        request = await self._opening(context, "OpenSession", "open",
                                      "OpenSession request")
        try:
            _check(validate.check_open_session, request)
        except _Abort as e:
            await context.abort(e.code, str(e))
        if len(self._sessions) >= self.max_sessions:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the coordinator serves at most {self.max_sessions} client "
                                f"sessions (--max-sessions) and all are open; close one or "
                                "start it with a larger --max-sessions")
        client_id = f"c{uuid.uuid4().hex}"   # unguessable: it proves ownership
        peer = self._peers[client_id] = _Peer(client_id, "client",
                                              self.lost_after_s + self.session_grace_s)
        session = self._sessions[client_id] = _Session(request.name, request.share or 1.0,
                                                       peer)
        if self.rec.on:
            t = self.rec.now()
            self.rec.add("session", "session opened", t, t,
                         detail=f"{client_id} ({request.name})")
        writer = None
        try:
            await context.write(pb.SessionEvent(
                client_id=client_id, heartbeat_s=self.heartbeat_s,
                lost_after_s=peer_deadline(self.heartbeat_s, self.lost_after_s)))
            writer = asyncio.ensure_future(self._session_writer(session, context))
            while True:
                msg = await _read(context)
                if msg is grpc.aio.EOF:
                    break
                peer.last = time.monotonic()
                if msg.beat and msg.beat % ANSWER_EVERY == 0:
                    session.out.put_nowait(pb.SessionEvent(beat=msg.beat))
        finally:
            if writer is not None:
                writer.cancel()
            self._peers.pop(client_id, None)
            self._sessions.pop(client_id, None)
            if peer.reason:
                log.warning("session %s (%s) %s; its slices are reclaimed", client_id,
                            request.name, peer.reason)
            self._spawn(self._close_session(client_id))

    @staticmethod
    async def _session_writer(session: _Session, context) -> None:
        """The one writer of a session stream: beat answers and lost-slice events."""
        while True:
            await context.write(await session.out.get())

    async def _close_session(self, client_id: str) -> None:
        t0 = self.rec.now() if self.rec.on else 0
        for rec in self.rm.slices_of(client_id):
            await self._free_slice(rec.slice_id)
        self.rec.add("session", "session closed", t0, detail=client_id)
        log.info("session %s closed", client_id)

    def _session_of(self, client_id: str) -> _Session:
        s = self._sessions.get(client_id)
        if s is None:
            raise _Abort(grpc.StatusCode.UNAUTHENTICATED,
                         f"unknown client {client_id[:64]!r}: open a session first")
        return s

    @_answers
    async def AllocateSlice(self, request, context):
        t0 = self.rec.now() if self.rec.on else 0
        reply = await self._allocate_slice(request)
        self.rec.add("rpc", "AllocateSlice", t0,
                     detail=f"{reply.slice_id} on island {reply.island} host {reply.host}, "
                     f"mesh {list(request.mesh_shape)}")
        return reply

    async def _allocate_slice(self, request):
        session = self._session_of(request.client_id)
        _check(validate.check_allocate, request)
        island = None if request.any_island else request.island
        try:
            rec = self.rm.reserve(request.client_id, list(request.mesh_shape),
                                  list(request.axis_names), island,
                                  hosts=request.hosts or None)
        except AllocationError as e:
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if e.code == "exhausted"
                    else grpc.StatusCode.INVALID_ARGUMENT)
            raise _Abort(code, str(e)) from None
        key = secrets.token_hex(16)
        if rec.members:
            return await self._start_members(rec, request, session, key)
        agent = self._agents.get(rec.worker_id)
        if agent is None:
            self.rm.release(rec.slice_id)
            raise _Abort(grpc.StatusCode.UNAVAILABLE,
                         f"island {rec.island} host {rec.host} is gone; ask again")
        try:
            rep = await agent[1].StartExecutor(pb.StartExecutorRequest(
                slice_id=rec.slice_id, device_indices=list(rec.devices),
                mesh_shape=list(rec.mesh_shape), axis_names=list(rec.axis_names),
                client_id=request.client_id, slice_key=key,
                share=session.share if self.rm.per_device > 1 else 0.0),
                timeout=120, metadata=grpc_util.call_metadata())
        except grpc.aio.AioRpcError as e:
            self.rm.release(rec.slice_id)
            raise _Abort(grpc.StatusCode.UNAVAILABLE,
                         f"island {rec.island} host {rec.host} could not start an executor "
                         f"for the slice: {e.details()}") from None
        if self.rm.slices.get(rec.slice_id) is not rec:
            # lost with its host, or the session closed, while the executor started
            self._spawn(self._stop_executor(rec.worker_id, rec.slice_id))
            raise _Abort(grpc.StatusCode.UNAVAILABLE,
                         f"island {rec.island} host {rec.host} was lost while the slice "
                         "started; ask again")
        rec.executor_address = rep.address
        reply = pb.AllocateSliceReply(slice_id=rec.slice_id, executor_address=rep.address,
                                      island=rec.island, host=rec.host,
                                      data_address=rep.data_address, slice_key=key,
                                      memory_budget=rep.memory_budget)
        h = self.rm.hosts[rec.worker_id]
        for d in rec.devices:
            reply.devices.add(island=rec.island, host=rec.host, index=d, kind=h.kind,
                              state="in_use", slice_id=rec.slice_id)
        return reply

    async def _start_members(self, rec, request, session, key: str):
        """A slice that spans hosts: member 0 first (it picks the rendezvous), then the
        others at once; any failure stops those started and gives the devices back."""
        n = len(rec.members)
        started: list = []
        hosts = [self._agents[w][2].rpartition(":")[0] if w in self._agents else ""
                 for w, _, _ in rec.members]

        async def start(k: int, rendezvous: str):
            wid, host, devices = rec.members[k]
            agent = self._agents.get(wid)
            if agent is None:
                raise _Abort(grpc.StatusCode.UNAVAILABLE,
                             f"island {rec.island} host {host} is gone; ask again")
            try:
                rep = await agent[1].StartExecutor(pb.StartExecutorRequest(
                    slice_id=rec.slice_id, device_indices=list(devices),
                    mesh_shape=list(rec.mesh_shape), axis_names=list(rec.axis_names),
                    client_id=request.client_id, slice_key=key, member=k, num_members=n,
                    rendezvous=rendezvous, member_hosts=hosts,
                    share=session.share if self.rm.per_device > 1 else 0.0),
                    timeout=120, metadata=grpc_util.call_metadata())
            except grpc.aio.AioRpcError as e:
                raise _Abort(grpc.StatusCode.UNAVAILABLE,
                             f"island {rec.island} host {host} could not start member {k} "
                             f"of slice {rec.slice_id}: {e.details()}") from None
            started.append(wid)
            return rep

        try:
            first = await start(0, "")
            rest = await asyncio.gather(*(start(k, first.rendezvous) for k in range(1, n)),
                                        return_exceptions=True)
            for r in rest:
                if isinstance(r, BaseException):
                    raise r
            if self.rm.slices.get(rec.slice_id) is not rec:
                raise _Abort(grpc.StatusCode.UNAVAILABLE,
                             f"a host of slice {rec.slice_id} was lost while it started; "
                             "ask again")
        except BaseException:
            self.rm.release(rec.slice_id)
            for wid in started:
                self._spawn(self._stop_executor(wid, rec.slice_id))
            raise
        reps = [first] + list(rest)
        rec.executor_address = first.address
        reply = pb.AllocateSliceReply(slice_id=rec.slice_id, executor_address=first.address,
                                      island=rec.island, host=rec.host, slice_key=key,
                                      memory_budget=first.memory_budget)
        for (wid, host, devices), rep in zip(rec.members, reps):
            reply.members.add(island=rec.island, host=host, device_indices=list(devices),
                              executor_address=rep.address, data_address=rep.data_address)
            kind = self.rm.hosts[wid].kind
            for d in devices:
                reply.devices.add(island=rec.island, host=host, index=d, kind=kind,
                                  state="in_use", slice_id=rec.slice_id)
        return reply

    @_answers
    async def ReleaseSlice(self, request, context):
        t0 = self.rec.now() if self.rec.on else 0
        self._session_of(request.client_id)
        rec = self.rm.slices.get(request.slice_id)
        if rec is None:
            raise _Abort(grpc.StatusCode.NOT_FOUND,
                         f"slice {request.slice_id[:64]!r} does not exist (released, lost "
                         "with its worker, or never allocated)")
        if rec.client_id != request.client_id:
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"slice {request.slice_id} belongs to another client")
        await self._free_slice(request.slice_id)
        self.rec.add("rpc", "ReleaseSlice", t0, detail=request.slice_id)
        return pb.Empty()

    @_answers
    async def Schedule(self, request, context):
        """Give a gang submission its position in each touched island's total order."""
        self._session_of(request.client_id)
        _check(validate.check_ids, list(request.slice_ids), "slice id")
        recs = []
        for sid in request.slice_ids:
            rec = self.rm.slices.get(sid)
            if rec is None:
                raise _Abort(grpc.StatusCode.NOT_FOUND, f"slice {sid!r} does not exist")
            if rec.client_id != request.client_id:
                raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                             f"slice {sid} is not one of this client's slices")
            recs.append(rec)
        t0 = self.rec.now() if self.rec.on else 0
        positions, seqs, host_seqs = self.scheduler.schedule_hosts(recs)
        if t0:
            self.rec.add("rpc", "Schedule", t0, detail=", ".join(
                f"{sid}@{p}" for sid, p in zip(request.slice_ids, positions)))
        return pb.ScheduleReply(positions=positions, slice_seqs=seqs,
                                host_seqs=[pb.HostSeqs(seqs=h) for h in host_seqs])

    async def _free_slice(self, slice_id: str) -> None:
        rec = self.rm.release(slice_id)
        if rec is None:
            return
        self.scheduler.forget(slice_id)
        await asyncio.gather(*(self._stop_executor(wid, slice_id)
                               for wid, _ in rec.placements()))

    async def _stop_executor(self, worker_id: str, slice_id: str) -> None:
        agent = self._agents.get(worker_id)
        if agent is None:
            return
        try:
            await agent[1].StopExecutor(pb.StopExecutorRequest(slice_id=slice_id),
                                        timeout=30, metadata=grpc_util.call_metadata())
        except grpc.aio.AioRpcError as e:
            log.warning("stopping executor of %s failed: %s", slice_id, e.details())

    # ------------------------------------------------------------------ profiling
    @_answers
    async def Profile(self, request, context):
        """The coordinator's spans and, through it, every worker agent's."""
        _check(validate.check_profile, request, self.rec.active)
        if request.action == pb.ProfileRequest.CLOCK:
            return tracing.serve_profile(pb, self.rec, request, "coordinator")
        agents = {wid: a[2] for wid, a in self._agents.items()}
        # START and STOP call every agent: blocking calls, off the event loop.
        return await asyncio.to_thread(self._profile, request, agents)

    def _profile(self, request, agents: Dict[str, str]):
        channels = {wid: grpc_util.channel(addr) for wid, addr in agents.items()}
        try:
            stubs = {wid: pbg.WorkerStub(ch) for wid, ch in channels.items()}
            reply = tracing.serve_profile(pb, self.rec, request, "coordinator",
                                          lambda session: self._collect_agents(session,
                                                                               stubs))
            if request.action == pb.ProfileRequest.START:
                self._start_agents(reply.session, stubs)
            return reply
        finally:
            for ch in channels.values():
                ch.close()

    @staticmethod
    def _agent_call(stub, action, session=0):
        return stub.Profile(pb.ProfileRequest(action=action, session=session), timeout=30)

    def _start_agents(self, session: int, stubs: dict) -> None:
        started = {}
        for wid, stub in stubs.items():
            try:
                samples = tracing.sample_clock(
                    lambda: self._agent_call(stub, pb.ProfileRequest.CLOCK), self.rec.now)
                rep = self._agent_call(stub, pb.ProfileRequest.START)
                started[wid] = (rep.session, samples)
            except grpc.RpcError as e:
                log.warning("profiling: worker %s did not start: %s", wid, e.details())
        self._profiles[session] = started

    def _collect_agents(self, session: int, stubs: dict) -> list:
        """Stop the agents' sessions and put their spans on this process's clock."""
        started = self._profiles.pop(session, {})
        out = []
        for wid, (agent_session, first) in started.items():
            stub = stubs.get(wid)
            if stub is None:
                continue
            try:
                last = tracing.sample_clock(
                    lambda: self._agent_call(stub, pb.ProfileRequest.CLOCK), self.rec.now)
                rep = self._agent_call(stub, pb.ProfileRequest.STOP, agent_session)
            except grpc.RpcError as e:
                log.warning("profiling: worker %s did not answer: %s", wid, e.details())
                continue
            clock = tracing.ClockMap(first, last)
            for trace in rep.processes:
                tracing.shift_trace(trace, clock)
                out.append(trace)
        return out


def _identity(b: bytes) -> bytes:
    return b


def add_to_server(service: CoordinatorService, server) -> None:
    """Register the service; ListDevices answers pre-serialized bytes (_DeviceTable)."""
    H = grpc
    handlers = {
        "RegisterWorker": H.stream_stream_rpc_method_handler(
            service.RegisterWorker, request_deserializer=_decoder(pb.WorkerUp),
            response_serializer=pb.WorkerEvent.SerializeToString),
        "OpenSession": H.stream_stream_rpc_method_handler(
            service.OpenSession, request_deserializer=_decoder(pb.SessionUp),
            response_serializer=pb.SessionEvent.SerializeToString),
        "ListDevices": H.unary_unary_rpc_method_handler(
            service.ListDevices, request_deserializer=_decoder(pb.ListDevicesRequest),
            response_serializer=_identity),
    }
    for name, req, rep in (("AllocateSlice", pb.AllocateSliceRequest, pb.AllocateSliceReply),
                           ("ReleaseSlice", pb.ReleaseSliceRequest, pb.Empty),
                           ("Schedule", pb.ScheduleRequest, pb.ScheduleReply),
                           ("Profile", pb.ProfileRequest, pb.ProfileReply),
                           ("Shutdown", pb.ShutdownRequest, pb.Empty)):
        handlers[name] = H.unary_unary_rpc_method_handler(
            getattr(service, name), request_deserializer=_decoder(req),
            response_serializer=rep.SerializeToString)
    server.add_generic_rpc_handlers(
        (H.method_handlers_generic_handler("pathways.Coordinator", handlers),))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (beyond loopback a --token is required)")
    ap.add_argument("--port", type=int, default=0, help="port to bind (0: any free port)")
    ap.add_argument("--devices-shared-by", type=int, default=1,
                    help="how many slices (of any clients) may share one device; >1 turns "
                    "on proportional-share time-multiplexing of shared devices")
    ap.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_S,
                    help="how often workers and clients send a heartbeat (seconds; they "
                    "send on multiples of it on the wall clock, so beats come in bursts)")
    ap.add_argument("--lost-after-s", type=float, default=LOST_AFTER_S,
                    help="a worker silent this long is lost (its slices fail); workers "
                    "and clients leave a coordinator silent for the longer of this and "
                    f"{3 * ANSWER_EVERY} heartbeats")
    ap.add_argument("--session-grace-s", type=float, default=SESSION_GRACE_S,
                    help="a client silent for --lost-after-s plus this long (frozen, not "
                    "closed) loses its session and its slices")
    ap.add_argument("--max-hosts", type=int, default=MAX_HOSTS,
                    help="registered hosts at most; past it RESOURCE_EXHAUSTED")
    ap.add_argument("--max-sessions", type=int, default=MAX_SESSIONS,
                    help="open client sessions at most; past it RESOURCE_EXHAUSTED")
    ap.add_argument("--udp-beats", action=argparse.BooleanOptionalAction, default=True,
                    help="take workers' beats as UDP datagrams on the gRPC port's number "
                    "(or another, which workers are told): a few µs each instead of a "
                    "stream message's ~140 µs. Workers whose datagrams get no answer keep "
                    "beating on their stream; --no-udp-beats: streams only")
    grpc_util.add_tls_arguments(ap)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pathways_torch.coordinator")
    add_arguments(ap)
    ap.add_argument("--parent-pid", type=int, default=0,
                    help="exit when this process dies (embedded clusters)")
    args = ap.parse_args(argv)
    serve(args)


def serve(args: argparse.Namespace) -> None:
    """Run the coordinator until SIGTERM/SIGINT (then exit the process)."""
    logging.basicConfig(level=os.environ.get("PATHWAYS_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(message)s")
    grpc_util.require_token_for(args.host, "the coordinator")
    grpc_util.apply_tls_arguments(args)
    if getattr(args, "parent_pid", 0):
        _proc.die_with_parent(args.parent_pid)
    hb = getattr(args, "heartbeat_s", HEARTBEAT_S)
    if hb <= 0 or getattr(args, "lost_after_s", LOST_AFTER_S) <= hb:
        raise SystemExit("--lost-after-s must be larger than --heartbeat-s (> 0)")
    asyncio.run(_serve(args))
    # Exit now: nothing must keep the port open after a signal.
    os._exit(0)


async def _serve(args: argparse.Namespace) -> None:
    service = CoordinatorService(
        args.devices_shared_by, getattr(args, "heartbeat_s", HEARTBEAT_S),
        getattr(args, "lost_after_s", LOST_AFTER_S),
        getattr(args, "session_grace_s", SESSION_GRACE_S),
        getattr(args, "max_hosts", MAX_HOSTS), getattr(args, "max_sessions", MAX_SESSIONS))
    # Streams are bounded by the explicit limits; this backstop bounds the short calls.
    srv = grpc_util.aio_server(service.max_hosts + service.max_sessions + 4096)
    add_to_server(service, srv)
    port = grpc_util.add_port(srv, f"{args.host}:{args.port}")
    loop = asyncio.get_running_loop()
    tasks = []
    if getattr(args, "udp_beats", True):
        service.beat_socket = _BeatSocket(args.host, port)
        tasks.append(asyncio.ensure_future(service.beat_socket.run(service.heartbeat_s)))
    await srv.start()
    tasks.append(asyncio.ensure_future(service.sweep()))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stopped.set)
    # The embedded cluster and pathways-run read this line to learn the port.
    print(f"PATHWAYS_COORDINATOR_PORT={port}", flush=True)
    await service.stopped.wait()
    if service._shutdown_reason:
        # Linger so that workers still starting hear "shut down" rather than nothing.
        await asyncio.sleep(SHUTDOWN_LINGER_S)
    for task in tasks:
        task.cancel()
    await srv.stop(0.5)
    if service.beat_socket is not None:
        service.beat_socket.close()


if __name__ == "__main__":
    main(sys.argv[1:])
