"""The host agent: registers the host with the coordinator and runs one executor per slice.

torch_xla's SPMD always spans every device of its process, so a slice smaller than the
host cannot be one SPMD program inside a host-wide process. The agent therefore keeps
a *zygote*: a process forked right after ``import torch, torch_xla`` and before any
device or gRPC thread exists. For each slice placed on the host the zygote forks an
executor that sees exactly that slice's devices (ready in a fraction of a second instead
of a ~9 s cold start). See docs/architecture.md for the measurement.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

log = logging.getLogger("pathways.worker")


class Zygote:
    """A single-threaded process that forks executors on request (JSON lines on a pipe)."""

    def __init__(self) -> None:
        agent_pid = os.getpid()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the zygote
            os.close(w)
            from .. import _proc
            _proc.die_with_parent(agent_pid, signal.SIGKILL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # executors are reaped by the kernel
            zygote_pid = os.getpid()
            with os.fdopen(r, "r") as f:
                for line in f:
                    req = json.loads(line)
                    if os.fork() == 0:
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        f.close()
                        _proc.die_with_parent(zygote_pid, signal.SIGKILL)
                        code = 1
                        try:
                            from .executor import run_executor
                            run_executor(req)
                            code = 0
                        finally:
                            os._exit(code)
            os._exit(0)
        os.close(r)
        self.pid = pid
        self._w = os.fdopen(w, "w")
        self._lock = threading.Lock()

    def spawn(self, request: dict) -> None:
        with self._lock:
            self._w.write(json.dumps(request) + "\n")
            self._w.flush()

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _kill_and_wait(pid: int, timeout: float = 5.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _make_service(zygote: Zygote, island: int, host: int, kind: str, bind_host: str,
                  arbiter_path: str, device_budget: int, num_devices: int = 0,
                  advertise_host: str = ""):
    import grpc
    from .. import tracing
    from ..rpc import pathways_pb2 as pb
    from ..rpc import pathways_pb2_grpc as pbg
    from ..rpc import validate

    class WorkerService(pbg.WorkerServicer):
        def __init__(self) -> None:
            self.address = ""
            self._lock = threading.Lock()
            self._pending: dict = {}     # slice_id -> (Event, [reply])
            self.executors: dict = {}    # slice_id -> pid
            self.members: dict = {}      # pid -> Popen: members of slices that span hosts
            self.rec = tracing.Recorder(tracing.skew_from_env())

        def Profile(self, request, context):
            validate.guard(context, validate.check_profile, request, self.rec.active)
            return tracing.serve_profile(pb, self.rec, request,
                                         f"worker island {island} host {host}")

        def StartExecutor(self, request, context):
            t0 = self.rec.now() if self.rec.on else 0
            reply = self._start_executor(request, context)
            self.rec.add("rpc", "StartExecutor", t0,
                         detail=f"{request.slice_id}: fork from the zygote until it serves, "
                         f"pid {reply.pid}")
            return reply

        def _start_executor(self, request, context):
            # Never fork an executor for a request that makes no sense on this host.
            validate.guard(context, validate.check_start_executor, request,
                           num_devices or validate.MAX_DEVICES)
            ev, box = threading.Event(), []
            with self._lock:
                if request.slice_id in self.executors or request.slice_id in self._pending:
                    context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                  f"slice {request.slice_id} already has an executor")
                self._pending[request.slice_id] = (ev, box)
            spec = dict(
                slice_id=request.slice_id, devices=list(request.device_indices),
                mesh_shape=list(request.mesh_shape), axis_names=list(request.axis_names),
                agent_address=self.address, island=island, host=host, kind=kind,
                bind_host=bind_host, advertise_host=advertise_host,
                client_id=request.client_id, share=request.share,
                arbiter=arbiter_path, slice_key=request.slice_key,
                memory_budget=device_budget)
            member = None
            if request.num_members > 1:
                # A host of a slice that spans hosts: a fresh process on jaxlib (see
                # worker/member.py), not a fork of the torch_xla zygote.
                spec.update(member=request.member, num_members=request.num_members,
                            rendezvous=request.rendezvous, agent_pid=os.getpid(),
                            member_hosts=list(request.member_hosts))
                member = subprocess.Popen(
                    [sys.executable, "-m", "pathways_torch.worker.member"],
                    stdin=subprocess.PIPE, text=True)
                member.stdin.write(json.dumps(spec) + "\n")
                member.stdin.close()
            else:
                zygote.spawn(spec)
            deadline = time.monotonic() + 120
            ok = ev.wait(0.2 if member is not None else 120)
            while not ok and member is not None and member.poll() is None and (
                    time.monotonic() < deadline):
                ok = ev.wait(0.2)
            if member is not None and member.poll() is not None and not box:
                ok = True
                box.append(pb.ExecutorReadyRequest(
                    pid=member.pid, error=f"the member process exited ({member.returncode})"))
            with self._lock:
                self._pending.pop(request.slice_id, None)
                if ok and not box[0].error:
                    self.executors[request.slice_id] = box[0].pid
                    if member is not None:
                        self.members[box[0].pid] = member
            if member is not None and (not ok or box[0].error):
                member.kill()
                member.wait()
            if not ok:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                              "the executor did not start within 120 s")
            if box[0].error:
                context.abort(grpc.StatusCode.INTERNAL,
                              f"the executor failed to start: {box[0].error}")
            return pb.StartExecutorReply(address=box[0].address, pid=box[0].pid,
                                         data_address=box[0].data_address,
                                         memory_budget=box[0].memory_budget,
                                         rendezvous=box[0].rendezvous)

        def ExecutorReady(self, request, context):
            with self._lock:
                pending = self._pending.get(request.slice_id)
            if pending is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no executor of slice "
                              f"{request.slice_id[:64]!r} is starting here")
            validate.guard(context, validate.check_executor_ready, request)
            pending[1].append(request)
            pending[0].set()
            return pb.Empty()

        def StopExecutor(self, request, context):
            t0 = self.rec.now() if self.rec.on else 0
            with self._lock:
                pid = self.executors.pop(request.slice_id, None)
            if pid is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"slice {request.slice_id[:64]!r}"
                              " has no executor here")
            self._stop(pid)
            self.rec.add("rpc", "StopExecutor", t0, detail=request.slice_id)
            return pb.Empty()

        def stop_all(self) -> None:
            with self._lock:
                pids = list(self.executors.values())
                self.executors.clear()
            for pid in pids:
                self._stop(pid, 2.0)

        def _stop(self, pid: int, timeout: float = 5.0) -> None:
            with self._lock:
                member = self.members.pop(pid, None)
            if member is None:
                _kill_and_wait(pid, timeout)       # the zygote's child: the kernel reaps it
                return
            member.terminate()
            try:
                member.wait(timeout)
            except subprocess.TimeoutExpired:
                member.kill()
                member.wait()

    return WorkerService()


class _Session:
    """The worker's registration: a stream to the coordinator, with heartbeats both ways.

    The agent sends a beat every ``heartbeat_s`` (the coordinator's first event says how
    often, and how long the coordinator may be silent: ``lost_after_s``), on multiples
    of it on the wall clock, and the coordinator answers every other one. When the
    coordinator takes beats as UDP datagrams (``rpc/beats.py``), the agent sends each beat
    as one too, and stops beating on the stream once an answer has come back that way
    (a network that drops UDP leaves it on the stream). When the stream
    breaks, or the coordinator says nothing for ``lost_after_s`` (a hung machine, a dead switch: the connection
    stays open), the worker stops its executors, whose slices the coordinator no longer
    knows, and registers again: with the next of its coordinator addresses (a
    comma-separated list), retrying until one answers (or, with ``reregister_timeout``,
    for that long: then ``ended`` is 1). When the coordinator says the cluster is shutting
    down (``Coordinator.Shutdown``), ``ended`` is 0: the agent exits cleanly.
    """

    def __init__(self, addresses: str, req, service, timeout: float,
                 reregister_timeout: float = 0.0) -> None:
        self.addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        self._next = 0
        self.address = self.addresses[0]
        self.req, self.service = req, service
        self.timeout = timeout          # for the first registration; 0: forever
        self.reregister_timeout = reregister_timeout    # for the later ones; 0: forever
        self.ended: Optional[int] = None    # the exit code, once the session is over
        self.events = None
        self._channel = None
        self.heartbeat_s, self.lost_after_s = 1.0, 10.0
        self._heard = time.monotonic()
        self._udp = None                # (socket, beat id, key) of this registration
        self._phase = 0.0               # where in the period datagram beats go
        self._udp_ok = False            # an answer came back as a datagram

    def _open_udp(self, first) -> None:
        """Start beating as datagrams if the coordinator's first event offers it."""
        import socket

        from ..rpc import beats
        self._close_udp()
        if not first.beat_port:
            return
        try:
            host = beats.host_of(self.address)
            family = socket.getaddrinfo(host, first.beat_port, type=socket.SOCK_DGRAM)[0][0]
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sock.connect((host, first.beat_port))
            sock.setblocking(False)
        except OSError as e:
            log.warning("beating on the stream: no UDP to %s:%d (%s)", self.address,
                        first.beat_port, e)
            return
        self._udp = (sock, first.beat_id, first.beat_key)
        self._phase = first.beat_phase_s

    def _close_udp(self) -> None:
        if self._udp is not None:
            self._udp[0].close()
        self._udp, self._udp_ok, self._phase = None, False, 0.0

    def _udp_answers(self) -> None:
        """Take the answers that came back as datagrams since the last beat."""
        from ..rpc import beats
        udp = self._udp
        if udp is None:
            return
        sock, beat_id, key = udp
        while True:
            try:
                got = beats.unpack(sock.recv(64), {beat_id: key}.get)
            except OSError:             # none waiting, a closed socket, an ICMP error
                return
            if got is not None and got[0] == beats.ANSWER:
                self._heard = time.monotonic()
                if not self._udp_ok:
                    log.info("beating as UDP datagrams to %s", self.address)
                    self._udp_ok = True

    def _udp_beat(self, beat: int) -> None:
        from ..rpc import beats
        udp = self._udp
        if udp is None:
            return
        sock, beat_id, key = udp
        try:
            sock.send(beats.pack(beats.BEAT, beat_id, beat, key))
        except OSError:
            pass

    def _beats(self, call_box: list):
        """The request stream: the registration, then one beat per interval; it ends
        the call when the coordinator has been silent past the read deadline."""
        from ..rpc import pathways_pb2 as pb
        yield pb.WorkerUp(register=self.req)
        beat = 0
        from ..rpc.grpc_util import until_beat
        while True:
            time.sleep(until_beat(self.heartbeat_s, self._phase))
            if call_box and call_box[0].done():
                return
            self._udp_answers()
            silent = time.monotonic() - self._heard
            if silent > self.lost_after_s:
                log.warning("the coordinator at %s said nothing for %.1f s", self.address,
                            silent)
                if call_box:
                    call_box[0].cancel()
                return
            beat += 1
            self._udp_beat(beat)
            if not self._udp_ok:
                yield pb.WorkerUp(beat=beat)

    def _register(self, deadline: Optional[float]) -> bool:
        import grpc
        from ..rpc import grpc_util
        from ..rpc import pathways_pb2_grpc as pbg
        while True:
            self.address = self.addresses[self._next % len(self.addresses)]
            channel = grpc_util.channel(self.address)
            try:
                box: list = []
                self._heard = time.monotonic()
                self.events = pbg.CoordinatorStub(channel).RegisterWorker(self._beats(box))
                box.append(self.events)
                first = grpc_util.first_event(self.events, max(self.lost_after_s, 10.0),
                                              "the coordinator's registration reply")
                self._heard = time.monotonic()
                if first.shutdown:
                    channel.close()
                    self._shut_down(first.shutdown_reason)
                    return False
                if self._channel is not None:
                    self._channel.close()       # the previous registration's
                self._channel = channel
                self.heartbeat_s = first.heartbeat_s or self.heartbeat_s
                self.lost_after_s = first.lost_after_s or self.lost_after_s
                self._open_udp(first)
                log.info("registered as %s with %s", first.worker_id, self.address)
                return True
            except grpc.RpcError as e:
                channel.close()
                retry = e.code() in (grpc.StatusCode.UNAVAILABLE,
                                     grpc.StatusCode.ALREADY_EXISTS,
                                     grpc.StatusCode.DEADLINE_EXCEEDED,
                                     grpc.StatusCode.RESOURCE_EXHAUSTED)
                if not retry or (deadline is not None and time.monotonic() > deadline):
                    print(f"worker island {self.req.island} host {self.req.host}: "
                          f"registration with {self.address} failed: {e.details()}",
                          file=sys.stderr, flush=True)
                    return False
                self._next += 1
                time.sleep(0.5)

    def first_registration(self) -> bool:
        return self._register(time.monotonic() + self.timeout if self.timeout else None)

    def _shut_down(self, reason: str) -> None:
        print(f"worker island {self.req.island} host {self.req.host}: the cluster is "
              f"shutting down ({reason}); exiting", file=sys.stderr, flush=True)
        self.ended = 0

    def hold(self) -> None:
        """Follow the coordinator's events until the session ends (``ended`` is set)."""
        import grpc
        while True:
            try:
                for ev in self.events:
                    self._heard = time.monotonic()
                    if ev.shutdown:
                        self._shut_down(ev.shutdown_reason)
                        return
            except grpc.RpcError:
                pass
            log.warning("lost the coordinator at %s; registering again", self.address)
            self.service.stop_all()
            self._next += 1
            t = self.reregister_timeout
            if not self._register(time.monotonic() + t if t else None):
                if self.ended is None:
                    self.ended = 1
                return


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pathways_torch.worker")
    add_arguments(ap)
    ap.add_argument("--parent-pid", type=int, default=0)
    serve(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--coordinator", "--coordinator-address", dest="coordinator",
                    default=os.environ.get("PATHWAYS_COORDINATOR_ADDRESS", ""),
                    help="coordinator address host:port; a comma-separated list: when "
                    "one is lost or goes silent, register with the next")
    ap.add_argument("--island", type=int, default=0)
    ap.add_argument("--host", "--node-rank", dest="host", type=int,
                    default=int(os.environ.get("NODE_RANK", 0)),
                    help="host index within the island")
    ap.add_argument("--devices", type=int, default=0,
                    help="devices on this host (0: CPU_NUM_DEVICES, or 1)")
    ap.add_argument("--bind-host", default="127.0.0.1",
                    help="address the worker and its executors listen on (beyond loopback "
                    "a token is required)")
    ap.add_argument("--advertise-host",
                    default=os.environ.get("PATHWAYS_ADVERTISE_HOST", ""),
                    help="the host the coordinator and clients dial to reach this worker "
                    "and its executors (default: --bind-host, or for 0.0.0.0 the address "
                    "of the interface that routes to the coordinator; "
                    "PATHWAYS_ADVERTISE_HOST, e.g. a pod's IP)")
    ap.add_argument("--agent-port", type=int, default=0,
                    help="the port the agent listens on (0: any free port; a fixed one for "
                    "a scheduler's health probes)")
    ap.add_argument("--memory-budget", default="",
                    help="bytes of buffers this host's devices may hold in all, e.g. 48G "
                    "(default: PATHWAYS_MEMORY_BUDGET, or 80%% of the memory available)")
    ap.add_argument("--register-timeout", type=float, default=120.0,
                    help="give up when the coordinator is not up within this many seconds "
                    "(0: retry forever)")
    ap.add_argument("--reregister-timeout", type=float, default=0.0,
                    help="after losing the coordinator, give up (exit 1) when none answers "
                    "for this many seconds (0: retry forever)")
    from ..rpc import grpc_util
    grpc_util.add_tls_arguments(ap)


