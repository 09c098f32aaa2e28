"""Paper Figure 7: parallel vs sequential dispatch over a chain of stages on different hosts.

Stage i runs a tiny program (``x + 1`` on 8x8) on a slice of host i; its result moves to
host i+1 (worker to worker) for the next stage. For each chain length K, --chains chains
are submitted back to back and timed until the last result exists:

- ``parallel``: the client dispatches every program and transfer at once; each worker
  waits for its inputs (the paper's parallel asynchronous dispatch).
- ``sequential``: the client waits until a stage's inputs exist before dispatching it
  (``pw.dispatch_mode("sequential")``), so host-side work sits on the critical path.
- ``ray``: the same chains over --hosts Ray actors (stage i on actor i, each
  ``.remote()`` taking the previous stage's ObjectRef, so Ray too dispatches ahead),
  numpy 8x8 instead of XLA (only if Ray is installed: ``make bench`` installs it; run
  before the cluster starts, so the two never share the CPUs).

For each K, --runs interleaved rounds of parallel and sequential (the order reversed every
other round). Prints one JSON object: computations per second (medians over rounds) per
K and mode; ``ratio``: parallel/sequential, the median of the per-round ratios with
their spread (``common.ratio_summary``); ``parallel_over_ray``: each round's parallel
rate over Ray's median (Ray runs apart, before the cluster: not interleaved).
    python bench/fig7_parallel_dispatch.py [--hosts 16] [--chains 20] [--runs 5] [--no-ray]
"""

from __future__ import annotations

import argparse
import time

from common import emit, interleaved, median, ratio_summary, ray_init

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


def ray_chains(hosts: int, ks, chains: int, runs: int):
    """Computations per second per K over Ray actors, or None when Ray is missing."""
    try:
        import numpy as np
        import ray
    except ImportError:
        return None
    ray_init()
    try:
        @ray.remote(num_cpus=0)
        class Stage:
            def step(self, x):
                return x + 1

        actors = [Stage.remote() for _ in range(hosts)]
        x0 = np.zeros((8, 8), np.float32)
        ray.get([a.step.remote(x0) for a in actors])           # start every actor
        rates = {}
        for k in ks:
            rs = []
            for _ in range(runs):
                t0 = time.perf_counter()
                outs = []
                for _ in range(chains):
                    h = actors[0].step.remote(x0)
                    for i in range(1, k):
                        h = actors[i % hosts].step.remote(h)
                    outs.append(h)
                last = ray.get(outs)[-1]
                rs.append(k * chains / (time.perf_counter() - t0))
                assert float(last[0, 0]) == k
            rates[k] = median(rs)
        return rates
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--stages", default="1,2,4,8,16")
    ap.add_argument("--chains", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args()
    ks = [int(k) for k in args.stages.split(",")]
    ray_rates = None if args.no_ray else ray_chains(args.hosts, ks, args.chains, args.runs)
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
            res = interleaved({m: (lambda m=m: run_chains(slices, k, args.chains, m))
                               for m in ("parallel", "sequential")}, args.runs)
            par, seq = res["parallel"], res["sequential"]
            rows[k] = {"parallel_per_s": round(median(par), 1),
                       "sequential_per_s": round(median(seq), 1),
                       "ratio": ratio_summary(par, seq)}
            if ray_rates:
                rows[k]["ray_per_s"] = round(ray_rates[k], 1)
                rows[k]["parallel_over_ray"] = ratio_summary([p / ray_rates[k]
                                                              for p in par])
    finally:
        pw.shutdown()
    emit({"benchmark": "fig7_parallel_dispatch", "hosts": args.hosts, "chains": args.chains,
          "runs": args.runs, "rounds": args.runs, "ray_interleaved": False,
          "cluster_startup_s": round(startup, 1),
          "stages": {str(k): v for k, v in rows.items()}})


if __name__ == "__main__":
    main()
