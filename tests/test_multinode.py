"""pathways-run's multi-machine modes, as separate processes on loopback: a coordinator,
worker agents that retry and re-register, clients that connect by address, the token."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from procs import port_closed, wait_gone, watched

# Every process the tests start dies with the test's process (PR_SET_PDEATHSIG, kept
# across exec), so a pytest run that is hard-killed takes them along; their own children
# (a supervisor's agent, an agent's executors) watch them in turn.
RUN = watched([sys.executable, "-m", "pathways_torch"])
TOKEN = "t0ps3cret"

CLIENT = textwrap.dedent("""
    import sys, torch
    import pathways_torch as pw
    pw.init()
    print("HOSTS", sorted({(d.island, d.host) for d in pw.devices()}), flush=True)
    slices = [pw.slice((2,), island=i) for i in (0, 1)]

    @pw.program
    def double(x):
        return x * 2

    print("ADDRESSES", [s._conn.address for s in slices],
          [s.data_address for s in slices], flush=True)
    x = pw.put(torch.arange(4.), slices[0])
    y = double(x).to(slices[1])               # island 0 -> island 1 over the data plane
    print("RESULT", double(y).torch().tolist(), flush=True)
""")


class Proc:
    """A pathways-run process whose output goes to a file (read with ``text()``); it is
    added to ``into`` (the test's list, stopped in its ``finally``) as soon as it runs."""

    def __init__(self, args, env, tmp_path, name, into):
        self.log = tmp_path / f"{name}.log"
        with open(self.log, "wb") as out:
            self.p = subprocess.Popen(RUN + args, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        into.append(self)

    def text(self):
        return self.log.read_text(errors="replace")

    def wait_for(self, needle, timeout=120):
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            assert self.p.poll() is None, f"exited {self.p.returncode}:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {needle!r} in:\n{self.text()[-3000:]}"
            time.sleep(0.1)
        return self.text()

    def stop(self, sig=signal.SIGTERM):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.p.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()


def base_env(token=TOKEN):
    e = dict(os.environ, PJRT_DEVICE="CPU")
    e.pop("PATHWAYS_ADDRESS", None)
    e.pop("PATHWAYS_TOKEN", None)
    if token:
        e["PATHWAYS_TOKEN"] = token
    return e


def stop_all(procs):
    for p in reversed(procs):
        p.stop()


def start_coordinator(tmp_path, procs, port=0, name="coordinator"):
    c = Proc(["--coordinator", "--port", str(port)], base_env(), tmp_path, name, procs)
    line = c.wait_for("PATHWAYS_COORDINATOR_PORT=")
    port = int(line.split("PATHWAYS_COORDINATOR_PORT=")[1].split()[0])
    return c, f"127.0.0.1:{port}"


def start_worker(tmp_path, procs, address, island, name=None, extra=()):
    return Proc(["--worker", "--coordinator-address", address, "--island", str(island),
                 "--devices-per-host", "2", *extra], base_env(), tmp_path,
                name or f"worker{island}", procs)


def registered(address, n, timeout=120):
    import grpc
    from pathways_torch.rpc import grpc_util
    from pathways_torch.rpc import pathways_pb2 as pb
    from pathways_torch.rpc import pathways_pb2_grpc as pbg
    grpc_util.set_token(TOKEN)
    try:
        stub = pbg.CoordinatorStub(grpc_util.channel(address))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                rep = stub.ListDevices(pb.ListDevicesRequest(), timeout=5)
                if sum(d.state != "lost" for d in rep.devices) >= 2 * n:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        return False
    finally:
        grpc_util.set_token(None)


def run_client(tmp_path, address, token=TOKEN):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    return subprocess.run(RUN + ["--address", address, str(script)], env=base_env(token),
                          capture_output=True, text=True, timeout=300)


def test_workers_started_before_the_coordinator_wait_for_it_and_serve_clients(tmp_path):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))                 # a free port for the coordinator to come up on
    port = s.getsockname()[1]
    s.close()
    address = f"127.0.0.1:{port}"
    procs, workers = [], []
    try:
        workers = [start_worker(tmp_path, procs, address, i) for i in (0, 1)]
        time.sleep(2)                        # the workers are retrying by now
        assert all(w.p.poll() is None for w in workers)
        coord, address = start_coordinator(tmp_path, procs, port)
        assert registered(address, 2)
        r = run_client(tmp_path, address)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "HOSTS [(0, 0), (1, 0)]" in r.stdout
        assert "RESULT [0.0, 4.0, 8.0, 12.0]" in r.stdout

        # a client without the token is refused, with a message that says what to do
        bad = run_client(tmp_path, address, token="")
        assert bad.returncode != 0
        assert "refused this client" in bad.stderr and "token" in bad.stderr
        wrong = run_client(tmp_path, address, token="guess")
        assert wrong.returncode != 0 and "token" in wrong.stderr

        # the coordinator restarts on the same port: the workers register again
        coord.stop()
        assert port_closed(address)
        coord, address = start_coordinator(tmp_path, procs, port, "coordinator2")
        assert registered(address, 2, timeout=60)
        r = run_client(tmp_path, address)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "RESULT [0.0, 4.0, 8.0, 12.0]" in r.stdout
    finally:
        stop_all(procs)
    assert wait_gone([w.p.pid for w in workers]) == []


