"""``make test-slurm``: a real Slurm cluster on this one machine, and Pathways on it.

Needs root, changes the machine while it runs, and takes several minutes, so it is not
part of ``make test`` (pytest does not collect this file: its name is not test_*.py).

1. Installs Debian's ``slurm-wlm`` and ``munge`` with apt-get if they are missing
   (Slurm 22.05 on Debian 12); no service is started by the install.
2. Writes ``/etc/slurm/slurm.conf`` for 4 emulated nodes n1..n4 on this machine (each a
   ``slurmd -N nX`` on its own port, ``NodeAddr=127.0.0.1``; the names in /etc/hosts),
   starts a private munged (its own key and socket under the work folder), slurmctld
   and the 4 slurmd, and waits until ``sinfo`` shows the nodes idle.
3. Runs Pathways through Slurm three ways, 2 islands x 1 host x 2 CPU devices with a
   token file, each timed from submission to the client's first step and to the end:

   - ``sbatch``: ``deploy/slurm/pathways.sbatch recipes/two_islands.py --steps 3
     --check`` on 3 nodes; the job must exit 0 and print the JSON summary with
     ``final_loss`` and ``torch_final_loss`` (``--check`` trains plain torch alongside);
   - ``torchx``: ``torchx run -s slurm --wait pathways_torch/deploy/torchx.py:cluster``
     from the repo with .venv on PATH (a heterogeneous job, one group per replica: 4
     nodes); the app must end SUCCEEDED (``torchx status``) with the same summary in the
     client's output. TorchX gets a ``squeue`` shim first on PATH (SQUEUE_SHIM says why:
     TorchX fails on Slurm 22.05's ``squeue --json`` for a pending job;
     ``--no-squeue-shim`` shows it);
   - ``elastic``: ``tests/deploy_elastic_client.py`` through the sbatch script; once it
     reports step >= 3 the agent process of island 1 is SIGKILLed (only the processes of
     that job, found by their command line and SLURM_JOB_ID), its ``pathways-run
     --max-restarts`` starts it again, and the job must end 0 with ``restarts == 1`` and
     ``match`` true. Skipped, with a note, when the client script is missing.

   The jobs get a TMPDIR of their own under the work folder; what they leave there is
   listed in the results (``jobs_left_in_tmpdir``), then removed.
4. Whatever happens (an error, Ctrl-C, SIGTERM): cancels the jobs, stops every daemon it
   started, kills what is left of its processes (by pid: every process whose environment
   carries this run's marker, or that works in the work folder, as slurmstepd does),
   restores /etc/slurm/slurm.conf and /etc/hosts, and removes its work folder. A run
   killed with SIGKILL leaves its marks, and the next run cleans them up first, so it is
   rerunnable; a fresh machine of this kind needs nothing else.

Results go to ``bench/slurm.json`` (bench/report.py puts them in docs/evaluation.md),
the jobs' outputs and the daemons' logs to ``bench/out/slurm/`` (git-ignored).

    make test-slurm                          # as root: .venv/bin/python tests/slurm/harness.py
    .venv/bin/python tests/slurm/harness.py --only sbatch     # one check (repeatable)
    .venv/bin/python tests/slurm/harness.py --keep-up   # leave the cluster up at the end
                                                        # (Enter tears it down)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = ROOT / ".venv" / "bin" / "python"
TORCHX = ROOT / ".venv" / "bin" / "torchx"
TORCHX_PIN = "torchx-nightly==2026.10.26"
SBATCH_SCRIPT = ROOT / "deploy" / "slurm" / "pathways.sbatch"
ELASTIC_CLIENT = ROOT / "tests" / "deploy_elastic_client.py"
COMPONENT = ROOT / "pathways_torch" / "deploy" / "torchx.py"
RESULTS = ROOT / "bench" / "slurm.json"
LOGS = ROOT / "bench" / "out" / "slurm"

WORK = Path("/tmp/pathways-test-slurm")       # fixed: a killed run's leftovers are found
MARK = "pathways-test-slurm"                  # on the lines/files it writes outside WORK
ENV_MARK = "PATHWAYS_TEST_SLURM_RUN"          # in the environment of all it starts
SLURM_CONF = Path("/etc/slurm/slurm.conf")
HOSTS = Path("/etc/hosts")
NODES = ["n1", "n2", "n3", "n4"]
CLUSTER = "pwtest"
PACKAGES = ["slurm-wlm", "munge"]
NODE_CPUS = 8
NODE_MEM_MB = 1000
JOB_LIMIT_MIN = 20                            # Slurm's time limit on every job
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}

T0 = time.monotonic()
WORK_IS_OURS = False                          # set once this run has made WORK
RUN_ID = f"{os.getpid()}-{secrets.token_hex(4)}"


class Failed(Exception):
    """A check or a stage failed; the message says what was seen."""


def say(msg: str) -> None:
    print(f"[test-slurm {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def stage(title: str) -> None:
    print(f"\n[test-slurm {time.monotonic() - T0:6.1f}s] ==== {title}", flush=True)


def run(cmd, check=True, timeout=120, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise Failed(f"{' '.join(map(str, cmd))} exited {r.returncode}:\n"
                     f"{(r.stdout + r.stderr).strip()[-3000:]}")
    return r


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"({path}: {e.strerror})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ processes, by pid

def proc_env(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def proc_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") \
            .decode(errors="replace").strip()
    except OSError:
        return ""


def pids() -> list:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def ancestors() -> set:
    """This process and its ancestors (never to be killed by a sweep)."""
    out, pid = set(), os.getpid()
    while pid > 1:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_pids(victims, sig=signal.SIGTERM, wait_s=10.0) -> list:
    """Signal ``victims``; SIGKILL those still there after ``wait_s``. Returns them."""
    victims = [p for p in victims if alive(p)]
    for p in victims:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(alive(p) for p in victims):
        time.sleep(0.2)
    for p in victims:
        if alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return victims


def proc_cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd").removesuffix(" (deleted)")
    except OSError:
        return ""


def marked_processes(other_runs_only: bool) -> list:
    """Our processes, never this one or its ancestors: those whose environment carries a
    run's marker (the daemons, the jobs' tasks, torchx), and those working in WORK
    (slurmstepd clears its environment, but works in the slurmd's log folder). With
    ``other_runs_only``, those of earlier runs only."""
    keep = ancestors()
    out = []
    for pid in pids():
        if pid in keep:
            continue
        run_id = proc_env(pid).get(ENV_MARK)
        cwd = proc_cwd(pid)
        in_work = cwd == str(WORK) or cwd.startswith(f"{WORK}/")
        if run_id is None and not in_work:
            continue
        if other_runs_only and (run_id == RUN_ID or (run_id is None and WORK_IS_OURS)):
            continue
        if alive(pid):
            out.append(pid)
    return out


def foreign_slurm_daemons() -> list:
    """slurmctld/slurmd/slurmdbd processes that are not ours (we would collide)."""
    out = []
    for pid in pids():
        cmd = proc_cmdline(pid)
        name = os.path.basename(cmd.split(" ", 1)[0]) if cmd else ""
        if name in ("slurmctld", "slurmd", "slurmdbd") and ENV_MARK not in proc_env(pid):
            out.append(f"{pid} {cmd}")
    return out


# ------------------------------------------------------------------ machine state

class Machine:
    """What this run changed outside WORK, restored by ``restore()`` (idempotent)."""

    def __init__(self):
        self.hosts_before: bytes | None = None
        self.hosts_after: bytes | None = None
        self.daemon_pids: dict = {}               # name -> pid, in start order

    # -- stale state of a run that was killed before it could clean up
    @staticmethod
    def clean_stale() -> None:
        stale = marked_processes(other_runs_only=True)
        if stale:
            say(f"a previous run left processes behind: {len(stale)}; killing them "
                f"(pids {stale[:12]}{' ...' if len(stale) > 12 else ''})")
            kill_pids(stale, signal.SIGKILL, wait_s=5)
        backup = WORK / "backup" / "slurm.conf"
        if backup.exists():
            say(f"restoring {SLURM_CONF} from a previous run's backup")
            shutil.copy2(backup, SLURM_CONF)
        elif SLURM_CONF.exists() and MARK in SLURM_CONF.read_text(errors="replace"):
            say(f"removing the {SLURM_CONF} a previous run left")
            SLURM_CONF.unlink()
        text = HOSTS.read_text()
        if MARK in text:
            say(f"removing a previous run's lines from {HOSTS}")
            HOSTS.write_text("".join(ln for ln in text.splitlines(keepends=True)
                                     if MARK not in ln))
        if WORK.exists():
            shutil.rmtree(WORK, ignore_errors=True)

    def write_hosts(self) -> None:
        self.hosts_before = HOSTS.read_bytes()
        sep = b"" if self.hosts_before.endswith(b"\n") or not self.hosts_before else b"\n"
        line = f"127.0.0.1 {' '.join(NODES)}  # {MARK}: emulated Slurm nodes\n".encode()
        self.hosts_after = self.hosts_before + sep + line
        HOSTS.write_bytes(self.hosts_after)         # in place: /etc/hosts may be a mount

    def write_slurm_conf(self, text: str) -> None:
        SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        if SLURM_CONF.exists():
            (WORK / "backup").mkdir(parents=True, exist_ok=True)
            shutil.copy2(SLURM_CONF, WORK / "backup" / "slurm.conf")
        SLURM_CONF.write_text(text)

    def restore(self) -> None:
        backup = WORK / "backup" / "slurm.conf"
        if backup.exists():
            shutil.copy2(backup, SLURM_CONF)
            backup.unlink()
            say(f"restored {SLURM_CONF}")
        elif SLURM_CONF.exists() and MARK in SLURM_CONF.read_text(errors="replace"):
            SLURM_CONF.unlink()
            say(f"removed {SLURM_CONF}")
        if self.hosts_before is not None:
            now = HOSTS.read_bytes()
            if now == self.hosts_after:
                HOSTS.write_bytes(self.hosts_before)
            else:                                   # someone else edited it meanwhile
                HOSTS.write_text("".join(ln for ln in now.decode().splitlines(True)
                                         if MARK not in ln))
            self.hosts_before = None
            say(f"restored {HOSTS}")


# ------------------------------------------------------------------ install

def installed(pkg: str) -> bool:
    r = run(["dpkg-query", "-W", "-f=${Status}", pkg], check=False)
    return r.returncode == 0 and "install ok installed" in r.stdout


def ensure_packages() -> None:
    missing = [p for p in PACKAGES if not installed(p)]
    if not missing:
        say(f"{' and '.join(PACKAGES)} already installed")
        return
    say(f"apt-get install {' '.join(missing)} (no service is started by the install)")
    policy = Path("/usr/sbin/policy-rc.d")      # tells invoke-rc.d to start nothing
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text(f"#!/bin/sh\n# {MARK}: temporary\nexit 101\n")
        policy.chmod(0o755)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends"] + missing
        r = run(cmd, check=False, timeout=900, env=env)
        if r.returncode != 0:
            say("apt-get install failed; apt-get update and again")
            run(["apt-get", "update", "-q"], timeout=600, env=env)
            run(cmd, timeout=900, env=env)
    finally:
        if made_policy:
            policy.unlink()
    still = [p for p in PACKAGES if not installed(p)]
    if still:
        raise Failed(f"apt-get did not install {still}")


def ensure_torchx() -> None:
    if TORCHX.exists():
        return
    say(f"{TORCHX} missing: pip install {TORCHX_PIN} into .venv")
    run([str(PY), "-m", "pip", "install", "-q", TORCHX_PIN], timeout=900)


# ------------------------------------------------------------------ the cluster

def slurm_conf(ports: dict) -> str:
    nodes = "\n".join(
        f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={n} Port={ports[n]} "
        f"CPUs={NODE_CPUS} RealMemory={NODE_MEM_MB} State=UNKNOWN" for n in NODES)
    w = WORK
    return f"""\
# {MARK}: written by tests/slurm/harness.py (make test-slurm) for the length of its run;
# it restores the previous file (or removes this one) when it ends.
ClusterName={CLUSTER}
SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)
SlurmctldPort={ports['ctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# our own munged: its socket (and key) are under the work folder
AuthInfo=socket={w}/munge/munge.sock
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool/%n
SlurmctldPidFile={w}/run/slurmctld.pid
SlurmdPidFile={w}/run/slurmd-%n.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: track processes by parentage, bind nothing
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
# heterogeneous jobs (TorchX) start only in the backfill pass: run it every second
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# no slurmdbd: finished jobs stay visible to squeue/scontrol for an hour instead
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=3600
# 4 nodes on one 2-core machine: slurmd takes the node sizes below as given. 8 CPUs:
# the TorchX component asks for --cpus-per-task=8 per worker by default. 1000 MB: at or
# under 1000 MB TorchX's slurm scheduler leaves out --mem (its workaround for small
# partitions), so the component's 32 GB per worker need not fit.
SlurmdParameters=config_overrides
InactiveLimit=0
KillWait=5
SlurmdTimeout=60
{nodes}
PartitionName=pw Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    def __init__(self, machine: Machine):
        self.m = machine
        self.env = dict(os.environ)                # ENV_MARK is in os.environ already

    def start(self) -> None:
        for d in ("state", "spool", "log", "run", "munge", "munge-key", "jobs", "torchx",
                  "tmp"):
            (WORK / d).mkdir(parents=True, exist_ok=True)
        for n in NODES:
            (WORK / "spool" / n).mkdir(exist_ok=True)
        WORK.chmod(0o755)
        (WORK / "munge").chmod(0o755)              # munged wants its socket dir open...
        (WORK / "munge-key").chmod(0o700)          # ... and its key private
        key = WORK / "munge-key" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        ports = {"ctld": free_port(), **{n: free_port() for n in NODES}}

        self.m.write_hosts()
        say(f"{HOSTS}: 127.0.0.1 {' '.join(NODES)}")
        self.m.write_slurm_conf(slurm_conf(ports))
        say(f"{SLURM_CONF}: 4 nodes n1..n4 on 127.0.0.1, slurmctld port {ports['ctld']}, "
            f"slurmd ports {[ports[n] for n in NODES]}")

        say("starting munged (private key and socket)")
        run(["munged", f"--socket={WORK}/munge/munge.sock", f"--key-file={key}",
             f"--pid-file={WORK}/run/munged.pid", f"--log-file={WORK}/log/munged.log",
             f"--seed-file={WORK}/munge-key/munged.seed"], env=self.env)
        self.m.daemon_pids["munged"] = int((WORK / "run" / "munged.pid").read_text())
        cred = run(["munge", "-S", f"{WORK}/munge/munge.sock", "-n"])
        run(["unmunge", "-S", f"{WORK}/munge/munge.sock"], input=cred.stdout)

        say("starting slurmctld")
        run(["slurmctld"], env=self.env, cwd=WORK)
        self.m.daemon_pids["slurmctld"] = self._pid("slurmctld.pid")
        for n in NODES:
            say(f"starting slurmd -N {n}")
            run(["slurmd", "-N", n], env=self.env, cwd=WORK)
            self.m.daemon_pids[f"slurmd-{n}"] = self._pid(f"slurmd-{n}.pid")

        say("waiting for sinfo to show the 4 nodes idle")
        deadline = time.monotonic() + 90
        while True:
            r = run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
            states = dict(ln.split() for ln in r.stdout.splitlines() if ln.strip())
            if len(states) == len(NODES) and all(s == "idle" for s in states.values()):
                break
            if time.monotonic() > deadline:
                raise Failed(f"the nodes are not idle after 90 s: {states or r.stderr}\n"
                             f"slurmctld.log:\n{tail(WORK / 'log' / 'slurmctld.log')}")
            time.sleep(0.5)
        say("sinfo:\n" + run(["sinfo"]).stdout.rstrip())

    def _pid(self, name: str) -> int:
        path = WORK / "run" / name
        deadline = time.monotonic() + 15
        while not path.exists():
            if time.monotonic() > deadline:
                raise Failed(f"{path} did not appear:\n{tail(WORK / 'log' / 'slurmctld.log')}")
            time.sleep(0.1)
        return int(path.read_text().strip())

    def stop(self) -> None:
        r = run(["squeue", "-h", "-o", "%A %T"], check=False, timeout=30)
        jobs = [ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()]
        if r.returncode == 0 and jobs:
            say(f"cancelling jobs {jobs}")
            run(["scancel"] + jobs, check=False, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                r = run(["squeue", "-h", "-o", "%A"], check=False, timeout=30)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.5)
        d = self.m.daemon_pids
        if any(alive(p) for p in d.values()):
            say(f"stopping {', '.join(f'{k} ({v})' for k, v in d.items())}")
            # the slurmd first, then slurmctld, then munged (they talk through it)
            kill_pids([v for k, v in d.items() if k.startswith("slurmd")], wait_s=15)
            kill_pids([v for k, v in d.items() if k == "slurmctld"], wait_s=15)
            kill_pids([v for k, v in d.items() if k == "munged"], wait_s=10)
        self.m.daemon_pids = {}


# ------------------------------------------------------------------ jobs

def job_info(job_id: str) -> dict:
    """scontrol's fields of a job (of the first component of a heterogeneous job)."""
    r = run(["scontrol", "-o", "show", "job", job_id], check=False, timeout=30)
    if r.returncode != 0 or not r.stdout.strip():
        return {}
    fields = {}
    for tok in r.stdout.splitlines()[0].split():
        k, sep, v = tok.partition("=")
        if sep and k not in fields:
            fields[k] = v
    return fields


def summary_of(text: str) -> dict | None:
    """The client's last JSON summary line (worker lines may follow it)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        i = line.find("{")
        if i < 0:
            continue
        try:
            obj = json.loads(line[i:])
        except ValueError:
            continue
        if isinstance(obj, dict) and ("final_loss" in obj or "restarts" in obj):
            return obj
    return None


FIRST_STEP = re.compile(r"\bstep 1/\d+ loss\b")


def check_summary(res: dict, summary: dict | None) -> None:
    if summary is None:
        raise Failed("no JSON summary line in the client's output")
    res["final_loss"] = summary.get("final_loss")
    res["torch_final_loss"] = summary.get("torch_final_loss")
    res["max_rel_diff"] = summary.get("max_rel_diff")
    if res["final_loss"] is None or res["torch_final_loss"] is None:
        raise Failed(f"the summary lacks final_loss / torch_final_loss: {summary}")
    if summary.get("match") is False:
        raise Failed(f"the losses differ from plain torch: {summary}")
    rel = abs(res["final_loss"] - res["torch_final_loss"]) / abs(res["torch_final_loss"])
    if rel > 1e-4:
        raise Failed(f"final_loss {res['final_loss']} vs torch {res['torch_final_loss']}: "
                     f"{rel:.2e} relative")


class SbatchJob:
    """One job of deploy/slurm/pathways.sbatch, polled for its output and its end."""

    def __init__(self, name: str, client_args: list, env: dict, nodes: int = 3):
        self.name, self.client_args, self.env, self.nodes = name, client_args, env, nodes
        self.job_id = ""
        self.out = Path()
        self.t_submit = 0.0
        self.t_first = None
        self.t_end = 0.0
        self.last_state = ""

    def submit(self) -> None:
        self.t_submit = time.monotonic()
        r = run(["sbatch", "--parsable", f"--nodes={self.nodes}", f"--time={JOB_LIMIT_MIN}",
                 f"--output={WORK}/jobs/{self.name}-%j.out", str(SBATCH_SCRIPT),
                 *self.client_args], env=self.env, cwd=ROOT)
        self.job_id = r.stdout.strip().split(";")[0]
        self.out = WORK / "jobs" / f"{self.name}-{self.job_id}.out"
        say(f"submitted job {self.job_id}: sbatch --nodes={self.nodes} "
            f"deploy/slurm/pathways.sbatch {' '.join(self.client_args)}")

    def text(self) -> str:
        try:
            return self.out.read_text(errors="replace")
        except OSError:
            return ""

    def poll(self) -> dict | None:
        """The job's fields once it has ended, else None (notes the first result and
        each change of state)."""
        if self.t_first is None and FIRST_STEP.search(self.text()):
            self.t_first = time.monotonic()
            say(f"job {self.job_id}: first step's result after "
                f"{self.t_first - self.t_submit:.1f} s")
        info = job_info(self.job_id)
        state = info.get("JobState", "?")
        if state != self.last_state:
            say(f"job {self.job_id}: {state}")
            self.last_state = state
        return info if state in TERMINAL else None

    def wait(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            info = self.poll()
            if info is not None:
                break
            if time.monotonic() > deadline:
                run(["scancel", self.job_id], check=False)
                raise Failed(f"job {self.job_id} did not end within {timeout:.0f} s; "
                             f"cancelled. Its output:\n{self.text()[-4000:]}")
            time.sleep(0.2)
        self.t_end = time.monotonic()
        self.poll()             # a first result written just before the end
        say(f"job {self.job_id}: {info.get('JobState')} exit {info.get('ExitCode')} after "
            f"{self.t_end - self.t_submit:.1f} s")
        return info

    def result(self, info: dict) -> dict:
        return {"job_id": self.job_id, "state": info.get("JobState"),
                "exit_code": info.get("ExitCode"),
                "first_result_s": None if self.t_first is None
                else round(self.t_first - self.t_submit, 1),
                "total_s": round(self.t_end - self.t_submit, 1)}

    def expect_success(self, info: dict) -> None:
        if info.get("JobState") != "COMPLETED" or info.get("ExitCode") != "0:0":
            raise Failed(f"job {self.job_id} ended {info.get('JobState')} exit "
                         f"{info.get('ExitCode')}. Its output:\n{self.text()[-5000:]}")


def job_env(**extra) -> dict:
    """The environment jobs are submitted with (sbatch passes it on): the venv first on
    PATH, as when it is activated (TorchX's slurm scheduler expects that), and a TMPDIR of
    their own under WORK (what they leave there is reported, then removed)."""
    return dict(os.environ, PATH=f"{PY.parent}:{os.environ.get('PATH', '')}",
                VIRTUAL_ENV=str(PY.parent.parent), TMPDIR=str(WORK / "tmp"),
                PJRT_DEVICE="CPU", **extra)


def pathways_env(token_file: Path, port: int) -> dict:
    return job_env(PATHWAYS_ISLANDS="2", PATHWAYS_HOSTS_PER_ISLAND="1",
                   PATHWAYS_DEVICES_PER_HOST="2", PATHWAYS_PORT=str(port),
                   PATHWAYS_TOKEN_FILE=str(token_file), PATHWAYS_PYTHON=str(PY))


def check_sbatch(token_file: Path) -> dict:
    job = SbatchJob("sbatch", ["recipes/two_islands.py", "--steps", "3", "--check"],
                    pathways_env(token_file, free_port()))
    job.submit()
    info = job.wait(timeout=900)
    res = job.result(info)
    job.expect_success(info)
    text = job.text()
    if "pathways.sbatch: the client exited with code 0" not in text:
        raise Failed(f"the sbatch script did not report the client's exit:\n{text[-3000:]}")
    check_summary(res, summary_of(text))
    if res["first_result_s"] is None:
        raise Failed("no 'step 1/3' progress line in the job's output")
    return res


TORCHX_JOBS: list = []          # ids whose slurm-ID-* files are moved out of the repo


def move_torchx_files() -> None:
    """TorchX's job writes slurm-JOBID.out (the batch script) and slurm-JOBID-ROLE-N.out
    /.err (srun) into its working directory, the repo root: move ours to WORK/torchx."""
    for job_id in TORCHX_JOBS:
        for f in [*ROOT.glob(f"slurm-{job_id}.out"), *ROOT.glob(f"slurm-{job_id}-*")]:
            shutil.move(str(f), WORK / "torchx" / f.name)


SQUEUE_SHIM = '''#!{python}
# {mark}: written by tests/slurm/harness.py, on PATH for TorchX only.
# Slurm 22.05's `squeue --json` leaves "job_resources" out of a PENDING job, and TorchX's
# slurm scheduler (torchx-nightly 2026.10.26, SlurmScheduler._describe_squeue) reads
# job["job_resources"]: KeyError right after sbatch (a heterogeneous job pends until the
# next backfill pass), so `torchx run --wait` and `torchx status` fail. This passes every
# call to the real squeue and, with --json, adds "job_resources": null where it is
# missing: what Slurm 24.11.5+ prints for a pending job, which TorchX handles.
import json, subprocess, sys
r = subprocess.run([{real!r}] + sys.argv[1:], capture_output=True, text=True)
out = r.stdout
if r.returncode == 0 and "--json" in sys.argv[1:]:
    d = json.loads(out)
    for job in d.get("jobs", []):
        job.setdefault("job_resources", None)
    out = json.dumps(d)
sys.stdout.write(out)
sys.stderr.write(r.stderr)
sys.exit(r.returncode)
'''


def squeue_shim() -> Path:
    real = shutil.which("squeue")
    if not real:
        raise Failed("squeue is not on PATH")
    d = WORK / "bin"
    d.mkdir(exist_ok=True)
    shim = d / "squeue"
    shim.write_text(SQUEUE_SHIM.format(python=PY, mark=MARK, real=real))
    shim.chmod(0o755)
    return d


def check_torchx(token_file: Path, shim: bool = True) -> dict:
    if not COMPONENT.exists():
        raise Failed(f"the TorchX component {COMPONENT.relative_to(ROOT)} is missing")
    port = free_port()
    cmd = [str(TORCHX), "run", "-s", "slurm", "-cfg", f"time={JOB_LIMIT_MIN}", "--wait",
           "pathways_torch/deploy/torchx.py:cluster", "--islands", "2",
           "--hosts_per_island", "1", "--devices_per_host", "2", "--token_file",
           str(token_file), "--port", str(port), "--script", "recipes/two_islands.py",
           "--", "--steps", "3", "--check"]
    say("(in the repo, .venv on PATH) torchx run -s slurm -cfg time=20 --wait "
        "pathways_torch/deploy/torchx.py:cluster --islands 2 --hosts_per_island 1 "
        "--devices_per_host 2 --token_file FILE --port PORT --script "
        "recipes/two_islands.py -- --steps 3 --check")
    env = job_env()
    if shim:
        env["PATH"] = f"{squeue_shim()}:{env['PATH']}"
        say("NOTE: TorchX runs with a squeue shim on PATH: Slurm 22.05's squeue --json "
            "omits job_resources for a pending job and TorchX fails on it with "
            "KeyError: 'job_resources' (--no-squeue-shim shows it)")
    log = WORK / "torchx" / "torchx-run.log"
    t_submit = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    handle, job_id, t_first, state = "", "", None, ""
    res: dict = {}
    deadline = t_submit + 900
    try:
        while True:
            text = log.read_text(errors="replace")
            if not handle:
                m = re.search(r"^(slurm://\S*/(\d+))\s*$", text, re.M)
                if m:
                    handle, job_id = m.group(1), m.group(2)
                    TORCHX_JOBS.append(job_id)
                    say(f"torchx submitted {handle} after "
                        f"{time.monotonic() - t_submit:.1f} s")
            if job_id:
                now = job_info(job_id).get("JobState", "?")
                if now != state:
                    say(f"job {job_id}: {now}")
                    state = now
            if job_id and t_first is None:
                for out in ROOT.glob(f"slurm-{job_id}-*.out"):
                    if FIRST_STEP.search(out.read_text(errors="replace")):
                        t_first = time.monotonic()
                        say(f"job {job_id}: first step's result after "
                            f"{t_first - t_submit:.1f} s ({out.name})")
                        break
            if p.poll() is not None:
                break
            if time.monotonic() > deadline:
                raise Failed(f"torchx run did not end within 900 s:\n{text[-3000:]}")
            time.sleep(0.2)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
            if job_id:
                run(["scancel", job_id], check=False)
    t_end = time.monotonic()
    text = log.read_text(errors="replace")
    res.update(app_handle=handle, job_id=job_id, torchx_exit=p.returncode,
               squeue_shim=shim,
               first_result_s=None if t_first is None else round(t_first - t_submit, 1),
               total_s=round(t_end - t_submit, 1))
    say(f"torchx run --wait exited {p.returncode} after {t_end - t_submit:.1f} s")
    if job_id:
        res["exit_code"] = job_info(job_id).get("ExitCode")
    move_torchx_files()
    outs = {f.name: f.read_text(errors="replace")
            for f in sorted((WORK / "torchx").glob(f"slurm-{job_id}-*"))} if job_id else {}

    def outputs() -> str:
        return "\n".join(f"--- {k}\n{v[-1500:]}" for k, v in outs.items())
    if p.returncode != 0 or not handle:
        raise Failed(f"torchx run exited {p.returncode}:\n{text[-3000:]}\n{outputs()}")
    st = run([str(TORCHX), "status", handle], check=False, cwd=ROOT, env=env)
    m = re.search(r"State:\s*(\w+)", st.stdout + st.stderr)
    res["status"] = m.group(1) if m else None
    say(f"torchx status {handle}: {res['status']}")
    if res["status"] != "SUCCEEDED":
        raise Failed(f"torchx status says {res['status']}:\n{st.stdout}{st.stderr}\n"
                     f"{outputs()}")
    summaries = [s for s in (summary_of(v) for k, v in outs.items() if k.endswith(".out"))
                 if s]
    check_summary(res, summaries[0] if summaries else None)
    if res["first_result_s"] is None:
        raise Failed("no 'step 1/3' progress line in the job's outputs")
    return res


def island1_agents(job_id: str) -> list:
    """The agent processes of island 1 in this job: `python -m pathways_torch.worker
    ... --island 1 ...` whose environment has SLURM_JOB_ID == job_id."""
    pat = re.compile(r"pathways_torch\.worker.*--island 1(\s|$)")
    return [pid for pid in pids() if pat.search(proc_cmdline(pid))
            and proc_env(pid).get("SLURM_JOB_ID") == job_id]


def check_elastic(token_file: Path) -> dict:
    if not ELASTIC_CLIENT.exists():
        say(f"NOTE: {ELASTIC_CLIENT.relative_to(ROOT)} is not there: the elastic check is "
            "skipped")
        return {"skipped": f"{ELASTIC_CLIENT.relative_to(ROOT)} missing"}
    steps = 12
    progress = WORK / "elastic-progress"
    ckpt = WORK / "elastic-ckpt"
    job = SbatchJob("elastic", [str(ELASTIC_CLIENT.relative_to(ROOT)), "--steps",
                                str(steps), "--checkpoint-dir", str(ckpt), "--progress",
                                str(progress)], pathways_env(token_file, free_port()))
    job.submit()

    def step_now() -> int:
        try:
            return int(progress.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return -1

    deadline = time.monotonic() + 600
    killed, t_kill, step_at_kill, t_resumed = [], None, None, None
    resumed = re.compile(r"resumed from the checkpoint of step (\d+) after ([\d.]+) s")
    while True:
        info = job.poll()
        if info is not None:
            break
        s = step_now()
        if job.t_first is None and s >= 1:
            job.t_first = time.monotonic()
            say(f"job {job.job_id}: step 1 done after {job.t_first - job.t_submit:.1f} s")
        if not killed and s >= 3:
            victims = island1_agents(job.job_id)
            if not victims:
                raise Failed(f"step {s}: no agent process of island 1 in job "
                             f"{job.job_id}:\n{job.text()[-3000:]}")
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            t_kill, step_at_kill, killed = time.monotonic(), s, victims
            say(f"job {job.job_id}: step {s} done; SIGKILLed island 1's agent and its "
                f"children (pids {victims})")
        elif killed and t_resumed is None:
            m = resumed.search(job.text())
            if m:
                t_resumed = time.monotonic()
                say(f"job {job.job_id}: fit resumed from the checkpoint of step "
                    f"{m.group(1)} {t_resumed - t_kill:.1f} s after the kill")
        if time.monotonic() > deadline:
            run(["scancel", job.job_id], check=False)
            raise Failed(f"job {job.job_id} did not end within 600 s:\n{job.text()[-4000:]}")
        time.sleep(0.1)
    job.t_end = time.monotonic()
    say(f"job {job.job_id}: {info.get('JobState')} exit {info.get('ExitCode')} after "
        f"{job.t_end - job.t_submit:.1f} s")
    res = job.result(info)
    m = resumed.search(job.text())
    res.update(steps=steps, killed_at_step=step_at_kill, killed_pids=killed,
               kill_to_resumed_s=None if t_resumed is None else round(t_resumed - t_kill, 1),
               resumed_from_step=int(m.group(1)) if m else None,
               fit_resume_s=float(m.group(2)) if m else None)
    if not killed:
        raise Failed(f"the job ended before step 3 was reported in {progress} (so nothing "
                     f"was killed):\n{job.text()[-3000:]}")
    job.expect_success(info)
    summary = summary_of(job.text())
    if summary is None:
        raise Failed(f"no JSON summary in the output:\n{job.text()[-3000:]}")
    res["restarts"], res["match"] = summary.get("restarts"), summary.get("match")
    if res["restarts"] != 1 or res["match"] is not True:
        raise Failed(f"expected restarts == 1 and match true, got {summary}")
    if "starting it again" not in job.text():
        raise Failed("pathways-run did not report restarting the agent:\n"
                     f"{job.text()[-3000:]}")
    return res


# ------------------------------------------------------------------ main

def slurm_version() -> str:
    r = run(["slurmctld", "-V"], check=False)       # "slurm-wlm 22.05.8"; needs no config
    return r.stdout.split()[-1] if r.returncode == 0 and r.stdout.split() else ""


def keep_logs() -> None:
    """The jobs' outputs and the daemons' logs into bench/out/slurm/ (git-ignored)."""
    if not WORK.exists():
        return
    shutil.rmtree(LOGS, ignore_errors=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    for sub in ("jobs", "log", "torchx"):
        for f in (WORK / sub).glob("*"):
            if f.is_file() and (f.suffix in (".out", ".err", ".log")):
                shutil.copy2(f, LOGS / f"{sub}-{f.name}")


def preflight() -> None:
    if os.geteuid() != 0:
        raise Failed("needs root (apt-get, /etc/hosts, /etc/slurm, the Slurm daemons): "
                     "run it as root (sudo make test-slurm)")
    if not Path("/etc/debian_version").exists():
        raise Failed("made for Debian (apt-get, Slurm 22.05 of Debian 12)")
    if not PY.exists():
        raise Failed(f"{PY} missing: make test-slurm bootstraps .venv first")
    r = run([str(PY), "-m", "pathways_torch", "--help"], timeout=120)
    for flag in ("--shutdown-cluster", "--replica-id", "--max-restarts", "--token-file",
                 "--wait-for-hosts"):
        if flag not in r.stdout:
            raise Failed(f"pathways-run has no {flag}: deploy/slurm/pathways.sbatch needs it")


def main() -> int:
    global WORK_IS_OURS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keep-up", action="store_true",
                    help="leave the cluster up after the checks until Enter is pressed")
    ap.add_argument("--no-squeue-shim", action="store_true",
                    help="run TorchX against the real squeue (shows its KeyError on Slurm "
                    "22.05's --json output of a pending job)")
    ap.add_argument("--only", choices=("sbatch", "torchx", "elastic"), action="append",
                    help="run only these checks (repeatable; default: all)")
    args = ap.parse_args()
    os.environ[ENV_MARK] = RUN_ID           # inherited by all we start, Slurm jobs too

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)

    results: dict = {"date": datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), "machine": f"{os.cpu_count()} x {platform.machine()}, "
        f"{platform.node()}", "layout": "2 islands x 1 host x 2 CPU devices",
        "checks": {}}
    checks = results["checks"]
    machine = Machine()
    cluster = None
    failed = False
    try:
        stage("preflight: root, .venv, pathways-run's flags")
        preflight()
        stage("clean up what a killed earlier run may have left")
        if foreign_slurm_daemons():
            raise Failed("Slurm daemons that this test did not start are running:\n  " +
                         "\n  ".join(foreign_slurm_daemons()) +
                         "\nthis test needs the machine's Slurm to itself")
        Machine.clean_stale()
        stage("install slurm-wlm and munge (apt-get, if missing) and TorchX (.venv)")
        ensure_packages()
        ensure_torchx()
        results["slurm_version"] = slurm_version()
        say(f"Slurm {results['slurm_version']}")

        stage("start the cluster: munged, slurmctld, slurmd x4")
        t = time.monotonic()
        WORK.mkdir(parents=True)
        WORK_IS_OURS = True
        cluster = Cluster(machine)
        cluster.start()
        checks["cluster_up"] = {"passed": True, "seconds": round(time.monotonic() - t, 1)}

        token_file = WORK / "token"
        token_file.write_text(secrets.token_urlsafe(24) + "\n")
        token_file.chmod(0o600)
        for name, fn, title in (
                ("sbatch", check_sbatch, "sbatch deploy/slurm/pathways.sbatch "
                 "recipes/two_islands.py --steps 3 --check (3 nodes)"),
                ("torchx", lambda t: check_torchx(t, shim=not args.no_squeue_shim),
                 "torchx run -s slurm ... torchx.py:cluster "
                 "(heterogeneous job, 4 nodes)"),
                ("elastic", check_elastic, "elastic: island 1's agent SIGKILLed "
                 "mid-training (sbatch, 3 nodes)")):
            if args.only and name not in args.only:
                continue
            stage(title)
            try:
                res = fn(token_file)
                res.setdefault("passed", "skipped" not in res)
                checks[name] = res
                say(f"{name}: {'skipped' if 'skipped' in res else 'PASSED'}")
            except Failed as e:
                failed = True
                checks[name] = {"passed": False, "error": str(e)[:4000]}
                say(f"{name}: FAILED\n{e}")
        if args.keep_up:
            stage("--keep-up: the cluster is up (sinfo, squeue, sbatch work); Enter ends")
            try:
                input()
            except EOFError:
                pass
    except (Failed, KeyboardInterrupt) as e:
        failed = True
        kind = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        checks.setdefault("setup", {"passed": False, "error": f"{kind}: {e}"[:4000]})
        say(f"{kind.upper()}: {e}")
        if WORK.exists():
            for log in sorted((WORK / "log").glob("*.log")):
                say(f"--- {log.name} (last lines)\n{tail(log, 15)}")
    finally:
        stage("tear down: jobs, daemons, leftover processes, /etc files, work folder")
        try:
            if cluster is not None:
                cluster.stop()
        except Exception as e:                      # the rest must still happen
            say(f"stopping the cluster: {e}")
        left = marked_processes(other_runs_only=False)
        if left:
            say(f"killing {len(left)} leftover processes: " + "; ".join(
                f"{p} {proc_cmdline(p)[:60]}" for p in left[:8]))
            kill_pids(left, signal.SIGKILL, wait_s=5)
        try:
            move_torchx_files()
        except OSError as e:
            say(f"moving TorchX's job files: {e}")
        left_tmp = sorted(str(p.relative_to(WORK / "tmp")) + ("/" if p.is_dir() else "")
                          for p in (WORK / "tmp").glob("*/*")) if WORK.exists() else []
        left_tmp = left_tmp[:20] + ([f"... {len(left_tmp) - 20} more"]
                                    if len(left_tmp) > 20 else [])
        if left_tmp:
            results["jobs_left_in_tmpdir"] = left_tmp
            say(f"the jobs left in their TMPDIR: {left_tmp}")
        keep_logs()
        machine.restore()
        shutil.rmtree(WORK, ignore_errors=True)
        left = marked_processes(other_runs_only=False)
        if left:
            failed = True
            say(f"processes still there: {left}")
        else:
            say("nothing of this run is left running")

    results["passed"] = not failed and all(c.get("passed") is not False
                                           for c in checks.values())
    results["total_s"] = round(time.monotonic() - T0, 1)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    stage(f"results ({RESULTS.relative_to(ROOT)}; logs in {LOGS.relative_to(ROOT)}/)")
    print(json.dumps(results, indent=2), flush=True)
    print(f"\nmake test-slurm: {'PASSED' if results['passed'] else 'FAILED'}", flush=True)
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
