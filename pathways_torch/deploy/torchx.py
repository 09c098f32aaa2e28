"""A Pathways cluster as a TorchX component: ``torchx run pathways.cluster ...``.

TorchX (``pip install pathways-torch[torchx]``) submits the same component to its
``local_cwd``, ``slurm`` and ``kubernetes`` schedulers. Three roles, the coordinator
first (TorchX's ``${rank0_env}`` names the variable that holds the host of role 0,
replica 0 on every scheduler):

- ``coordinator`` (1 replica): ``pathways-run --coordinator`` on ``--port``;
- ``worker`` (``islands * hosts_per_island`` replicas): ``pathways-run --worker``; a
  replica's island and host index come from its ``${replica_id}``, the coordinator's
  host from ``${rank0_env}``; agents and executors bind port 0, so workers sharing a
  machine (``local_cwd``) never collide; ``--max_restarts`` restarts a dead agent in its
  replica (TorchX's local scheduler restarts nothing) and is the role's ``max_retries``
  where the scheduler restarts replicas (Kubernetes);
- ``client`` (only with ``--script`` or ``--m``): waits until every worker has
  registered, runs the script with ``PATHWAYS_ADDRESS`` set, then shuts the cluster
  down, so every process exits and the app ends SUCCEEDED, or FAILED with the
  script's error in its log. Without it the cluster serves clients until cancelled
  (``torchx cancel``); attach with ``pathways-run --address HOST:PORT script.py``.

A cluster that spans machines needs a token: ``--token_file`` (a path every node can
read) or ``--token_secret`` (a Kubernetes Secret with the key ``token``); the token
itself never appears in the job. Without one everything binds loopback (one machine).

Example::

    torchx run -s local_cwd pathways.cluster --islands 2 --devices_per_host 2 \\
        --script recipes/two_islands.py -- --steps 3
    torchx run -s slurm pathways.cluster --islands 2 --hosts_per_island 4 \\
        --token_file ~/.pathways/token --script train.py
"""

from typing import Dict, Optional

import torchx.specs as specs

DEFAULT_PORT = 7000
TOKEN_DIR = "/etc/pathways/token"       # where --token_secret is mounted
TLS_DIR = "/etc/pathways/tls"           # where --tls_secret is mounted
LAUNCHER = ["-m", "pathways_torch"]      # pathways-run, as arguments of --python


def _secret_mount(role: specs.Role, secret: str, path: str) -> None:
    """Mount Kubernetes Secret ``secret`` at ``path`` in ``role``'s pods.

    TorchX has no secret mount: a VolumeMount makes the pod's volume and the container's
    mount, and the pod overlay swaps the volume's claim for the Secret."""
    from torchx.specs.overlays import JOIN, set_overlay
    volume = f"mount-{len(role.mounts)}"          # the name TorchX gives that volume
    role.mounts.append(specs.VolumeMount(src=secret, dst_path=path, read_only=True))
    set_overlay(role, "kubernetes", "V1Pod", {"spec": {JOIN("volumes", on="name"): [
        {"name": volume, "persistentVolumeClaim": None,
         "secret": {"secretName": secret}}]}})


