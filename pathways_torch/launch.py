"""``pathways-run``: start a Pathways cluster and run a client script, torchrun-style.

Four modes:

- **local** (default): start an embedded cluster (a coordinator and one worker process
  per host) on this machine, run the script as the client with ``PATHWAYS_ADDRESS`` set
  (so its ``pw.init()`` connects instead of starting its own cluster), and stop
  everything when the script ends, fails, or the launcher gets Ctrl-C / SIGTERM. The
  exit code is the script's.
- ``--coordinator``: run the coordinator of a multi-machine cluster in the foreground.
- ``--worker --coordinator-address HOST:PORT --island I``: run one host's worker agent.
  It retries until the coordinator is up and registers again after it restarts.
- ``--address HOST:PORT script.py``: run the script as a client of a running cluster.

torchrun's names work where they mean the same thing: ``--nnodes`` for hosts per
island, ``--node-rank`` / ``NODE_RANK`` for a worker's host index, ``--master-addr`` /
``--master-port`` (``MASTER_ADDR`` / ``MASTER_PORT``) for the coordinator's address,
``-m`` to run a module, ``--standalone`` for the local mode.

In a scheduler's batch job (TorchX, Slurm), where every process starts at once:
``--replica-id R`` places a worker (island ``R // --hosts-per-island``, host ``R %
--hosts-per-island``), ``--max-restarts N`` restarts its agent when it dies, and a client
with ``--wait-for-hosts N --shutdown-cluster`` waits for the hosts, runs the script, then
shuts the cluster down so that every process exits (``pathways_torch/deploy/``).

A cluster that listens beyond loopback needs a shared token: ``--token``,
``PATHWAYS_TOKEN`` or ``--token-file`` / ``PATHWAYS_TOKEN_FILE``, the same on every node
and client. ``--tls-cert``, ``--tls-key`` and
``--tls-ca`` (PEM files; ``PATHWAYS_TLS_CERT`` / ``_KEY`` / ``_CA``) turn on TLS for
gRPC and the data plane in every mode; with a CA, servers require client certificates
(mutual TLS). The launcher exports them, so everything it starts inherits them.

Example::

    pathways-run --devices-per-host 8 recipes/quickstart.py           # one machine
    PATHWAYS_TOKEN=s3cret pathways-run --coordinator --host 0.0.0.0 --port 7000
    PATHWAYS_TOKEN=s3cret pathways-run --worker --coordinator-address node0:7000 \\
        --island 0 --node-rank 1 --bind-host 0.0.0.0
    PATHWAYS_TOKEN=s3cret pathways-run --address node0:7000 recipes/train_gpt.py
    pathways-run --tls-cert node.pem --tls-key node.key --tls-ca ca.pem --coordinator ...
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from typing import List, Optional

from .client.cluster import ADDRESS_ENV
from .errors import PathwaysError
from .rpc import grpc_util
from .worker.memory import parse_bytes


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _master_address() -> str:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else ""


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="pathways-run",
        description="Start a Pathways cluster (or a part of one) and run SCRIPT as its "
        "client.")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--standalone", action="store_true",
                      help="local mode (the default): a whole cluster on this machine")
    mode.add_argument("--coordinator", action="store_true",
                      help="run the coordinator of a multi-machine cluster")
    mode.add_argument("--worker", action="store_true",
                      help="run this host's worker agent (needs --coordinator-address)")
    ap.add_argument("--address", default=os.environ.get(ADDRESS_ENV, ""),
                    help="run SCRIPT as a client of the cluster at HOST:PORT")
    ap.add_argument("--token", default=None,
                    help=f"the cluster's shared token (default: {grpc_util.TOKEN_ENV})")
    ap.add_argument("--token-file", default=os.environ.get(grpc_util.TOKEN_FILE_ENV, ""),
                    help="read the token from this file's first line (a mounted secret; "
                    f"{grpc_util.TOKEN_FILE_ENV})")
    grpc_util.add_tls_arguments(ap)
    ap.add_argument("--islands", type=int, default=_env_int("PATHWAYS_ISLANDS", 1))
    ap.add_argument("--hosts-per-island", "--hosts_per_island", "--nnodes", type=int,
                    dest="hosts_per_island", default=_env_int("PATHWAYS_HOSTS_PER_ISLAND", 1))
    ap.add_argument("--devices-per-host", "--devices_per_host", type=int,
                    default=_env_int("PATHWAYS_DEVICES_PER_HOST",
                                     _env_int("CPU_NUM_DEVICES", 8)))
    # coordinator
    ap.add_argument("--host", default="127.0.0.1", help="coordinator: address to bind")
    ap.add_argument("--port", "--master-port", "--master_port", type=int, dest="port",
                    default=_env_int("MASTER_PORT", 0),
                    help="coordinator: port to bind (0: any free port, printed)")
    ap.add_argument("--devices-shared-by", type=int, default=1,
                    help="coordinator / local: slices that may share one device (>1 turns "
                    "on proportional shares between clients)")
    from .coordinator import service as coord
    for flag, default, what in (
            ("--heartbeat-s", coord.HEARTBEAT_S, "how often workers and clients beat"),
            ("--lost-after-s", coord.LOST_AFTER_S, "a worker silent this long is lost"),
            ("--session-grace-s", coord.SESSION_GRACE_S,
             "a frozen client is dropped after --lost-after-s plus this"),
            ("--max-hosts", coord.MAX_HOSTS, "registered hosts at most"),
            ("--max-sessions", coord.MAX_SESSIONS, "open client sessions at most")):
        ap.add_argument(flag, type=type(default), default=default,
                        help=f"coordinator: {what} (default {default})")
    ap.add_argument("--udp-beats", action=argparse.BooleanOptionalAction, default=True,
                    help="coordinator: take workers' beats as UDP datagrams on --port's "
                    "number (workers fall back to their TCP stream when none is answered)")
    # worker
    ap.add_argument("--coordinator-address", "--master-addr", "--master_addr",
                    dest="coordinator_address",
                    default=os.environ.get("PATHWAYS_COORDINATOR_ADDRESS",
                                           _master_address()),
                    help="worker: the coordinator's HOST:PORT")
    ap.add_argument("--coordinator-env", default="",
                    help="worker / client: read the coordinator's host from this "
                    "environment variable (a scheduler's: TorchX's rank-0 host, a JobSet "
                    "pod's coordinator label) and its port from --port / MASTER_PORT")
    ap.add_argument("--island", type=int, default=_env_int("PATHWAYS_ISLAND", 0),
                    help="worker: its island (default: PATHWAYS_ISLAND, or 0)")
    ap.add_argument("--node-rank", "--node_rank", type=int, dest="node_rank",
                    default=_env_int("NODE_RANK", 0), help="worker: host index in its island")
    ap.add_argument("--replica-id", type=int, default=_env_int("PATHWAYS_REPLICA_ID", -1),
                    help="worker: its index among all the cluster's hosts (a scheduler's "
                    "replica or task id): island = R // --hosts-per-island, node rank = "
                    "R %% --hosts-per-island")
    ap.add_argument("--max-restarts", type=int, default=0,
                    help="worker: run the agent as a child and start it again when it dies, "
                    "up to N times (it registers as the replacement; torchrun's "
                    "--max-restarts for schedulers that restart nothing themselves)")
    ap.add_argument("--bind-host", default="127.0.0.1",
                    help="worker: address it and its executors listen on")
    ap.add_argument("--advertise-host", default=os.environ.get("PATHWAYS_ADVERTISE_HOST", ""),
                    help="worker: the host others dial to reach it (default: --bind-host; "
                    "for 0.0.0.0, the address of the interface that routes to the "
                    "coordinator; PATHWAYS_ADVERTISE_HOST)")
    ap.add_argument("--agent-port", type=int, default=0,
                    help="worker: the port its agent listens on (0: any; a fixed one for "
                    "health probes)")
    ap.add_argument("--memory-budget", default="",
                    help="worker / local: bytes of buffers a host's devices may hold in "
                    "all, e.g. 48G (default: 80%% of the memory available, split over the "
                    "local workers)")
    ap.add_argument("--register-timeout", type=float, default=0.0,
                    help="worker: give up (exit 1) if no coordinator answers for this many "
                    "seconds, at the start or after losing it (0: retry forever); client "
                    "with --wait-for-hosts: how long to wait for them")
    # client of a running cluster, in a batch job
    ap.add_argument("--wait-for-hosts", type=int, default=0,
                    help="client: before the script starts, wait until this many hosts "
                    "have registered (a batch job whose processes start together)")
    ap.add_argument("--shutdown-cluster", action="store_true",
                    help="client: when the script ends (whatever its exit code), shut the "
                    "cluster down: the coordinator and every worker exit 0, so the "
                    "scheduler sees the job end")
    ap.add_argument("-m", "--module", action="store_true",
                    help="run SCRIPT as a module (python -m), as torchrun's -m")
    ap.add_argument("script", nargs="?", help="the client script (or module with -m)")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.memory_budget:
        try:
            parse_bytes(args.memory_budget)
        except ValueError as e:
            ap.error(str(e))
    if args.token_file:
        args.token_file = os.path.abspath(args.token_file)
        try:
            grpc_util.token_from_file(args.token_file)
        except PathwaysError as e:
            ap.error(str(e))
    if args.replica_id >= 0:
        if args.hosts_per_island < 1:
            ap.error("--replica-id needs --hosts-per-island >= 1")
        args.island, args.node_rank = divmod(args.replica_id, args.hosts_per_island)
    if args.max_restarts < 0:
        ap.error("--max-restarts must be >= 0")
    if args.coordinator_env and not args.coordinator:
        host = os.environ.get(args.coordinator_env, "")
        if not host or not args.port:
            ap.error(f"--coordinator-env {args.coordinator_env} needs that variable set "
                     f"(it is {'set' if host else 'not set'}) and the coordinator's --port "
                     "(or MASTER_PORT)")
        args.coordinator_address = f"{host}:{args.port}"
        if not args.worker and not args.address:
            args.address = args.coordinator_address
    if not (args.coordinator or args.worker) and not args.script:
        ap.error("give the client SCRIPT to run (or --coordinator / --worker)")
    if args.worker and not args.coordinator_address:
        ap.error("--worker needs --coordinator-address HOST:PORT (or MASTER_ADDR and "
                 "MASTER_PORT, or PATHWAYS_COORDINATOR_ADDRESS)")
    if args.worker:
        host = args.coordinator_address.split(",")[0].strip().rpartition(":")[0].strip("[]")
        if host and not grpc_util.is_loopback(host):
            if grpc_util.is_loopback(args.bind_host):
                ap.error(f"the coordinator ({host}) is on another machine, which cannot "
                         f"reach a worker bound to {args.bind_host}: give --bind-host "
                         "0.0.0.0 (or this host's address)")
            if not (args.token or args.token_file or os.environ.get(grpc_util.TOKEN_ENV)):
                ap.error(f"the coordinator ({host}) is on another machine: a cluster beyond "
                         "one machine needs the shared token on every node: --token-file "
                         f"PATH (or {grpc_util.TOKEN_ENV})")
    if (args.shutdown_cluster or args.wait_for_hosts) and (
            args.coordinator or args.worker or not args.address):
        ap.error("--shutdown-cluster and --wait-for-hosts are for a client of a running "
                 "cluster: give --address HOST:PORT (or --coordinator-env)")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    if args.token is not None:
        os.environ[grpc_util.TOKEN_ENV] = args.token   # children inherit it
    if args.token_file:
        os.environ[grpc_util.TOKEN_FILE_ENV] = args.token_file
    try:
        grpc_util.apply_tls_arguments(args)             # exported too
    except PathwaysError as e:
        print(f"pathways-run: {e}", file=sys.stderr)
        return 2
    if args.coordinator:
        from .coordinator.service import serve
        serve(argparse.Namespace(host=args.host, port=args.port,
                                 devices_shared_by=args.devices_shared_by,
                                 heartbeat_s=args.heartbeat_s, lost_after_s=args.lost_after_s,
                                 session_grace_s=args.session_grace_s,
                                 max_hosts=args.max_hosts, max_sessions=args.max_sessions,
                                 udp_beats=args.udp_beats))
        return 0
    if args.worker:
        os.environ.setdefault("CPU_NUM_DEVICES", str(args.devices_per_host))
        if args.max_restarts:
            return _supervise(args)
        from .worker.agent import serve
        serve(argparse.Namespace(coordinator=args.coordinator_address, island=args.island,
                                 host=args.node_rank, devices=args.devices_per_host,
                                 bind_host=args.bind_host,
                                 advertise_host=args.advertise_host,
                                 agent_port=args.agent_port,
                                 memory_budget=args.memory_budget,
                                 register_timeout=args.register_timeout,
                                 reregister_timeout=args.register_timeout))
        return 0
    return _run_client(args)


def _status(code: int) -> int:
    """A child's return code as a shell would report it (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def _agent_command(args: argparse.Namespace) -> List[str]:
    cmd = [sys.executable, "-m", "pathways_torch.worker",
           "--coordinator", args.coordinator_address, "--island", str(args.island),
           "--host", str(args.node_rank), "--devices", str(args.devices_per_host),
           "--bind-host", args.bind_host, "--agent-port", str(args.agent_port),
           "--register-timeout", str(args.register_timeout),
           "--reregister-timeout", str(args.register_timeout),
           "--parent-pid", str(os.getpid())]
    if args.advertise_host:
        cmd += ["--advertise-host", args.advertise_host]
    if args.memory_budget:
        cmd += ["--memory-budget", args.memory_budget]
    return cmd


