"""Paper Figure 6: the computation size at which pathways_torch reaches in-process throughput.

One computation is ``y = tanh(y @ w)`` on n x n float32 (one matmul of 2n^3 flops);
a chain of them, each consuming the previous result, is run for n in --sizes, in one
run, alternating, medians of --runs:

- ``in_process``: plain lazy torch_xla in this process, ``y = tanh(y @ w);
  torch_xla.sync()`` per computation (the paper's JAX baseline).
- ``op_by_op``: one ``@pw.program`` call per computation on a 1-device slice of the
  embedded cluster (one worker process), each call taking the previous call's future.
- ``chained``: the same calls recorded with ``pw.graph()``, --block calls per graph.

The computation size is reported as the in-process time per computation (as the paper
does, in ms). For each size: throughput of each pathways variant relative to in-process
(``in_process_us / variant_us``; 1.0 = parity), taken per run from the measurements
made next to each other and then the median over runs, so that a burst of load from
elsewhere on the machine hits both sides of a ratio. ``parity`` gives, per variant, the
smallest size from which the relative throughput stays >= --threshold for every larger
size measured (default 0.9: paired runs on the shared 2-core development machine differ
by 5-10 %), and ``first_reach`` the smallest size at which it reaches it at all (null if
it never does).

The number of computations per measurement adapts to the size (about --target-s of
in-process time, between 16 and --max-steps).

    python bench/fig6_computation_size.py [--sizes 8,16,...,1024] [--runs 5]
"""

from __future__ import annotations

import argparse
import time

from common import emit, median

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402


@pw.program
def step(y, w):
    return torch.tanh(y @ w)


def inputs(n: int):
    g = torch.Generator().manual_seed(n)
    y = torch.randn(n, n, generator=g)
    w = torch.randn(n, n, generator=g) / n ** 0.5
    return y, w


def reference(n: int, steps: int) -> torch.Tensor:
    y, w = inputs(n)
    for _ in range(steps):
        y = torch.tanh(y @ w)
    return y


def in_process(n: int, steps: int):
    """µs per computation in this process's XLA device, and the final value."""
    import torch_xla
    dev = torch_xla.device()
    y, w = (t.to(dev) for t in inputs(n))
    torch_xla.sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        y = torch.tanh(y @ w)
        torch_xla.sync()
    out = y.cpu()
    return (time.perf_counter() - t0) / steps * 1e6, out


def op_by_op(s, n: int, steps: int):
    y0, w0 = inputs(n)
    y, w = pw.put(y0, s), pw.put(w0, s)
    pw.wait([y, w])
    t0 = time.perf_counter()
    for _ in range(steps):
        y = step(y, w)
    y.wait()
    dt = time.perf_counter() - t0
    return dt / steps * 1e6, y.torch()


def chained(s, n: int, steps: int, block: int):
    y0, w0 = inputs(n)
    y, w = pw.put(y0, s), pw.put(w0, s)
    pw.wait([y, w])
    steps = max(1, steps // block) * block
    t0 = time.perf_counter()
    for _ in range(steps // block):
        with pw.graph():
            for _ in range(block):
                y = step(y, w)
    y.wait()
    dt = time.perf_counter() - t0
    return dt / steps * 1e6, y.torch()


def parity(sizes, rel, threshold):
    """Smallest size from which ``rel`` stays >= threshold for all larger sizes."""
    best = None
    for n in reversed(sizes):
        if rel[n] >= threshold:
            best = n
        else:
            break
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8,16,32,64,128,256,512,1024")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--target-s", type=float, default=0.3)
    ap.add_argument("--max-steps", type=int, default=4096)
    # 0.9, not 1.0: paired runs on this shared 2-core machine differ by 5-10 %.
    ap.add_argument("--threshold", type=float, default=0.9)
    args = ap.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    pw.init(devices_per_host=1)
    rows = {}
    try:
        s = pw.slice((1,))
        for n in sizes:
            # Warm every path (trace, compile) and check numerics against plain torch.
            want = reference(n, 3)
            est, got = in_process(n, 3)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            _, got = op_by_op(s, n, 3)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            chained(s, n, args.block, args.block)
            est = min(in_process(n, 16)[0] for _ in range(2))
            steps = int(min(args.max_steps, max(16, args.target_s * 1e6 / est)))
            steps = max(args.block, steps // args.block * args.block)
            res = {"in_process": [], "op_by_op": [], "chained": []}
            for _ in range(args.runs):
                res["in_process"].append(in_process(n, steps)[0])
                res["op_by_op"].append(op_by_op(s, n, steps)[0])
                res["chained"].append(chained(s, n, steps, args.block)[0])
            med = {k: median(v) for k, v in res.items()}
            rows[n] = {"steps": steps,
                       "in_process_us": round(med["in_process"], 1),
                       "op_by_op_us": round(med["op_by_op"], 1),
                       "chained_us": round(med["chained"], 1),
                       "op_by_op_rel_throughput": round(median(
                           [a / b for a, b in zip(res["in_process"], res["op_by_op"])]), 3),
                       "chained_rel_throughput": round(median(
                           [a / b for a, b in zip(res["in_process"], res["chained"])]), 3)}
            print(f"n={n}", rows[n], flush=True)
    finally:
        pw.shutdown()
    def at(n):
        return None if n is None else {"n": n,
                                       "in_process_ms": round(rows[n]["in_process_us"] / 1e3,
                                                              3)}

    par, first = {}, {}
    for k in ("op_by_op", "chained"):
        rel = {m: rows[m][f"{k}_rel_throughput"] for m in sizes}
        par[k] = at(parity(sizes, rel, args.threshold))
        first[k] = at(next((m for m in sizes if rel[m] >= args.threshold), None))
    emit({"benchmark": "fig6_computation_size", "computation": "tanh(y @ w), n x n f32",
          "runs": args.runs, "block": args.block, "threshold": args.threshold,
          "sizes": {str(n): v for n, v in rows.items()}, "parity": par,
          "first_reach": first})


if __name__ == "__main__":
    main()
