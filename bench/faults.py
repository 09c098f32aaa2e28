"""How fast faults are noticed, with real processes and real signals (medians of runs).

- worker_lost_s: SIGKILL a worker -> its Array raises pw.WorkerLostError in the client.
- dead_sender_s: SIGKILL the worker that owes a transfer -> the receiving island's Array
  raises pw.WorkerLostError (the receiver checks the sender's data socket each second).
- client_lost_s: SIGKILL a client process -> its devices show free in pw.devices().
- backpressure_resume_ms: an output waiting for memory -> done, after the release that
  makes room is sent (the wait is applied early, ahead of the ops queued before it).

Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch

from common import emit, median

import pathways_torch as pw
from pathways_torch.client import runtime

RUNS = int(os.environ.get("PATHWAYS_FAULT_RUNS", "3"))
os.environ["PATHWAYS_RESTART_WORKERS"] = "0"     # measure the loss, not the restart

OTHER = textwrap.dedent("""
    import json, sys, time, torch
    import pathways_torch as pw
    pw.init(address=sys.argv[1])
    s = pw.slice((2,))
    x = pw.put(torch.ones(4), s)
    print(json.dumps([[d.island, d.host, d.index] for d in s.devices]), flush=True)
    time.sleep(600)
""")


@pw.program
def double(x):
    return x * 2


@pw.program
def slow(x):
    for _ in range(40):
        x = torch.tanh(x @ x) * 0.5 + 0.01
    return x


def worker_pid(island: int) -> int:
    c = runtime._state.cluster
    for p in c.procs:
        if "pathways_torch.worker" in p.args and \
                p.args[p.args.index("--island") + 1] == str(island):
            return p.pid
    raise RuntimeError("no worker")


def until_raises(fn, exc) -> float:
    t0 = time.monotonic()
    try:
        fn()
    except exc:
        return time.monotonic() - t0
    raise RuntimeError(f"{fn} did not raise {exc}")


def one_worker_run() -> tuple:
    pw.init(islands=2, devices_per_host=2, timeout=60)
    try:
        a, b = pw.slice((2,), island=0), pw.slice((2,), island=1)
        xa = double(pw.put(torch.ones(4), a))
        xa.torch()
        y = slow(pw.put(torch.randn(1024, 1024) / 32, b)).to(a)
        os.kill(worker_pid(1), signal.SIGKILL)
        t_kill = time.monotonic()
        until_raises(y.torch, pw.WorkerLostError)
        dead_sender = time.monotonic() - t_kill
        os.kill(worker_pid(0), signal.SIGKILL)
        t_kill = time.monotonic()
        deadline = t_kill + 10
        while time.monotonic() < deadline:          # the next blocking call raises
            try:
                double(xa).torch()
            except pw.WorkerLostError:
                break
            time.sleep(0.01)
        worker_lost = time.monotonic() - t_kill
        return worker_lost, dead_sender
    finally:
        pw.shutdown()


def client_run() -> float:
    pw.init(devices_per_host=4, timeout=60)
    try:
        address = runtime._state.address
        env = dict(os.environ, PJRT_DEVICE="CPU")
        env.pop("PATHWAYS_ADDRESS", None)
        p = subprocess.Popen([sys.executable, "-c", OTHER, address], env=env,
                             stdout=subprocess.PIPE, text=True)
        theirs = {tuple(d) for d in json.loads(p.stdout.readline())}
        p.kill()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            free = {(d.island, d.host, d.index) for d in pw.devices() if d.state == "free"}
            if theirs <= free:
                break
            time.sleep(0.02)
        p.wait()
        return time.monotonic() - t0
    finally:
        pw.shutdown()


def backpressure_run() -> float:
    import threading
    pw.init(devices_per_host=2, memory_budget="64M", timeout=60)   # 32 MiB per device
    try:
        s = pw.slice((1,))
        x = pw.put(torch.ones(2 << 20), s)                 # 8 MiB
        ys = [double(x) for _ in range(3)]                 # full
        s.stats()
        y4 = double(x)
        sent = []

        def drop():
            time.sleep(0.5)
            sent.append(time.monotonic())
            ys[0] = None

        threading.Thread(target=drop).start()
        y4.wait()
        return (time.monotonic() - sent[0]) * 1e3
    finally:
        pw.shutdown()


def main() -> None:
    worker, sender, client, bp = [], [], [], []
    for _ in range(RUNS):
        w, d = one_worker_run()
        worker.append(w)
        sender.append(d)
        client.append(client_run())
        bp.append(backpressure_run())
    emit({"bench": "faults", "runs": RUNS,
          "worker_lost_s": round(median(worker), 3), "worker_lost_all": worker,
          "dead_sender_s": round(median(sender), 3), "dead_sender_all": sender,
          "client_lost_s": round(median(client), 3), "client_lost_all": client,
          "backpressure_resume_ms": round(median(bp), 1), "backpressure_all": bp})


if __name__ == "__main__":
    main()
