"""Paper Figure 5: dispatch overhead of OpByOp, Chained and Fused, on one worker.

A chain of --steps tiny computations (``y + 1`` on 8x8 float32), each consuming the
previous result, measured in one run in --runs interleaved rounds (every variant once
per round, the order reversed every other round, after one dropped warm-up round):

- ``in_process``: plain lazy torch_xla in this process: ``y = y + 1; torch_xla.sync()``.
- ``op_by_op``: one ``@pw.program`` call per computation.
- ``chained``: the same calls recorded with ``pw.graph()``, --block calls per graph,
  so each submission carries --block dataflow nodes in one message.
- ``fused``: one program that does --block additions, called steps/block times.
- ``ray``: a Ray actor holding the tensor, one chained ``.remote()`` call per
  computation (only if Ray is installed: ``make bench`` installs it).

Prints one JSON object: µs per computation for each (medians over rounds), and
``*_over_in_process``: the median of the per-round ratios to in-process with their spread
(``common.ratio_summary``). Ray runs before the cluster starts (so the two never share
the CPUs), not interleaved: ``*_over_ray`` divide each round's time by Ray's median.
    python bench/fig5_dispatch_overhead.py [--steps 1024] [--block 128] [--runs 15]
"""

from __future__ import annotations

import argparse
import time

from common import emit, in_process_chain_us, interleaved, median, ratio_summary, ray_init

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402


@pw.program
def add_one(y):
    return y + 1


def make_fused(block: int):
    @pw.program(name=f"fused{block}")
    def fused(y):
        for _ in range(block):
            y = y + 1
        return y
    return fused


def op_by_op(s, steps: int) -> float:
    y = pw.put(torch.zeros(8, 8), s)
    y.wait()
    t0 = time.perf_counter()
    for _ in range(steps):
        y = add_one(y)
    y.wait()
    dt = time.perf_counter() - t0
    assert float(y.torch()[0, 0]) == steps
    return dt / steps * 1e6


def chained(s, steps: int, block: int) -> float:
    y = pw.put(torch.zeros(8, 8), s)
    y.wait()
    t0 = time.perf_counter()
    for _ in range(steps // block):
        with pw.graph():
            for _ in range(block):
                y = add_one(y)
    y.wait()
    dt = time.perf_counter() - t0
    assert float(y.torch()[0, 0]) == steps // block * block
    return dt / (steps // block * block) * 1e6


def fused(s, steps: int, block: int, prog) -> float:
    y = pw.put(torch.zeros(8, 8), s)
    y.wait()
    t0 = time.perf_counter()
    for _ in range(steps // block):
        y = prog(y)
    y.wait()
    dt = time.perf_counter() - t0
    assert float(y.torch()[0, 0]) == steps // block * block
    return dt / (steps // block * block) * 1e6


def ray_chain(steps: int):
    """µs per chained actor call, or None when Ray is not installed."""
    try:
        import ray
    except ImportError:
        return None
    ray_init()
    try:
        @ray.remote
        class Stepper:
            def __init__(self):
                self.y = torch.zeros(8, 8)

            def step(self, _prev=None):
                self.y = self.y + 1
                return 0

        actor = Stepper.remote()
        ray.get(actor.step.remote())
        results = []
        for _ in range(3):
            t0 = time.perf_counter()
            ref = None
            for _ in range(steps):
                ref = actor.step.remote(ref)       # each call waits for the previous
            ray.get(ref)
            results.append((time.perf_counter() - t0) / steps * 1e6)
        return median(results)
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args()
    ray_us = None if args.no_ray else ray_chain(args.steps)
    pw.init(devices_per_host=1)
    try:
        s = pw.slice((1,))
        prog = make_fused(args.block)
        # warm-up; a recorded graph runs fused (one compile) from its second submission
        in_process_chain_us(50), op_by_op(s, 50), chained(s, 2 * args.block, args.block)
        fused(s, args.block, args.block, prog)
        res = interleaved({
            "in_process": lambda: in_process_chain_us(args.steps),
            "op_by_op": lambda: op_by_op(s, args.steps),
            "chained": lambda: chained(s, args.steps, args.block),
            "fused": lambda: fused(s, args.steps, args.block, prog)}, args.runs, warmup=1)
    finally:
        pw.shutdown()
    med = {k: median(v) for k, v in res.items()}
    out = {"benchmark": "fig5_dispatch_overhead", "steps": args.steps, "block": args.block,
           "runs": args.runs, "rounds": args.runs}
    for k, v in med.items():
        out[f"{k}_us"] = round(v, 1)
    for k in ("op_by_op", "chained", "fused"):
        out[f"{k}_over_in_process"] = ratio_summary(res[k], res["in_process"])
    if ray_us is not None:
        out["ray_actor_us"] = round(ray_us, 1)
        out["ray_interleaved"] = False
        for k in ("chained", "op_by_op"):
            out[f"{k}_over_ray"] = ratio_summary([t / ray_us for t in res[k]])
    emit(out)


if __name__ == "__main__":
    main()