def serve(args: argparse.Namespace) -> None:
    """Run the host agent until SIGTERM/SIGINT (then exit the process)."""
    logging.basicConfig(level=os.environ.get("PATHWAYS_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(message)s")
    from .. import _proc
    from ..rpc import grpc_util
    if not args.coordinator:
        raise SystemExit("the worker needs --coordinator-address HOST:PORT (or "
                         "PATHWAYS_COORDINATOR_ADDRESS)")
    grpc_util.require_token_for(args.bind_host, "the worker")
    grpc_util.apply_tls_arguments(args)
    if getattr(args, "parent_pid", 0):
        _proc.die_with_parent(args.parent_pid)
    from .dataplane import remove_orphan_shm
    remove_orphan_shm()         # left by processes of this host killed mid-transfer
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    from .devices import device_kind
    kind = device_kind()
    num_devices = args.devices or int(os.environ.get("CPU_NUM_DEVICES", "1"))

    # Preload the heavy modules once; every executor is forked with them in memory.
    import torch  # noqa: F401
    from .._xla import import_torch_xla
    import_torch_xla()
    zygote = Zygote()

    from ..rpc import pathways_pb2 as pb
    from ..rpc import pathways_pb2_grpc as pbg

    from .arbiter import ShareArbiter
    arbiter = ShareArbiter()        # after the fork: the zygote must not hold its threads
    from .memory import default_budget, parse_bytes
    budget = parse_bytes(args.memory_budget) if args.memory_budget else default_budget()
    advertise = getattr(args, "advertise_host", "") or grpc_util.advertised_host(
        args.bind_host, args.coordinator.split(",")[0].strip())
    service = _make_service(zygote, args.island, args.host, kind, args.bind_host,
                            arbiter.path, max(1, budget // num_devices), num_devices,
                            advertise)
    srv = grpc_util.server(max_workers=32)
    pbg.add_WorkerServicer_to_server(service, srv)
    port = grpc_util.add_port(srv, f"{args.bind_host}:{getattr(args, 'agent_port', 0)}")
    srv.start()
    service.address = f"{advertise}:{port}"

    req = pb.RegisterWorkerRequest(island=args.island, host=args.host,
                                   num_devices=num_devices, kind=kind,
                                   address=service.address, pid=os.getpid())
    session = _Session(args.coordinator, req, service, args.register_timeout,
                       getattr(args, "reregister_timeout", 0.0))
    if not session.first_registration():
        zygote.stop()
        arbiter.close()
        _proc.remove_torch_tempdir()
        os._exit(session.ended if session.ended is not None else 1)
    threading.Thread(target=session.hold, name="coordinator-session", daemon=True).start()
    try:
        _proc.serve_until_signal(srv, until=lambda: session.ended is not None)
    finally:
        service.stop_all()
        zygote.stop()
        arbiter.close()
        _proc.remove_torch_tempdir()
    os._exit(session.ended or 0)
