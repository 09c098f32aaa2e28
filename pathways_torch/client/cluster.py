"""The embedded local cluster: a coordinator and one worker process per host, on loopback.

``pw.init()`` without an address starts one; ``pathways-run`` starts one for a script.
Each process runs in its own process group and dies with its parent, so nothing
outlives the client even when it is killed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

import grpc

from ..errors import PathwaysError, TimeoutError
from ..rpc import grpc_util
from ..rpc import pathways_pb2 as pb
from ..rpc import pathways_pb2_grpc as pbg

#: Where ``pw.init()`` finds a running cluster (``pathways-run`` sets it for its script).
ADDRESS_ENV = "PATHWAYS_ADDRESS"


class LocalCluster:
    """Start ``islands * hosts_per_island`` workers with ``devices_per_host`` devices each.

    Example::

        with LocalCluster(islands=1, hosts_per_island=1, devices_per_host=8) as c:
            print(c.address)
    """

    def __init__(self, islands: int = 1, hosts_per_island: int = 1,
                 devices_per_host: int = 8, timeout: float = 180.0,
                 env: Optional[dict] = None, devices_shared_by: int = 1) -> None:
        if islands < 1 or hosts_per_island < 1 or devices_per_host < 1:
            raise ValueError("islands, hosts_per_island and devices_per_host must be >= 1")
        self.islands, self.hosts_per_island = islands, hosts_per_island
        self.devices_per_host = devices_per_host
        self.devices_shared_by = devices_shared_by
        self.procs: List[subprocess.Popen] = []
        self.logdir = tempfile.mkdtemp(prefix="pathways-")
        self.address = ""
        base_env = dict(os.environ)
        base_env.setdefault("PJRT_DEVICE", "CPU")
        base_env["PYTHONUNBUFFERED"] = "1"
        base_env.update(env or {})
        try:
            self._start(base_env, timeout)
        except BaseException:
            self.stop(keep_logs=True)       # the error message points at the logs
            raise

    def _spawn(self, args: List[str], env: dict, log_name: str, **kw) -> subprocess.Popen:
        log = open(os.path.join(self.logdir, log_name), "wb")
        p = subprocess.Popen(
            [sys.executable, "-m"] + args + ["--parent-pid", str(os.getpid())],
            env=env, stdin=subprocess.DEVNULL, stderr=log, start_new_session=True, **kw)
        p._pw_log = log.name  # type: ignore[attr-defined]
        log.close()
        self.procs.append(p)
        return p

    def _start(self, env: dict, timeout: float) -> None:
        coord = self._spawn(["pathways_torch.coordinator", "--port", "0",
                             "--devices-shared-by", str(self.devices_shared_by)], env,
                            "coordinator.log", stdout=subprocess.PIPE)
        line = coord.stdout.readline().decode()
        if not line.startswith("PATHWAYS_COORDINATOR_PORT="):
            raise PathwaysError(f"the coordinator did not start:\n{self._tail(coord)}")
        self.address = f"127.0.0.1:{int(line.split('=')[1])}"
        for i in range(self.islands):
            for h in range(self.hosts_per_island):
                wenv = dict(env)
                wenv["CPU_NUM_DEVICES"] = str(self.devices_per_host)
                self._spawn(["pathways_torch.worker", "--coordinator", self.address,
                             "--island", str(i), "--host", str(h),
                             "--devices", str(self.devices_per_host)], wenv,
                            f"worker-i{i}-h{h}.log")
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        """Wait until every worker registered; fail early if one of them exits."""
        want = self.islands * self.hosts_per_island
        stub = pbg.CoordinatorStub(grpc_util.channel(self.address))
        deadline = time.monotonic() + timeout
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise PathwaysError(
                        f"a cluster process exited with code {p.returncode} during start-up "
                        f"({' '.join(p.args[2:4])}):\n{self._tail(p)}")
            try:
                rep = stub.ListDevices(pb.ListDevicesRequest(), timeout=5)
                if rep.registered_workers >= want:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only some of {want} workers registered within {timeout:.0f} s; "
                    f"logs are in {self.logdir}")
            time.sleep(0.1)

    @staticmethod
    def _tail(p: subprocess.Popen, n: int = 3000) -> str:
        try:
            with open(p._pw_log, "rb") as f:  # type: ignore[attr-defined]
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def stop(self, timeout: float = 10.0, keep_logs: bool = False) -> None:
        """Stop every process (and their children) that this cluster started.

        The processes' logs are removed unless ``keep_logs`` or ``PATHWAYS_KEEP_LOGS``.
        """
        procs, self.procs = self.procs, []
        for p in procs:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Executors and zygotes are in the worker's process group: end them all.
            _signal_group(p.pid, signal.SIGKILL)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout is not None:
                p.stdout.close()
        if not (keep_logs or os.environ.get("PATHWAYS_KEEP_LOGS")):
            shutil.rmtree(self.logdir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
