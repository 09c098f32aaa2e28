"""Several clients sharing one host's devices: throughput and proportional shares
(the paper's Figures 8 and 9).

One embedded host with 2 devices, each shared by up to 8 slices. Every client is its own
process with its own slice over both devices and keeps its queue full of a ~10 ms
program; the host's arbiter interleaves their programs. Measured over the same window
while every client is busy:

- ``clients`` / ``throughput``: programs per second summed over 1, 2 and 4 equal clients
  (Figure 8: more clients should not lose aggregate throughput);
- ``shares``: each client's fraction of the device time for weights 1:1:1:1 and 1:2:4:8
  against the fraction its weight asks for (Figure 9).

    python bench/fig9_shares.py [--seconds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from common import emit

CLIENT = r'''
import json, os, sys, threading, time, torch
import pathways_torch as pw
share, go_file, seconds = float(sys.argv[1]), sys.argv[2], float(sys.argv[3])
pw.init(share=share, name=f"share{share:g}")
s = pw.slice((2,), axis_names=("x",))

@pw.program
def work(a, b):
    for _ in range(8):
        a = torch.tanh(a @ b)
    return a

a = pw.put(torch.randn(512, 512) / 23, s, pw.P("x", None))
b = pw.put(torch.randn(512, 512) / 23, s)
work(a, b).wait()
print("READY", flush=True)
while not os.path.exists(go_file):
    time.sleep(0.01)
go = float(open(go_file).read())
while time.time() < go:
    time.sleep(0.001)
start, stop = go + 1.0, go + 1.0 + seconds
marks = {}

def sample():
    for key, at in (("start", start), ("stop", stop)):
        time.sleep(max(0.0, at - time.time()))
        st = s.stats(sync=False)
        marks[key] = (st.busy_seconds, st.executed, time.time())

sampler = threading.Thread(target=sample)
sampler.start()
inflight = []
while time.time() < stop + 1.0:
    inflight.append(work(a, b))
    if len(inflight) > 32:
        inflight.pop(0).wait()
sampler.join()
(b0, e0, t0), (b1, e1, t1) = marks["start"], marks["stop"]
print("RESULT", json.dumps({"share": share, "busy_s": b1 - b0,
                            "programs_per_s": (e1 - e0) / (t1 - t0)}), flush=True)
pw.shutdown()
'''


def run(address: str, weights, seconds: float, tmp: pathlib.Path) -> list:
    script = tmp / "client.py"
    script.write_text(CLIENT)
    go = tmp / f"go-{time.monotonic_ns()}"
    env = dict(os.environ, PATHWAYS_ADDRESS=address)
    procs = [subprocess.Popen([sys.executable, str(script), str(w), str(go), str(seconds)],
                              env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for w in weights]
    try:
        for p in procs:
            line = p.stdout.readline()
            if not line.startswith("READY"):
                raise RuntimeError(p.stderr.read()[-3000:])
        (tmp / "go.tmp").write_text(str(time.time() + 0.5))
        (tmp / "go.tmp").rename(go)
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    res = []
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(err[-3000:])
        res.append(json.loads([l for l in out.splitlines()
                               if l.startswith("RESULT ")][0].split(" ", 1)[1]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=6.0)
    args = ap.parse_args()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from pathways_torch.client.cluster import LocalCluster
    out = {"benchmark": "multi_client_shares", "seconds": args.seconds,
           "devices": 2, "clients": [], "throughput": [], "shares": {}}
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(devices_per_host=2, devices_shared_by=8) as cluster:
        tmp = pathlib.Path(tmp)
        for n in (1, 2, 4):
            res = run(cluster.address, [1] * n, args.seconds, tmp)
            out["clients"].append(n)
            out["throughput"].append(round(sum(r["programs_per_s"] for r in res), 2))
        for weights in ([1, 1, 1, 1], [1, 2, 4, 8]):
            res = run(cluster.address, weights, args.seconds, tmp)
            total = sum(r["busy_s"] for r in res)
            key = ":".join(map(str, weights))
            measured = [round(r["busy_s"] / total, 4) for r in res]
            wanted = [w / sum(weights) for w in weights]
            out["shares"][key] = {
                "weights": weights, "measured": measured,
                "wanted": [round(w, 4) for w in wanted],
                "max_relative_error": round(max(abs(m - w) / w
                                                for m, w in zip(measured, wanted)), 3),
                "busy_fraction_of_window": round(total / args.seconds, 3)}
    emit(out)


if __name__ == "__main__":
    main()
