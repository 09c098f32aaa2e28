"""Several clients sharing one host's devices: throughput and proportional shares
(the paper's Figures 8 and 9).

One embedded host with 2 devices, each shared by up to 8 slices. Every client is its own
process with its own slice over both devices and keeps its queue full of a ~10 ms
program; the host's arbiter interleaves their programs. Measured over the same window
while every client is busy:

- ``clients`` / ``throughput``: programs per second summed over 1, 2 and 4 equal clients
  (Figure 8: more clients should not lose aggregate throughput). One pool of 4 client
  processes stays up; in each of --rounds interleaved rounds the first 1, 2 and 4 of them
  run one window each (the order reversed every other round; the others hold their
  slices idle). ``throughput`` holds medians over rounds, ``aggregate_4_over_1`` (and
  ``_2_over_1``) the median of the per-round ratios with their spread
  (``common.ratio_summary``);
- ``shares``: each client's fraction of the device time for weights 1:1:1:1 and 1:2:4:8
  against the fraction its weight asks for (Figure 9), one window of fresh clients each.

    python bench/fig9_shares.py [--seconds 2.5] [--rounds 7] [--share-seconds 5]
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

from common import emit, interleaved, median, ratio_summary

CLIENT = r'''
import json, os, sys, threading, time, torch
import pathways_torch as pw
share = float(sys.argv[1])
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
for line in sys.stdin:               # "RUN <go time> <seconds>": one window; EOF: done
    go, seconds = (float(v) for v in line.split()[1:])
    while time.time() < go:
        time.sleep(0.001)
    start, stop = go + 0.5, go + 0.5 + seconds
    marks = {}

    def sample():
        for key, at in (("start", start), ("stop", stop)):
            time.sleep(max(0.0, at - time.time()))
            st = s.stats(sync=False)
            marks[key] = (st.busy_seconds, st.executed, time.time())

    sampler = threading.Thread(target=sample)
    sampler.start()
    inflight = []
    while time.time() < stop + 0.3:
        inflight.append(work(a, b))
        if len(inflight) > 32:
            inflight.pop(0).wait()
    pw.wait(inflight)
    sampler.join()
    (b0, e0, t0), (b1, e1, t1) = marks["start"], marks["stop"]
    print("RESULT", json.dumps({"share": share, "busy_s": b1 - b0,
                                "programs_per_s": (e1 - e0) / (t1 - t0)}), flush=True)
pw.shutdown()
'''


class Clients:
    """Client processes, one per weight, up and READY (slice allocated, program
    compiled); ``window(ix, seconds)`` has clients ``ix`` run one window together."""

    def __init__(self, address: str, weights, tmp: pathlib.Path):
        script = tmp / "client.py"
        script.write_text(CLIENT)
        env = dict(os.environ, PATHWAYS_ADDRESS=address)
        self.errs = [tmp / f"client-{time.monotonic_ns()}-{i}.err"
                     for i in range(len(weights))]
        self.procs = []
        for w, err in zip(weights, self.errs):
            with open(err, "w") as f:           # a file: nobody drains a pipe meanwhile
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(script), str(w)], env=env, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=f, text=True))
        for i, p in enumerate(self.procs):
            line = p.stdout.readline()
            if not line.startswith("READY"):
                self.close()
                raise RuntimeError(self.errs[i].read_text()[-3000:])

    def window(self, ix, seconds: float) -> list:
        go = time.time() + 0.3
        for i in ix:
            self.procs[i].stdin.write(f"RUN {go} {seconds}\n")
            self.procs[i].stdin.flush()
        res = []
        for i in ix:
            p = self.procs[i]
            line = p.stdout.readline()
            while line and not line.startswith("RESULT "):
                line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"client {i} exited ({p.wait()}): "
                                   + self.errs[i].read_text()[-3000:])
            res.append(json.loads(line.split(" ", 1)[1]))
        return res

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None and not p.stdin.closed:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()


def run(address: str, weights, seconds: float, tmp: pathlib.Path) -> list:
    """One window of fresh clients, one per weight."""
    clients = Clients(address, weights, tmp)
    try:
        return clients.window(range(len(weights)), seconds)
    finally:
        clients.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.5,
                    help="window of each throughput measurement")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--share-seconds", type=float, default=5.0)
    args = ap.parse_args()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from pathways_torch.client.cluster import LocalCluster
    ns = (1, 2, 4)
    out = {"benchmark": "multi_client_shares", "seconds": args.seconds,
           "share_seconds": args.share_seconds, "rounds": args.rounds,
           "devices": 2, "clients": list(ns), "throughput": [], "shares": {}}
    with tempfile.TemporaryDirectory() as tmp, \
            LocalCluster(devices_per_host=2, devices_shared_by=8) as cluster:
        tmp = pathlib.Path(tmp)
        pool = Clients(cluster.address, [1] * max(ns), tmp)
        try:
            def agg(n):
                return lambda: sum(r["programs_per_s"]
                                   for r in pool.window(range(n), args.seconds))
            res = interleaved({n: agg(n) for n in ns}, args.rounds)
        finally:
            pool.close()
        out["throughput"] = [round(median(res[n]), 2) for n in ns]
        out["per_round_throughput"] = {str(n): [round(x, 2) for x in res[n]] for n in ns}
        for n in ns[1:]:
            out[f"aggregate_{n}_over_1"] = ratio_summary(res[n], res[1])
        for weights in ([1, 1, 1, 1], [1, 2, 4, 8]):
            # fresh clients: the pool's have unequal device time behind them, which the
            # host's fair queue makes up for (a pool's 1:1:1:1 window gave 0 % : 2 % :
            # 48 % : 49 %)
            res = run(cluster.address, weights, args.share_seconds, tmp)
            total = sum(r["busy_s"] for r in res)
            key = ":".join(map(str, weights))
            measured = [round(r["busy_s"] / total, 4) for r in res]
            wanted = [w / sum(weights) for w in weights]
            out["shares"][key] = {
                "weights": weights, "measured": measured,
                "wanted": [round(w, 4) for w in wanted],
                "max_relative_error": round(max(abs(m - w) / w
                                                for m, w in zip(measured, wanted)), 3),
                "busy_fraction_of_window": round(total / args.share_seconds, 3)}
    emit(out)


if __name__ == "__main__":
    main()
