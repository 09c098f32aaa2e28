"""The Coordinator gRPC service: worker registration, client sessions, slices."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import threading
import uuid

import grpc

from .. import _proc, tracing
from ..rpc import grpc_util, validate
from ..rpc import pathways_pb2 as pb
from ..rpc import pathways_pb2_grpc as pbg
from .resources import AllocationError, ResourceManager
from .scheduler import GangScheduler

log = logging.getLogger("pathways.coordinator")


HEARTBEAT_S = 1.0


class CoordinatorService(pbg.CoordinatorServicer):
    def __init__(self, devices_shared_by: int = 1) -> None:
        self.rm = ResourceManager(devices_shared_by)
        self.scheduler = GangScheduler()
        self._workers: dict = {}           # worker_id -> Worker stub
        self._sessions: dict = {}          # client_id -> (name, share)
        self._lock = threading.Lock()
        self.rec = tracing.Recorder(tracing.skew_from_env())
        # profile session -> {worker_id: (agent session, clock samples at start)}
        self._profiles: dict = {}

    # -- workers
    def RegisterWorker(self, request, context):
        """A worker's session: registered while this stream lives, lost when it breaks
        (a killed worker's connection closes at once; heartbeats find silent ones)."""
        validate.guard(context, validate.check_register_worker, request)
        try:
            h = self.rm.add_host(request.island, request.host, request.num_devices,
                                 request.kind, request.address, request.pid)
        except AllocationError as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        stub = pbg.WorkerStub(grpc_util.channel(request.address))
        with self._lock:
            self._workers[h.worker_id] = stub
        if self.rec.on:
            t = self.rec.now()
            self.rec.add("session", "worker registered", t, t,
                         detail=f"island {h.island} host {h.host} ({h.worker_id})")
        log.info("worker %s registered: island %d host %d, %d %s devices at %s",
                 h.worker_id, h.island, h.host, h.num_devices, h.kind, h.address)
        closed = threading.Event()
        context.add_callback(closed.set)
        try:
            yield pb.WorkerEvent(worker_id=h.worker_id, heartbeat_s=HEARTBEAT_S)
            while not closed.wait(HEARTBEAT_S):
                yield pb.WorkerEvent(heartbeat_s=HEARTBEAT_S)
        finally:
            self._worker_lost(h.worker_id)

    def _worker_lost(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)
        gone = self.rm.mark_lost(worker_id)
        for rec in gone:
            self.scheduler.forget(rec.slice_id)
        log.warning("worker %s is gone; %d slices lost", worker_id, len(gone))

    def ListDevices(self, request, context):
        reply = pb.ListDevicesReply(registered_workers=len(self.rm.hosts))
        for row in self.rm.device_table():
            reply.devices.add(**row)
        return reply

    # -- clients
    def OpenSession(self, request, context):
        validate.guard(context, validate.check_open_session, request)
        client_id = f"c{uuid.uuid4().hex}"   # unguessable: it proves ownership
        done = threading.Event()
        with self._lock:
            self._sessions[client_id] = (request.name, request.share or 1.0)
        if self.rec.on:
            t = self.rec.now()
            self.rec.add("session", "session opened", t, t,
                         detail=f"{client_id} ({request.name})")

        def on_close():
            done.set()
            self._close_session(client_id)

        context.add_callback(on_close)
        yield pb.SessionEvent(client_id=client_id)
        done.wait()

    def _close_session(self, client_id: str) -> None:
        t0 = self.rec.now() if self.rec.on else 0
        with self._lock:
            self._sessions.pop(client_id, None)
        for rec in self.rm.slices_of(client_id):
            self._free_slice(rec.slice_id)
        self.rec.add("session", "session closed", t0, detail=client_id)
        log.info("session %s closed", client_id)

    def AllocateSlice(self, request, context):
        t0 = self.rec.now() if self.rec.on else 0
        reply = self._allocate_slice(request, context)
        self.rec.add("rpc", "AllocateSlice", t0,
                     detail=f"{reply.slice_id} on island {reply.island} host {reply.host}, "
                     f"mesh {list(request.mesh_shape)}")
        return reply

    def _allocate_slice(self, request, context):
        with self._lock:
            session = self._sessions.get(request.client_id)
        if session is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"unknown client {request.client_id!r}: open a session first")
        validate.guard(context, validate.check_allocate, request)
        island = None if request.any_island else request.island
        try:
            rec = self.rm.reserve(request.client_id, list(request.mesh_shape),
                                  list(request.axis_names), island)
        except AllocationError as e:
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if e.code == "exhausted"
                    else grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(code, str(e))
        stub = self._workers.get(rec.worker_id)
        if stub is None:
            self.rm.release(rec.slice_id)
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"island {rec.island} host {rec.host} is gone; ask again")
        key = secrets.token_hex(16)
        try:
            rep = stub.StartExecutor(pb.StartExecutorRequest(
                slice_id=rec.slice_id, device_indices=list(rec.devices),
                mesh_shape=list(rec.mesh_shape), axis_names=list(rec.axis_names),
                client_id=request.client_id, slice_key=key,
                share=session[1] if self.rm.per_device > 1 else 0.0), timeout=120)
        except grpc.RpcError as e:
            self.rm.release(rec.slice_id)
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"island {rec.island} host {rec.host} could not start an executor "
                          f"for the slice: {e.details()}")
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

    def ReleaseSlice(self, request, context):
        t0 = self.rec.now() if self.rec.on else 0
        reply = self._release_slice(request, context)
        self.rec.add("rpc", "ReleaseSlice", t0, detail=request.slice_id)
        return reply

    def _release_slice(self, request, context):
        self._known_client(request.client_id, context)
        rec = self.rm.slices.get(request.slice_id)
        if rec is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"slice {request.slice_id[:64]!r} does not exist (released, lost "
                          "with its worker, or never allocated)")
        if rec.client_id != request.client_id:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"slice {request.slice_id} belongs to another client")
        self._free_slice(request.slice_id)
        return pb.Empty()

    def Schedule(self, request, context):
        """Give a gang submission its position in each touched island's total order."""
        self._known_client(request.client_id, context)
        validate.guard(context, validate.check_ids, list(request.slice_ids), "slice id")
        recs = []
        for sid in request.slice_ids:
            rec = self.rm.slices.get(sid)
            if rec is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"slice {sid!r} does not exist")
            if rec.client_id != request.client_id:
                context.abort(grpc.StatusCode.PERMISSION_DENIED,
                              f"slice {sid} is not one of this client's slices")
            recs.append(rec)
        t0 = self.rec.now() if self.rec.on else 0
        positions, seqs = self.scheduler.schedule(recs)
        self.rec.add("rpc", "Schedule", t0, detail=", ".join(
            f"{sid}@{p}" for sid, p in zip(request.slice_ids, positions)))
        return pb.ScheduleReply(positions=positions, slice_seqs=seqs)

    # -- profiling
    def Profile(self, request, context):
        """The coordinator's spans and, through it, every worker agent's."""
        validate.guard(context, validate.check_profile, request, self.rec.active)
        reply = tracing.serve_profile(pb, self.rec, request, "coordinator",
                                      self._collect_agents)
        if request.action == pb.ProfileRequest.START:
            self._start_agents(reply.session)
        return reply

    def _known_client(self, client_id: str, context) -> None:
        with self._lock:
            known = client_id in self._sessions
        if not known:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"unknown client {client_id[:64]!r}: open a session first")

    def _agent_call(self, stub, action, session=0):
        return stub.Profile(pb.ProfileRequest(action=action, session=session), timeout=30)

    def _start_agents(self, session: int) -> None:
        with self._lock:
            workers = dict(self._workers)
        started = {}
        for wid, stub in workers.items():
            try:
                samples = tracing.sample_clock(
                    lambda: self._agent_call(stub, pb.ProfileRequest.CLOCK), self.rec.now)
                rep = self._agent_call(stub, pb.ProfileRequest.START)
                started[wid] = (rep.session, samples)
            except grpc.RpcError as e:
                log.warning("profiling: worker %s did not start: %s", wid, e.details())
        with self._lock:
            self._profiles[session] = started

    def _collect_agents(self, session: int) -> list:
        """Stop the agents' sessions and put their spans on this process's clock."""
        with self._lock:
            started = self._profiles.pop(session, {})
            workers = dict(self._workers)
        out = []
        for wid, (agent_session, first) in started.items():
            stub = workers.get(wid)
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

    def _free_slice(self, slice_id: str) -> None:
        rec = self.rm.release(slice_id)
        if rec is None:
            return
        self.scheduler.forget(slice_id)
        stub = self._workers.get(rec.worker_id)
        if stub is None:
            return
        try:
            stub.StopExecutor(pb.StopExecutorRequest(slice_id=slice_id), timeout=30)
        except grpc.RpcError as e:
            log.warning("stopping executor of %s failed: %s", slice_id, e.details())


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (beyond loopback a --token is required)")
    ap.add_argument("--port", type=int, default=0, help="port to bind (0: any free port)")
    ap.add_argument("--devices-shared-by", type=int, default=1,
                    help="how many slices (of any clients) may share one device; >1 turns "
                    "on proportional-share time-multiplexing of shared devices")
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
    srv = grpc_util.server(max_workers=64)
    service = CoordinatorService(args.devices_shared_by)
    pbg.add_CoordinatorServicer_to_server(service, srv)
    port = grpc_util.add_port(srv, f"{args.host}:{args.port}")
    srv.start()
    # The embedded cluster and pathways-run read this line to learn the port.
    print(f"PATHWAYS_COORDINATOR_PORT={port}", flush=True)
    _proc.serve_until_signal(srv)
    # Exit now: interpreter shutdown would join gRPC's worker threads, and a session
    # handler blocked there must not keep the port open.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
