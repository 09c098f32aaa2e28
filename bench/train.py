"""Training throughput: SPMD parity, pipelining, and two islands (paper Tables 1 and 2).

The small GPT of recipes/common.py (byte-level, 4 layers, d=128, seq 64) at global
batch 64 (the headline for SPMD parity and two islands: 8 sequences per micro-batch) and
16 (the pipeline headline: 8 micro-batches of 2 sequences, overhead-bound), AdamW, the
same data. Every configuration is built once per batch size (its programs compiled),
then measured in --runs interleaved rounds: each round times one block of --steps steps
of every configuration, in an order reversed every other round, after one dropped
warm-up round. Each ratio is the median of its per-round ratios with their spread
(``common.ratio_summary``); steps/s are medians over rounds:

- ``spmd_parity``: pw.Trainer(DataParallel) on a 4-device slice against the same model
  trained with plain torch_xla SPMD on 4 devices in a subprocess (SPMD spans every
  device of its process) that stays up and times a block whenever asked. Bar: >= 0.95.
- ``pipeline``: pw.Pipeline with S = 2 and 4 stages (one device each, 8 micro-batches)
  against pw.Trainer(DataParallel) on S devices. Bar: >= 0.9.
- ``two_islands``: pw.MultiIsland over 2 islands x 2 devices against DataParallel on
  one 4-device slice. Bar: >= 0.9.

All of them hold their slices at once, in one cluster of 2 islands (island 0's host
carries every configuration's devices but the second island's half of MultiIsland).

    python bench/train.py [--steps 4] [--runs 9] [--batches 64,16]
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import subprocess
import sys
import time

from common import emit, interleaved, median, ratio_summary

import importlib.util  # noqa: E402

import torch  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "recipe_common", pathlib.Path(__file__).resolve().parents[1] / "recipes" / "common.py")
_recipes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_recipes)
gpt, lm_loss = _recipes.gpt, _recipes.lm_loss
stdlib_text, text_batches = _recipes.stdlib_text, _recipes.text_batches

SEQ = 64


def timed(step_fn, batches, warmup: int, steps: int) -> float:
    """Steps per second of ``step_fn(x, y)`` (returns a loss) after ``warmup`` steps."""
    for _ in range(warmup):
        loss = step_fn(*next(batches))
    float(loss)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step_fn(*next(batches))
    float(loss)
    return steps / (time.perf_counter() - t0)


def serve_baseline(devices: int) -> None:
    """Plain torch_xla SPMD in this process (a subprocess of the benchmark): one model per
    batch size; each stdin line ``batch warmup steps`` times one block, answered with a
    ``RATE <steps/s>`` line."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    xr.use_spmd()
    dev = torch_xla.device()
    mesh = xs.Mesh(np.arange(devices), (devices,), ("data",))
    steppers = {}

    def stepper(batch):
        model = gpt(seq=SEQ).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

        def step(x, y):
            x, y = x.to(dev), y.to(dev)
            xs.mark_sharding(x, mesh, ("data", None))
            xs.mark_sharding(y, mesh, ("data", None))
            opt.zero_grad()
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            torch_xla.sync()
            return loss
        return step, text_batches(stdlib_text(), batch, SEQ)

    for line in sys.stdin:
        if not line.strip():
            break
        batch, warmup, steps = (int(v) for v in line.split())
        if batch not in steppers:
            steppers[batch] = stepper(batch)
        step, batches = steppers[batch]
        print(f"RATE {timed(step, batches, warmup, steps)}", flush=True)


