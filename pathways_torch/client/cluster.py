"""The embedded local cluster: a coordinator and one worker process per host, on loopback.

``pw.init()`` without an address starts one; ``pathways-run`` starts one for a script.
Each process runs in its own process group and dies with its parent, so nothing
outlives the client even when it is killed.

The cluster supervises its workers: a worker process that exits while the cluster runs
(killed, crashed) is started again with the same arguments, a bounded number of times
with a growing back-off, and registers with the coordinator as the replacement of the
lost host (fresh devices, no state: clients rebuild their slices, see
``pw.Trainer.fit``). ``LocalCluster(restart_workers=False)`` or
``PATHWAYS_RESTART_WORKERS=0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import grpc

from .._proc import kill_group, remove_orphan_folders
from ..errors import PathwaysError, TimeoutError
from ..rpc import grpc_util
from ..rpc import pathways_pb2 as pb
from ..rpc import pathways_pb2_grpc as pbg
from ..worker.memory import default_budget

#: Where ``pw.init()`` finds a running cluster (``pathways-run`` sets it for its script).
ADDRESS_ENV = "PATHWAYS_ADDRESS"
#: ``0`` turns off the restart of dead workers in clusters that do not say otherwise.
RESTART_ENV = "PATHWAYS_RESTART_WORKERS"

log = logging.getLogger("pathways_torch.cluster")

#: A worker that ran this long before it died starts a new count of restarts: the bound
#: stops crash loops, not a long-running cluster's occasional loss.
STABLE_S = 60.0


@dataclasses.dataclass
class WorkerRestart:
    """One restart of a dead worker process by ``LocalCluster``."""

    island: int
    host: int
    exit_code: int          # of the process that died (negative: the signal)
    old_pid: int
    new_pid: int
    at: float               # time.monotonic() of the restart


@dataclasses.dataclass
class _Worker:
    args: List[str]
    env: dict
    log_name: str
    proc: subprocess.Popen
    started: float = dataclasses.field(default_factory=time.monotonic)
    restarts: int = 0               # in a row (see STABLE_S)
    due: Optional[float] = None     # when a pending restart starts (monotonic)
    gave_up: bool = False


def wait_for_hosts(address: str, want: int, timeout: float, *,
                   check: Optional[Callable[[], None]] = None, hint: str = "",
                   poll_s: float = 0.5) -> None:
    """Block until ``want`` hosts have registered with the coordinator at ``address``
    (``check()`` runs before each poll and may raise). Raises ``pw.TimeoutError`` past
    ``timeout`` seconds, and ``PathwaysError`` at once when the coordinator refuses us.

    Example::

        wait_for_hosts("node0:7000", 4, 300)     # a batch job's client, before its script
    """
    deadline = time.monotonic() + timeout
    why = "the coordinator did not answer"
    with grpc_util.channel(address) as ch:
        stub = pbg.CoordinatorStub(ch)
        while True:
            if check is not None:
                check()
            try:
                seen = stub.ListDevices(pb.ListDevicesRequest(), timeout=5,
                                        wait_for_ready=True).registered_workers
                if seen >= want:
                    return
                why = f"{seen} of {want} hosts registered"
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.PERMISSION_DENIED):
                    raise PathwaysError(f"the coordinator at {address} refused this client: "
                                        f"{e.details()}") from None
                why = f"the coordinator did not answer ({e.code().name})"
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster at {address} is not complete after "
                                   f"{timeout:g} s: {why}" + (f"; {hint}" if hint else ""))
            time.sleep(poll_s)


class LocalCluster:
    """Start ``islands * hosts_per_island`` workers with ``devices_per_host`` devices each.

    With ``restart_workers`` (default on, unless ``PATHWAYS_RESTART_WORKERS=0``), a
    monitor thread restarts a worker process that exits while the cluster runs: after
    ``restart_backoff`` seconds, doubled at each further restart of the same worker, at
    most ``max_restarts`` times in a row per worker (a worker that ran for
    ``STABLE_S`` = 60 s before it died starts a new count); each restart is logged (logger
    ``pathways_torch.cluster``) and recorded in ``restarts``. The replacement registers
    for the same island and host, with fresh devices. ``stop()`` never races with a
    restart: once it begins, nothing is started any more. ``coordinator_args`` are extra
    flags of the coordinator (``["--session-grace-s", "5"]``).

    Example::

        with LocalCluster(islands=1, hosts_per_island=1, devices_per_host=8) as c:
            print(c.address)
            ...
            print(c.restarts)          # [WorkerRestart(island=0, host=0, ...)] if one died
    """

    def __init__(self, islands: int = 1, hosts_per_island: int = 1,
                 devices_per_host: int = 8, timeout: float = 180.0,
                 env: Optional[dict] = None, devices_shared_by: int = 1,
                 memory_budget: Optional[int] = None,
                 restart_workers: Optional[bool] = None, max_restarts: int = 3,
                 restart_backoff: float = 0.5,
                 coordinator_args: Sequence[str] = ()) -> None:
        if islands < 1 or hosts_per_island < 1 or devices_per_host < 1:
            raise ValueError("islands, hosts_per_island and devices_per_host must be >= 1")
        if max_restarts < 0 or restart_backoff < 0:
            raise ValueError("max_restarts and restart_backoff must be >= 0")
        if restart_workers is None:
            restart_workers = os.environ.get(RESTART_ENV, "1") != "0"
        self.restart_workers = bool(restart_workers)
        self.max_restarts, self.restart_backoff = max_restarts, restart_backoff
        self.restarts: List[WorkerRestart] = []
        self._workers: Dict[Tuple[int, int], _Worker] = {}
        self._lock = threading.Lock()          # procs, _workers, _stopping
        self._stopping = threading.Event()
        self._monitor: Optional[threading.Thread] = None
        self.islands, self.hosts_per_island = islands, hosts_per_island
        self.devices_per_host = devices_per_host
        self.devices_shared_by = devices_shared_by
        self.coordinator_args = list(coordinator_args)
        # Each worker's buffer budget: by default the workers split 80% of the memory
        # available now, so together they never ask the kernel for more than it has.
        self.memory_budget = memory_budget or default_budget(islands * hosts_per_island)
        self.procs: List[subprocess.Popen] = []
        self.logdir = tempfile.mkdtemp(prefix="pathways-")
        # Each process's TMPDIR, a folder of this one, removed when the process is
        # replaced and at stop: a killed worker cannot remove its own (its arbiter's
        # socket, torch's and the loaders' temporary files).
        remove_orphan_folders(tempfile.gettempdir(), _RUNDIR_PREFIX)
        self.rundir = tempfile.mkdtemp(prefix=f"{_RUNDIR_PREFIX}{os.getpid()}-")
        self.address = ""
        base_env = dict(os.environ)
        base_env.setdefault("PJRT_DEVICE", "CPU")
        base_env["PYTHONUNBUFFERED"] = "1"
        # What the client can import, its local workers can too: the script's folder
        # and any path it added (pw.DataLoader datasets, pw.colocated functions).
        extra = [p for p in sys.path if p and os.path.isdir(p)
                 and not p.startswith((sys.prefix, sys.base_prefix))]
        if extra:
            base_env["PYTHONPATH"] = os.pathsep.join(
                extra + [p for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        base_env.update(env or {})
        try:
            self._start(base_env, timeout)
        except BaseException:
            self.stop(keep_logs=True)       # the error message points at the logs
            raise

    def _spawn(self, args: List[str], env: dict, log_name: str, append: bool = False,
               **kw) -> subprocess.Popen:
        tmp = tempfile.mkdtemp(prefix=log_name.split(".")[0].replace("worker-", "") + "-",
                               dir=self.rundir)
        with open(os.path.join(self.logdir, log_name), "ab" if append else "wb") as f:
            p = subprocess.Popen(
                [sys.executable, "-m"] + args + ["--parent-pid", str(os.getpid())],
                env=dict(env, TMPDIR=tmp), stdin=subprocess.DEVNULL, stderr=f,
                start_new_session=True, **kw)
        p._pw_log = f.name  # type: ignore[attr-defined]
        p._pw_tmp = tmp  # type: ignore[attr-defined]
        if not append:
            self.procs.append(p)
        return p

    def _start(self, env: dict, timeout: float) -> None:
        coord = self._spawn(["pathways_torch.coordinator", "--port", "0",
                             "--devices-shared-by", str(self.devices_shared_by)]
                            + self.coordinator_args, env,
                            "coordinator.log", stdout=subprocess.PIPE)
        line = coord.stdout.readline().decode()
        if not line.startswith("PATHWAYS_COORDINATOR_PORT="):
            raise PathwaysError(f"the coordinator did not start:\n{self._tail(coord)}")
        self.address = f"127.0.0.1:{int(line.split('=')[1])}"
        for i in range(self.islands):
            for h in range(self.hosts_per_island):
                wenv = dict(env)
                wenv["CPU_NUM_DEVICES"] = str(self.devices_per_host)
                args = ["pathways_torch.worker", "--coordinator", self.address,
                        "--island", str(i), "--host", str(h),
                        "--devices", str(self.devices_per_host),
                        "--memory-budget", str(self.memory_budget)]
                name = f"worker-i{i}-h{h}.log"
                self._workers[(i, h)] = _Worker(args, wenv, name,
                                                self._spawn(args, wenv, name))
        self.wait_ready(timeout)
        if self.restart_workers:
            self._monitor = threading.Thread(target=self._supervise, name="pw-supervisor",
                                             daemon=True)
            self._monitor.start()

    # ------------------------------------------------------------------ supervision
    def _supervise(self) -> None:
        """Restart workers that exit while the cluster runs (the monitor thread)."""
        coordinator = self.procs[0]
        while not self._stopping.wait(0.2):
            with self._lock:
                if self._stopping.is_set():
                    return
                if coordinator.poll() is not None:
                    log.error("the coordinator exited with code %s; workers are not "
                              "restarted any more (logs in %s)", coordinator.returncode,
                              self.logdir)
                    return
                for (island, host), w in self._workers.items():
                    try:
                        self._check_worker(island, host, w)
                    except Exception:       # keep supervising the others
                        log.exception("restarting worker island %d host %d failed",
                                      island, host)
                        w.gave_up = True

    def _check_worker(self, island: int, host: int, w: _Worker) -> None:
        """Restart ``w`` if it exited (called with the lock held, while not stopping)."""
        if w.gave_up or w.proc.poll() is None:
            return
        now = time.monotonic()
        if w.due is None:
            code = w.proc.returncode
            if now - w.started >= STABLE_S:
                w.restarts = 0
            # The dead worker's executors and zygote die with it (parent-death signal);
            # make sure of it before a replacement comes.
            kill_group(w.proc.pid)
            shutil.rmtree(w.proc._pw_tmp, ignore_errors=True)  # type: ignore[attr-defined]
            if w.restarts >= self.max_restarts:
                w.gave_up = True
                log.error("worker island %d host %d exited with code %s; it was restarted "
                          "%d times already, not again (log: %s)", island, host, code,
                          w.restarts, os.path.join(self.logdir, w.log_name))
                return
            delay = self.restart_backoff * (2 ** w.restarts)
            w.due = now + delay
            log.warning("worker island %d host %d (pid %d) exited with code %s; restarting "
                        "it in %.1f s (restart %d of at most %d)", island, host,
                        w.proc.pid, code, delay, w.restarts + 1, self.max_restarts)
        if now < w.due:
            return
        old = w.proc
        with open(os.path.join(self.logdir, w.log_name), "ab") as f:
            f.write(f"\n--- pathways: the worker exited with code {old.returncode}; "
                    f"restarted by the local cluster ---\n".encode())
        w.proc = self._spawn(w.args, w.env, w.log_name, append=True)
        w.started = time.monotonic()
        w.restarts += 1
        w.due = None
        self.procs[self.procs.index(old)] = w.proc
        self.restarts.append(WorkerRestart(island, host, old.returncode, old.pid,
                                           w.proc.pid, now))
        log.warning("worker island %d host %d restarted as pid %d", island, host,
                    w.proc.pid)

    def worker_pid(self, island: int, host: int = 0) -> int:
        """The process id of the worker agent of ``island``/``host`` (now)."""
        with self._lock:
            return self._workers[(island, host)].proc.pid

    def wait_ready(self, timeout: float) -> None:
        """Wait until every worker registered; fail early if one of them exits."""
        def check() -> None:
            for p in self.procs:
                if p.poll() is not None:
                    raise PathwaysError(
                        f"a cluster process exited with code {p.returncode} during start-up "
                        f"({' '.join(p.args[2:4])}):\n{self._tail(p)}")

        wait_for_hosts(self.address, self.islands * self.hosts_per_island, timeout,
                       check=check, hint=f"logs are in {self.logdir}", poll_s=0.1)

    @staticmethod
    def _tail(p: subprocess.Popen, n: int = 3000) -> str:
        try:
            with open(p._pw_log, "rb") as f:  # type: ignore[attr-defined]
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def pids(self) -> List[int]:
        with self._lock:
            return [p.pid for p in self.procs]

    def stop(self, timeout: float = 10.0, keep_logs: bool = False) -> None:
        """Stop every process (and their children) that this cluster started.

        The processes' logs are removed unless ``keep_logs`` or ``PATHWAYS_KEEP_LOGS``.
        Restarts end first: a worker is restarted only under the lock and only while the
        cluster is not stopping, so every process it ever started is in ``procs`` here.
        """
        with self._lock:
            self._stopping.set()
            procs, self.procs = self.procs, []
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(10)
        for p in procs:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Executors and zygotes are in the worker's process group: end them all.
            kill_group(p.pid)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout is not None:
                p.stdout.close()
        shutil.rmtree(self.rundir, ignore_errors=True)
        if not (keep_logs or os.environ.get("PATHWAYS_KEEP_LOGS")):
            shutil.rmtree(self.logdir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_RUNDIR_PREFIX = "pathways-tmp-"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
