"""The TorchX component (issue 13, parts 1, 2 and the local half of 5).

For real with TorchX's ``local_cwd`` scheduler: ``torchx run`` starts the coordinator,
the workers and the client as separate processes; the client's numbers match plain
torch; every process exits and the app ends SUCCEEDED (FAILED, with the error in the
log, when the client fails); a worker agent killed mid-``fit`` comes back and training
resumes. The ``slurm`` and ``kubernetes`` schedulers cannot run here: their dry runs
(the sbatch script, the Volcano job) are checked structurally, and the commands their
replicas would run are parsed by pathways-run's own parser.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("torchx")

from torchx.runner import get_runner  # noqa: E402

from pathways_torch import launch  # noqa: E402
from pathways_torch.deploy import torchx as component  # noqa: E402

from procs import cmdline, topmost, wait_gone, with_cmdline  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchx(args, tmp_path, **kw):
    """``torchx ARGS`` as a user with this venv activated runs it, from the repo root."""
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    env.pop("PATHWAYS_ADDRESS", None)
    cmd = [os.path.join(BIN, "torchx"), *args]
    if kw.pop("background", False):
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(tmp_path / "torchx.log",
                                "wb"), stderr=subprocess.STDOUT)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=kw.pop("timeout", 600))


def local_run(tmp_path, port, *component_args):
    return ["run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'logs'}", "--wait",
            "--log", "pathways.cluster", "--islands", "2", "--hosts_per_island", "1",
            "--devices_per_host", "2", "--port", str(port), *component_args]


def summary(out: str) -> dict:
    for line in reversed(out.splitlines()):
        _, _, rest = line.partition(" ")
        if rest.startswith("{"):
            return json.loads(rest)
    raise AssertionError(f"no JSON summary in:\n{out[-3000:]}")


def gone(port):
    """No process of the app (they all carry the coordinator's port) is left."""
    return wait_gone(with_cmdline(f"--port {port}") + with_cmdline(f"localhost:{port}"))


def test_local_cwd_runs_the_two_island_recipe_and_matches_torch(tmp_path):
    port = free_port()
    r = torchx(local_run(tmp_path, port, "--script", "recipes/two_islands.py", "--",
                         "--steps", "3", "--check"), tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "job finished: SUCCEEDED" in out
    s = summary(out)
    assert s["match"] and s["max_rel_diff"] <= 1e-4, s
    assert len(s["losses"]) == 3 and s["dcn_bytes"] > 0
    # coordinator, both workers and the client each ran as their own process and
    # ended: the workers were told the cluster shut down
    assert out.count("the cluster is shutting down") == 2
    assert {line.split(" ", 1)[0] for line in out.splitlines()} >= {
        "coordinator/0", "worker/0", "worker/1", "client/0"}
    assert gone(port) == []


def test_a_client_that_fails_fails_the_app_with_its_error_in_the_log(tmp_path):
    script = tmp_path / "bad_client.py"
    script.write_text("import pathways_torch as pw\npw.init()\n"
                      "raise RuntimeError('the client failed on purpose')\n")
    port = free_port()
    r = torchx(local_run(tmp_path, port, "--script", str(script)), tmp_path)
    out = r.stdout + r.stderr
    assert "job finished: FAILED" in out, out[-4000:]
    assert "client/0" in out and "RuntimeError: the client failed on purpose" in out
    assert "exited with code 1" in out                # the reason the cluster shut down
    assert gone(port) == []


def test_a_killed_worker_agent_comes_back_and_fit_resumes(tmp_path):
    port = free_port()
    progress = tmp_path / "progress"
    app = torchx(local_run(tmp_path, port, "--max_restarts", "1", "--script",
                           "tests/deploy_elastic_client.py", "--", "--steps", "12",
                           "--checkpoint-dir", str(tmp_path / "ckpt"),
                           "--progress", str(progress)), tmp_path, background=True)
    log = tmp_path / "torchx.log"
    try:
        deadline = time.monotonic() + 300
        while not (progress.exists() and int(progress.read_text() or 0) >= 3):
            assert app.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        agents = topmost([p for p in with_cmdline(f"--coordinator localhost:{port}")
                          if "pathways_torch.worker" in cmdline(p)
                          and "--island 1 " in cmdline(p)])
        assert len(agents) == 1, agents
        os.kill(agents[0], signal.SIGKILL)
        assert app.wait(400) == 0, log.read_text()[-4000:]
    finally:
        if app.poll() is None:
            app.send_signal(signal.SIGINT)
            app.wait(60)
    out = log.read_text()
    assert "job finished: SUCCEEDED" in out
    assert "starting it again" in out                  # the replica's supervisor
    s = summary(out)
    assert s["restarts"] == 1 and s["match"], s
    assert gone(port) == []



# ------------------------------------------------------------------ dry runs

def app(**kw):
    args = dict(islands=2, hosts_per_island=2, devices_per_host=4, script="train.py",
                token_file="/shared/pathways/token", worker_cpu=16, worker_memMB=65536)
    args.update(kw)
    return component.cluster("--steps", "10", **args)


def test_the_slurm_dry_run_is_one_heterogeneous_job_with_the_coordinator_first(
        tmp_path, monkeypatch):
    info = get_runner().dryrun(app(), "slurm", cfg={})
    req = info.request
    names = list(req.replicas)
    assert names == ["coordinator-0", "worker-0", "worker-1", "worker-2", "worker-3",
                     "client-0"]
    script = req.materialize()
    assert script.count("#SBATCH hetjob") == 5              # 6 het groups, one per replica
    for n, replica in req.replicas.items():
        env = dict(replica.env)
        assert env["PATHWAYS_TOKEN_FILE"] == "/shared/pathways/token"
        assert "PATHWAYS_TOKEN" not in env                  # the token is not in the job
        assert replica.entrypoint == "python"
        argv = list(replica.args)
        assert "SLURM_JOB_NODELIST_HET_GROUP_0" in argv or n.startswith("coordinator")
        if n.startswith("worker"):
            assert env["CPU_NUM_DEVICES"] == "4" and env["PJRT_DEVICE"] == "CPU"
            assert replica.sbatch_opts["cpus-per-task"] == "16"
            # what the replica runs, through pathways-run's parser
            a = _parse(argv, {**env, "SLURM_JOB_NODELIST_HET_GROUP_0": "n1"}, tmp_path,
                       monkeypatch)
            rid = int(n.split("-")[1])
            assert (a.island, a.node_rank) == divmod(rid, 2)
            assert a.coordinator_address == "n1:7000" and a.bind_host == "0.0.0.0"
        if n.startswith("client"):
            a = _parse(argv, {**env, "SLURM_JOB_NODELIST_HET_GROUP_0": "n1"}, tmp_path,
                       monkeypatch)
            assert a.address == "n1:7000" and a.wait_for_hosts == 4
            assert a.shutdown_cluster and a.script == "train.py"
            assert a.script_args == ["--steps", "10"]


def _parse(argv, env, tmp_path, monkeypatch):
    """pathways-run's view of ``python -m pathways_torch ARGS`` under ``env`` (with the
    token file it names replaced by a real one: what the node's shared file holds)."""
    assert argv[:2] == ["-m", "pathways_torch"], argv
    if "PATHWAYS_TOKEN_FILE" in env:
        token = tmp_path / "token"
        token.write_text("s3cret\n")
        env = {**env, "PATHWAYS_TOKEN_FILE": str(token)}
    with monkeypatch.context() as m:
        for k, v in env.items():
            if v is not None:
                m.setenv(k, v)
        return launch.parse(argv[2:])


def test_the_kubernetes_dry_run_mounts_secrets_and_restarts_workers(tmp_path,
                                                                    monkeypatch):
    pytest.importorskip("kubernetes")
    a = app(token_file=None, token_secret="pw-token", tls_secret="pw-tls",
            image="ghcr.io/me/pathways:1", max_restarts=2, pjrt_device="TPU")
    cfg = {"queue": "default", "validate_spec": False}     # no API server to validate with
    job = get_runner().dryrun(a, "kubernetes", cfg=cfg).request.resource
    tasks = job["spec"]["tasks"]
    assert [t["name"] for t in tasks] == ["coordinator-0", "worker-0", "worker-1",
                                          "worker-2", "worker-3", "client-0"]
    assert [t.get("maxRetry", 0) for t in tasks] == [0, 2, 2, 2, 2, 0]
    for t in tasks:
        pod = t["template"]
        spec = pod.spec
        (c,) = spec.containers
        assert c.image == "ghcr.io/me/pathways:1"
        env = {e.name: e.value for e in c.env}
        assert env["PATHWAYS_TOKEN_FILE"] == "/etc/pathways/token/token"
        assert env["PATHWAYS_TLS_CA"] == "/etc/pathways/tls/ca.crt"
        secrets = {v.name: v.secret.secret_name for v in spec.volumes if v.secret}
        assert sorted(secrets.values()) == ["pw-tls", "pw-token"]
        assert not any(v.persistent_volume_claim for v in spec.volumes)
        mounts = {m.name: m.mount_path for m in c.volume_mounts}
        assert {mounts[n] for n in secrets} == {"/etc/pathways/token", "/etc/pathways/tls"}
        if t["name"].startswith("worker"):
            assert env["PJRT_DEVICE"] == "TPU" and "CPU_NUM_DEVICES" not in env
            a = _parse(c.command[1:], {**env, "VC_COORDINATOR_0_HOSTS":
                                       "pw-coordinator-0.pw"}, tmp_path, monkeypatch)
            assert a.coordinator_address == "pw-coordinator-0.pw:7000"
            assert a.max_restarts == 2
            assert c.resources.limits["cpu"] == "16000m"


def test_the_cli_finds_the_component_without_hiding_torchx_builtins(tmp_path):
    r = torchx(["builtins"], tmp_path, timeout=120)
    assert "pathways.cluster" in r.stdout and "dist.ddp" in r.stdout, r.stdout + r.stderr
    r = torchx(["run", "-s", "slurm", "--dryrun", "pathways.cluster", "--islands", "2",
                "--token_file", "/shared/token", "--script", "train.py"], tmp_path,
               timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "#SBATCH hetjob" in r.stdout and "--coordinator-env" in r.stdout


def test_the_component_refuses_arguments_that_cannot_work():
    for kw, message in [
            (dict(islands=0), ">= 1"),
            (dict(script="a.py", m="pkg.main"), "not both"),
            (dict(token_file="/t", token_secret="s"), "not both"),
            (dict(max_restarts=-1), "max_restarts"),
    ]:
        with pytest.raises(ValueError, match=message):
            component.cluster(**kw)
    with pytest.raises(ValueError, match="no --script"):
        component.cluster("--steps", "3")
    # without a token everything binds loopback: one machine only
    roles = component.cluster(script="a.py").roles
    assert [r.name for r in roles] == ["coordinator", "worker", "client"]
    assert "127.0.0.1" in roles[0].args and "127.0.0.1" in roles[1].args
    assert [r.name for r in component.cluster().roles] == ["coordinator", "worker"]
