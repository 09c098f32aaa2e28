"""One slice's executor: owns the slice's devices through torch_xla (PJRT) in SPMD mode.

It serves the Executor gRPC service: ``Compile`` registers a program (an HLO module
traced by the client) and warms XLA's compile cache with placeholders; ``Dispatch`` is
the client's ordered stream of puts, executions, releases and barriers, run one after
another by a single execution thread (so every op runs in the order the client sent
it); ``Fetch`` and ``Wait`` block on the object store. ``Profile`` opens and closes a
``pw.profile()`` session: while one is open, every op records spans (``tracing``) and
executions run to completion, so their spans are device time.

The service is put together from parts, each a file: oploop.py (the ordered op loop
and executions, top to bottom: the hot path), programs.py (compile, cached launches),
transfers.py (puts, transfers, reads), backpressure.py (the memory budget) and
checkpoint_io.py; this file holds the RPCs, the readers and the completion watermarks.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Optional

from .. import tracing
from ..rpc import codec, validate
from ..sharding import P, spec_candidates
from .memory import MemoryPlans
from .backpressure import BackPressure
from .checkpoint_io import CheckpointIO
from .fused import Fusion
from .oploop import OpLoop
from .programs import Programs
from .ready import wait_entries
from .store import Entry
from .transfers import Transfers

log = logging.getLogger("pathways.executor")


def run_executor(req: dict) -> None:
    """Entry point of a forked executor process (see agent.Zygote)."""
    import faulthandler
    faulthandler.enable()               # a crash leaves its stacks in the worker's log
    from .devices import slice_env, with_torch_rounding
    os.environ.update(slice_env(req["kind"], req["devices"]))
    os.environ["XLA_FLAGS"] = with_torch_rounding(os.environ.get("XLA_FLAGS", ""))
    from .. import _proc
    from ..rpc import grpc_util
    from ..rpc import pathways_pb2 as pb
    from ..rpc import pathways_pb2_grpc as pbg

    agent = pbg.WorkerStub(grpc_util.channel(req["agent_address"]))
    service = None
    plans = MemoryPlans.enable()        # before XLA reads its flags
    try:
        service = ExecutorService(req, plans)
        srv = grpc_util.server(max_workers=16)
        pbg.add_ExecutorServicer_to_server(service, srv)
        port = grpc_util.add_port(srv, f"{req['bind_host']}:0")
        srv.start()
    except Exception as e:  # report why, so the client sees it
        agent.ExecutorReady(pb.ExecutorReadyRequest(
            slice_id=req["slice_id"], pid=os.getpid(),
            error=f"{type(e).__name__}: {e}"), timeout=30)
        raise
    # What exists now (torch, torch_xla, the service) lives as long as the process:
    # keep it out of the cyclic collector, whose full passes over it cost ~0.2 s each.
    import gc
    gc.freeze()
    agent.ExecutorReady(pb.ExecutorReadyRequest(
        slice_id=req["slice_id"], pid=os.getpid(),
        address=f"{req.get('advertise_host') or req['bind_host']}:{port}",
        data_address=service.dataplane.address, memory_budget=service.budget), timeout=30)
    try:
        _proc.serve_until_signal(srv)
    finally:
        if plans is not None:
            plans.close()
    service.stop()


def _make_servicer_base():
    from ..rpc import pathways_pb2_grpc as pbg
    return pbg.ExecutorServicer


class ExecutorService(OpLoop, Programs, Transfers, BackPressure, CheckpointIO,
                      _make_servicer_base()):
    def __init__(self, req: dict, plans: Optional[MemoryPlans] = None) -> None:
        import numpy as np
        import torch
        from .._xla import import_torch_xla
        torch_xla = import_torch_xla()
        import torch_xla.runtime as xr
        import torch_xla.distributed.spmd as xs
        from ..rpc import pathways_pb2 as pb
        from .dataplane import DataPlane
        from .store import ObjectStore

        self.pb = pb
        self.torch = torch
        self.torch_xla = torch_xla
        self.xs = xs
        n_slice = len(req["devices"])
        # A one-device slice needs no partitioner: plain mode is ~2x cheaper per op.
        self.spmd = n_slice > 1
        if self.spmd:
            xr.use_spmd()
        self.device = torch_xla.device()
        # Inputs marked for donation may be aliased with outputs of the same shape.
        torch_xla._XLAC._xla_set_enable_alias_with_buffer_donor_config(True)
        # torch's lazy core shares one device buffer among equal scalars put on the
        # device; a cached launch donates its donated inputs unconditionally, so every
        # buffer here must be its own (programs keep their constants in their HLO).
        torch_xla._XLAC._set_xla_enable_device_data_cache(False)
        n = xr.global_runtime_device_count()
        if n != len(req["devices"]):
            raise RuntimeError(f"runtime shows {n} devices, slice has {len(req['devices'])}")
        self.mesh_shape = tuple(req["mesh_shape"])
        self.axis_names = tuple(req["axis_names"])
        self.mesh = xs.Mesh(np.arange(n), self.mesh_shape, self.axis_names)
        self.where = f"island {req['island']} host {req['host']}"
        self.slice_id = req["slice_id"]
        self._key = req.get("slice_key", "")
        self.store = ObjectStore()
        self.programs: dict = {}
        self.executed = 0
        self.compiles = 0
        self.plans = plans
        self.planned_bytes: dict = {}   # program name -> XLA's plan per device (largest)
        self._spec_strings: dict = {}
        self._puts: dict = {}           # buffer id -> (meta, spec, [chunks]) while chunked
        # Spans for pw.profile(); recorded only while a profile is open.
        self.rec = tracing.Recorder(tracing.skew_from_env())
        self.process_name = f"executor {self.where} slice {self.slice_id}"
        self.dataplane = DataPlane(req["bind_host"], self.rec,
                                   advertise_host=req.get("advertise_host", ""))
        self.dataplane.on_pull = self._on_pull
        self.transfer_timeout = 600.0
        from .memory import default_budget
        # Bytes of buffers each device of the slice may hold (the worker's budget split
        # over its devices); see _make_room for what happens when outputs do not fit.
        self.budget = int(req.get("memory_budget") or default_budget())
        self.backpressure_timeout = float(os.environ.get("PATHWAYS_BACKPRESSURE_TIMEOUT",
                                                         "120"))
        from .arbiter import connect
        # Shared devices: every execution waits for the host arbiter's grant (and is run
        # to completion inside it, so its device time can be charged to this client).
        self.arbiter = connect(req.get("arbiter"), req.get("client_id", ""),
                               req.get("share", 0.0))
        self._resolve_lock = threading.RLock()
        self._resolving: dict = {}      # transfer id -> Event set once it is resolved
        # Received buffers that queued sends still read: a release of one must leave its
        # bytes to them (transfer id -> sends not yet past _resolve).
        self._sending: dict = {}
        self._sending_lock = threading.Lock()
        self._gang_next = 1             # the slice_seq of the next scheduled gang op
        self._fusion = Fusion()         # which recorded graphs run fused (worker/fused.py)
        self.cached_launches = 0        # executions launched without tracing
        self._in_gang = False           # running a gang op inside one arbiter grant
        self.gang_positions: list = []  # island positions of the gang ops run, in order
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        # Items taken off the queue early while an op waits for memory (see _make_room).
        self._ahead: "collections.deque" = collections.deque()
        self.backpressure_waits = 0     # ops that waited for memory, and for how long
        self.backpressure_seconds = 0.0
        self._events: "queue.SimpleQueue" = queue.SimpleQueue()
        self._watcher: Optional[threading.Thread] = None   # pushes done_seq (WatchOps)
        self._watch_asks = 0            # WatchOps processed on this stream
        self._stream_lock = threading.Lock()
        self._streaming = False         # a Dispatch stream is open
        self.loaders: dict = {}         # loader id -> worker.loader.HostLoader
        self._thread = threading.Thread(target=self._loop, name="executor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self.dataplane.close()
        for loader in list(self.loaders.values()):
            loader.close()

    # ------------------------------------------------------------------ helpers
    def _err(self, kind: str, message: str, program: str = ""):
        return self.pb.BufferError(kind=kind, message=message, program=program,
                                   host=self.where)

    def _shards(self, spec) -> int:
        """Into how many pieces ``spec`` cuts a buffer (1 when replicated)."""
        if not self.spmd:
            return 1
        sizes = dict(zip(self.axis_names, self.mesh_shape))
        n = 1
        for d in range(len(spec)):
            for a in spec.axes(d):
                n *= sizes.get(a, 1)
        return n

    def _padded(self, spec, rank: int) -> tuple:
        entries = list(spec) + [None] * (rank - len(spec))
        return tuple(entries[:rank])

    def _shard(self, t, spec) -> None:
        if self.spmd:
            self.xs.mark_sharding(t, self.mesh, self._padded(spec, t.dim()))

    def _spec_of(self, t):
        """Map a tensor's HLO sharding back to a partition spec (None if it is none)."""
        if not self.spmd:
            return P(), "{replicated}"
        s = self.torch_xla._XLAC._get_xla_sharding_spec(t)
        rank = t.dim()
        if s in ("", "{replicated}"):
            return P(), s
        table = self._spec_strings.setdefault(rank, {})
        if s in table:
            return table[s], s
        n = 1
        for m in self.mesh_shape:
            n *= m
        for cand in spec_candidates(rank, self.axis_names):
            if any(v is cand for v in table.values()):
                continue
            d = self.torch.zeros((n,) * rank).to(self.device)
            self._shard(d, cand)
            cs = self.torch_xla._XLAC._get_xla_sharding_spec(d) or "{replicated}"
            table.setdefault(cs, cand)
            if cs == s:
                return cand, s
        return None, s

    # ------------------------------------------------------------------ RPCs
    def _authorize(self, context) -> None:
        """Only the client that owns the slice may call: its calls carry the slice key."""
        if self._key:
            from ..rpc.ownership import check_slice_key
            check_slice_key(
                context, self._key,
                f"slice {self.slice_id} on {self.where} belongs to another client (or "
                "the call lacks the slice key from AllocateSlice)")

    def Compile(self, request, context):
        self._authorize(context)
        validate.guard(context, validate.check_compile, request, self.axis_names,
                       self._cap())
        fut: Future = Future()
        rec = self.rec
        self._queue.put(("compile", request, fut, rec.now() if rec.on else 0))
        try:
            return fut.result()
        except Exception as e:
            import grpc
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, MemoryError)
                    else grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(code, f"compiling program '{request.name}' on {self.where} "
                          f"failed: {e}")

    def Dispatch(self, request_iterator, context):
        self._authorize(context)
        rec = self.rec
        # One stream at a time: the op numbering (after_seq) and the barrier events
        # belong to one client stream.
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
                    t = rec.now() if rec.on else 0    # queue spans start on arrival
                    for op in batch.ops:
                        if op.WhichOneof("kind") != "release":
                            index += 1
                            self._queue.put(("op", op, index, t))
                        else:
                            self._queue.put(("op", op, 0, t))
            except Exception:
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
            self._unwatch()

    def Fetch(self, request, context):
        self._authorize(context)
        validate.guard(context, validate.check_timeout, request.timeout_s)
        rec = self.rec
        t0 = rec.now() if rec.on else 0
        nbytes = 0
        try:
            for chunk in self._fetch(request):
                nbytes += len(chunk.data)
                yield chunk
        finally:
            if t0:
                rec.add("fetch", "fetch", t0, buffer_ids=(request.buffer_id,),
                        nbytes=nbytes)

    def _fetch(self, request):
        entry, parts, err = self._read_parts(request)
        if err is not None:
            yield err
            return
        try:
            data = b"".join(bytes(codec.byte_view(p)) for p in parts)
        finally:
            self.store.end_read(entry)
        t = entry.tensor
        meta = self.pb.TensorMeta(dtype=codec.dtype_name(t.dtype), shape=list(t.shape))
        for i, part in enumerate(codec.chunks(data)):
            yield self.pb.FetchChunk(meta=meta if i == 0 else None, data=bytes(part))

    def _on_pull(self, raw: bytes):
        """A fetch on the data plane (see dataplane.py): (FetchChunk, payload views,
        same_host, release), ``release`` to be called once the views are sent."""
        from .dataplane import read_pull
        req, refused = read_pull(self, raw)
        if refused is not None:
            return refused, None, False, None
        rec = self.rec
        t0 = rec.now() if rec.on else 0
        entry, parts, err = self._read_parts(req)
        if err is not None:
            return err, None, False, None
        t = entry.tensor
        if t0:
            rec.add("fetch", "fetch", t0, buffer_ids=(req.buffer_id,),
                    nbytes=codec.nbytes(t.dtype, tuple(t.shape)), detail="data plane")
        meta = self.pb.TensorMeta(dtype=codec.dtype_name(t.dtype), shape=list(t.shape))
        return (self.pb.FetchChunk(meta=meta), [codec.byte_view(p) for p in parts],
                req.same_host, lambda: self.store.end_read(entry))

    def Wait(self, request, context):
        self._authorize(context)
        validate.guard(context, validate.check_wait, request)
        rec = self.rec
        t0 = rec.now() if rec.on else 0
        try:
            return self._wait(request)
        finally:
            if t0:
                rec.add("wait", "wait", t0, buffer_ids=request.buffer_ids)

    def _wait(self, request):
        pb = self.pb
        timeout = request.timeout_s or 600.0
        deadline = time.monotonic() + timeout
        reply = pb.WaitReply()
        ready = []
        for bid in request.buffer_ids:
            try:
                entry = self.store.wait_for(bid, request.after_seq,
                                            max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                reply.errors.append(self._err("timeout", f"buffer {bid} not ready in {timeout} s"))
                reply.failed.append(True)
                continue
            if entry is not None:
                self._resolve(entry)
            if entry is None:
                reply.errors.append(self._err("unknown_buffer", f"buffer {bid} does not exist"))
                reply.failed.append(True)
            elif entry.error is not None:
                reply.errors.append(entry.error)
                reply.failed.append(True)
            else:
                ready.append(entry)
                reply.errors.append(pb.BufferError())
                reply.failed.append(False)
        if ready:
            # Block until the device work that produces them is done (where the
            # runtime allows, not the work queued after it).
            wait_entries(self.torch_xla._XLAC, ready, self.store, not self.spmd)
        return reply

    def Stats(self, request, context):
        self._authorize(context)
        import torch_xla.debug.metrics as met
        alias = met.metric_data("InputOutputAliasCount")
        return self.pb.StatsReply(
            aliased_buffers=int(alias[1]) if alias else 0,
            num_buffers=len(self.store.entries), buffer_bytes=self.store.bytes,
            device_bytes=self.store.device_bytes,
            num_programs=len(self.programs), num_devices=len(self.mesh.device_ids),
            executed=self.executed, compiles=self.compiles, pid=os.getpid(),
            gang_positions=self.gang_positions, bytes_received=self.dataplane.bytes_received,
            bytes_sent=self.dataplane.bytes_sent, recv_seconds=self.dataplane.recv_seconds,
            busy_seconds=self.arbiter.busy_seconds if self.arbiter else 0.0,
            shared=self.arbiter is not None, memory_budget=self.budget,
            backpressure_waits=self.backpressure_waits,
            backpressure_seconds=self.backpressure_seconds, planned_bytes=self.planned_bytes,
            cached_launches=self.cached_launches, fused_launches=self._fusion.launches,
            fused_programs=self._fusion.programs)

    def OpenLoader(self, request, context):
        """Build a pw.DataLoader's dataset here and say what its batches look like."""
        self._authorize(context)
        from .loader import open_loader
        return open_loader(self, request, context, self._loader_put)

    def PeekLoader(self, request, context):
        """Whether a stream's batch exists, once this host's loader got to it."""
        self._authorize(context)
        from .loader import peek_loader
        return peek_loader(self, request)

    def _loader_put(self, blocks: dict, axis: str, rows: int):
        """A loaded part of a batch (one slice of one host: one block) on the devices."""
        (cpu,) = blocks.values()
        spec = P(axis) if axis and cpu.dim() else P()
        return self._to_device(cpu, spec), self._shards(spec)

    def _batch(self, op) -> None:
        """A BatchOp: bind the loader's batch (epoch, index) to the op's buffer ids."""
        from .loader import take_batch
        placed, err = take_batch(self, op, self.transfer_timeout)
        for k, bid in enumerate(op.outputs):
            if err is not None:
                self.store.put(bid, Entry(error=err))
            else:
                t, shards = placed[k]
                self.store.put(bid, Entry(t, None, codec.nbytes(t.dtype, tuple(t.shape)),
                                          "", None, shards))

    def Colocated(self, request, context):
        """Run an importable function here on the host copies of some buffers."""
        self._authorize(context)
        from .colocated import run_colocated
        return run_colocated(self, request, context)

    def Profile(self, request, context):
        self._authorize(context)
        validate.guard(context, validate.check_profile, request, self.rec.active)
        if request.action == self.pb.ProfileRequest.STOP:
            # The client sent STOP after a barrier: every op it had dispatched ran. Sends
            # run on the sender pool; let those already under way finish and record.
            self.dataplane.wait_idle(2.0)
        return tracing.serve_profile(self.pb, self.rec, request, self.process_name)

    # ------------------------------------------------------------- completion watermarks
    def _watch(self) -> None:
        """A WatchOp, in stream order: push one ``done_seq`` watermark covering every op
        up to this one, once what they produce is ready. The first starts the pusher."""
        store = self.store
        with store.cond:
            self._watch_asks += 1
            if self._watcher is None:
                store.start_noting()
                self._watcher = threading.Thread(target=self._push_watermarks,
                                                 args=(self._events,), daemon=True,
                                                 name="watermarks")
                self._watcher.start()
            store.cond.notify_all()

    def _unwatch(self) -> None:
        store = self.store
        with store.cond:
            if self._watcher is None:
                return
            self._watcher, self._watch_asks = None, 0
            store.stop_noting()
            store.cond.notify_all()

    def _push_watermarks(self, events) -> None:
        """For each batch of WatchOps: wait until what the ops before them produce is
        ready (transfers received, device work done), then push the count with the
        failed buffers among them. Nothing is pushed while nobody asks."""
        store, me = self.store, threading.current_thread()
        served = 0
        while True:
            with store.cond:
                store.cond.wait_for(lambda: self._watcher is not me or
                                    self._watch_asks > served)
                if self._watcher is not me:
                    return
                seq, served = store.processed, self._watch_asks
            noted, launched = store.take_noted()
            ev = self.pb.DispatchEvent(done_seq=seq)
            for bid in noted:
                entry = store.get(bid)
                if entry is None:
                    continue
                self._resolve(entry)
                if entry.error is not None:
                    ev.failed_ids.append(bid)
                    ev.errors.append(entry.error)
            try:
                if launched is None:
                    self.torch_xla._XLAC._xla_wait_device_ops([])
                else:       # the buffers put since the last watermark, not what follows
                    wait_entries(self.torch_xla._XLAC, [store.get(b) for b in launched],
                                 store, not self.spmd)
            except Exception:
                # a failed execution: its own outputs say so; stop vouching for readiness
                log.warning("watermarks stopped: %s", traceback.format_exc())
                self._unwatch()
                events.put(self.pb.DispatchEvent(unwatched=True))
                return
            events.put(ev)
