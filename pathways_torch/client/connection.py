"""The client's link to one slice's executor: an ordered, batched control stream.

Every put, execution, release and barrier goes onto one long-lived bidirectional gRPC
stream. The stream's request iterator drains whatever is queued into one ``OpBatch``
message, so many tiny programs cost one message, not one round trip each (Python gRPC
spends ~200 µs of CPU per message on each side here; see docs/architecture.md).
Releases of dropped Arrays are queued from finalizers in their place in the order, so
a release never overtakes the op that creates its buffer.

Bulk bytes do not ride the stream: a put of ``PUT_MIN_BYTES`` or more goes on the
executor's data plane (worker/dataplane.py) straight from the tensor's storage, followed
by a ``RecvOp`` in the stream's order, and a fetch is a pull on that plane, whose bytes
land in the tensor the caller gets. When client and executor share a machine (a
loopback address), the bytes go through /dev/shm instead of the socket.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import grpc
import torch

from .. import tracing
from .._ids import random_id
from ..errors import (
    CheckpointError,
    ClusterShutdownError,
    ColocatedError,
    DataLoaderError,
    OutOfMemoryError,
    ProgramError,
    TimeoutError,
    WorkerLostError,
)
from ..rpc import codec, grpc_util
from ..rpc import pathways_pb2 as pb
from ..rpc import pathways_pb2_grpc as pbg
from ..rpc.ownership import SLICE_KEY, with_slice_key
from ..worker import dataplane
from . import graph as graph_mod

_CLOSE = object()


class _CloseLoader:
    """Queued by a dropped pw.DataLoader: travels in a ReleaseOp (which, like every
    release, takes no sequence number), in its place in the order."""

    __slots__ = ("loader_id",)

    def __init__(self, loader_id: int) -> None:
        self.loader_id = loader_id
_MAX_BATCH_OPS = 512
_MAX_BATCH_BYTES = 8 << 20
# Watermarks a stream asks for unasked after each multi-slice wait (_watch_tail): one for
# the work sent next, one for what follows it while that one is on its way.
_UNASKED = 2
# Puts of at least this many bytes use the data plane; smaller ones ride the control
# stream, as fast or faster there (64 KiB: 0.95-1.48 ms on the stream, 1.36-1.47 ms on
# the plane; 256 KiB: 1.83-1.89 against 1.54-1.70). Fetches use the plane whatever
# their size: a pull answers a scalar in ~0.4 ms where the Fetch RPC takes ~1.1 ms
# (bench/runtime.py, small_round_trips; docs/architecture.md, Decision 19).
PUT_MIN_BYTES = 256 << 10
FETCH_MIN_BYTES = 0


class _ClientPlane:
    """The client's data plane (it only dials): one per process, remade when the
    cluster token or TLS settings change; None when it cannot serve (TLS without a
    client certificate), and the bytes then ride the control stream."""

    _lock = threading.Lock()
    _plane = None
    _key = None

    @classmethod
    def get(cls) -> Optional[dataplane.DataPlane]:
        key = (grpc_util.token(), grpc_util.tls())
        with cls._lock:
            if cls._key != key:
                if cls._plane:
                    cls._plane.close()
                try:
                    cls._plane = dataplane.DataPlane("", listen=False)
                except Exception:
                    cls._plane = False
                cls._key = key
            return cls._plane or None

    @classmethod
    def forget(cls) -> None:
        cls._plane, cls._key = None, None
        cls._lock = threading.Lock()


class _SocketCall:
    """A pull in flight, which ``mark_lost`` cancels by shutting its socket."""

    def __init__(self) -> None:
        self.sock = None

    def cancel(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def raise_buffer_error(err, what: str) -> None:
    """Turn a pb.BufferError into the matching typed exception."""
    if err.kind == "timeout":
        raise TimeoutError(f"{what}: {err.message} (a longer deadline: timeout=... on the "
                           "call, or pw.init(timeout=...))")
    if err.kind == "lost":
        raise WorkerLostError(f"{what}: {err.message}")
    if err.kind == "io":
        raise CheckpointError(f"{what}: {err.message}")
    prog = f" (program '{err.program}' on {err.host})" if err.program else ""
    if err.kind == "oom":
        raise OutOfMemoryError(f"{what}{prog}: {err.message}", program=err.program,
                               host=err.host)
    if err.kind == "data":
        raise DataLoaderError(f"{what}: {err.message}", host=err.host)
    if err.kind == "colocated":
        raise ColocatedError(f"{what}: {err.message}", program=err.program, host=err.host)
    raise ProgramError(f"{what}{prog}: {err.message}", program=err.program, host=err.host)


def _raise_failures(rep: pb.WaitReply, what: str) -> None:
    """Raise the first failed buffer of a WaitReply, if any."""
    for failed, err in zip(rep.failed, rep.errors):
        if failed:
            raise_buffer_error(err, what)


class _Loop:
    """One event loop thread for the calls that go out to many slices at once."""

    _lock = threading.Lock()
    _loop = None

    @classmethod
    def get(cls):
        with cls._lock:
            if cls._loop is None:
                import asyncio
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="pw-fanout",
                                 daemon=True).start()
                cls._loop = loop
            return cls._loop


def _forget_loop_in_child() -> None:
    _Loop._loop = None              # its thread does not exist in a forked child
    _Loop._lock = threading.Lock()
    _ClientPlane.forget()           # nor do its sockets' locks


os.register_at_fork(after_in_child=_forget_loop_in_child)


class _LoopTask:
    """A task on ``_Loop`` that ``mark_lost`` can cancel from any thread."""

    def __init__(self, loop, task) -> None:
        self._loop, self._task = loop, task

    def cancel(self) -> None:
        self._loop.call_soon_threadsafe(self._task.cancel)


def wait_many(groups: list, timeout: Optional[float]) -> None:
    """``pw.wait`` over several slices, with completion watermarks: a slice whose last
    watermark covers the Arrays is answered from local state; the others are asked for
    one (a WatchOp on their streams, no call) and the wait takes their pushes. Slices
    whose executor stopped vouching get Wait calls, all at once from one event loop
    (gRPC asyncio).
    ``groups``: (connection, buffer ids, after_seq, what). Raises the first failure."""
    import asyncio
    t = max(conn.timeout if timeout is None else timeout for conn, *_ in groups)
    deadline = time.monotonic() + t
    replies: list = [None] * len(groups)
    while True:
        with _WATERMARKS:
            waiting = []
            for k, (conn, ids, seq, _) in enumerate(groups):
                if replies[k] is None and conn.ask(seq):
                    replies[k] = conn.known(ids, seq)
                    if replies[k] is None:
                        waiting.append(k)
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                break
            countdown = _Countdown(len(waiting))
            for k in waiting:
                groups[k][0]._waiters.append((max(groups[k][2], 1), countdown))
        countdown.event.wait(left)
        with _WATERMARKS:
            for k in waiting:
                conn = groups[k][0]
                conn._waiters = [w for w in conn._waiters if w[1] is not countdown]
    rpc = [k for k, r in enumerate(replies) if r is None]
    if rpc:
        loop = _Loop.get()

        async def all_waits():
            return await asyncio.gather(*(groups[k][0]._wait_aio(groups[k][1], groups[k][2],
                                                                 timeout) for k in rpc),
                                        return_exceptions=True)

        left = max(0.0, deadline - time.monotonic())
        for k, rep in zip(rpc, asyncio.run_coroutine_threadsafe(
                all_waits(), loop).result(left + 30)):
            replies[k] = rep
    first = None
    for (conn, _, _, what), rep in zip(groups, replies):
        try:
            conn._wait_result(rep, what, timeout or conn.timeout)
        except Exception as e:      # check every reply; raise the first failure
            first = first or e
    if first is not None:
        raise first


# Guards every connection's watermark state (_done_seq, _failed, _waiters).
_WATERMARKS = threading.Lock()


class _Countdown:
    """A ``wait_many`` waiting on n slices' watermarks: set once, when the last of them
    arrived or a stream broke, so the waiting thread wakes once rather than on each
    watermark (the others would wake it to re-check every slice, k times over k)."""

    __slots__ = ("left", "event")

    def __init__(self, n: int) -> None:
        self.left = n
        self.event = threading.Event()


class ExecutorConnection:
    def __init__(self, address: str, where: str, timeout: float, slice_id: str = "",
                 key: str = "", data_address: str = "") -> None:
        self.address = address
        self.data_address = data_address   # the executor's data plane ("": none)
        self.slice_id = slice_id
        self.where = where
        self.timeout = timeout
        self.closed = False
        self.broken: Optional[str] = None
        self._channel = grpc_util.channel(address)
        # Every call carries the slice's key: the executor serves its owner only.
        ch = with_slice_key(self._channel, key) if key else self._channel
        self.stub = pbg.ExecutorStub(ch)
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._seq = 0                      # ordered ops queued so far
        self._seq_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._barriers: dict = {}
        self._barrier_ids = itertools.count(1)
        self._inflight: set = set()       # blocking calls mark_lost must cancel
        self._key = key
        self._aio = None                  # (channel, stub, metadata) on _Loop
        self._responses = self.stub.Dispatch(self._requests())
        # The stream answers only barriers: its reader starts with the first one, so a
        # slice that never waits on a barrier costs the channel's two threads, not three.
        self._reader: Optional[threading.Thread] = None
        self._reader_lock = threading.Lock()
        # Completion watermarks (after ``ask``): every buffer of the first _done_seq
        # ordered ops is ready, except those in _failed (id -> pb.BufferError).
        self._unvouched = False            # the executor stopped giving watermarks
        self._asked = 0                    # the highest seq a pending WatchOp covers
        self._unasked = 0                  # WatchOps the stream may add unasked (_watch_tail)
        self._done_seq = 0
        self._failed: dict = {}
        self._waiters: list = []           # (seq, _Countdown) of wait_many calls
        # pw.DataLoader streams told of their host's made batches (DispatchEvent.made):
        # loader id -> a callable taking each pb.LoaderMade
        self.loader_watchers: Dict[int, Callable] = {}

    # ------------------------------------------------------------- ids and ops
    def new_id(self) -> int:
        return next(self._ids)

    def send(self, op: pb.Op, direct: bool = False):
        """Queue one ordered op; returns the sequence number a reader must wait past.

        Inside ``pw.graph()`` the op is recorded instead, and the returned SeqCell
        gets its number when the graph is submitted.
        """
        self._check()
        if not direct:
            g = graph_mod.current()
            if g is not None:
                return g.record(self, op)
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
            self._q.put(op)
        return seq

    @property
    def seq(self) -> int:
        return self._seq

    def send_gang(self, position: int, slice_seq: int, ops: list,
                  host_seqs: Sequence[int] = ()):
        """Queue a recorded graph's ops for this slice as one GangOp (``host_seqs``:
        the host's gang sequence number, from the scheduler)."""
        return self.send(pb.Op(gang=pb.GangOp(position=position, slice_seq=slice_seq,
                                              ops=ops, host_seq=host_seqs[0] if host_seqs
                                              else 0)), direct=True)

    def parts(self) -> List["ExecutorConnection"]:
        """The executor connections behind this one (itself; see client/members.py)."""
        return [self]

    def close_loader(self, loader_id: int) -> None:
        """Called when a pw.DataLoader is dropped (a finalizer, like ``release``)."""
        self.loader_watchers.pop(loader_id, None)
        if not self.closed:
            self._q.put(_CloseLoader(loader_id))

    def watch_loader(self, loader_id: int, fn: Callable) -> None:
        """Call ``fn(pb.LoaderMade)`` for each batch position the host's loader pushes."""
        self.loader_watchers[loader_id] = fn
        self._start_reader()

    def release(self, buffer_id: int) -> None:
        """Called from Array finalizers; SimpleQueue.put is safe there (reentrant)."""
        if not self.closed:
            self._q.put(buffer_id)
            if self._failed:
                self._failed.pop(buffer_id, None)

    def put(self, tensor, spec_msg: pb.Spec):
        """Send a CPU tensor to the slice; returns (buffer id, seq). The bytes are
        written before this returns, so the caller may change the tensor afterwards."""
        bid = self.new_id()
        meta = pb.TensorMeta(dtype=codec.dtype_name(tensor.dtype), shape=list(tensor.shape))
        plane = self._plane(tensor.numel() * tensor.element_size(), PUT_MIN_BYTES)
        if plane is not None:
            tid = self.send_bulk(plane, [codec.byte_view(tensor.contiguous())])
            seq = self.send(pb.Op(recv=pb.RecvOp(buffer_id=bid, meta=meta, spec=spec_msg,
                                                 transfer_id=tid, src_host="the client")))
            return bid, seq
        data = codec.to_bytes(tensor)
        parts = codec.chunks(data)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            seq = self.send(pb.Op(put=pb.PutOp(
                buffer_id=bid, meta=meta if i == 0 or last else None, spec=spec_msg,
                data=bytes(part), last=last)))
        return bid, seq

    def _plane(self, nbytes: Optional[int], least: int) -> Optional[dataplane.DataPlane]:
        """The data plane for ``nbytes`` (None: a size not known) where ``least`` is
        the smallest size it takes, or None for the control stream."""
        if not self.data_address or (nbytes is not None and nbytes < least):
            return None
        return _ClientPlane.get()

    def send_bulk(self, plane, views: list) -> int:
        """Write ``views`` (bytes that follow each other) to the executor's data plane
        as one transfer; its id, for the RecvOp that takes them in."""
        self._check()
        tid = random_id()
        try:
            plane.send(self.data_address, tid, views, same_host=self._same_host())
        except OSError as e:
            self._check()
            raise WorkerLostError(f"a put on {self.where}: its data plane at "
                                  f"{self.data_address} is unreachable ({e})") from None
        return tid

    def _same_host(self) -> bool:
        return dataplane.is_loopback(self.data_address) and dataplane.shm_allowed()

    # ------------------------------------------------------------- stream plumbing
    def _requests(self) -> Iterable[pb.OpBatch]:
        """Drain the queue into batches; releases (ints) keep their place in the order."""
        q = self._q
        while True:
            item = q.get()
            ops: List[pb.Op] = []
            releases: List[int] = []
            loaders: List[int] = []
            size, done = 0, False
            while True:
                if item is _CLOSE:
                    done = True
                    break
                if isinstance(item, int):
                    releases.append(item)
                elif isinstance(item, _CloseLoader):
                    loaders.append(item.loader_id)
                else:
                    if releases or loaders:
                        ops.append(pb.Op(release=pb.ReleaseOp(buffer_ids=releases,
                                                              loader_ids=loaders)))
                        releases, loaders = [], []
                    ops.append(item)
                    if item.HasField("put"):
                        size += item.ByteSize()
                if len(ops) >= _MAX_BATCH_OPS or size >= _MAX_BATCH_BYTES:
                    break
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    if self._unasked and ops and not ops[-1].HasField("watch"):
                        self._watch_tail(ops)
                    break
            if releases or loaders:
                ops.append(pb.Op(release=pb.ReleaseOp(buffer_ids=releases,
                                                      loader_ids=loaders)))
            if ops:
                yield pb.OpBatch(ops=ops)
            if done:
                return

    def _watch_tail(self, ops: List[pb.Op]) -> None:
        """End a batch that drained the queue with a WatchOp: after a multi-slice
        ``pw.wait`` on this stream, the executor then pushes a watermark when the work
        sent next is done, before anyone waits, and the next wait reads local state
        instead of asking and waiting for a round trip. One at a time (while one is on
        its way, ``_read`` asks for the rest when it arrives), and at most ``_UNASKED``
        after each wait: a client that submits work without waiting gets no stream of
        watermarks to read."""
        with self._seq_lock:
            # A watermark answering the last WatchOp reports at least the ops before it
            # (``_asked``), or also the WatchOp itself, depending on when the executor's
            # pusher reads its count: only one below ``_asked`` is still on its way.
            if not self._q.empty() or self._unvouched or self._done_seq < self._asked:
                return      # more ops follow, or a watermark is on its way (see _read)
            self._unasked -= 1
            ops.append(self._watch_op())

    def _watch_rest(self) -> None:
        """A watermark arrived: ask for the next if ops were sent after the last
        WatchOp (``_watch_tail`` skipped them while one was on its way)."""
        with self._seq_lock:
            if self._seq > self._asked + 1 and self._done_seq >= self._asked and \
                    self._unasked and not (self.closed or self.broken or self._unvouched):
                self._unasked -= 1
                self._q.put(self._watch_op())

    def _watch_op(self) -> pb.Op:
        """Under _seq_lock: a WatchOp numbered next; it covers every op before it."""
        self._seq += 1
        self._asked = self._seq - 1
        return pb.Op(watch=pb.WatchOp())

    def _read(self) -> None:
        try:
            for ev in self._responses:
                if ev.barrier:
                    e = self._barriers.pop(ev.barrier, None)
                    if e is not None:
                        e.set()
                elif ev.done_seq:
                    for bid, err in zip(ev.failed_ids, ev.errors):
                        self._failed[bid] = err
                    with _WATERMARKS:
                        self._done_seq = max(self._done_seq, ev.done_seq)
                        if self._waiters:
                            self._count_down()
                    if self._unasked:
                        self._watch_rest()
                elif ev.unwatched:
                    self._unwatched()
                for made in ev.made:
                    fn = self.loader_watchers.get(made.loader_id)
                    if fn is not None:
                        fn(made)
        except grpc.RpcError as e:
            if not self.closed:
                self.broken = f"the executor of {self.where} is unreachable: {e.details()}"
        finally:
            for e in list(self._barriers.values()):
                e.set()
            self._unwatched()

    def _count_down(self) -> None:
        """Under _WATERMARKS: count down the waits the new watermark covers."""
        left = []
        for seq, countdown in self._waiters:
            if self._done_seq >= seq:
                countdown.left -= 1
                if countdown.left <= 0:
                    countdown.event.set()
            else:
                left.append((seq, countdown))
        self._waiters = left

    def _wake_waiters(self) -> None:
        """Under _WATERMARKS: the stream broke or stopped vouching; waiters re-check."""
        for _, countdown in self._waiters:
            countdown.event.set()
        self._waiters = []

    def _unwatched(self) -> None:
        with _WATERMARKS:
            self._unvouched = True
            self._wake_waiters()

    def _start_reader(self) -> None:
        if self._reader is None:
            with self._reader_lock:
                if self._reader is None:
                    self._reader = threading.Thread(target=self._read, daemon=True,
                                                    name=f"pw-read-{self.where}")
                    self._reader.start()

    @property
    def watching(self) -> bool:
        """A watermark was asked for on this stream."""
        return self._asked > 0

    def ask(self, after_seq: int) -> bool:
        """Ask for a completion watermark covering ``after_seq`` (a WatchOp on the
        stream), unless one already covers it or is on its way; False when this
        executor no longer vouches, or the slice is lost or closed (``wait_many`` then
        calls Wait, which raises why)."""
        if self.closed or self.broken or self._unvouched:
            return False
        if self._asked < after_seq and self._done_seq < after_seq:
            self._start_reader()
            with self._seq_lock:
                self._q.put(self._watch_op())
        self._unasked = _UNASKED
        return True

    def known(self, buffer_ids: List[int], after_seq: int) -> Optional[pb.WaitReply]:
        """What a Wait would answer, from the watermarks; None while not yet known."""
        if self._done_seq < max(after_seq, 1):
            return None
        rep = pb.WaitReply()
        for bid in buffer_ids:
            err = self._failed.get(bid)
            rep.failed.append(err is not None)
            rep.errors.append(err if err is not None else pb.BufferError())
        return rep

    def mark_lost(self, reason: str) -> None:
        """The coordinator says the slice's host is lost (closed, or silent past its
        read deadline): every pending and later call fails with WorkerLostError now,
        instead of waiting for an executor that may never answer."""
        if self.closed or self.broken:
            return
        self.broken = f"the executor of {self.where} is lost: {reason}"
        for e in list(self._barriers.values()):
            e.set()
        with _WATERMARKS:
            self._wake_waiters()
        for call in list(self._inflight):
            call.cancel()

    def _check(self) -> None:
        if self.closed:
            raise ClusterShutdownError(
                f"the slice on {self.where} was released or the cluster shut down; "
                "create a new slice and put the data again")
        if self.broken:
            raise WorkerLostError(self.broken)

    # ------------------------------------------------------------- blocking calls
    def barrier(self, timeout: Optional[float] = None) -> None:
        """Block until every op sent so far has been processed by the executor."""
        self.barrier_finish(self.barrier_start(), timeout)

    def barrier_start(self) -> threading.Event:
        """Send a barrier; ``barrier_finish`` waits for it (start many, then finish)."""
        self._start_reader()
        token = next(self._barrier_ids)
        ev = threading.Event()
        self._barriers[token] = ev
        self.send(pb.Op(barrier=pb.BarrierOp(token=token)))
        return ev

    def barrier_finish(self, ev: threading.Event, timeout: Optional[float] = None) -> None:
        if not ev.wait(timeout or self.timeout):
            raise TimeoutError(f"the executor of {self.where} did not reach a barrier "
                               f"within {timeout or self.timeout} s")
        self._check()

    def fetch(self, buffer_id: int, after_seq: int, what: str,
              timeout: Optional[float] = None, nbytes: Optional[int] = None):
        """The buffer as a CPU tensor; ``nbytes`` (its size, where the caller knows
        it) keeps small fetches on the control stream."""
        rec = tracing.CLIENT
        if not rec.on:
            return self._fetch(buffer_id, after_seq, what, timeout, nbytes)
        t0 = rec.now()
        out = self._fetch(buffer_id, after_seq, what, timeout, nbytes)
        rec.add("fetch", "fetch", t0, buffer_ids=(buffer_id,),
                nbytes=out.numel() * out.element_size(), detail=self.slice_id)
        return out

    def _fetch(self, buffer_id: int, after_seq: int, what: str, timeout: Optional[float],
               nbytes: Optional[int] = None):
        self._check()
        t = timeout or self.timeout
        plane = self._plane(nbytes, FETCH_MIN_BYTES)
        if plane is not None:
            return self._pull(plane, buffer_id, after_seq, what, t)
        chunks = self.stub.Fetch(pb.FetchRequest(buffer_id=buffer_id, after_seq=after_seq,
                                                 timeout_s=t), timeout=t + 5)
        self._inflight.add(chunks)
        try:
            meta, parts = None, []
            for c in chunks:
                if c.has_error:
                    raise_buffer_error(c.error, what)
                if meta is None:
                    meta = c.meta
                parts.append(c.data)
        except grpc.RpcError as e:
            raise self._rpc_error(e, what, t) from None
        finally:
            self._inflight.discard(chunks)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return codec.from_bytes(data, meta.dtype, meta.shape)

    def _pull(self, plane, buffer_id: int, after_seq: int, what: str, t: float):
        """A fetch on the data plane: the bytes land in the returned tensor's storage."""
        req = pb.FetchRequest(buffer_id=buffer_id, after_seq=after_seq, timeout_s=t,
                              slice_key=self._key, same_host=self._same_host())
        reply, payload = self._pull_reply(plane, req, what, t)
        dtype = codec.dtype_from_name(reply.meta.dtype)
        shape = tuple(reply.meta.shape)
        if payload.numel() != codec.nbytes(dtype, shape):
            raise WorkerLostError(f"{what}: {self.where} sent {payload.numel()} bytes for "
                                  f"{reply.meta.dtype}{list(shape)}")
        if payload.numel() == 0:
            return torch.empty(shape, dtype=dtype)
        return payload.view(dtype).reshape(shape)

    def _pull_reply(self, plane, req: pb.FetchRequest, what: str, t: float):
        """Send a pull and wait for its answer: (FetchChunk, payload bytes as a uint8
        tensor); the buffer's failure, a timeout or a lost peer raise, typed."""
        call = _SocketCall()
        self._inflight.add(call)
        try:
            reply, payload = plane.pull(self.data_address, req.SerializeToString(), t + 5,
                                        call)
        except socket.timeout:
            self._check()
            raise TimeoutError(f"{what}: no answer from {self.where} within {t} s") from None
        except OSError as e:
            self._check()
            raise WorkerLostError(f"{what}: the data plane of {self.where} at "
                                  f"{self.data_address} is unreachable ({e})") from None
        finally:
            self._inflight.discard(call)
        if reply.has_error:
            raise_buffer_error(reply.error, what)
        return reply, payload

    def wait(self, buffer_ids: List[int], after_seq: int, what: str,
             timeout: Optional[float] = None) -> None:
        rec = tracing.CLIENT
        t0 = rec.now() if rec.on else 0
        try:
            self._wait(buffer_ids, after_seq, what, timeout)
        finally:
            rec.add("wait", "wait", t0, buffer_ids=buffer_ids, detail=self.slice_id)

    def _wait(self, buffer_ids: List[int], after_seq: int, what: str,
              timeout: Optional[float]) -> None:
        """One slice's Wait, as a future so that ``mark_lost`` can cancel it; no call
        when the slice's watermarks (see ``wait_many``) vouch for the buffers or one
        that will is on its way."""
        self._check()
        t = timeout or self.timeout
        if not self._unvouched:
            rep = self.known(buffer_ids, after_seq)
            if rep is not None:
                self._wait_result(rep, what, t)
                return
            if self._asked >= after_seq:
                wait_many([(self, buffer_ids, after_seq, what)], timeout)
                return
        fut = self.stub.Wait.future(pb.WaitRequest(buffer_ids=buffer_ids,
                                                   after_seq=after_seq, timeout_s=t),
                                    timeout=t + 5)
        self._inflight.add(fut)
        try:
            rep = fut.result()
        except grpc.FutureCancelledError:
            raise self._cancelled(what) from None
        except grpc.RpcError as e:
            raise self._rpc_error(e, what, t) from None
        finally:
            self._inflight.discard(fut)
        _raise_failures(rep, what)

    async def _wait_aio(self, buffer_ids: List[int], after_seq: int,
                        timeout: Optional[float]):
        """One Wait on ``_Loop`` (see ``wait_many``); returns the reply or the error."""
        import asyncio
        self._check()
        if self._aio is None:
            md = tuple(grpc_util.call_metadata() or ())
            if self._key:
                md += ((SLICE_KEY, self._key),)
            ch = grpc_util.aio_channel(self.address)
            self._aio = (ch, pbg.ExecutorStub(ch), md)
        _, stub, md = self._aio
        t = timeout or self.timeout
        handle = _LoopTask(asyncio.get_running_loop(), asyncio.current_task())
        self._inflight.add(handle)
        try:
            return await stub.Wait(pb.WaitRequest(buffer_ids=buffer_ids, after_seq=after_seq,
                                                  timeout_s=t), timeout=t + 5, metadata=md)
        finally:
            self._inflight.discard(handle)

    def _wait_result(self, rep, what: str, t: float) -> None:
        """Raise what a ``_wait_aio`` result says went wrong, if anything."""
        import asyncio
        if isinstance(rep, asyncio.CancelledError):
            raise self._cancelled(what)
        if isinstance(rep, grpc.RpcError):
            raise self._rpc_error(rep, what, t)
        if isinstance(rep, BaseException):
            raise rep
        _raise_failures(rep, what)

    def _cancelled(self, what: str) -> Exception:
        """A wait that ``mark_lost`` cancelled: the lost host's error."""
        self._check()
        return WorkerLostError(f"{what}: the wait on {self.where} was cancelled")

    def _rpc_error(self, e: grpc.RpcError, what: str, t: Optional[float] = None) -> Exception:
        if self.broken and not self.closed:
            return WorkerLostError(f"{what}: {self.broken}")
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TimeoutError(f"{what}: no answer from {self.where} within "
                                f"{t or self.timeout} s")
        if self.closed:
            return ClusterShutdownError(f"{what}: the slice was released or the cluster "
                                        "shut down")
        return WorkerLostError(f"{what}: the executor of {self.where} is unreachable "
                               f"({e.code().name}: {e.details()})")

    def compile(self, req: pb.CompileRequest, name: str) -> pb.CompileReply:
        """Register a program with the executor (blocks: once per program, slice, shardings)."""
        self._check()
        try:
            return self.stub.Compile(req, timeout=self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ProgramError(e.details(), program=name, host=self.where) from None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise OutOfMemoryError(e.details(), program=name, host=self.where) from None
            raise self._rpc_error(e, f"compiling program '{name}'") from None

    def stats(self) -> pb.StatsReply:
        return self.stub.Stats(pb.StatsRequest(), timeout=self.timeout)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._q.put(_CLOSE)
        self._channel.close()
        plane = _ClientPlane._plane
        if self.data_address and plane:
            plane.forget(self.data_address)
        self._unwatched()
        if self._aio is not None:
            import asyncio
            asyncio.run_coroutine_threadsafe(self._aio[0].close(), _Loop.get())

