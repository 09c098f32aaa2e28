"""The executor of one host of a slice that spans hosts (issue 14).

Each host of such a slice runs one of these processes, a member; together they act as
one executor. The client sends every member the same ordered stream (the programs, in
the same order: that is what keeps their collectives from deadlocking), except that a
put carries only the shards of the member's own devices, and a fetch answers with them.
Programs run on ``MultiHostRuntime`` (jaxlib's PJRT client, gloo collectives; Decision
18 in docs/architecture.md), so a member is a fresh process started by the worker
agent, not a fork of its torch_xla zygote: the two XLA runtimes do not share a process.

Start-up: member 0 picks the rendezvous (a free port on its host) and reports it with
its address; the coordinator then starts the others with it. Every member reports
ready as soon as it serves gRPC and meets the others in the background, so the slice's
ops wait for the meeting, not the allocation.

Moves to and from other slices go host to host on the data plane (``dataplane.py``):
the client tells each source host which of its blocks each destination host needs
(``SendOp.blocks``), and each destination host which pieces to expect
(``RecvOp.pieces``); a received buffer is taken in when something first needs it.
Checkpoints are torch.distributed.checkpoint directories as on one host: each member
writes the blocks it is the first to hold as chunks of the keys (``_save``), and the
client merges every member's metadata. Donation is not done here (inputs are kept).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Dict, List, Optional

import numpy as np

from .. import tracing
from ..rpc import validate
from ..sharding import P, member_blocks, spec_from_proto, spec_to_proto

log = logging.getLogger("pathways.member")


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a wire dtype name (``rpc/codec.py``'s names)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class _Buf:
    __slots__ = ("array", "error", "nbytes", "pending", "lock")

    def __init__(self, array=None, error=None, nbytes: int = 0, pending=None) -> None:
        self.array, self.error, self.nbytes = array, error, nbytes
        self.pending = pending          # a RecvOp whose pieces have not been taken in
        self.lock = threading.Lock() if pending is not None else None


class _Program:
    def __init__(self, name: str, compiled, params, constants, in_avals) -> None:
        self.name, self.compiled = name, compiled
        self.in_avals = in_avals        # (numpy dtype, shape) of each flat input
        self.params = params            # ("i", k) or ("c", k) per HLO parameter
        self.constants = constants      # global arrays


def _make_servicer_base():
    from ..rpc import pathways_pb2_grpc as pbg
    return pbg.ExecutorServicer


class MemberService(_make_servicer_base()):
    """The Executor service of one member; ops run in stream order on one thread."""

    def __init__(self, req: dict) -> None:
        from ..rpc import pathways_pb2 as pb
        self.pb = pb
        self.req = req
        self.slice_id = req["slice_id"]
        self.member, self.members = int(req["member"]), int(req["num_members"])
        self.mesh_shape = tuple(req["mesh_shape"])
        self.axis_names = tuple(req["axis_names"])
        self.local_devices = len(req["devices"])
        self.where = f"island {req['island']} host {req['host']}"
        self._key = req.get("slice_key", "")
        self.budget = int(req.get("memory_budget") or 0) or (8 << 30)
        self.rt = None                  # MultiHostRuntime, once the members have met
        self.mesh = None
        self._met = threading.Event()
        self._meet_error = ""
        self.store: Dict[int, _Buf] = {}
        self.cond = threading.Condition()
        self.processed = 0
        self.programs: Dict[str, _Program] = {}
        self.executed = self.compiles = 0
        self.gang_positions: List[int] = []
        self._unready: List[int] = []   # outputs not yet checked by a watermark
        self._failed_new: List[int] = []  # buffers put failed since the last watermark
        self._puts: dict = {}           # buffer id -> [meta, spec, chunks] while chunked
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._events: "queue.SimpleQueue" = queue.SimpleQueue()
        self._stream_lock = threading.Lock()
        self._streaming = False
        from .arbiter import connect
        # Shared devices: programs run inside the host arbiter's grants, gang ops in
        # the host's gang order (the order that keeps collectives from deadlocking).
        self.arbiter = connect(req.get("arbiter"), req.get("client_id", ""),
                               float(req.get("share") or 0.0))
        self._in_grant = False
        self.rec = tracing.Recorder(tracing.skew_from_env())
        from .dataplane import DataPlane
        self.dataplane = DataPlane(req["bind_host"], self.rec,
                                   advertise_host=req.get("advertise_host", ""))
        self.dataplane.on_pull = self._on_pull
        self.transfer_timeout = 600.0
        self.process_name = (f"executor {self.where} slice {self.slice_id} member "
                             f"{self.member}/{self.members}")
        self.loaders: dict = {}         # loader id -> worker.loader.HostLoader
        threading.Thread(target=self._loop, name="member", daemon=True).start()

    # ------------------------------------------------------------------ start-up
    def meet(self, rendezvous: str) -> None:
        """Meet the other members at ``rendezvous`` (blocks until all have come)."""
        from .multihost import MultiHostError, MultiHostRuntime
        kind = os.environ.get("PJRT_DEVICE", "CPU").upper()
        try:
            if kind == "CPU":
                self.rt = MultiHostRuntime(rendezvous, self.members, self.member,
                                           self.local_devices,
                                           heartbeat_timeout_s=int(self.req.get(
                                               "heartbeat_timeout_s", 10)),
                                           init_timeout_s=120)
            else:       # TPU, GPU: torch_xla's own multi-controller SPMD
                from .multicontroller import TorchXlaRuntime
                self.rt = TorchXlaRuntime(rendezvous, self.members, self.member,
                                          self.local_devices, devices=self.req["devices"],
                                          member_hosts=self.req.get("member_hosts", ()),
                                          kind=kind)
            self.mesh = self.rt.mesh(self.mesh_shape, self.axis_names)
        except MultiHostError as e:
            self._meet_error = str(e)
        except Exception as e:      # noqa: BLE001 (report any start-up failure)
            self._meet_error = f"{type(e).__name__}: {e}"
        self._met.set()

    # ------------------------------------------------------------------ helpers
    def _err(self, kind: str, message: str, program: str = ""):
        return self.pb.BufferError(kind=kind, message=message, program=program,
                                   host=self.where)

    def _authorize(self, context) -> None:
        if self._key:
            from ..rpc.ownership import check_slice_key
            check_slice_key(context, self._key,
                            f"slice {self.slice_id} on {self.where} belongs to another "
                            "client (or the call lacks the slice key from AllocateSlice)")

    def _failure(self, e: Exception, program: str = ""):
        """A runtime failure as a BufferError: a peer's broken connection is a lost
        member (the whole slice is one failure domain)."""
        text = str(e)
        low = text.lower()
        lost = any(w in low for w in ("gloo", "connection", "peer", "socket", "closed",
                                      "unavailable", "coordination"))
        if lost:
            return self._err("lost", f"a host of slice {self.slice_id} ({self.members} "
                             f"hosts) failed during a collective: {text[:400]}", program)
        return self._err("program", text[:1000], program)

    def _check_ready(self, bid: int, buf: _Buf) -> None:
        """Block until ``buf`` is computed (or received); a failure becomes its error."""
        self._resolve(buf)
        if buf.error is not None or buf.array is None:
            return
        try:
            self.rt.wait(buf.array)
        except Exception as e:      # noqa: BLE001 (jaxlib's errors are untyped)
            buf.error = self._failure(e)
            buf.array = None

    def _wait_entry(self, bid: int, after_seq: int, timeout: float) -> Optional[_Buf]:
        with self.cond:
            if not self.cond.wait_for(lambda: bid in self.store or
                                      self.processed >= after_seq, timeout):
                raise TimeoutError
            return self.store.get(bid)

    # ------------------------------------------------------------------ RPCs
    def Compile(self, request, context):
        self._authorize(context)
        validate.guard(context, validate.check_compile, request, self.axis_names,
                       self.budget * self.local_devices * self.members)
        fut: Future = Future()
        self._queue.put(("compile", request, fut))
        try:
            return fut.result()
        except Exception as e:      # noqa: BLE001
            import grpc
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"compiling program '{request.name}' on {self.where} (member "
                          f"{self.member} of {self.members}) failed: {e}")

    def Dispatch(self, request_iterator, context):
        self._authorize(context)
        with self._stream_lock:
            if self._streaming:
                import grpc
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"slice {self.slice_id} on {self.where} already has a "
                              "Dispatch stream; a slice serves one client stream")
            self._streaming = True
            events = self._events = queue.SimpleQueue()

        def pump():
            index = 0
            try:
                for batch in request_iterator:
                    for op in batch.ops:
                        if op.WhichOneof("kind") != "release":
                            index += 1
                            self._queue.put(("op", op, index))
                        else:
                            self._queue.put(("op", op, 0))
            except Exception:       # noqa: BLE001 (the stream ended)
                pass
            finally:
                events.put(None)

        threading.Thread(target=pump, name="dispatch-pump", daemon=True).start()
        try:
            while True:
                ev = events.get()
                if ev is None:
                    return
                yield ev
        finally:
            with self._stream_lock:
                self._streaming = False

    def Fetch(self, request, context):
        self._authorize(context)
        validate.guard(context, validate.check_timeout, request.timeout_s)
        pb = self.pb
        if not request.local_shards:
            # The whole value: only this member's shards exist here; say what to ask.
            yield pb.FetchChunk(has_error=True, error=self._err(
                "input", "a member of a slice that spans hosts answers local_shards "
                "fetches only"))
            return
        reply, views = self._local_reply(request)
        if reply.has_error:
            yield reply
            return
        data = b"".join(bytes(v) for v in views)
        from ..rpc.codec import CHUNK_BYTES
        pieces = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
        reply.data = pieces[0]
        yield reply
        for p in pieces[1:]:
            yield pb.FetchChunk(data=p)

    def _on_pull(self, raw: bytes):
        """A fetch of this host's shards on the data plane (dataplane.py)."""
        from .dataplane import read_pull
        req, refused = read_pull(self, raw)
        if refused is not None:
            return refused, None, False, None
        reply, views = self._local_reply(req)
        return reply, views, req.same_host, None

    def _ready_buf(self, bid: int, after_seq: int, timeout: float):
        """Buffer ``bid`` once computed or received: (buf, None), or (None, the
        BufferError that says why not)."""
        try:
            buf = self._wait_entry(bid, after_seq, timeout or 600.0)
        except TimeoutError:
            return None, self._err("timeout", f"buffer {bid} not ready in {timeout} s")
        if buf is None:
            return None, self._err("unknown_buffer", f"buffer {bid} does not exist")
        self._check_ready(bid, buf)
        if buf.error is not None:
            return None, buf.error
        return buf, None

    def _local_reply(self, req):
        """This host's shards of ``req``'s buffer: a FetchChunk naming their blocks
        (or the buffer's error), and their bytes in that order."""
        pb = self.pb
        buf, err = self._ready_buf(req.buffer_id, req.after_seq, req.timeout_s)
        if err is not None:
            return pb.FetchChunk(has_error=True, error=err), []
        dtype, shape = self.rt.aval(buf.array)
        reply = pb.FetchChunk()
        reply.meta.dtype = _dtype_name(dtype)
        reply.meta.shape.extend(shape)
        views = []
        for start, value in self.rt.local_blocks(buf.array):
            reply.blocks.add(start=list(start), shape=list(value.shape))
            views.append(memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8)))
        return reply, views

    def Wait(self, request, context):
        self._authorize(context)
        validate.guard(context, validate.check_wait, request)
        pb = self.pb
        timeout = request.timeout_s or 600.0
        deadline = time.monotonic() + timeout
        reply = pb.WaitReply()
        for bid in request.buffer_ids:
            try:
                buf = self._wait_entry(bid, request.after_seq,
                                       max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                reply.errors.append(self._err("timeout", f"buffer {bid} not ready in "
                                              f"{timeout} s"))
                reply.failed.append(True)
                continue
            if buf is None:
                buf = _Buf(error=self._err("unknown_buffer", f"buffer {bid} does not exist"))
            self._check_ready(bid, buf)
            reply.failed.append(buf.error is not None)
            reply.errors.append(buf.error if buf.error is not None else pb.BufferError())
        return reply

    def Stats(self, request, context):
        self._authorize(context)
        with self.cond:
            nbytes = sum(b.nbytes for b in self.store.values())
            n = len(self.store)
        return self.pb.StatsReply(
            num_buffers=n, buffer_bytes=nbytes, num_programs=len(self.programs),
            num_devices=self.local_devices * self.members, executed=self.executed,
            compiles=self.compiles, pid=os.getpid(), gang_positions=self.gang_positions,
            memory_budget=self.budget, bytes_received=self.dataplane.bytes_received,
            bytes_sent=self.dataplane.bytes_sent, recv_seconds=self.dataplane.recv_seconds)

    def Profile(self, request, context):
        self._authorize(context)
        validate.guard(context, validate.check_profile, request, self.rec.active)
        return tracing.serve_profile(self.pb, self.rec, request, self.process_name)

    # ------------------------------------------------------------------ the op thread
    def _loop(self) -> None:
        self._met.wait()
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, msg, index = item
            if kind == "compile":
                try:
                    if self._meet_error:
                        raise RuntimeError(self._meet_error)
                    index.set_result(self._compile(msg))
                except Exception as e:      # noqa: BLE001
                    log.debug("compile failed: %s", traceback.format_exc())
                    index.set_exception(e)
                continue
            try:
                self._process(index, msg)
            except Exception:       # noqa: BLE001 (never let one op end the stream)
                log.error("op failed: %s", traceback.format_exc())
            if index:
                with self.cond:
                    self.processed = index
                    self.cond.notify_all()

    def _process(self, index: int, op) -> None:
        which = op.WhichOneof("kind")
        if which == "gang":
            if op.gang.slice_seq > 0:
                self.gang_positions.append(op.gang.position)
            if self.arbiter is not None and op.gang.host_seq:
                self._granted(lambda: [self._one(inner, index) for inner in op.gang.ops],
                              op.gang.host_seq)
            else:
                for inner in op.gang.ops:
                    self._one(inner, index)
        elif which == "execute" and self.arbiter is not None:
            self._granted(lambda: self._one(op, index), 0)
        else:
            self._one(op, index)

    def _granted(self, body, gang: int) -> None:
        """Run ``body`` to completion inside one grant of the host's arbiter."""
        with self.arbiter.grant(more=lambda: not self._queue.empty(), gang=gang):
            start = len(self._unready)
            body()
            for b in self._unready[start:]:
                with self.cond:
                    buf = self.store.get(b)
                if buf is not None:
                    self._check_ready(b, buf)

    def _put_buf(self, bid: int, buf: _Buf) -> None:
        with self.cond:
            self.store[bid] = buf
            self.cond.notify_all()
        if buf.array is not None or buf.pending is not None:
            self._unready.append(bid)
        else:
            self._failed_new.append(bid)

    # ------------------------------------------------------------------ transfers
    def _discard(self, r) -> None:
        for piece in r.pieces:
            self.dataplane.discard(piece.transfer_id)

    def _resolve(self, buf: _Buf) -> None:
        """Take in a received buffer (waits for its pieces); one thread does it."""
        if buf.pending is None:
            return
        with buf.lock:
            r = buf.pending
            if r is None:
                return
            try:
                buf.array = self._from_full(self._receive(r), r.spec)
            except _Lost as e:
                buf.error = self._err("lost", str(e))
            except _Failed as e:
                buf.error = e.error                 # the original failure, unchanged
            except Exception as e:      # noqa: BLE001
                buf.error = self._err("input", f"receiving into buffer {r.buffer_id} "
                                      f"failed: {type(e).__name__}: {e}")
            finally:
                buf.pending = None
            if buf.error is not None:
                buf.array = None

    def _receive(self, r) -> np.ndarray:
        """The whole tensor with every piece's blocks filled in (what this host needs
        of it); raises ``_Lost`` or ``_Failed``."""
        from .dataplane import listening
        dtype = np_dtype(r.meta.dtype)
        full = np.zeros(tuple(r.meta.shape), dtype)
        for k, piece in enumerate(r.pieces):
            deadline = time.monotonic() + self.transfer_timeout
            misses, arrival = 0, None
            while arrival is None and time.monotonic() < deadline:
                arrival = self.dataplane.take(piece.transfer_id, 1.0)
                if arrival is None and piece.src_data_address:
                    misses = 0 if listening(piece.src_data_address) else misses + 1
                    if misses >= 2:
                        break
            if arrival is None or arrival.error is not None:
                for rest in r.pieces[k + 1:]:
                    self.dataplane.discard(rest.transfer_id)
            if arrival is None:
                src = piece.src_host or piece.src_data_address
                raise _Lost(f"transfer {piece.transfer_id} from {src} cannot arrive: it "
                            "no longer listens (its worker died, or its slice was released)"
                            if misses >= 2 else f"transfer {piece.transfer_id} did not "
                            f"arrive within {self.transfer_timeout:.0f} s")
            try:
                if arrival.error is not None:
                    err = self.pb.BufferError()
                    err.ParseFromString(arrival.error)
                    raise _Failed(err)
                flat = np.frombuffer(arrival.payload, dtype) if arrival.nbytes else \
                    np.zeros(0, dtype)
                at = 0
                for b in piece.blocks:
                    n = int(np.prod(tuple(b.shape)))
                    index = tuple(slice(s, s + m) for s, m in zip(b.start, b.shape))
                    full[index] = flat[at:at + n].reshape(tuple(b.shape))
                    at += n
                del flat
            finally:
                if hasattr(arrival.payload, "close"):
                    arrival.payload.close()
        return full

    # ------------------------------------------------------------------ checkpoints
    def _save(self, op) -> None:
        """Write the blocks of ``op``'s buffers this host is the first to hold, as
        chunks of their keys, into ``op.path/m<member>`` (a DCP directory the client
        merges with the other members'); the status buffer gets the bytes written."""
        import torch
        from .. import sharding
        chunks, err = {}, None
        for key, b in zip(op.keys, op.buffer_ids):
            with self.cond:
                buf = self.store.get(b)
            if buf is None:
                err = self._err("unknown_buffer", f"buffer {b} to save as '{key}' does not "
                                "exist (released or never created)")
                break
            self._check_ready(b, buf)
            if buf.error is not None:
                err = buf.error
                break
            held = self.rt.blocks_by_host(buf.array, self.mesh)
            shards = self.rt.local_blocks(buf.array)
            for blk in held[self.member]:
                if any(blk in held[m] for m in range(self.member)):
                    continue        # a lower member writes it
                start = tuple(a for a, _ in blk)
                value = _cut(shards, start, tuple(e - a for a, e in blk))
                chunks[(key, start)] = _to_torch(torch, value)
        if err is None:
            try:
                nbytes = _write_chunks(os.path.join(op.path, f"m{self.member}"), chunks,
                                       {k: self.rt.aval(self.store[b].array)[1]
                                        for k, b in zip(op.keys, op.buffer_ids)})
                self._put_buf(op.status_id, _Buf(self.rt.put(
                    np.array([nbytes], np.int64), sharding.P(), self.mesh), None, 8))
                return
            except Exception as ex:     # noqa: BLE001
                err = self._err("io", f"writing checkpoint {op.path} on {self.where} "
                                f"failed: {type(ex).__name__}: {ex}")
        self._fail([op.status_id], err)

    def _load(self, op) -> None:
        """Read keys of a DCP checkpoint into new buffers (this host's blocks)."""
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp
        from ..rpc import codec
        try:
            flat = {k: torch.empty(tuple(m.shape), dtype=codec.dtype_from_name(m.dtype))
                    for k, m in zip(op.keys, op.metas)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")     # "no process group": by design
                dcp.load(flat, checkpoint_id=op.path, no_dist=True)
            for k, b, m, spec in zip(op.keys, op.buffer_ids, op.metas, op.specs):
                full = _to_numpy(flat.pop(k), np_dtype(m.dtype))
                self._put_buf(b, _Buf(self._from_full(full, spec), None, full.nbytes))
        except Exception as ex:     # noqa: BLE001
            self._fail(op.buffer_ids, self._err(
                "io", f"reading checkpoint {op.path} on {self.where} failed: "
                f"{type(ex).__name__}: {ex}"))

    def _send_now(self, buf: _Buf, op) -> None:
        """Send ``op.blocks`` of ``buf`` (this host's shards) to ``op.dst_data_address``."""
        payload, error = None, None
        try:
            self._check_ready(op.buffer_id, buf)
            if buf.error is not None:
                error = buf.error.SerializeToString()
            else:
                shape = self.rt.aval(buf.array)[1]
                shards = self.rt.local_blocks(buf.array)
                parts = []
                for b in op.blocks:
                    part = _cut(shards, tuple(b.start), tuple(b.shape))
                    if part is None:
                        raise ValueError(f"no shard on this host holds the block at "
                                         f"{list(b.start)} of shape {list(b.shape)} of "
                                         f"{list(shape)}")
                    parts.append(np.ascontiguousarray(part).tobytes())
                payload = memoryview(b"".join(parts))
        except Exception as e:      # noqa: BLE001
            error = self._err("program", f"sending buffer {op.buffer_id} from "
                              f"{self.where} failed: {e}").SerializeToString()
        try:
            self.dataplane.send(op.dst_data_address, op.transfer_id, payload, error,
                                op.same_host)
        except OSError as e:
            log.error("transfer %d to %s failed: %s", op.transfer_id, op.dst_data_address, e)

    def _fail(self, ids, err) -> None:
        for b in ids:
            self._put_buf(b, _Buf(error=err))

    def _one(self, op, index: int) -> None:
        which = op.WhichOneof("kind")
        if self._meet_error and which not in ("release", "barrier", "watch"):
            self._fail(validate.op_outputs(op), self._err(
                "lost", f"the hosts of slice {self.slice_id} did not meet: "
                f"{self._meet_error}"))
            return
        if which == "execute":
            self._execute(op.execute)
        elif which == "put":
            self._put(op.put)
        elif which == "release":
            if op.release.loader_ids:
                from .loader import close_loaders
                close_loaders(self, op.release.loader_ids)
            with self.cond:
                gone = [self.store.pop(b, None) for b in op.release.buffer_ids]
            for buf in gone:
                if buf is not None and buf.pending is not None:
                    self._discard(buf.pending)
        elif which == "recv":
            r = op.recv
            n = int(np.prod(tuple(r.meta.shape))) * np_dtype(r.meta.dtype).itemsize
            self._put_buf(r.buffer_id, _Buf(None, None, n, pending=r))
        elif which == "send":
            if op.send.transfer_id:
                with self.cond:
                    buf = self.store.get(op.send.buffer_id)
                if buf is None:
                    buf = _Buf(error=self._err("unknown_buffer", f"buffer "
                                               f"{op.send.buffer_id} to send does not exist"))
                self.dataplane.send_async(self._send_now, buf, op.send)
        elif which == "barrier":
            self._events.put(self.pb.DispatchEvent(barrier=op.barrier.token))
        elif which == "watch":
            self._watch(index)
        elif which == "save":
            self._save(op.save)
        elif which == "load":
            self._load(op.load)
        elif which == "batch":
            self._batch(op.batch)
        else:
            self._fail(validate.op_outputs(op), self._err(
                "program", f"a {which} op is not done on a slice that spans hosts"))

    def Colocated(self, request, context):
        """pw.colocated on this host's region of the inputs (worker/colocated.py)."""
        self._authorize(context)
        from .colocated import run_colocated_member
        return run_colocated_member(self, request, context)

    # ------------------------------------------------------------------ pw.DataLoader
    def OpenLoader(self, request, context):
        """This host's loader of a pw.DataLoader: it loads its own devices' rows."""
        import grpc
        self._authorize(context)
        if not self._met.wait(self.transfer_timeout) or self._meet_error:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the hosts of slice "
                          f"{self.slice_id} did not meet: {self._meet_error}")
        from .loader import open_loader
        return open_loader(self, request, context, self._loader_put)

    def PeekLoader(self, request, context):
        """Whether a stream's batch exists, once this host's loader got to it."""
        self._authorize(context)
        from .loader import peek_loader
        return peek_loader(self, request)

    def _loader_put(self, blocks: dict, axis: str, rows: int):
        """This host's rows of a part of a batch ({sub-block: rows}) as the slice's
        global array of ``rows`` rows, split over ``axis``."""
        from ..rpc import codec
        first = next(iter(blocks.values()))
        dtype = np_dtype(codec.dtype_name(first.dtype))
        shape = (rows,) + tuple(first.shape[1:])
        spec = P(axis) if axis else P()
        mine, _ = member_blocks(shape, spec, self.axis_names, self.mesh_shape,
                                self.member, self.members)
        step = rows // (dict(zip(self.axis_names, self.mesh_shape))[axis] if axis else 1)
        values = [_to_numpy(blocks[blk[0][0] // step], dtype) for blk in mine]
        return self._global(shape, spec, values), sum(v.nbytes for v in values)

    def _batch(self, op) -> None:
        from .loader import take_batch
        placed, err = take_batch(self, op, self.transfer_timeout)
        if err is not None:
            self._fail(op.outputs, err)
            return
        for bid, (array, nbytes) in zip(op.outputs, placed):
            self._put_buf(bid, _Buf(array, None, nbytes))

    def _watch(self, index: int) -> None:
        """A completion watermark covering every op before this one."""
        ev = self.pb.DispatchEvent(done_seq=index)
        pending, self._unready = self._failed_new + self._unready, []
        self._failed_new = []
        with self.cond:
            bufs = [(b, self.store.get(b)) for b in pending]
        for b, buf in bufs:
            if buf is None:
                continue
            self._check_ready(b, buf)
            if buf.error is not None:
                ev.failed_ids.append(b)
                ev.errors.append(buf.error)
        self._events.put(ev)

    def _compile(self, req):
        from ..sharding import P
        t0 = time.perf_counter()
        rt = self.rt
        constants = [rt.put(np.frombuffer(c.data, np_dtype(c.meta.dtype)).reshape(
            tuple(c.meta.shape)), P(), self.mesh) for c in req.constants]
        params, specs = [], []
        for p in req.params:
            if p.WhichOneof("source") == "input":
                params.append(("i", p.input))
                specs.append(spec_from_proto(req.input_specs[p.input]))
            else:
                params.append(("c", p.constant))
                specs.append(P())
        out_specs = ([spec_from_proto(s) for s in req.out_specs]
                     if req.has_out_specs else None)
        compiled = rt.compile(req.hlo, specs, self.mesh, out_specs)
        reply = self.pb.CompileReply()
        for spec, hlo in zip(compiled.out_specs, compiled.out_hlo):
            spec_to_proto(spec if spec is not None else P(), reply.out_specs.add())
            reply.out_spec_known.append(spec is not None)
            reply.out_hlo_shardings.append(hlo)
        in_avals = [(np_dtype(m.dtype), tuple(m.shape)) for m in req.inputs]
        self.programs[req.program_id] = _Program(req.name, compiled, params, constants,
                                                 in_avals)
        self.compiles += 1
        reply.compile_s = time.perf_counter() - t0
        return reply

    def _execute(self, op) -> None:
        prog = self.programs.get(op.program_id)
        if prog is None:
            self._fail(op.outputs, self._err("program",
                                             f"unknown program id {op.program_id!r}"))
            return
        inputs = []
        for b in op.inputs:
            with self.cond:
                buf = self.store.get(b)
            if buf is None:
                self._fail(op.outputs, self._err(
                    "unknown_buffer", f"input buffer {b} of program '{prog.name}' does "
                    "not exist (released or never created)", prog.name))
                return
            self._resolve(buf)
            if buf.error is not None:
                self._fail(op.outputs, buf.error)   # the original failure, unchanged
                return
            inputs.append(buf.array)
        got = [self.rt.aval(a) for a in inputs]
        if got != prog.in_avals:
            # XLA checks this with a process abort; refuse it here.
            self._fail(op.outputs, self._err(
                "input", f"program '{prog.name}' was compiled for inputs "
                f"{_avals(prog.in_avals)} but got {_avals(got)}", prog.name))
            return
        args = [inputs[k] if src == "i" else prog.constants[k] for src, k in prog.params]
        try:
            outs = self.rt.run(prog.compiled, args)
        except Exception as e:      # noqa: BLE001
            self._fail(op.outputs, self._failure(e, prog.name))
            return
        self.executed += 1
        for b, o in zip(op.outputs, outs):
            dtype, shape = self.rt.aval(o)
            self._put_buf(b, _Buf(o, None, int(np.prod(shape)) * dtype.itemsize))

    def _put(self, op) -> None:
        parts = self._puts.get(op.buffer_id)
        if not op.last:
            if parts is None:
                self._puts[op.buffer_id] = [op.meta, op.spec, [op.data]]
            else:
                parts[2].append(op.data)
            return
        if parts is not None:
            del self._puts[op.buffer_id]
            meta, spec_msg, chunks = parts
            data = b"".join(chunks + [op.data])
        else:
            meta, spec_msg, data = op.meta, op.spec, op.data
        try:
            self._put_buf(op.buffer_id, self._assemble(meta, spec_msg, data))
        except Exception as e:      # noqa: BLE001
            self._fail([op.buffer_id], self._err(
                "input", f"put of buffer {op.buffer_id} failed: {e}"))

    def _assemble(self, meta, spec_msg, data: bytes) -> _Buf:
        """A global array from this host's blocks (``member_blocks`` order)."""
        dtype = np_dtype(meta.dtype)
        shape = tuple(meta.shape)
        spec = spec_from_proto(spec_msg)
        blocks, _ = member_blocks(shape, spec, self.axis_names, self.mesh_shape,
                                  self.member, self.members)
        sizes = [int(np.prod([b - a for a, b in blk])) for blk in blocks]
        if sum(sizes) * dtype.itemsize != len(data):
            raise ValueError(f"{len(data)} bytes for this host's shards of "
                             f"{meta.dtype}{list(shape)}, which need "
                             f"{sum(sizes) * dtype.itemsize}")
        flat = np.frombuffer(data, dtype)
        values, at = [], 0
        for blk, n in zip(blocks, sizes):
            values.append(flat[at:at + n].reshape(tuple(b - a for a, b in blk)))
            at += n
        return _Buf(self._global(shape, spec, values), None, len(data))

    def _from_full(self, full: np.ndarray, spec_msg):
        """A global array from a host-side tensor holding (at least) this host's part."""
        spec = spec_from_proto(spec_msg)
        blocks, _ = member_blocks(full.shape, spec, self.axis_names, self.mesh_shape,
                                  self.member, self.members)
        return self._global(full.shape, spec, [
            full[tuple(slice(a, b) for a, b in blk)] for blk in blocks])

    def _global(self, shape, spec, values: list):
        """The slice's global array whose local devices hold ``values`` (one per
        distinct block of this host, ``member_blocks`` order)."""
        _, where = member_blocks(shape, spec, self.axis_names, self.mesh_shape,
                                 self.member, self.members)
        return self.rt.from_blocks(shape, spec, self.mesh, values, where)


def _cut(shards, start: tuple, shape: tuple) -> Optional[np.ndarray]:
    """The block at ``start`` of ``shape`` from the local shard that contains it."""
    for s0, value in shards:
        if all(a <= b and b + n <= a + m
               for a, b, n, m in zip(s0, start, shape, value.shape)):
            return value[tuple(slice(b - a, b - a + n) for a, b, n in zip(s0, start, shape))]
    return None


def _to_torch(torch, value: np.ndarray):
    value = np.array(value, order="C", copy=True)     # writable, keeps a 0-d shape
    if value.dtype.name == "bfloat16":
        return torch.from_numpy(value.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(value)


def _to_numpy(t, dtype: np.dtype) -> np.ndarray:
    import torch
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(dtype)
    return t.numpy()


def _write_chunks(path: str, chunks: dict, shapes: dict) -> int:
    """A DCP directory at ``path`` holding ``chunks`` ((key, start) -> tensor) as
    chunks of their keys (whose whole shapes are ``shapes``); returns the bytes.

    DCP writes them (as flat entries under temporary names), then the metadata is
    rewritten to say what they are: chunks at ``start`` of the real keys."""
    import dataclasses
    import pickle
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorStorageMetadata)
    os.makedirs(path, exist_ok=True)
    names = {f"chunk{i}": kc for i, kc in enumerate(chunks)}
    if chunks:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({n: chunks[kc] for n, kc in names.items()}, checkpoint_id=path,
                     no_dist=True)
        md = dcp.FileSystemReader(path).read_metadata()
    else:
        from torch.distributed.checkpoint.metadata import Metadata
        md = Metadata(state_dict_metadata={}, storage_data={}, planner_data={})
    state, storage = {}, {}
    for n, (key, start) in names.items():
        t = chunks[(key, start)]
        entry = state.setdefault(key, TensorStorageMetadata(
            properties=md.state_dict_metadata[n].properties,
            size=torch.Size(shapes[key]), chunks=[]))
        entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size(start),
                                                 sizes=torch.Size(t.shape)))
        info = next(v for i, v in md.storage_data.items() if i.fqn == n)
        storage[MetadataIndex(key, torch.Size(start))] = info
    md = dataclasses.replace(md, state_dict_metadata=state, storage_data=storage,
                             planner_data={k: (k,) for k in state})
    # DCP's own on-disk metadata format (a pickle on the shared filesystem, read by DCP);
    # nothing here crosses the wire.
    tmp = os.path.join(path, ".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(md, f)
    os.replace(tmp, os.path.join(path, ".metadata"))
    return sum(t.numel() * t.element_size() for t in chunks.values())


class _Lost(Exception):
    """A piece of a transfer cannot arrive: its sender is gone."""


class _Failed(Exception):
    """The sender's buffer had failed: ``error`` is its BufferError."""

    def __init__(self, error) -> None:
        super().__init__(error.message)
        self.error = error


def _avals(avals) -> str:
    return ", ".join(f"{d}{list(s)}" for d, s in avals)


def _dtype_name(dtype) -> str:
    return str(np.dtype(dtype))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_member(req: dict) -> None:
    """Entry point: serve the slice's Executor service on this host, report to the
    agent, then meet the other members."""
    from .. import _proc
    from ..rpc import grpc_util
    from ..rpc import pathways_pb2 as pb
    from ..rpc import pathways_pb2_grpc as pbg
    from .devices import with_torch_rounding
    _proc.die_with_parent(int(req["agent_pid"]), signal.SIGKILL)
    os.environ["XLA_FLAGS"] = with_torch_rounding(os.environ.get("XLA_FLAGS", ""))
    agent = pbg.WorkerStub(grpc_util.channel(req["agent_address"]))
    bind = req["bind_host"]
    advertise = req.get("advertise_host") or bind
    try:
        service = MemberService(req)
        srv = grpc_util.server(max_workers=16)
        pbg.add_ExecutorServicer_to_server(service, srv)
        port = grpc_util.add_port(srv, f"{bind}:0")
        srv.start()
        rendezvous = req.get("rendezvous") or f"{advertise}:{_free_port(bind)}"
    except Exception as e:      # noqa: BLE001 (report why, so the client sees it)
        agent.ExecutorReady(pb.ExecutorReadyRequest(
            slice_id=req["slice_id"], pid=os.getpid(),
            error=f"{type(e).__name__}: {e}"), timeout=30)
        raise
    agent.ExecutorReady(pb.ExecutorReadyRequest(
        slice_id=req["slice_id"], pid=os.getpid(), address=f"{advertise}:{port}",
        data_address=service.dataplane.address, memory_budget=service.budget,
        rendezvous=rendezvous), timeout=30)
    threading.Thread(target=service.meet, args=(rendezvous,), name="meet",
                     daemon=True).start()
    _proc.serve_until_signal(srv)
    # jax.distributed.shutdown() waits for every member at a barrier; the slice is
    # being stopped as a whole, so leave without it.
    os._exit(0)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    run_member(json.loads(sys.stdin.readline()))


if __name__ == "__main__":
    main()
