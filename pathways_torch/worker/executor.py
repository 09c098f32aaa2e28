"""One slice's executor: owns the slice's devices through torch_xla (PJRT) in SPMD mode.

It serves the Executor gRPC service: ``Compile`` registers a program (an HLO module
traced by the client) and warms XLA's compile cache with placeholders; ``Dispatch`` is
the client's ordered stream of puts, executions, releases and barriers, run one after
another by a single execution thread (so every op runs in the order the client sent
it); ``Fetch`` and ``Wait`` block on the object store. ``Profile`` opens and closes a
``pw.profile()`` session: while one is open, every op records spans (``tracing``) and
executions run to completion, so their spans are device time.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import re
import threading
import time
import traceback
import warnings
from concurrent.futures import Future
from typing import Optional

from .. import tracing
from ..rpc import codec, validate
from ..sharding import P, device_block, spec_candidates, spec_from_proto, spec_to_proto
from .dataplane import listening
from .memory import MemoryPlans, gib
from .fused import Fusion, Segment
from .store import Entry

log = logging.getLogger("pathways.executor")


def run_executor(req: dict) -> None:
    """Entry point of a forked executor process (see agent.Zygote)."""
    from .devices import slice_env
    os.environ.update(slice_env(req["kind"], req["devices"]))
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


class _Program:
    __slots__ = ("name", "xla_name", "comp", "params", "constants", "out_specs", "out_bytes",
                 "out_nbytes", "out_shards", "donate", "out_device_bytes", "in_avals",
                 "cached", "hlo_bytes", "out_avals", "program_id")

    def __init__(self, name, xla_name, comp, params, constants, out_specs):
        self.donate = ()
        self.in_avals = []            # (torch dtype, shape) of each flat input
        self.out_bytes = 0
        self.out_nbytes = []
        self.out_device_bytes = 0     # bytes its outputs take on each device
        self.out_shards = []
        self.name = name
        self.xla_name = xla_name
        self.comp = comp
        self.params = params          # list of ("i", k) or ("c", k)
        self.constants = constants    # device tensors
        self.out_specs = out_specs    # list of spec tuples, or None
        # (graph hash, feed) for torch_xla's _run_cached_graph: the compiled executable
        # launched without re-tracing; feed: per HLO parameter, an input position (>= 0)
        # or -1 and the constant's device tensor. None: trace each call.
        self.cached = None
        self.hlo_bytes = 0            # the size of its HLO (fused runs are capped by it)
        self.out_avals = []           # (torch dtype, shape) of each output
        self.program_id = ""


def _make_servicer_base():
    from ..rpc import pathways_pb2_grpc as pbg
    return pbg.ExecutorServicer


class ExecutorService(_make_servicer_base()):
    def __init__(self, req: dict, plans: Optional[MemoryPlans] = None) -> None:
        import numpy as np
        import torch
        import torch_xla
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

    def _to_device(self, cpu, spec):
        """A CPU tensor onto the slice's devices with ``spec``. Sharded, each device
        gets only its shard, copied from ``cpu`` (which may be freed after): 2x
        faster here than a whole copy that ``mark_sharding`` then cuts."""
        if not self.spmd or cpu.numel() == 0:
            t = cpu.to(self.device)
            self._shard(t, spec)
            return t
        padded = self._padded(spec, cpu.dim())
        shape = tuple(cpu.shape)
        shards = []
        for k in range(len(self.mesh.device_ids)):
            block = device_block(shape, P(*padded), self.axis_names, self.mesh_shape, k)
            shards.append(cpu[tuple(slice(a, b) for a, b in block)])
        return self.torch_xla._XLAC._global_tensor_from_cpu_shards(
            shards, self.mesh.get_op_sharding(padded), list(shape))

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

    def _read_parts(self, request):
        """The buffer ``request`` names, held for reading (``end_read`` it after the
        parts are used) and on the host (``_host_parts``): (entry, parts, None), or
        (None, None, the FetchChunk that says why not)."""
        entry, err = self._readable(request)
        if err is not None:
            return None, None, err
        try:
            return entry, self._host_parts(entry.tensor), None
        except Exception as e:  # an asynchronous execution failure surfaces here
            self.store.end_read(entry)
            return None, None, self.pb.FetchChunk(has_error=True,
                                                  error=self._read_failed(entry, e))

    def _read_failed(self, entry, e: Exception, what: str = "a put"):
        """The BufferError of a buffer whose producer failed (seen when it is read)."""
        what = f"program '{entry.origin}'" if entry.origin else what
        return self._err("program", f"{what} failed on {self.where}: {e}", entry.origin)

    def _host_parts(self, t) -> list:
        """The buffer's bytes on the host, as contiguous CPU tensors whose bytes, one
        after the other, are the whole tensor's (row-major), with as few copies as the
        runtime allows: a one-device buffer is viewed in place (DLPack; CPU device
        memory is host memory, other devices copy once); a sharded one is read shard
        by shard (torch_xla's gather of ``.cpu()`` is 3x slower here), once per
        distinct shard, and only put together when its shards are not row blocks."""
        torch, XLAC = self.torch, self.torch_xla._XLAC
        if t.device.type != "xla":          # a status a save wrote: already on the host
            return [t.contiguous()]
        # the views below need the device work that produces ``t`` done (.cpu() waits
        # on its own); an execution's failure surfaces here
        XLAC._xla_wait_device_ops([])
        if not self.spmd:
            if t.numel():
                from torch_xla.utils import dlpack
                try:
                    return [torch.utils.dlpack.from_dlpack(dlpack.to_dlpack(t))]
                except Exception:
                    pass
            return [t.cpu().contiguous()]
        if XLAC._get_xla_sharding_spec(t) in ("", "{replicated}") or not t.numel():
            return [t.cpu().contiguous()]
        shards = XLAC._get_local_shards([t])[0]
        places = XLAC._get_local_shard_replica_and_indices([t])[0]
        blocks = {}
        for (cpu, _), (replica, index) in zip(shards, places):
            if replica == 0 and index is not Ellipsis:
                start = tuple(i.start for i in index)
                blocks[start] = cpu[tuple(slice(0, i.stop - i.start) for i in index)]
        shape = tuple(t.shape)
        order = sorted(blocks)
        if all(tuple(b.shape[1:]) == shape[1:] for b in blocks.values()):
            return [blocks[k].contiguous() for k in order]    # row blocks, in order
        whole = torch.empty(shape, dtype=t.dtype)
        for start, b in blocks.items():
            whole[tuple(slice(s, s + n) for s, n in zip(start, b.shape))] = b
        return [whole]

    def _readable(self, request):
        """The entry ``request`` names, ready and held for reading (``end_read`` it
        after), or (None, the FetchChunk that says why not)."""
        pb = self.pb
        timeout = request.timeout_s or 600.0
        try:
            entry = self.store.wait_for(request.buffer_id, request.after_seq, timeout)
        except TimeoutError:
            return None, pb.FetchChunk(has_error=True, error=self._err(
                "timeout", f"buffer {request.buffer_id} was not produced within {timeout} s"))
        if entry is None:
            return None, pb.FetchChunk(has_error=True, error=self._err(
                "unknown_buffer", f"buffer {request.buffer_id} does not exist on this slice "
                "(released, or never created)"))
        self._resolve(entry)
        if entry.error is not None:
            return None, pb.FetchChunk(has_error=True, error=entry.error)
        if not self.store.begin_read(entry):
            return None, pb.FetchChunk(has_error=True, error=self._err(
                "donated", f"buffer {request.buffer_id} was donated to a program"))
        return entry, None

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
        ready = False
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
                ready = True
                reply.errors.append(pb.BufferError())
                reply.failed.append(False)
        if ready:
            # Block until the device work queued so far (which produces them) is done.
            self.torch_xla._XLAC._xla_wait_device_ops([])
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
        return run_colocated(self, request)

    def Profile(self, request, context):
        self._authorize(context)
        validate.guard(context, validate.check_profile, request, self.rec.active)
        if request.action == self.pb.ProfileRequest.STOP:
            # The client sent STOP after a barrier: every op it had dispatched ran. Sends
            # run on the sender pool; let those already under way finish and record.
            self.dataplane.wait_idle(2.0)
        return tracing.serve_profile(self.pb, self.rec, request, self.process_name)

    # ------------------------------------------------------------------ execution thread
    def _loop(self) -> None:
        while True:
            item = self._ahead.popleft() if self._ahead else self._queue.get()
            if item is None:
                return
            kind, msg, index, t_in = item
            if t_in:
                self._queued(kind, msg, index, t_in)
            if kind == "compile":
                fut = index
                try:
                    fut.set_result(self._compile(msg))
                except Exception as e:
                    log.debug("compile failed: %s", traceback.format_exc())
                    fut.set_exception(e)
                continue
            self._process(index, msg)

    def _queued(self, kind: str, msg, index, t_in: int) -> None:
        """Record how long an op waited between its arrival and its start (profiling)."""
        program, which = "", kind
        if kind == "op":
            which = msg.WhichOneof("kind")
            if which == "release":
                return
            if which == "execute":
                prog = self.programs.get(msg.execute.program_id)
                program = prog.name if prog is not None else ""
        else:
            program = msg.name
        self.rec.add("queue", program or which, t_in, detail=which, program=program)

    def _process(self, index: int, op) -> None:
        which = op.WhichOneof("kind")
        try:
            if which == "gang":
                g = op.gang
                rec = self.rec
                t0 = rec.now() if rec.on else 0
                if g.slice_seq > 0:
                    if g.slice_seq != self._gang_next:   # the client enqueues in order
                        log.error("gang op %d arrived, expected %d", g.slice_seq,
                                  self._gang_next)
                    self._gang_next = g.slice_seq + 1
                    self.gang_positions.append(g.position)
                if self.arbiter is not None and g.host_seq:
                    # Shared devices: the whole gang op runs in one grant, in the
                    # host's gang order (see worker/arbiter.py).
                    with self.arbiter.grant(gang=g.host_seq):
                        self._in_gang = True
                        try:
                            self._gang_ops(g.ops)
                        finally:
                            self._in_gang = False
                else:
                    self._gang_ops(g.ops)
                if t0:
                    rec.add("gang", "gang", t0,
                            detail=f"island position {g.position}, {len(g.ops)} ops")
            else:
                self._one(op)
        except Exception:  # never let one op kill the stream
            log.error("op %s failed: %s", which, traceback.format_exc())
        if index:
            self.store.advance(index)

    def _gang_ops(self, ops) -> None:
        """A recorded graph's ops for this slice, in order. A graph this executor has
        seen before runs its consecutive executions as one fused XLA computation
        (worker/fused.py): traced one by one, launched once."""
        seg = self._fusion.segment(ops, self.rec.on)
        if seg is None:
            for inner in ops:
                self._one(inner)
            return
        for inner in ops:
            if not self._fuse(seg, inner):
                if seg.count:
                    self._flush(seg)
                    seg = Segment()
                self._one(inner)
        self._flush(seg)

    def _fuse(self, seg, op) -> bool:
        """Add an execution to ``seg`` (launched at ``_flush``); False for an op that
        must run on its own: not an execution, donating, malformed or too big."""
        if op.WhichOneof("kind") != "execute":
            return False
        x = op.execute
        prog = self.programs.get(x.program_id)
        if prog is None or x.donate or not seg.takes(prog):
            return False
        # What validate.check_execute checks, on the segment's outputs too; anything
        # odd runs alone, where it is checked and reported.
        entries, made = self.store.entries, seg.avals
        outputs, avals = x.outputs, prog.in_avals
        if len(x.inputs) != len(avals) or len(outputs) != len(prog.out_avals):
            return False
        for b in outputs:
            if b in made or b in entries:
                return False
        if len(outputs) > 1 and len(set(outputs)) != len(outputs):
            return False
        sources = []
        for b, aval in zip(x.inputs, avals):
            here = seg.produced(b)
            if here is not None:
                if made[b] != aval:
                    return False
                sources.append(here)
                continue
            e = entries.get(b)
            if e is None or e.pending is not None or e.error is not None or e.donated:
                return False
            t = e.tensor
            if t is None or t.dtype != aval[0] or t.shape != aval[1]:
                return False
            sources.append(seg.source(b, t))
        if self.store.device_bytes + seg.device_bytes + prog.out_device_bytes > self.budget:
            return False
        seg.add(prog, tuple(sources), outputs)
        return True

    def _flush(self, seg) -> None:
        """Launch ``seg``'s executions as one computation: its cached executable when
        this run was launched before, else traced (and its launch plan kept). Their
        outputs (or the failure) enter the store only now."""
        if not seg.count:
            return
        X = self.torch_xla._XLAC
        key = tuple(seg.key)
        plans = self._fusion.plans
        try:
            plan = plans.get(key)
            if plan is not None:
                outs = X._run_cached_graph(plan[0], [seg.ext[k] if k >= 0 else v
                                                     for k, v in plan[1]])
                self.cached_launches += 1
            else:
                outs, starts = [], []
                for prog, sources, _ in seg.ops:
                    args = [seg.ext[s] if s.__class__ is int else outs[starts[s[0]] + s[1]]
                            for s in sources]
                    starts.append(len(outs))
                    outs.extend(self._run(prog, args))
                if key not in plans:
                    plans[key] = plan = (None if self.spmd else
                                         self._plan_of(outs, seg.ext))
                if plan is not None:
                    X._xla_warm_up_cache(outs, [])
                    outs = X._run_cached_graph(plan[0], [seg.ext[k] if k >= 0 else v
                                                         for k, v in plan[1]])
                else:
                    X._xla_sync_multi(outs, [], wait=False)
            if self._in_gang:
                X._xla_wait_device_ops([])
        except Exception as e:  # noqa: BLE001
            names = seg.names()
            err = self._err("program", f"programs {names} (run fused, as a recorded "
                            f"graph) failed on {self.where}: {type(e).__name__}: {e}",
                            names)
            for b, _ in seg.outputs():
                self.store.put(b, Entry(error=err))
            return
        put = self.store.put
        at = 0
        for prog, _, ids in seg.ops:
            for b, o, n, k in zip(ids, outs[at:at + len(ids)], prog.out_nbytes,
                                  prog.out_shards):
                put(b, Entry(o, None, n, prog.name, None, k))
            at += len(ids)
        self.executed += seg.count
        self._fusion.launches += 1
        self._fusion.programs += seg.count

    def _one(self, op) -> None:
        which = op.WhichOneof("kind")
        bad = self._invalid(op, which)
        if bad is not None:
            self._reject(which, validate.op_outputs(op), bad,
                         op.recv if which == "recv" else None)
            return
        if which == "execute":
            self._execute(op.execute)
        elif which == "put":
            self._put(op.put)
        elif which == "release":
            self._release(op.release.buffer_ids)
            if op.release.loader_ids:
                from .loader import close_loaders
                close_loaders(self, op.release.loader_ids)
        elif which == "recv":
            r = op.recv
            err = self._room_for(_nbytes(r.meta), r.spec,
                                 f"the transfer into buffer {r.buffer_id}", {r.buffer_id})
            if err is not None:
                # the bytes still arrive; take them off the data socket and drop them
                self._discard_recv(r)
                self.store.put(r.buffer_id, Entry(error=err))
            else:
                self.store.put(r.buffer_id, Entry(None, None, _nbytes(r.meta), "", r,
                                                  self._shards(spec_from_proto(r.spec))))
        elif which == "send":
            self._send(op.send)
        elif which == "barrier":
            self._events.put(self.pb.DispatchEvent(barrier=op.barrier.token))
        elif which == "watch":
            self._watch()
        elif which == "batch":
            self._batch(op.batch)
        elif which == "save":
            t0 = self.rec.now() if self.rec.on else 0
            self._save(op.save)
            self.rec.add("checkpoint", "save", t0, buffer_ids=op.save.buffer_ids,
                         detail=op.save.path)
        elif which == "load":
            t0 = self.rec.now() if self.rec.on else 0
            self._load(op.load)
            self.rec.add("checkpoint", "load", t0, buffer_ids=op.load.buffer_ids,
                         detail=op.load.path)

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
            noted = store.take_noted()
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
                self.torch_xla._XLAC._xla_wait_device_ops([])
            except Exception:
                # a failed execution: its own outputs say so; stop vouching for readiness
                log.warning("watermarks stopped: %s", traceback.format_exc())
                self._unwatch()
                events.put(self.pb.DispatchEvent(unwatched=True))
                return
            events.put(ev)

    def _invalid(self, op, which):
        """Why an op of the stream is malformed (a validate.InvalidMessage), or None.
        Puts are checked chunk by chunk in _put_now."""
        V = validate
        try:
            if which == "execute":
                x = op.execute
                V.check_execute(x, self.programs.get(x.program_id), self.store.entries)
            elif which == "recv":
                V.check_recv(op.recv, self.axis_names, self._cap(),
                             self.store.entries.__contains__)
            elif which == "send":
                V.check_send(op.send)
            elif which == "save":
                V.check_save(op.save, self.store.entries.__contains__)
            elif which == "load":
                V.check_load(op.load, self.axis_names, self._cap(),
                             self.store.entries.__contains__)
            elif which == "batch":
                V.check_new_ids(op.batch.outputs, self.store.entries.__contains__,
                                "a loader batch")
            elif which == "gang":
                raise V.InvalidMessage("a gang op inside a gang op (graphs do not nest)")
            elif which is None:
                raise V.InvalidMessage("an op with no kind")
        except V.InvalidMessage as e:
            return e
        return None

    def _reject(self, which, ids, e, recv=None) -> None:
        """A malformed op: its outputs fail with ``e`` (kind "input", or "oom"), except
        ids of live buffers, which keep their value; an op without outputs is dropped."""
        if not ids:
            log.warning("dropped a malformed %s op on %s: %s", which, self.where, e)
            return
        err = self._err(e.kind, f"refused a malformed {which or 'empty'} op: {e}")
        live = self.store.entries
        if recv is not None and ids[0] not in live:
            self._discard_recv(recv)                # its bytes may still come
        for b in ids:
            if b not in live:
                self.store.put(b, Entry(error=err))

    def _discard_recv(self, r) -> None:
        """Drop the bytes of a transfer (all its pieces), now or when they come."""
        self.dataplane.discard(r.transfer_id)
        for piece in r.pieces:
            self.dataplane.discard(piece.transfer_id)

    def _cap(self) -> int:
        """Bytes the slice's devices could hold together (one buffer's upper bound)."""
        return self.budget * len(self.mesh.device_ids)

    # ------------------------------------------------------------------ transfers
    def _resolve(self, entry) -> None:
        """Turn a received transfer into a device buffer (waits for its bytes)."""
        if entry.pending is None:
            return
        rec = self.rec
        t0 = rec.now() if rec.on else 0
        r = entry.pending
        if self._resolve_now(entry) and t0:
            rec.add("transfer", "recv to device", t0, transfer_id=r.transfer_id,
                    nbytes=entry.nbytes,
                    detail="waits for the bytes, then host to device (resharded)")

    def _resolve_now(self, entry) -> bool:
        # One thread resolves each transfer; others wait for that one alone. (A lock
        # held over the wait deadlocked: a relay's send waited for it while the
        # execution thread held it, waiting for bytes only that relay unblocks.)
        with self._resolve_lock:
            r = entry.pending
            if r is None:
                return False
            done = self._resolving.get(r.transfer_id)
            if done is None:
                done = self._resolving[r.transfer_id] = threading.Event()
                mine = True
            else:
                mine = False
        if not mine:
            done.wait()
            return False
        try:
            if r.pieces:
                self._resolve_pieces(entry, r)
                return True
            arrival, lost = self._take(r.transfer_id, r.src_data_address, r.src_host)
            try:
                if lost:
                    entry.error = self._err("lost", lost)
                elif arrival is None:
                    entry.error = self._err(
                        "timeout", f"transfer {r.transfer_id} did not arrive within "
                        f"{self.transfer_timeout:.0f} s")
                elif arrival.error is not None:
                    err = self.pb.BufferError()
                    err.ParseFromString(arrival.error)
                    entry.error = err            # the original failure, unchanged
                else:
                    want = _nbytes(r.meta)
                    if arrival.nbytes != want:
                        raise ValueError(f"transfer brought {arrival.nbytes} bytes, "
                                         f"{r.meta.dtype}{list(r.meta.shape)} needs {want}")
                    dtype = codec.dtype_from_name(r.meta.dtype)
                    shape = tuple(r.meta.shape)
                    if want == 0:
                        cpu = self.torch.empty(shape, dtype=dtype)
                    else:
                        cpu = self.torch.frombuffer(arrival.payload, dtype=self.torch.uint8)
                        cpu = cpu.view(dtype).reshape(shape)
                    entry.tensor = self._to_device(cpu, spec_from_proto(r.spec))
                    del cpu
            except Exception as e:
                entry.error = self._err("input", f"receiving transfer {r.transfer_id} "
                                        f"failed: {type(e).__name__}: {e}")
            finally:
                if arrival is not None and hasattr(arrival.payload, "close"):
                    arrival.payload.close()
                entry.pending = None
        finally:
            with self._resolve_lock:
                del self._resolving[r.transfer_id]
            done.set()
        return True

    def _resolve_pieces(self, entry, r) -> None:
        """A move from a slice that spans hosts: each host's piece fills its blocks of
        the whole tensor, which then becomes a device buffer with the wanted spec."""
        torch = self.torch
        dtype = codec.dtype_from_name(r.meta.dtype)
        full = torch.empty(tuple(r.meta.shape), dtype=dtype)
        try:
            for k, piece in enumerate(r.pieces):
                arrival, lost = self._take(piece.transfer_id, piece.src_data_address,
                                           piece.src_host)
                if lost or arrival is None or arrival.error is not None:
                    for rest in r.pieces[k + 1:]:
                        self.dataplane.discard(rest.transfer_id)
                if lost:
                    entry.error = self._err("lost", lost)
                    return
                if arrival is None:
                    entry.error = self._err("timeout", f"transfer {piece.transfer_id} did "
                                            f"not arrive within {self.transfer_timeout:.0f} s")
                    return
                try:
                    if arrival.error is not None:
                        err = self.pb.BufferError()
                        err.ParseFromString(arrival.error)
                        entry.error = err        # the original failure, unchanged
                        return
                    flat = torch.frombuffer(arrival.payload, dtype=torch.uint8) \
                        if arrival.nbytes else torch.empty(0, dtype=torch.uint8)
                    at = 0
                    for b in piece.blocks:
                        n = codec.nbytes(dtype, tuple(b.shape))
                        if at + n > arrival.nbytes:
                            raise ValueError(f"piece {piece.transfer_id} brought "
                                             f"{arrival.nbytes} bytes, too few for its blocks")
                        index = tuple(slice(s, s + m) for s, m in zip(b.start, b.shape))
                        full[index] = flat[at:at + n].view(dtype).reshape(tuple(b.shape))
                        at += n
                    del flat
                finally:
                    if hasattr(arrival.payload, "close"):
                        arrival.payload.close()
            entry.tensor = self._to_device(full, spec_from_proto(r.spec))
        except Exception as e:
            entry.error = self._err("input", f"receiving transfer {r.transfer_id} "
                                    f"failed: {type(e).__name__}: {e}")
        finally:
            entry.pending = None

    def _take(self, transfer_id: int, src_address: str, src_host: str):
        """Wait for a transfer's bytes; (arrival, "") or (None, why the sender is
        gone). While waiting, check each second that the sender still listens, so a
        transfer from a dead worker fails within seconds instead of at the timeout."""
        deadline = time.monotonic() + self.transfer_timeout
        misses = 0
        while True:
            left = deadline - time.monotonic()
            arrival = self.dataplane.take(transfer_id, min(max(left, 0.0), 1.0))
            if arrival is not None or left <= 1.0:
                return arrival, ""
            if not src_address:
                continue
            misses = 0 if listening(src_address) else misses + 1
            if misses >= 2:
                src = src_host or src_address
                return None, (f"transfer {transfer_id} from {src} cannot arrive: {src} "
                              "no longer listens (its worker died, or its slice was "
                              "released before the transfer was sent)")

    def _release(self, ids) -> None:
        """Free buffers; bytes still due for a dropped transfer are dropped on arrival."""
        for b in ids:
            e = self.store.get(b)
            if e is not None and e.pending is not None:
                with self._sending_lock:
                    r = e.pending
                    if r is not None and r.transfer_id not in self._sending:
                        self._discard_recv(r)
        self.store.release(ids)

    def _send(self, op) -> None:
        entry = self.store.get(op.buffer_id)
        if entry is None:
            err = self._err("unknown_buffer", f"buffer {op.buffer_id} to send does not exist")
            entry = Entry(error=err)
        held = entry.pending.transfer_id if entry.pending is not None else None
        if held is not None:        # a relay: the send resolves it, even once released
            with self._sending_lock:
                self._sending[held] = self._sending.get(held, 0) + 1
        self.dataplane.send_async(self._send_now, entry, op, held)

    def _send_now(self, entry, op, held=None) -> None:
        payload, error, reading = None, None, False
        rec = self.rec
        t0 = rec.now() if rec.on else 0
        try:
            try:
                self._resolve(entry)
            finally:
                if held is not None:
                    with self._sending_lock:
                        n = self._sending.pop(held) - 1
                        if n:
                            self._sending[held] = n
            if entry.error is not None:
                error = entry.error.SerializeToString()
            elif not self.store.begin_read(entry):
                error = self._err("donated", "the buffer to send was donated to a "
                                  "program").SerializeToString()
            else:
                reading = True      # until sent: the payload may view device memory
                if op.blocks:       # a piece of a move to a slice that spans hosts
                    cpu = entry.tensor.cpu().contiguous()
                    validate.check_blocks(op.blocks, tuple(cpu.shape), "send")
                    payload = [codec.byte_view(
                        cpu[tuple(slice(s, s + n) for s, n in zip(b.start, b.shape))]
                        .contiguous()) for b in op.blocks]
                else:
                    payload = [codec.byte_view(p) for p in self._host_parts(entry.tensor)]
        except Exception as e:
            error = self._read_failed(entry, e, "a transfer").SerializeToString()
            payload = None
        if t0:
            rec.add("transfer", "read for send", t0, program=entry.origin,
                    buffer_ids=(op.buffer_id,), transfer_id=op.transfer_id,
                    nbytes=sum(map(len, payload)) if payload is not None else 0,
                    detail="waits for the producer, then device to host")
        try:
            self.dataplane.send(op.dst_data_address, op.transfer_id,
                                payload if error is None else None, error, op.same_host)
        except OSError as e:
            log.error("transfer %d to %s failed: %s", op.transfer_id, op.dst_data_address, e)
        finally:
            if reading:
                self.store.end_read(entry)

    def _compile(self, req):
        import torch_xla.core.xla_builder as xb
        t0 = time.perf_counter()
        torch, dev = self.torch, self.device
        xla_name = "xla::" + (re.sub(r"\W", "_", req.name) or "program")
        comp = xb.computation_from_module_proto(req.name or "program", req.hlo)
        constants = [codec.from_bytes(c.data, c.meta.dtype, c.meta.shape).to(dev)
                     for c in req.constants]
        params = [("i", p.input) if p.WhichOneof("source") == "input" else ("c", p.constant)
                  for p in req.params]
        out_specs = ([tuple(spec_from_proto(s)) for s in req.out_specs]
                     if req.has_out_specs else None)
        prog = _Program(req.name, xla_name, comp, params, constants, out_specs)
        prog.donate = tuple(req.donate)
        prog.hlo_bytes = len(req.hlo)
        prog.program_id = req.program_id
        prog.in_avals = [(codec.dtype_from_name(m.dtype), tuple(m.shape))
                         for m in req.inputs]

        def placeholders():
            out = []
            for meta, spec in zip(req.inputs, req.input_specs):
                t = torch.zeros(tuple(meta.shape),
                                dtype=codec.dtype_from_name(meta.dtype)).to(dev)
                self._shard(t, spec_from_proto(spec))
                out.append(t)
            # donated like the real inputs, so the cached executable aliases the same way
            self._mark_donated(out, prog.donate)
            return out

        for attempt in range(2):
            ph = placeholders()
            outs = self._run(prog, ph)
            plan = self._cached_plan(prog, ph, outs)
            prog.out_nbytes = [codec.nbytes(o.dtype, o.shape) for o in outs]
            prog.out_avals = [(o.dtype, tuple(o.shape)) for o in outs]
            prog.out_bytes = sum(prog.out_nbytes)
            # Not yet knowing the shardings, refuse only what no sharding could fit.
            if out_specs is None and prog.out_bytes > self.budget * len(self.mesh.device_ids):
                raise MemoryError(self._oom_text(prog, prog.out_bytes))
            try:
                if out_specs is not None or plan is not None:
                    # Output shardings are given (or trivial): compile only, under the
                    # graph hash that _run_cached_graph looks up.
                    self.torch_xla._XLAC._xla_warm_up_cache(outs, [])
                else:
                    # Run once on zeros to learn the shardings XLA's propagation chose.
                    self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=True)
                break
            except RuntimeError:
                # A wait reports the failure of an *earlier* asynchronous execution on
                # these devices (that failure is its own program's, reported with it).
                if attempt:
                    raise
        if plan is not None:
            prog.cached = self._check_plan(plan, ph, len(outs))
        reply = self.pb.CompileReply()
        for o in outs:
            spec, hlo = self._spec_of(o)
            prog.out_shards.append(self._shards(spec) if spec is not None else 1)
            spec_to_proto(spec if spec is not None else (), reply.out_specs.add())
            reply.out_spec_known.append(spec is not None)
            reply.out_hlo_shardings.append(hlo)
        prog.out_device_bytes = sum(n // k for n, k in zip(prog.out_nbytes, prog.out_shards))
        if self.plans is not None:
            planned = self.plans.record(req.hlo)
            self.planned_bytes[req.name] = max(planned, self.planned_bytes.get(req.name, 0))
        self.programs[req.program_id] = prog
        self.compiles += 1
        reply.compile_s = time.perf_counter() - t0
        rec = self.rec
        if rec.on:
            end = rec.now()
            rec.add("compile", req.name, end - int(reply.compile_s * 1e9), end,
                    program=req.name)
        return reply

    def _cached_plan(self, prog: _Program, ph: list, outs: list):
        """How to launch ``prog``'s executable again without tracing it (before
        ``outs`` are synced): its graph hash and where each HLO parameter comes from.
        Tracing a call (``_xla_user_computation`` then a sync) costs ~35 µs here, a
        cached launch ~24 µs (docs/architecture.md, Decision 20). Only for one-device
        slices without donation: a sharded input whose layout differs from the
        placeholder's, or a donated one, needs torch_xla's checks on each call."""
        if self.spmd or prog.donate:
            return None
        return self._plan_of(outs, ph)

    def _plan_of(self, outs: list, inputs: list):
        """(graph hash, feed) of the traced ``outs`` whose graph parameters are
        ``inputs`` (device data) and constants; None when some input is not one."""
        if os.environ.get("PATHWAYS_CACHED_LAUNCH") == "0":
            return None
        X = self.torch_xla._XLAC
        try:
            graph_hash = X._get_graph_hash(outs)
            ids, values = X._get_tensors_xla_device_data_node(outs)
        except Exception:       # noqa: BLE001 (an API this torch_xla lacks: trace)
            return None
        position = {X._xla_get_tensor_id(t): k for k, t in enumerate(inputs)}
        feed = [(position.get(i, -1), v) for i, v in zip(ids, values)]
        # Every input must be a parameter of the graph: torch_xla folds a scalar 0 or 1
        # (a "special scalar", such as a zero placeholder) into a constant.
        if sorted(k for k, _ in feed if k >= 0) != list(range(len(inputs))):
            return None
        return graph_hash, feed

    def _check_plan(self, plan, ph: list, n_outs: int):
        """``plan`` when one launch on the placeholders gives ``n_outs`` outputs."""
        try:
            got = self.torch_xla._XLAC._run_cached_graph(
                plan[0], [ph[k] if k >= 0 else v for k, v in plan[1]])
        except Exception:       # noqa: BLE001 (not in the cache after all: trace)
            return None
        return plan if len(got) == n_outs else None

    def _run(self, prog: _Program, inputs):
        args = [inputs[k] if src == "i" else prog.constants[k] for src, k in prog.params]
        outs = self.torch_xla._XLAC._xla_user_computation(prog.xla_name, args, prog.comp)
        if prog.out_specs is not None and self.spmd:
            for o, spec in zip(outs, prog.out_specs):
                self.xs.mark_sharding(o, self.mesh, self._padded(spec, o.dim()))
        return outs

    def _execute(self, op) -> None:
        prog = self.programs.get(op.program_id)
        if prog is None:
            err = self._err("program", f"unknown program id {op.program_id!r}")
            for b in op.outputs:
                self.store.put(b, Entry(error=err))
            return
        inputs, entries = [], []
        for b in op.inputs:
            e = self.store.get(b)
            if e is None:
                err = self._err("unknown_buffer",
                                f"input buffer {b} of program '{prog.name}' does not exist "
                                "(released or never created)", prog.name)
                break
            self._resolve(e)
            if e.error is not None:
                err = e.error   # the original failure travels downstream unchanged
                break
            if e.donated:
                err = self._err("donated", f"input buffer {b} of program '{prog.name}' was "
                                "donated to an earlier program", prog.name)
                break
            inputs.append(e.tensor)
            entries.append(e)
        else:
            err = None
        if err is None and prog.out_device_bytes > self.budget:
            err = self._err("oom", self._oom_text(prog, prog.out_device_bytes), prog.name)
        donated = [k for k in op.donate if k < len(op.inputs) and
                   list(op.inputs).count(op.inputs[k]) == 1] if op.donate else ()
        if err is None:
            # Donated inputs' memory becomes the outputs'.
            need = prog.out_device_bytes - sum(entries[k].nbytes // entries[k].shards
                                               for k in donated)
            if need > 0 and self.store.device_bytes + need > self.budget:
                err = self._make_room(need, f"program '{prog.name}'", set(op.inputs),
                                      prog.name)
        if err is None and donated:
            for k in donated:
                self.store.donate(entries[k])
            self._mark_donated(inputs, donated)
        rec = self.rec
        t0 = rec.now() if rec.on else 0
        if err is None:
            try:
                if self._in_gang:       # inside its gang op's grant: run to the end
                    outs = self._run(prog, inputs)
                    self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=True)
                elif self.arbiter is not None:
                    with self.arbiter.grant(
                            more=lambda: bool(self._ahead) or not self._queue.empty()):
                        outs = self._run(prog, inputs)
                        self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=True)
                elif t0:
                    # Profiling: run to completion, so the span is the device time.
                    outs = self._run(prog, inputs)
                    self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=True)
                elif prog.cached is not None:
                    # Asynchronous, as below, and without tracing the call again.
                    outs = self.torch_xla._XLAC._run_cached_graph(
                        prog.cached[0], [inputs[k] if k >= 0 else v
                                         for k, v in prog.cached[1]])
                    self.cached_launches += 1
                else:
                    outs = self._run(prog, inputs)
                    # Asynchronous: the next op's host work overlaps this execution (~30
                    # µs an op instead of ~150 µs with wait=True here). Outputs that
                    # cannot fit were refused above, so executions do not fail for want
                    # of memory.
                    self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=False)
                if len(outs) != len(op.outputs):
                    raise RuntimeError(f"program returned {len(outs)} outputs, "
                                       f"{len(op.outputs)} were declared")
            except Exception as e:
                err = self._err("program", f"program '{prog.name}' failed on {self.where}: "
                                f"{type(e).__name__}: {e}", prog.name)
        if t0:
            rec.add("execute", prog.name, t0, program=prog.name, buffer_ids=op.outputs,
                    detail=f"failed: {err.message}" if err is not None else "")
        if err is not None:
            for b in op.outputs:
                self.store.put(b, Entry(error=err))
            return
        put = self.store.put
        for b, o, n, k in zip(op.outputs, outs, prog.out_nbytes, prog.out_shards):
            put(b, Entry(o, None, n, prog.name, None, k))
        for k in donated:           # the donated inputs' memory now holds outputs
            gone = self._err("donated", f"buffer {op.inputs[k]} was donated to program "
                             f"'{prog.name}'; read that program's outputs instead", prog.name)
            put(op.inputs[k], Entry(None, gone, 0, prog.name))
        self.executed += 1

    def _mark_donated(self, tensors, positions) -> None:
        for k in positions:
            self.torch_xla._XLAC._set_buffer_donation(tensors[k], True)

    def _oom_text(self, prog, asked: int) -> str:
        return (f"program '{prog.name}' needs {gib(asked)} per device for its outputs, but "
                f"the buffer budget of {self.where} is {gib(self.budget)} per device "
                f"({gib(self._free())} free now); use a bigger slice, shard the outputs, or "
                "raise the budget (pw.init(memory_budget=...), pathways-run --worker "
                "--memory-budget)")

    def _free(self) -> int:
        return max(0, self.budget - self.store.device_bytes)

    # ------------------------------------------------------------------ back-pressure
    def _room_for(self, nbytes: int, spec_msg, what: str, keep: set):
        """None when a buffer of ``nbytes`` with ``spec_msg`` fits (after waiting for
        releases), else the "oom" error: at once when it exceeds the whole budget."""
        per_device = nbytes // self._shards(spec_from_proto(spec_msg))
        if per_device > self.budget:
            return self._err(
                "oom", f"{what} needs {gib(per_device)} per device, more than the whole "
                f"{gib(self.budget)} per-device budget of {self.where} "
                f"({gib(self._free())} free now); shard it over more devices or raise the "
                "budget (pw.init(memory_budget=...))")
        return self._make_room(per_device, what, keep)

    def _make_room(self, need: int, what: str, keep: set, program: str = ""):
        """Wait until ``need`` more bytes per device fit in the budget; None when they do.

        Releases travel on the same ordered stream as the ops, so while this op waits,
        the ops behind it are taken off the queue and their releases applied early:
        a release may overtake ops that do not touch its buffer (and that buffer must
        exist already). Past the back-pressure timeout the op fails with an "oom" error
        that says how much was asked and what is free.
        """
        store = self.store
        if need <= 0 or store.device_bytes + need <= self.budget:
            return None
        t0 = time.monotonic()
        deadline = t0 + self.backpressure_timeout
        while store.device_bytes + need > self.budget:
            self._apply_early_releases(keep)
            if store.device_bytes + need <= self.budget:
                break
            left = deadline - time.monotonic()
            if left <= 0 or (self._ahead and self._ahead[-1] is None):
                return self._err(
                    "oom", f"{what} needs {gib(need)} per device and waited "
                    f"{time.monotonic() - t0:.0f} s for releases, but only "
                    f"{gib(self._free())} of the {gib(self.budget)} per-device budget of "
                    f"{self.where} is free; drop Arrays you no longer need (del x), or "
                    "raise the budget (pw.init(memory_budget=...))", program)
            try:
                self._ahead.append(self._queue.get(timeout=min(left, 0.05)))
            except queue.Empty:
                pass
        self.backpressure_waits += 1
        self.backpressure_seconds += time.monotonic() - t0
        return None

    def _apply_early_releases(self, keep: set) -> None:
        """Apply the releases among the queued ops whose buffers exist and that no op
        before them (or the waiting op, ``keep``) uses."""
        while True:                     # take in what has arrived
            try:
                self._ahead.append(self._queue.get_nowait())
            except queue.Empty:
                break
        used = set(keep)
        for item in self._ahead:
            if item is None or item[0] != "op":
                continue
            op = item[1]
            if op.WhichOneof("kind") == "release":
                ids = op.release.buffer_ids
                now = [b for b in ids if b not in used and b in self.store.entries]
                if now:
                    self._release(now)
                    done = set(now)
                    rest = [b for b in ids if b not in done]
                    del ids[:]
                    ids.extend(rest)
            else:
                used.update(_buffer_ids(op))

    def _put(self, op) -> None:
        rec = self.rec
        if rec.on:
            t0 = rec.now()
            self._put_now(op)
            rec.add("put", "put", t0, buffer_ids=(op.buffer_id,), nbytes=len(op.data),
                    detail="" if op.last else "chunk")
        else:
            self._put_now(op)

    def _put_now(self, op) -> None:
        parts = self._puts.get(op.buffer_id)
        bad = parts[2] if parts is not None and parts[0] is None else None
        if bad is None:
            others = sum(_nbytes(p[0]) for p in self._puts.values()
                         if p[0] is not None) if parts is None and self._puts else 0
            try:
                validate.check_put(op, parts, others, self.axis_names, self._cap(),
                                   self.store.entries.__contains__)
            except validate.InvalidMessage as e:
                bad = e
        if bad is not None:     # the rest of a refused put is dropped as it comes
            if op.last:
                self._puts.pop(op.buffer_id, None)
                self._reject("put", [op.buffer_id], bad)
            else:
                self._puts[op.buffer_id] = (None, None, bad)
            return
        if not op.last:
            if parts is None:
                self._puts[op.buffer_id] = (op.meta, op.spec, [op.data])
            else:
                parts[2].append(op.data)
            return
        if parts is not None:
            del self._puts[op.buffer_id]
            meta, spec, chunks = parts
            data = b"".join(chunks + [op.data])
        else:
            meta, spec, data = op.meta, op.spec, op.data
        err = self._room_for(len(data), spec, f"the put of buffer {op.buffer_id}",
                             {op.buffer_id})
        if err is not None:
            self.store.put(op.buffer_id, Entry(error=err))
            return
        try:
            cpu = codec.from_bytes(data, meta.dtype, meta.shape)
            p = spec_from_proto(spec)
            t = self._to_device(cpu, p)
            entry = Entry(t, None, len(data), "", None, self._shards(p))
        except Exception as e:
            entry = Entry(error=self._err("input", f"put of buffer {op.buffer_id} failed: {e}"))
        self.store.put(op.buffer_id, entry)


    # ------------------------------------------------------------------ checkpoints
    def _save(self, op) -> None:
        """Write buffers into a torch.distributed.checkpoint directory (one per executor;
        the client merges the metadata of all executors into the checkpoint's)."""
        import torch.distributed.checkpoint as dcp
        flat, err = {}, None
        for key, b in zip(op.keys, op.buffer_ids):
            e = self.store.get(b)
            if e is None:
                err = self._err("unknown_buffer", f"buffer {b} to save as '{key}' does "
                                "not exist (released or never created)")
                break
            self._resolve(e)
            if e.error is not None:
                err = e.error
                break
            if not self.store.begin_read(e):
                err = self._err("donated", f"buffer {b} to save as '{key}' was donated")
                break
            try:
                flat[key] = e.tensor.cpu()
            except Exception as ex:
                err = self._err("program", f"computing '{key}' failed on {self.where}: {ex}",
                                e.origin)
                break
            finally:
                self.store.end_read(e)
        if err is None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")     # "no process group": by design
                    dcp.save(flat, checkpoint_id=op.path, no_dist=True)
                nbytes = sum(t.numel() * t.element_size() for t in flat.values())
                self.store.put(op.status_id, Entry(self.torch.tensor([nbytes]), None, 8))
                return
            except Exception as ex:
                err = self._err("io", f"writing checkpoint {op.path} on {self.where} "
                                f"failed: {type(ex).__name__}: {ex}")
        self.store.put(op.status_id, Entry(error=err))

    def _load(self, op) -> None:
        """Read keys of a torch.distributed.checkpoint directory into new buffers."""
        import torch.distributed.checkpoint as dcp
        torch = self.torch
        try:
            flat = {k: torch.empty(tuple(m.shape), dtype=codec.dtype_from_name(m.dtype))
                    for k, m in zip(op.keys, op.metas)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(flat, checkpoint_id=op.path, no_dist=True)
            for k, b, spec in zip(op.keys, op.buffer_ids, op.specs):
                p = spec_from_proto(spec)
                t = self._to_device(flat[k], p)
                self.store.put(b, Entry(t, None, codec.nbytes(t.dtype, t.shape), "", None,
                                        self._shards(p)))
        except Exception as ex:
            err = self._err("io", f"reading checkpoint {op.path} on {self.where} failed: "
                            f"{type(ex).__name__}: {ex}")
            for b in op.buffer_ids:
                self.store.put(b, Entry(error=err))


def _buffer_ids(op) -> list:
    """Every buffer id an op reads or writes."""
    which = op.WhichOneof("kind")
    if which == "execute":
        return list(op.execute.inputs) + list(op.execute.outputs)
    if which in ("put", "recv", "send"):
        return [getattr(op, which).buffer_id]
    if which == "save":
        return list(op.save.buffer_ids) + [op.save.status_id]
    if which == "load":
        return list(op.load.buffer_ids)
    if which == "batch":
        return list(op.batch.outputs)
    if which == "gang":
        return [b for inner in op.gang.ops for b in _buffer_ids(inner)]
    return []


def _nbytes(meta) -> int:
    from ..rpc import codec
    return codec.nbytes(codec.dtype_from_name(meta.dtype), tuple(meta.shape))