def test_workers_bound_to_every_interface_advertise_an_address_others_can_dial(tmp_path):
    """--bind-host 0.0.0.0 (as on a real cluster) must not hand out "0.0.0.0:port":
    the worker advertises the interface that routes to the coordinator (here loopback),
    or --advertise-host (a pod's IP, say)."""
    procs = []
    try:
        coord, address = start_coordinator(tmp_path, procs)
        start_worker(tmp_path, procs, address, 0, extra=("--bind-host", "0.0.0.0"))
        start_worker(tmp_path, procs, address, 1, extra=("--bind-host", "0.0.0.0",
                                                         "--advertise-host", "localhost"))
        assert registered(address, 2)
        r = run_client(tmp_path, address)
        assert r.returncode == 0, r.stderr[-3000:]
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("ADDRESSES"))
        assert "0.0.0.0" not in line and "127.0.0.1:" in line and "localhost:" in line, line
        assert "RESULT [0.0, 4.0, 8.0, 12.0]" in r.stdout
    finally:
        stop_all(procs)


def test_listening_beyond_loopback_needs_a_token(tmp_path):
    e = base_env(token="")
    r = subprocess.run(RUN + ["--coordinator", "--host", "0.0.0.0", "--port", "0"], env=e,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "token" in r.stderr and "PATHWAYS_TOKEN" in r.stderr
    r = subprocess.run(RUN + ["--worker", "--coordinator-address", "127.0.0.1:1",
                              "--bind-host", "0.0.0.0"], env=e, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "token" in r.stderr


def test_worker_mode_needs_a_coordinator_address():
    e = base_env()
    e.pop("MASTER_ADDR", None)
    e.pop("PATHWAYS_COORDINATOR_ADDRESS", None)
    r = subprocess.run(RUN + ["--worker"], env=e, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--coordinator-address" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_ctrl_c_of_a_client_leaves_the_cluster_serving(tmp_path, sig):
    procs = []
    try:
        coord, address = start_coordinator(tmp_path, procs)
        for i in (0, 1):
            start_worker(tmp_path, procs, address, i)
        assert registered(address, 2)
        script = tmp_path / "hold.py"
        script.write_text(textwrap.dedent("""
            import time, torch
            import pathways_torch as pw
            pw.init()
            s = pw.slice((2,), island=0)
            pw.put(torch.ones(2), s).torch()
            print("HOLDING", flush=True)
            time.sleep(300)
        """))
        c = Proc(["--address", address, str(script)], base_env(), tmp_path, "holder",
                 procs)
        c.wait_for("HOLDING")
        c.stop(sig)
        assert c.p.returncode != 0
        r = run_client(tmp_path, address)    # island 0's devices were freed for it
        assert r.returncode == 0, r.stderr[-3000:]
        assert "RESULT [0.0, 4.0, 8.0, 12.0]" in r.stdout
    finally:
        stop_all(procs)


def test_a_batch_job_forms_restarts_a_dead_agent_and_ends_when_its_client_does(tmp_path):
    """What a scheduler's job does (TorchX, Slurm): every process started at once, the
    token from a file, workers placed by replica id, an agent that dies started again
    by its supervisor (--max-restarts), a client that waits for every host
    (--wait-for-hosts) and shuts the cluster down when it ends (--shutdown-cluster):
    then every process exits 0, so the scheduler sees the job end."""
    from procs import cmdline, topmost, with_cmdline
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = base_env(token=None)
    procs = []
    address = None
    try:
        coord = Proc(["--coordinator", "--port", "0", "--token-file", str(token_file)], env,
                     tmp_path, "coordinator", procs)
        line = coord.wait_for("PATHWAYS_COORDINATOR_PORT=")
        address = f"127.0.0.1:{int(line.split('PATHWAYS_COORDINATOR_PORT=')[1].split()[0])}"
        workers = [Proc(["--worker", "--coordinator-address", address, "--replica-id",
                         str(r), "--hosts-per-island", "1", "--devices-per-host", "2",
                         "--max-restarts", "1", "--register-timeout", "60",
                         "--token-file", str(token_file)], env, tmp_path, f"worker{r}",
                        procs)
                   for r in (0, 1)]
        assert registered(address, 2)
        # The agent of island 1 dies: its supervisor starts it again, it re-registers.
        (agent,) = topmost([p for p in with_cmdline(f"--coordinator {address}")
                            if "pathways_torch.worker" in cmdline(p)
                            and "--island 1 " in cmdline(p)])
        os.kill(agent, signal.SIGKILL)
        workers[1].wait_for("starting it again")
        assert registered(address, 2, timeout=60)

        script = tmp_path / "client.py"
        script.write_text(CLIENT)
        r = subprocess.run(RUN + ["--address", address, "--wait-for-hosts", "2",
                                  "--shutdown-cluster", "--token-file", str(token_file),
                                  str(script)], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "RESULT [0.0, 4.0, 8.0, 12.0]" in r.stdout
        for p in [coord] + workers:
            assert p.p.wait(30) == 0, p.text()[-3000:]
        assert "the cluster is shutting down" in workers[0].text()
        assert port_closed(address)
    finally:
        stop_all(procs)
    assert address and wait_gone(with_cmdline(address)) == []


def test_launcher_flags_of_batch_jobs_say_what_is_wrong(tmp_path, capsys):
    from pathways_torch import launch
    a = launch.parse(["--worker", "--coordinator-address", "127.0.0.1:7000",
                      "--replica-id", "5", "--hosts-per-island", "2"])
    assert (a.island, a.node_rank) == (2, 1)
    cases = [
        (["--worker", "--coordinator-address", "127.0.0.1:1", "--token-file",
          str(tmp_path / "missing")], "cannot read the cluster token file"),
        (["--worker", "--coordinator-address", "192.0.2.1:7000", "--bind-host",
          "0.0.0.0"], "needs the shared token"),
        (["--worker", "--coordinator-address", "192.0.2.1:7000", "--token", "x"],
         "--bind-host 0.0.0.0"),
        (["--shutdown-cluster", "script.py"], "for a client of a running cluster"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            launch.parse(argv)
        assert message in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit):
        launch.parse(["--coordinator", "--token-file", str(tmp_path / "empty")])
    assert "is empty" in capsys.readouterr().err