def _supervise(args: argparse.Namespace) -> int:
    """Run the worker agent as a child; start it again when it dies, up to
    ``--max-restarts`` times (1 s apart, doubling), as torchrun restarts its workers.
    The agent's clean exit (the cluster shut down) ends the supervisor with 0."""
    import time
    child: Optional[subprocess.Popen] = None
    stopping: list = []

    def forward(signum, frame):
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, forward)
    restarts, backoff = 0, 1.0
    where = f"worker island {args.island} host {args.node_rank}"
    while True:
        # Its own TMPDIR, removed after it: a killed agent leaves its sockets there.
        with tempfile.TemporaryDirectory(prefix="pathways-worker-",
                                         ignore_cleanup_errors=True) as tmp:
            child = subprocess.Popen(_agent_command(args), env=dict(os.environ, TMPDIR=tmp))
            code = child.wait()
        if code == 0 or stopping:
            return _status(code)
        if restarts >= args.max_restarts:
            print(f"pathways-run: {where}: the agent exited with code {code}; it was "
                  f"restarted {restarts} times (--max-restarts {args.max_restarts}), not "
                  "again", file=sys.stderr, flush=True)
            return _status(code)
        restarts += 1
        print(f"pathways-run: {where}: the agent exited with code {code}; starting it "
              f"again in {backoff:g} s ({restarts}/{args.max_restarts})", file=sys.stderr,
              flush=True)
        time.sleep(backoff)
        backoff *= 2


