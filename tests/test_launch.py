"""pathways-run and process teardown: normal exit, crash, interpreter exit, SIGKILL."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from procs import alive, cmdline, port_closed, wait_gone, with_cmdline

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = pathlib.Path(__file__).resolve().parent
RUN = [sys.executable, "-m", "pathways_torch"]     # what the pathways-run script calls


def coordinators_of(owner: int) -> list:
    """The coordinator processes started by process ``owner`` (a launcher or an embedded
    client): the cluster gives each ``--parent-pid <owner>`` on its command line, which
    (unlike ``--port 0``) tells which cluster it belongs to."""
    return [p for p in with_cmdline(f"--parent-pid {owner}")
            if "pathways_torch.coordinator" in cmdline(p)]


CLIENT = textwrap.dedent("""
    import os, sys, torch
    import pathways_torch as pw
    sys.path.insert(0, os.environ["PW_TESTS_DIR"])
    from procs import cmdline, with_cmdline
    pw.init()
    print("ADDRESS", os.environ.get("PATHWAYS_ADDRESS", ""), flush=True)
    # the launcher (our parent) started the cluster: its coordinator, alive now (as in
    # coordinators_of)
    print("COORDINATOR", *[p for p in with_cmdline(f"--parent-pid {os.getppid()}")
                           if "pathways_torch.coordinator" in cmdline(p)], flush=True)
    print("DEVICES", len(pw.devices()), flush=True)
    s = pw.slice((2,))

    @pw.program
    def double(x):
        return x * 2

    print("RESULT", double(pw.put(torch.arange(4.), s)).torch().tolist(), flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "crash":
        raise SystemExit(3)
""")


def env():
    e = dict(os.environ)
    e.pop("PATHWAYS_ADDRESS", None)
    e["PW_TESTS_DIR"] = str(TESTS)
    return e


def coordinator_pid(out) -> int:
    (pids,) = lines(out, "COORDINATOR")
    (pid,) = map(int, pids.split())             # exactly one
    return pid


def lines(out, key):
    return [l.split(" ", 1)[1] for l in out.splitlines() if l.startswith(key + " ")]


@pytest.fixture()
def client_script(tmp_path):
    p = tmp_path / "client.py"
    p.write_text(CLIENT)
    return p


def test_pathways_run_runs_the_script_and_stops_the_cluster(client_script):
    r = subprocess.run(RUN + ["--devices-per-host", "2", str(client_script)], env=env(),
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    (address,) = lines(r.stdout, "ADDRESS")
    assert address.startswith("127.0.0.1:")          # pw.init() found the launcher's cluster
    assert lines(r.stdout, "DEVICES") == ["2"]
    assert lines(r.stdout, "RESULT") == ["[0.0, 2.0, 4.0, 6.0]"]
    assert wait_gone(with_cmdline(address)) == []
    assert wait_gone([coordinator_pid(r.stdout)]) == []     # the coordinator is gone too
    assert port_closed(address)


def test_pathways_run_passes_on_the_exit_code_of_a_crash(client_script):
    r = subprocess.run(RUN + ["--devices-per-host", "2", str(client_script), "crash"],
                       env=env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 3
    (address,) = lines(r.stdout, "ADDRESS")
    assert wait_gone(with_cmdline(address)) == []
    assert wait_gone([coordinator_pid(r.stdout)]) == []     # the coordinator is gone too
    assert port_closed(address)


def test_a_scripts_own_cluster_shape_under_pathways_run_is_said_to_be_ignored(tmp_path):
    """``pw.init(devices_per_host=4)`` in a script that pathways-run runs on a cluster of
    2-device hosts attaches to that cluster; it used to say nothing, and the script
    failed later on a slice of 4. A warning now names the argument and the cluster's
    shape; a script that asks for the shape the cluster has gets none."""
    p = tmp_path / "shaped.py"
    p.write_text(textwrap.dedent("""
        import sys, warnings, pathways_torch as pw
        warnings.simplefilter("always")
        pw.init(devices_per_host=int(sys.argv[1]))
        print("DEVICES", len(pw.devices()), flush=True)
        pw.shutdown()
    """))
    for asked, warned in (("4", True), ("2", False)):
        r = subprocess.run(RUN + ["--devices-per-host", "2", str(p), asked], env=env(),
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        assert lines(r.stdout, "DEVICES") == ["2"]
        said = re.search(r"shaped\.py:4: UserWarning: pw\.init\(devices_per_host=4\).*"
                         r"ignored\. That cluster has 1 host\(s\) in 1 island\(s\), with 2 "
                         r"device\(s\) each", r.stderr)
        assert bool(said) == warned, r.stderr[-3000:]


EMBEDDED = textwrap.dedent("""
    import os, sys, time, torch
    import pathways_torch as pw
    pw.init(devices_per_host=2)
    s = pw.slice((2,))
    pw.put(torch.ones(2), s).torch()
    print("ADDRESS", pw.client.runtime._state.address, flush=True)
    print("COORDINATOR", *[p.pid for p in pw.client.runtime._state.cluster.procs
                           if "pathways_torch.coordinator" in p.args], flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(300)
""")


def test_interpreter_exit_stops_the_embedded_cluster(tmp_path):
    p = tmp_path / "embedded.py"
    p.write_text(EMBEDDED)
    r = subprocess.run([sys.executable, str(p), "exit"], env=env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (address,) = lines(r.stdout, "ADDRESS")
    assert wait_gone(with_cmdline(address)) == []
    assert wait_gone([coordinator_pid(r.stdout)]) == []     # the coordinator is gone too
    assert port_closed(address)


def test_sigkill_of_the_client_takes_the_cluster_down(tmp_path):
    p = tmp_path / "embedded.py"
    p.write_text(EMBEDDED)
    proc = subprocess.Popen([sys.executable, str(p), "sleep"], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ADDRESS "), line
        address = line.split()[1]
        coord = coordinator_pid(line + proc.stdout.readline())
        assert alive(coord) and coordinators_of(proc.pid) == [coord]
        assert len(with_cmdline(address)) >= 1        # the worker agent
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert wait_gone(with_cmdline(address), timeout=20) == []
    assert wait_gone([coord], timeout=20) == []       # the coordinator too
    assert port_closed(address)


HOLDER = textwrap.dedent("""
    import torch
    import pathways_torch as pw
    pw.init()                                   # PATHWAYS_ADDRESS: the test's cluster
    s = pw.slice((3,))
    pw.put(torch.ones(3), s).torch()
    print("HELD", sum(d.state == "in_use" for d in pw.devices()), flush=True)
    # exits without release or shutdown
""")


def test_a_client_that_exits_loses_its_slices(tmp_path):
    from pathways_torch.client.cluster import LocalCluster
    import pathways_torch as pw
    p = tmp_path / "holder.py"
    p.write_text(HOLDER)
    with LocalCluster(devices_per_host=4) as cluster:
        e = env()
        e["PATHWAYS_ADDRESS"] = cluster.address
        r = subprocess.run([sys.executable, str(p)], env=e, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert lines(r.stdout, "HELD") == ["3"]
        pw.init(cluster.address)
        try:
            import time
            deadline = time.monotonic() + 10
            while any(d.state != "free" for d in pw.devices()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert [d.state for d in pw.devices()] == ["free"] * 4
            assert len(pw.slice((4,)).devices) == 4     # the whole host is usable again
        finally:
            pw.shutdown()


SLEEPER = textwrap.dedent("""
    import os, time, torch
    import pathways_torch as pw
    pw.init()
    s = pw.slice((2,))
    pw.put(torch.ones(2), s).torch()
    print("ADDRESS", os.environ["PATHWAYS_ADDRESS"], flush=True)
    time.sleep(300)
""")


def test_ctrl_c_of_pathways_run_stops_the_script_and_the_cluster(tmp_path):
    p = tmp_path / "sleeper.py"
    p.write_text(SLEEPER)
    proc = subprocess.Popen(RUN + ["--devices-per-host", "2", str(p)], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ADDRESS "), line
        address = line.split()[1]
        assert len(with_cmdline(address)) >= 1       # the worker agent
        (coord,) = coordinators_of(proc.pid)         # the launcher's coordinator
        proc.send_signal(signal.SIGINT)              # what Ctrl-C sends
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code != 0                                 # the script was interrupted
    assert wait_gone(with_cmdline(address)) == []
    assert wait_gone([coord]) == []                  # the coordinator too
    assert port_closed(address)


PID_SLEEPER = textwrap.dedent("""
    import os, time, torch
    import pathways_torch as pw
    pw.init()
    s = pw.slice((2,))
    pw.put(torch.ones(2), s).torch()
    print("PID", os.getpid(), os.environ["PATHWAYS_ADDRESS"], flush=True)
    time.sleep(300)
""")


def test_sigkill_of_pathways_run_ends_the_script_and_the_cluster(tmp_path):
    """A launcher killed outright (SIGKILL: no handler runs, as when a job scheduler
    or the OOM killer ends it) takes its script down too; before, the script ran on
    against a cluster that was gone."""
    p = tmp_path / "sleeper.py"
    p.write_text(PID_SLEEPER)
    proc = subprocess.Popen(RUN + ["--devices-per-host", "2", str(p)], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=ROOT)
    script = None
    try:
        line = proc.stdout.readline()
        assert line.startswith("PID "), line
        pid, address = line.split()[1:]
        script = int(pid)
        (coord,) = coordinators_of(proc.pid)
        assert alive(script)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    try:
        assert wait_gone([script], timeout=20) == []
        assert wait_gone(with_cmdline(address), timeout=20) == []
        assert wait_gone([coord], timeout=20) == []
    finally:
        if script is not None and alive(script):
            os.kill(script, signal.SIGKILL)
