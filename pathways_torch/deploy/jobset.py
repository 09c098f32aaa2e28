"""A Pathways cluster as a Kubernetes JobSet: ``python -m pathways_torch.deploy.jobset``.

Pathways on Cloud deploys the same way: a ``coordinator`` replicated job (one pod: the
resource manager and gang scheduler) and a ``workers`` replicated job with one Indexed
Job per island, one pod per host. Pods find each other without a service of ours:

- the JobSet ``coordinator`` field labels every pod with the coordinator pod's stable
  DNS name (``jobset.sigs.k8s.io/coordinator``), which the downward API hands to
  ``pathways-run --coordinator-env``;
- a worker's island is its Job's index in the JobSet (annotation
  ``jobset.sigs.k8s.io/job-index``) and its host index the Job's completion index, read
  the same way (``PATHWAYS_ISLAND``, ``NODE_RANK``);
- each worker advertises its pod IP (``PATHWAYS_ADVERTISE_HOST``);
- ``network.enableDNSHostnames`` with ``publishNotReadyAddresses`` makes the names
  resolve before the pods are ready, and ``startupPolicy: InOrder`` starts the workers
  once the coordinator runs.

The cluster token (and TLS files) come from Secrets, never from the manifest: the
manifest names them. Probes are TCP checks on the gRPC ports (the servers do not
implement gRPC health checking). Clients in the cluster (or port-forwarded) connect to
``<name>-coordinator-0-0.<name>:<port>``.

Example::

    python -m pathways_torch.deploy.jobset --islands 2 --hosts-per-island 4 \\
        --devices-per-host 8 --image ghcr.io/me/pathways:latest --token-secret pw-token \\
        | kubectl apply -f -

The output is JSON, which kubectl reads as YAML (``--yaml`` writes YAML with PyYAML).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
COORDINATOR_LABEL = "jobset.sigs.k8s.io/coordinator"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
TLS_DIR = "/etc/pathways/tls"
AGENT_PORT = 7001


class JobSetError(ValueError):
    """The arguments cannot make a working cluster; the message says what to change."""


def _field(path: str) -> dict:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def _resources(spec: Dict[str, str]) -> dict:
    return {"requests": dict(spec), "limits": dict(spec)} if spec else {}


def _probe(port: int, period: int) -> dict:
    return {"tcpSocket": {"port": port}, "periodSeconds": period, "failureThreshold": 3}


def _secrets(token_secret: str, tls_secret: str) -> tuple:
    """Env entries and volumes for the token and TLS Secrets (names only)."""
    env: List[dict] = [{"name": "PATHWAYS_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": token_secret, "key": "token"}}}]
    volumes: List[dict] = []
    mounts: List[dict] = []
    if tls_secret:
        env += [{"name": "PATHWAYS_TLS_CERT", "value": f"{TLS_DIR}/tls.crt"},
                {"name": "PATHWAYS_TLS_KEY", "value": f"{TLS_DIR}/tls.key"},
                {"name": "PATHWAYS_TLS_CA", "value": f"{TLS_DIR}/ca.crt"}]
        volumes.append({"name": "tls", "secret": {"secretName": tls_secret}})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    return env, volumes, mounts


def _job(container: dict, volumes: list, completions: int,
         indexed: bool) -> dict:
    pod = {"restartPolicy": "OnFailure", "containers": [container]}
    if volumes:
        pod["volumes"] = volumes
    spec = {"parallelism": completions, "completions": completions,
            "backoffLimit": 6 * completions, "template": {"spec": pod}}
    if indexed:
        spec["completionMode"] = "Indexed"
    return {"spec": spec}


def manifest(name: str, islands: int, hosts_per_island: int, devices_per_host: int,
             image: str, *, token_secret: str, tls_secret: str = "", port: int = 7000,
             pjrt_device: str = "CPU", memory_budget: str = "",
             coordinator_resources: Optional[Dict[str, str]] = None,
             worker_resources: Optional[Dict[str, str]] = None,
             namespace: str = "", max_restarts: int = 0) -> dict:
    """The JobSet for ``islands`` x ``hosts_per_island`` hosts, as a dict.

    Example::

        m = manifest("pw", 2, 4, 8, "img:1", token_secret="pw-token")
        [j["name"] for j in m["spec"]["replicatedJobs"]]     # ['coordinator', 'workers']
    """
    if islands < 1 or hosts_per_island < 1 or devices_per_host < 1:
        raise JobSetError("islands, hosts per island and devices per host must be >= 1")
    if not token_secret:
        raise JobSetError(
            "a cluster that listens beyond loopback needs a token: create a Secret with a "
            "key 'token' (kubectl create secret generic pw-token "
            "--from-literal=token=$(openssl rand -hex 16)) and pass --token-secret pw-token")
    if not image:
        raise JobSetError("give the container image: --image REPO/NAME:TAG")
    secret_env, volumes, mounts = _secrets(token_secret, tls_secret)

    coordinator = {
        "name": "coordinator", "image": image,
        "command": ["pathways-run", "--coordinator", "--host", "0.0.0.0",
                    "--port", str(port)],
        "env": secret_env,
        # workers' heartbeats come as UDP datagrams to the same port number
        "ports": [{"name": "grpc", "containerPort": port},
                  {"name": "beats", "containerPort": port, "protocol": "UDP"}],
        "readinessProbe": _probe(port, 5), "livenessProbe": _probe(port, 10),
    }
    worker_cmd = ["pathways-run", "--worker", "--coordinator-env",
                  "PATHWAYS_COORDINATOR_HOST", "--port", str(port),
                  "--devices-per-host", str(devices_per_host), "--bind-host", "0.0.0.0",
                  "--agent-port", str(AGENT_PORT)]
    if memory_budget:
        worker_cmd += ["--memory-budget", memory_budget]
    worker_env = [
        {"name": "PATHWAYS_COORDINATOR_HOST", **_field(f"metadata.labels['{COORDINATOR_LABEL}']")},
        {"name": "PATHWAYS_ISLAND", **_field(f"metadata.annotations['{JOB_INDEX}']")},
        {"name": "NODE_RANK", **_field(f"metadata.annotations['{COMPLETION_INDEX}']")},
        {"name": "PATHWAYS_ADVERTISE_HOST", **_field("status.podIP")},
        {"name": "PJRT_DEVICE", "value": pjrt_device},
    ]
    if pjrt_device == "CPU":
        worker_env.append({"name": "CPU_NUM_DEVICES", "value": str(devices_per_host)})
    worker = {
        "name": "worker", "image": image, "command": worker_cmd,
        "env": worker_env + secret_env,
        "ports": [{"name": "agent", "containerPort": AGENT_PORT}],
        "readinessProbe": _probe(AGENT_PORT, 5), "livenessProbe": _probe(AGENT_PORT, 10),
    }
    for c, res in ((coordinator, coordinator_resources), (worker, worker_resources)):
        if res:
            c["resources"] = _resources(res)
        if mounts:
            c["volumeMounts"] = mounts

    meta = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    return {
        "apiVersion": JOBSET_API, "kind": "JobSet", "metadata": meta,
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True,
                        "subdomain": name},
            "startupPolicy": {"startupPolicyOrder": "InOrder"},
            "coordinator": {"replicatedJob": "coordinator", "jobIndex": 0, "podIndex": 0},
            "failurePolicy": {"maxRestarts": max_restarts},
            "replicatedJobs": [
                {"name": "coordinator", "replicas": 1,
                 "template": _job(coordinator, volumes, 1, indexed=False)},
                {"name": "workers", "replicas": islands,
                 "template": _job(worker, volumes, hosts_per_island, indexed=True)},
            ],
        },
    }


def client_address(name: str, port: int = 7000) -> str:
    """Where clients in the cluster reach the coordinator of JobSet ``name``."""
    return f"{name}-coordinator-0-0.{name}:{port}"


def _pairs(text: str) -> Dict[str, str]:
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise JobSetError(f"resources are KEY=VALUE,...: {item!r} is not")
        out[key] = value
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pathways_torch.deploy.jobset",
                                 description="Print a JobSet manifest for a Pathways "
                                 "cluster (kubectl apply -f -).")
    ap.add_argument("--name", default="pathways")
    ap.add_argument("--namespace", default="")
    ap.add_argument("--islands", type=int, default=1)
    ap.add_argument("--hosts-per-island", type=int, default=1)
    ap.add_argument("--devices-per-host", type=int, default=8)
    ap.add_argument("--image", required=True)
    ap.add_argument("--port", type=int, default=7000, help="the coordinator's port")
    ap.add_argument("--token-secret", default="",
                    help="a Secret holding the cluster token under the key 'token'")
    ap.add_argument("--tls-secret", default="",
                    help="a Secret with tls.crt, tls.key and ca.crt (mutual TLS)")
    ap.add_argument("--pjrt-device", default="CPU", help="PJRT_DEVICE of the workers")
    ap.add_argument("--memory-budget", default="", help="bytes of buffers per host, e.g. 48G")
    ap.add_argument("--coordinator-resources", default="cpu=2,memory=4Gi")
    ap.add_argument("--worker-resources", default="",
                    help="e.g. cpu=16,memory=64Gi,google.com/tpu=4")
    ap.add_argument("--max-restarts", type=int, default=0,
                    help="JobSet failurePolicy: times the whole JobSet may be recreated")
    ap.add_argument("--yaml", action="store_true", help="YAML instead of JSON (PyYAML)")
    args = ap.parse_args(argv)
    try:
        m = manifest(args.name, args.islands, args.hosts_per_island, args.devices_per_host,
                     args.image, token_secret=args.token_secret, tls_secret=args.tls_secret,
                     port=args.port, pjrt_device=args.pjrt_device,
                     memory_budget=args.memory_budget,
                     coordinator_resources=_pairs(args.coordinator_resources),
                     worker_resources=_pairs(args.worker_resources),
                     namespace=args.namespace, max_restarts=args.max_restarts)
    except JobSetError as e:
        print(f"jobset: {e}", file=sys.stderr)
        return 2
    if args.yaml:
        import yaml
        sys.stdout.write(yaml.safe_dump(m, sort_keys=False))
    else:
        sys.stdout.write(json.dumps(m, indent=2) + "\n")
    print(f"# clients connect to {client_address(args.name, args.port)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
