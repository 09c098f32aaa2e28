"""Where a program call's time goes: CPU µs per call of every thread of the client and
of the slice's executor, split into stages by py-spy samples (docs/architecture.md,
Decision 20).

A chain of ``y + 1`` on 8x8 float32 on a 1-device slice runs for --seconds in a child
process (``op``: one call per step, a wait every 256 calls; ``graph``: 128 calls per
``pw.graph()``, a wait every 8 graphs). Over a window of it, each thread's CPU time comes
from /proc/<pid>/task/<tid>/stat (what it really spent); when py-spy is installed
(``pip install py-spy``; it is not a dependency), that CPU time is split by the thread's
samples among the stages below (a sample counts for a stage when the stage's function
is on its stack). Linux only.

    python bench/breakdown.py [--mode op|graph] [--seconds 16] [--window 8]

Prints one JSON object: µs per call, and per thread its CPU µs per call and stages.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

from common import emit

STAGES = {   # label: a function on the stack (py-spy's name for it)
    "client: the call": "Program.__call__",
    "client: flatten the arguments": "tree_flatten",
    "client: Array.wait": "Array.wait",
    "client: graph submission": "Graph.submit",
    "client: gang Schedule RPC": "_State.schedule",
    "client: stream writer": "ExecutorConnection._requests",
    "executor: op loop": "OpLoop._loop",
    "executor: validate": "OpLoop._invalid",
    "executor: execute": "OpLoop._execute",
    "executor: trace (_xla_user_computation)": "Programs._run",
    "executor: fused run, gather": "OpLoop._fuse",
    "executor: fused run, launch": "OpLoop._flush",
    "executor: store advance": "ObjectStore.advance",
    "executor: Wait RPC": "ExecutorService.Wait",
    "executor: stream pump": "ExecutorService.Dispatch.<locals>.pump",
}

CHILD = r"""
import os, sys, time
import torch, pathways_torch as pw
mode, seconds, ready = sys.argv[1], float(sys.argv[2]), sys.argv[3]
@pw.program
def add_one(y):
    return y + 1
pw.init(devices_per_host=1)
s = pw.slice((1,))
y = pw.put(torch.zeros(8, 8), s)
for _ in range(3):
    with pw.graph():
        for _ in range(128):
            y = add_one(y)
y.wait()
open(ready, "w").write(str(os.getpid()))
t_end, n, t0 = time.time() + seconds, 0, time.perf_counter()
while time.time() < t_end:
    if mode == "op":
        for _ in range(256):
            y = add_one(y)
        n += 256
    else:
        for _ in range(8):
            with pw.graph():
                for _ in range(128):
                    y = add_one(y)
        n += 1024
    y.wait()
print("US_PER_CALL", (time.perf_counter() - t0) / n * 1e6, flush=True)
pw.shutdown()
"""


def children(pid: int) -> list:
    out = []
    for p in pathlib.Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def executor_pid(client: int) -> int:
    """The slice's executor: the client's worker agent's zygote's child."""
    for agent in children(client):
        cmd = pathlib.Path(f"/proc/{agent}/cmdline").read_bytes()
        if b"pathways_torch.worker" in cmd:
            for zygote in children(agent):
                kids = children(zygote)
                if kids:
                    return kids[0]
    raise RuntimeError("no executor process found under the client")


def thread_cpu(pid: int) -> dict:
    """tid -> CPU seconds (user + system)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for t in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            f = (t / "stat").read_text().rsplit(")", 1)[1].split()
            out[t.name] = (int(f[11]) + int(f[12])) / tick
        except (OSError, IndexError):
            pass
    return out


def spy_samples(path: str) -> dict:
    """tid -> (thread name, Counter of stage -> samples, total samples)."""
    want = {fn: label for label, fn in STAGES.items()}
    out = {}
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        m = re.match(r"\s*thread \((\d+)\):\s*(.*)", frames[0])
        if not m:
            continue
        name, counts, total = out.get(m.group(1), (m.group(2), collections.Counter(), 0))
        fns = {re.sub(r" \(.*?\)$", "", f) for f in frames[1:]}
        for fn in fns & want.keys():
            counts[want[fn]] += int(n)
        out[m.group(1)] = (name, counts, total + int(n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("op", "graph"), default="op")
    ap.add_argument("--seconds", type=float, default=16.0)
    ap.add_argument("--window", type=float, default=8.0)
    args = ap.parse_args()
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    with tempfile.TemporaryDirectory() as tmp:
        ready = os.path.join(tmp, "ready")
        child = subprocess.Popen([sys.executable, "-c", CHILD, args.mode, str(args.seconds),
                                  ready], stdout=subprocess.PIPE, text=True)
        try:
            while not os.path.exists(ready):
                if child.poll() is not None:
                    raise RuntimeError("the benchmark process exited early")
                time.sleep(0.2)
            time.sleep(1.0)
            pids = {"client": child.pid, "executor": executor_pid(child.pid)}
            before = {who: thread_cpu(p) for who, p in pids.items()}
            spies = []
            if spy:
                spies = [subprocess.Popen(
                    [spy, "record", "--nonblocking", "-r", "100", "-d", str(int(args.window)),
                     "-f", "raw", "--threads", "-p", str(p), "-o",
                     os.path.join(tmp, f"{who}.txt")], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL) for who, p in pids.items()]
            time.sleep(args.window)
            after = {who: thread_cpu(p) for who, p in pids.items()}
            for s in spies:
                s.wait()
            out, _ = child.communicate(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
        us = float(re.search(r"US_PER_CALL ([\d.]+)", out).group(1))
        calls = args.window * 1e6 / us
        samples = {}
        for who in pids:
            path = os.path.join(tmp, f"{who}.txt")
            if os.path.exists(path):
                samples.update({tid: (who,) + v for tid, v in spy_samples(path).items()})
    threads = []
    for who in pids:
        for tid, t in after[who].items():
            cpu = (t - before[who].get(tid, 0.0)) * 1e6 / calls
            if cpu < 0.5:
                continue
            _, name, counts, total = samples.get(tid, (who, "native (no Python frames)",
                                                       {}, 0))
            threads.append({"process": who, "thread": name, "cpu_us_per_call": round(cpu, 1),
                            "stages_us": {k: round(cpu * v / total, 1)
                                          for k, v in sorted(counts.items()) if total}})
    threads.sort(key=lambda t: -t["cpu_us_per_call"])
    emit({"benchmark": "breakdown", "mode": args.mode, "us_per_call": round(us, 1),
          "py_spy": bool(spy), "threads": threads})


if __name__ == "__main__":
    main()
