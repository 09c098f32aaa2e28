"""The Kubernetes JobSet of a cluster (issue 13, part 4), checked without a cluster.

What cannot run here (an API server with the JobSet controller, DNS, images) is not
pretended: the manifest is compared with a golden file, each embedded Job template is
validated against the Kubernetes batch/v1 schema (kubernetes-validate, offline), and the
commands the pods run are parsed by pathways-run's own parser with the environment the
downward API would give them.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import kubernetes_validate
import pytest

from pathways_torch import launch
from pathways_torch.deploy import jobset

GOLDEN = pathlib.Path(__file__).parent / "golden" / "jobset.json"
K8S = "1.33"


def make(**kw):
    args = dict(token_secret="pw-token", tls_secret="pw-tls",
                worker_resources={"cpu": "16", "memory": "64Gi"},
                coordinator_resources={"cpu": "2", "memory": "4Gi"}, memory_budget="48G")
    args.update(kw)
    return jobset.manifest("pw", 2, 4, 8, "ghcr.io/me/pathways:1", **args)


def test_the_manifest_matches_its_golden_file():
    m = make()
    if os.environ.get("PATHWAYS_REGEN_GOLDEN"):
        GOLDEN.write_text(json.dumps(m, indent=2) + "\n")
    assert m == json.loads(GOLDEN.read_text()), (
        "the JobSet changed; if on purpose, rerun with PATHWAYS_REGEN_GOLDEN=1")


def test_roles_order_replicas_and_discovery():
    spec = make()["spec"]
    coord, workers = spec["replicatedJobs"]
    assert (coord["name"], coord["replicas"]) == ("coordinator", 1)       # first: InOrder
    assert (workers["name"], workers["replicas"]) == ("workers", 2)       # a Job per island
    job = workers["template"]["spec"]
    assert job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"] == 4                  # a pod per host
    assert spec["startupPolicy"] == {"startupPolicyOrder": "InOrder"}
    assert spec["network"]["enableDNSHostnames"] and spec["network"]["publishNotReadyAddresses"]
    assert spec["coordinator"] == {"replicatedJob": "coordinator", "jobIndex": 0, "podIndex": 0}
    env = {e["name"]: e for e in job["template"]["spec"]["containers"][0]["env"]}
    path = lambda n: env[n]["valueFrom"]["fieldRef"]["fieldPath"]  # noqa: E731
    assert path("PATHWAYS_COORDINATOR_HOST") == \
        "metadata.labels['jobset.sigs.k8s.io/coordinator']"
    assert path("PATHWAYS_ISLAND") == "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    assert path("NODE_RANK") == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert path("PATHWAYS_ADVERTISE_HOST") == "status.podIP"
    assert jobset.client_address("pw") == "pw-coordinator-0-0.pw:7000"


def test_secrets_are_referenced_never_inlined():
    m = make()
    text = json.dumps(m)
    for job in m["spec"]["replicatedJobs"]:
        pod = job["template"]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        token = next(e for e in c["env"] if e["name"] == "PATHWAYS_TOKEN")
        assert token == {"name": "PATHWAYS_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "pw-token", "key": "token"}}}
        assert pod["volumes"] == [{"name": "tls", "secret": {"secretName": "pw-tls"}}]
        assert c["volumeMounts"][0]["mountPath"] == jobset.TLS_DIR
        port = c["ports"][0]["containerPort"]
        assert c["readinessProbe"]["tcpSocket"]["port"] == port
        assert c["livenessProbe"]["tcpSocket"]["port"] == port
        assert c["resources"]["requests"] == c["resources"]["limits"]
    assert '"value": "s' not in text.replace('"value": "status', "")      # no secret value
    with pytest.raises(jobset.JobSetError, match="needs a token"):
        make(token_secret="")


@pytest.mark.parametrize("tls", ["", "pw-tls"])
def test_every_job_template_is_a_valid_kubernetes_job(tls):
    for job in make(tls_secret=tls)["spec"]["replicatedJobs"]:
        obj = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": job["name"]},
               **job["template"]}
        kubernetes_validate.validate(obj, K8S, strict=True)


def test_the_pods_commands_parse_as_pathways_run_would_see_them(monkeypatch):
    spec = make()["spec"]
    coord, workers = (j["template"]["spec"]["template"]["spec"]["containers"][0]
                      for j in spec["replicatedJobs"])
    a = launch.parse(coord["command"][1:])
    assert a.coordinator and a.host == "0.0.0.0" and a.port == 7000
    # the environment the downward API gives island 1's third host
    monkeypatch.setenv("PATHWAYS_COORDINATOR_HOST", "pw-coordinator-0-0.pw")
    monkeypatch.setenv("PATHWAYS_ISLAND", "1")
    monkeypatch.setenv("NODE_RANK", "2")
    monkeypatch.setenv("PATHWAYS_TOKEN", "s3cret")       # from the token Secret
    a = launch.parse(workers["command"][1:])
    assert a.worker and a.coordinator_address == "pw-coordinator-0-0.pw:7000"
    assert (a.island, a.node_rank, a.devices_per_host) == (1, 2, 8)
    assert a.bind_host == "0.0.0.0" and a.agent_port == jobset.AGENT_PORT
    monkeypatch.delenv("PATHWAYS_COORDINATOR_HOST")
    with pytest.raises(SystemExit):
        launch.parse(workers["command"][1:])          # says the variable is not set


def test_the_command_line_prints_json_and_refuses_without_a_token():
    cmd = [sys.executable, "-m", "pathways_torch.deploy.jobset", "--islands", "2",
           "--hosts-per-island", "4", "--devices-per-host", "8", "--image", "img:1"]
    r = subprocess.run(cmd + ["--token-secret", "t"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kind"] == "JobSet"
    assert "pathways-coordinator-0-0.pathways:7000" in r.stderr
    import yaml
    y = subprocess.run(cmd + ["--token-secret", "t", "--yaml"], capture_output=True,
                       text=True, timeout=120)
    assert yaml.safe_load(y.stdout) == json.loads(r.stdout)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--token-secret" in r.stderr
