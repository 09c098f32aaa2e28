"""Dispatch overhead: a chain of tiny programs through the client vs. in-process torch_xla.

A chain of N calls ``y = y + 1`` on an 8x8 float32 tensor, each call consuming the
previous result. Both variants run in this one process, alternating, several times:

- ``in_process``: plain lazy torch_xla as users write it, ``y = y + 1; torch_xla.sync()``
  per step, on this process's own XLA CPU device.
- ``pathways``: the same step as a ``@pw.program`` on a 1-device slice of the embedded
  cluster (one worker process), dispatched as futures; the clock stops when the last
  result has been computed (``pw.wait``).

Prints one JSON object: µs per step (median of the runs) for each, and their ratio.
    python bench/dispatch.py [--steps 1000] [--runs 5]
"""

from __future__ import annotations

import argparse
import time

from common import emit, in_process_chain_us, median

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402

in_process = in_process_chain_us


def through_pathways(s, steps: int) -> float:
    @pw.program
    def add_one(y):
        return y + 1

    y = pw.put(torch.zeros(8, 8), s)
    add_one(y).wait()                      # trace and compile outside the clock
    t0 = time.perf_counter()
    for _ in range(steps):
        y = add_one(y)
    pw.wait([y])
    dt = time.perf_counter() - t0
    assert float(y.torch()[0, 0]) == steps
    return dt / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    pw.init(devices_per_host=1)
    try:
        s = pw.slice((1,))
        in_process(50), through_pathways(s, 50)           # warm both paths
        a, b = [], []
        for _ in range(args.runs):
            a.append(in_process(args.steps))
            b.append(through_pathways(s, args.steps))
    finally:
        pw.shutdown()
    ia, pb_ = median(a), median(b)
    emit({
        "benchmark": "dispatch_chain",
        "steps": args.steps, "runs": args.runs,
        "in_process_us_per_step": round(ia, 1),
        "pathways_us_per_step": round(pb_, 1),
        "ratio_pathways_over_in_process": round(pb_ / ia, 3),
        "in_process_runs_us": [round(x, 1) for x in a],
        "pathways_runs_us": [round(x, 1) for x in b],
    })


if __name__ == "__main__":
    main()