def _run_client(args: argparse.Namespace) -> int:
    cluster = None
    env = dict(os.environ)
    if args.address:
        env[ADDRESS_ENV] = args.address
    else:
        from .client.cluster import LocalCluster
        cluster = LocalCluster(args.islands, args.hosts_per_island, args.devices_per_host,
                               devices_shared_by=args.devices_shared_by,
                               memory_budget=parse_bytes(args.memory_budget)
                               if args.memory_budget else None)
        env[ADDRESS_ENV] = cluster.address
    cmd = [sys.executable] + (["-m"] if args.module else []) + [args.script] + args.script_args
    child = None

    def forward(signum, frame):
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 1
    try:
        if args.wait_for_hosts:
            from .client.cluster import wait_for_hosts
            wait_for_hosts(args.address, args.wait_for_hosts, args.register_timeout or 300.0,
                           hint="check the workers' logs (--register-timeout waits longer)")
        child = subprocess.Popen(_dies_with_us(cmd), env=env)
        code = child.wait()
    except PathwaysError as e:
        print(f"pathways-run: {e}", file=sys.stderr, flush=True)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        if cluster is not None:
            cluster.stop()
        for s, h in old.items():
            signal.signal(s, h)
        if args.shutdown_cluster:
            _shutdown_cluster(args.address, f"the client {args.script} exited with code "
                              f"{code}")
    return _status(code)


# Runs before the script, in the child: the kernel sends it SIGTERM when the launcher
# dies, even by SIGKILL (which no handler sees); kept across the exec of the script.
_DIE_WITH_PARENT = """
import ctypes, os, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 15)     # PR_SET_PDEATHSIG, SIGTERM
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)                                         # the launcher is gone already
os.execv(sys.argv[2], sys.argv[2:])
"""


def _dies_with_us(cmd: list) -> list:
    """``cmd`` started so that it ends when this launcher process ends, however it
    ends: the script's process is the same (its pid, its signals), a few ms later."""
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid())] + cmd


def _shutdown_cluster(address: str, reason: str) -> None:
    """Ask the coordinator at ``address`` to stop every worker and itself."""
    import grpc

    from .rpc import pathways_pb2 as pb
    from .rpc import pathways_pb2_grpc as pbg
    try:
        with grpc_util.channel(address) as ch:
            pbg.CoordinatorStub(ch).Shutdown(pb.ShutdownRequest(reason=reason), timeout=10)
    except grpc.RpcError as e:
        print(f"pathways-run: could not shut the cluster at {address} down: "
              f"{e.code().name} {e.details()}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
