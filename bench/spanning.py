"""A training step on a slice that spans hosts against one on a single host (issue 14).

One cluster (1 island x 3 hosts x 4 CPU devices). Slice A: 4 devices of one host
(torch_xla's in-process SPMD, the executor of Decision 2). Slice B: 2 devices on each of
two other hosts (``pw.slice((4,), hosts=2)``: two member executors on jaxlib, gloo
between them). The same ``pw.Trainer`` with DataParallel over "data" steps on each;
rounds interleave A and B, each round timing ``--steps`` steps after a warm-up (the
loss read back at the end of each round). Reports the median of per-round ratios B/A
with their spread, and the losses of both (they must agree: same model, same data).
To say where the difference goes, each round also times a chain of ``--steps`` tiny
programs (``x + 1`` on 8 floats, no collective: the per-program cost of the path) and
one all-reduce-bearing program (the sum of a 1 MiB array sharded over "data").

    python bench/spanning.py [--rounds 5] [--steps 20] [--width 256]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from common import emit, median

import pathways_torch as pw


def model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    pw.init(islands=1, hosts_per_island=3, devices_per_host=4, timeout=300)
    try:
        one = pw.slice((4,), axis_names=("data",))
        two = pw.slice((4,), axis_names=("data",), hosts=2)
        assert not one.spans_hosts and two.spans_hosts, (one, two)
        base = model(args.width)
        trainers = {}
        for name, s in (("one_host", one), ("two_hosts", two)):
            m = copy.deepcopy(base)
            trainers[name] = pw.Trainer(m, torch.optim.SGD(m.parameters(), lr=0.01),
                                        torch.nn.functional.cross_entropy, slice=s,
                                        parallelism=pw.DataParallel("data"))
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch, args.width, generator=g)
        y = torch.randint(0, 8, (args.batch,), generator=g)
        losses = {k: float(t.step(x, y)) for k, t in trainers.items()}    # warm-up

        @pw.program
        def plus(v):
            return v + 1

        @pw.program
        def total(v):
            return v.sum()

        slices = {"one_host": one, "two_hosts": two}
        small = {k: pw.put(torch.zeros(8), s) for k, s in slices.items()}
        big = {k: pw.put(torch.ones(1 << 18), s, pw.P("data")) for k, s in slices.items()}
        for k in slices:
            plus(small[k]).wait()
            total(big[k]).wait()
        rounds = []
        for _ in range(args.rounds):
            r = {}
            for name, t in trainers.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    loss = t.step(x, y)
                float(loss)
                r[name] = (time.perf_counter() - t0) / args.steps * 1e3
                v = small[name]
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    v = plus(v)
                v.wait()
                r[name + "_tiny"] = (time.perf_counter() - t0) / args.steps * 1e3
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    s_ = total(big[name])
                s_.wait()
                r[name + "_allreduce"] = (time.perf_counter() - t0) / args.steps * 1e3
            rounds.append(r)

        def ratio(key):
            xs = [r["two_hosts" + key] / r["one_host" + key] for r in rounds]
            return {"median": median(xs), "min": min(xs), "max": max(xs)}

        emit({"benchmark": "spanning", "width": args.width, "batch": args.batch,
              "steps": args.steps, "rounds": rounds,
              "ms": {k: median([r[k] for r in rounds]) for k in rounds[0]},
              "two_hosts_over_one_host": ratio(""),
              "tiny_program_ratio": ratio("_tiny"),
              "allreduce_program_ratio": ratio("_allreduce"),
              "first_loss": losses})
    finally:
        pw.shutdown()


if __name__ == "__main__":
    main()
