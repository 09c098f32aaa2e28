"""Paper Figure 7: parallel vs sequential dispatch over a chain of stages on different hosts.

Stage i runs a tiny program (``x + 1`` on 8x8) on a slice of host i; its result moves to
host i+1 (worker to worker) for the next stage. For each chain length K, --chains chains
are submitted back to back and timed until the last result exists:

- ``parallel``: the client dispatches every program and transfer at once; each worker
  waits for its inputs (the paper's parallel asynchronous dispatch).
- ``sequential``: the client waits until a stage's inputs exist before dispatching it
  (``pw.dispatch_mode("sequential")``), so host-side work sits on the critical path.

Prints one JSON object: computations per second (median of --runs) per K and mode, and
the parallel/sequential ratio.
    python bench/fig7_parallel_dispatch.py [--hosts 16] [--chains 20] [--runs 3]
"""

from __future__ import annotations

import argparse
import time

from common import emit, median

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402


@pw.program
def stage(x):
    return x + 1


def run_chains(slices, k: int, chains: int, mode: str) -> float:
    """Computations per second for ``chains`` chains of ``k`` stages."""
    x0 = pw.put(torch.zeros(8, 8), slices[0])
    x0.wait()
    with pw.dispatch_mode(mode):
        t0 = time.perf_counter()
        outs = []
        for _ in range(chains):
            h = stage(x0)
            for i in range(1, k):
                h = stage(h.to(slices[i % len(slices)]))
            outs.append(h)
        pw.wait(outs)
        dt = time.perf_counter() - t0
    assert float(outs[-1].torch()[0, 0]) == k
    return k * chains / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--stages", default="1,2,4,8,16")
    ap.add_argument("--chains", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    ks = [int(k) for k in args.stages.split(",")]
    t0 = time.perf_counter()
    pw.init(islands=1, hosts_per_island=args.hosts, devices_per_host=1)
    startup = time.perf_counter() - t0
    try:
        slices = [pw.slice((1,)) for _ in range(args.hosts)]
        assert len({s.host for s in slices}) == args.hosts
        for k in ks:                                   # warm every stage's compile
            run_chains(slices, k, 1, "parallel")
        rows = {}
        for k in ks:
            par, seq = [], []
            for _ in range(args.runs):
                par.append(run_chains(slices, k, args.chains, "parallel"))
                seq.append(run_chains(slices, k, args.chains, "sequential"))
            rows[k] = {"parallel_per_s": round(median(par), 1),
                       "sequential_per_s": round(median(seq), 1),
                       "ratio": round(median(par) / median(seq), 2)}
    finally:
        pw.shutdown()
    emit({"benchmark": "fig7_parallel_dispatch", "hosts": args.hosts, "chains": args.chains,
          "runs": args.runs, "cluster_startup_s": round(startup, 1),
          "stages": {str(k): v for k, v in rows.items()}})


if __name__ == "__main__":
    main()