def cluster(
    *script_args: str,
    islands: int = 1,
    hosts_per_island: int = 1,
    devices_per_host: int = 8,
    script: Optional[str] = None,
    m: Optional[str] = None,
    image: str = "pathways-torch:latest",
    name: str = "pathways",
    port: int = DEFAULT_PORT,
    python: str = "python",
    pjrt_device: str = "CPU",
    coordinator_cpu: int = 2,
    coordinator_memMB: int = 4096,
    worker_cpu: int = 8,
    worker_gpu: int = 0,
    worker_memMB: int = 32768,
    worker_h: Optional[str] = None,
    client_cpu: int = 4,
    client_memMB: int = 16384,
    token_file: Optional[str] = None,
    token_secret: Optional[str] = None,
    tls_dir: Optional[str] = None,
    tls_secret: Optional[str] = None,
    memory_budget: Optional[str] = None,
    max_restarts: int = 0,
    register_timeout: int = 300,
    env: Optional[Dict[str, str]] = None,
) -> specs.AppDef:
    """A Pathways cluster: a coordinator, one worker per host, and a client script.

    Args:
        script_args: arguments of the client script (after ``--``)
        islands: islands of hosts (each island's devices form slices)
        hosts_per_island: worker hosts per island
        devices_per_host: accelerator devices per worker host (CPU devices on CPU XLA)
        script: the client script; omit it (and --m) for a cluster that serves clients
            until cancelled
        m: the client as a module (python -m), instead of --script
        image: container image (kubernetes; local_cwd and slurm run from the current
            directory)
        name: the app's name
        port: the coordinator's port
        python: the Python that has pathways_torch installed, on every node
        pjrt_device: PJRT_DEVICE of the workers (CPU, TPU, CUDA)
        coordinator_cpu: CPUs of the coordinator
        coordinator_memMB: memory of the coordinator (MB)
        worker_cpu: CPUs per worker host
        worker_gpu: GPUs per worker host
        worker_memMB: memory per worker host (MB)
        worker_h: a TorchX named resource for the workers (overrides worker_cpu/gpu/memMB)
        client_cpu: CPUs of the client
        client_memMB: memory of the client (MB)
        token_file: a file every node can read holding the cluster token (slurm, local)
        token_secret: a Kubernetes Secret holding the token under the key 'token'
        tls_dir: a directory every node can read with tls.crt, tls.key, ca.crt (mutual TLS)
        tls_secret: a Kubernetes Secret with tls.crt, tls.key and ca.crt
        memory_budget: bytes of device buffers per worker host, e.g. 48G
        max_restarts: times a dead worker agent is started again (it registers as the
            replacement and Trainer.fit(max_restarts=) resumes)
        register_timeout: seconds workers and the client wait for the cluster to form
        env: extra environment variables for every role
    """
    if islands < 1 or hosts_per_island < 1 or devices_per_host < 1:
        raise ValueError("islands, hosts_per_island and devices_per_host must be >= 1")
    if script and m:
        raise ValueError("give the client as --script PATH or --m MODULE, not both")
    if token_file and token_secret:
        raise ValueError("give the token as --token_file or --token_secret, not both")
    if tls_dir and tls_secret:
        raise ValueError("give TLS files as --tls_dir or --tls_secret, not both")
    if max_restarts < 0:
        raise ValueError("max_restarts must be >= 0")
    if script_args and not (script or m):
        raise ValueError(f"script arguments {list(script_args)} but no --script or --m")

    hosts = islands * hosts_per_island
    bind = "0.0.0.0" if (token_file or token_secret) else "127.0.0.1"
    common = {"PYTHONUNBUFFERED": "1", **(env or {})}
    if token_file:
        common["PATHWAYS_TOKEN_FILE"] = token_file
    elif token_secret:
        common["PATHWAYS_TOKEN_FILE"] = f"{TOKEN_DIR}/token"
    tls = tls_dir or (TLS_DIR if tls_secret else None)
    if tls:
        common.update(PATHWAYS_TLS_CERT=f"{tls}/tls.crt", PATHWAYS_TLS_KEY=f"{tls}/tls.key",
                      PATHWAYS_TLS_CA=f"{tls}/ca.crt")
    find = ["--coordinator-env", specs.macros.rank0_env, "--port", str(port)]

    coordinator = specs.Role(
        name="coordinator", image=image, entrypoint=python,
        args=LAUNCHER + ["--coordinator", "--host", bind, "--port", str(port)],
        env=dict(common), port_map={"grpc": port},
        resource=specs.resource(cpu=coordinator_cpu, memMB=coordinator_memMB))
    worker_args = LAUNCHER + [
        "--worker", *find, "--replica-id", specs.macros.replica_id,
        "--hosts-per-island", str(hosts_per_island),
        "--devices-per-host", str(devices_per_host), "--bind-host", bind,
        "--register-timeout", str(register_timeout)]
    if max_restarts:
        worker_args += ["--max-restarts", str(max_restarts)]
    if memory_budget:
        worker_args += ["--memory-budget", memory_budget]
    worker_env = dict(common, PJRT_DEVICE=pjrt_device)
    if pjrt_device == "CPU":
        worker_env["CPU_NUM_DEVICES"] = str(devices_per_host)
    worker = specs.Role(
        name="worker", image=image, entrypoint=python, args=worker_args, env=worker_env,
        num_replicas=hosts, max_retries=max_restarts,
        resource=specs.resource(cpu=worker_cpu, gpu=worker_gpu, memMB=worker_memMB,
                                h=worker_h))
    roles = [coordinator, worker]
    if script or m:
        program = ["-m", m] if m else [script]
        roles.append(specs.Role(
            name="client", image=image, entrypoint=python,
            args=LAUNCHER + [*find, "--wait-for-hosts", str(hosts),
                                      "--register-timeout", str(register_timeout),
                                      "--shutdown-cluster", *program, *script_args],
            env=dict(common),
            resource=specs.resource(cpu=client_cpu, memMB=client_memMB)))
    for role in roles:
        if token_secret:
            _secret_mount(role, token_secret, TOKEN_DIR)
        if tls_secret:
            _secret_mount(role, tls_secret, TLS_DIR)
    return specs.AppDef(name=name, roles=roles)