class Baseline:
    """The plain torch_xla SPMD subprocess; ``rate(batch, warmup, steps)`` times a block."""

    def __init__(self, devices: int):
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-baseline",
                                      str(devices)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def rate(self, batch: int, warmup: int, steps: int) -> float:
        self.proc.stdin.write(f"{batch} {warmup} {steps}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RATE "):
                return float(line.split()[1])
        raise RuntimeError(f"the torch_xla SPMD baseline exited ({self.proc.wait()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def trainer_block(pw, parallelism, slice_, batch):
    """A fresh trainer; returns ``block(warmup, steps) -> steps/s`` on its own data."""
    model = gpt(seq=SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    tr = pw.Trainer(model, opt, lm_loss, slice=slice_, parallelism=parallelism)
    batches = text_batches(stdlib_text(), batch, SEQ)
    return lambda warmup, steps: timed(tr.step, batches, warmup, steps)


# (ratio, subject, baseline): each from the same rounds.
RATIOS = (("spmd_parity", "pw_dp4", "torch_xla_spmd4"),
          ("pipeline2_over_spmd2", "pw_pipe2", "pw_dp2"),
          ("pipeline4_over_spmd4", "pw_pipe4", "pw_dp4"),
          ("pipeline4_x4_over_spmd4", "pw_pipe4_x4", "pw_dp4"),
          ("two_islands_over_one", "pw_two_islands", "pw_dp4"))


def measure(pw, slices, baseline: Baseline, batch: int, args) -> dict:
    """Every configuration at one global batch size, in ``args.runs`` interleaved rounds."""
    blocks = {"torch_xla_spmd4": lambda w, n: baseline.rate(batch, w, n),
              "pw_dp4": trainer_block(pw, pw.DataParallel("data"), slices["dp4"], batch),
              "pw_pipe4": trainer_block(pw, pw.Pipeline(4, 8, slices["pipe4"]), None, batch),
              # the same pipeline, each stage program computing 4 micro-batches in turn
              "pw_pipe4_x4": trainer_block(pw, pw.Pipeline(4, 8, slices["pipe4"],
                                                           per_program=4), None, batch),
              "pw_two_islands": trainer_block(pw, pw.MultiIsland(slices["two"], "data"),
                                              None, batch),
              "pw_dp2": trainer_block(pw, pw.DataParallel("data"), slices["dp2"], batch),
              "pw_pipe2": trainer_block(pw, pw.Pipeline(2, 8, slices["pipe2"]), None, batch)}
    first = set()

    def case(name):
        def run():
            w = args.warmup if name not in first else 1     # compiles on the first block
            first.add(name)
            return blocks[name](w, args.steps)
        return run

    t0 = time.perf_counter()
    res = interleaved({k: case(k) for k in blocks}, args.runs, warmup=1)
    print(f"batch {batch}: {args.runs} rounds + a warm-up round in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    m = {k: median(v) for k, v in res.items()}
    out = {"model": f"gpt d128 L4 seq{SEQ} batch{batch}", "batch": batch,
           "micro_batch": batch // 8, "rounds": args.runs,
           "steps_per_s": {k: round(v, 3) for k, v in m.items()},
           "tokens_per_s": {k: round(v * batch * SEQ) for k, v in m.items()},
           "per_round_steps_per_s": {k: [round(x, 3) for x in v] for k, v in res.items()}}
    for key, subject, base in RATIOS:
        out[key] = ratio_summary(res[subject], res[base])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=9, help="interleaved rounds")
    ap.add_argument("--batches", default="64,16",
                    help="global batch sizes; the first is the headline")
    ap.add_argument("--serve-baseline", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_baseline:
        serve_baseline(args.serve_baseline)
        return
    import pathways_torch as pw
    sizes = [int(b) for b in args.batches.split(",")]
    baseline = Baseline(4)
    pw.init(islands=2, devices_per_host=14)
    try:
        slices = {"dp4": pw.slice((4,), axis_names=("data",), island=0),
                  "dp2": pw.slice((2,), axis_names=("data",), island=0),
                  "pipe2": [pw.slice((1,), island=0) for _ in range(2)],
                  "pipe4": [pw.slice((1,), island=0) for _ in range(4)],
                  "two": [pw.slice((2,), axis_names=("data",), island=i)
                          for i in range(2)]}
        results = []
        for b in sizes:
            results.append(measure(pw, slices, baseline, b, args))
            gc.collect()                            # the trainers of this batch size
    finally:
        pw.shutdown()
        baseline.close()
    # The first batch size is the headline for SPMD parity and two islands (64: 8
    # sequences per micro-batch, where the devices' work outweighs the runtime's
    # per-program cost, as in the paper's Table 2); the pipeline's headline is the batch
    # of 2 sequences per micro-batch (16: issue 16's configuration). Every batch size is
    # under "by_batch".
    emit({"benchmark": "training_throughput", "steps": args.steps, "runs": args.runs,
          "rounds": args.runs, **results[0],
          "by_batch": {str(r["batch"]): r for r in results}})


if __name__ == "__main__":
    main()
