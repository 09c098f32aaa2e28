"""Training steps/s of this tree against another revision of pathways_torch, interleaved.

The recipes' GPT (recipes/common.py: byte-level, 4 layers, d=128, seq 64, AdamW) under
pw.Trainer(DataParallel) on a 4-device slice, at global batch 64 and 16. Each round runs
the baseline revision and this tree in turn (A, B, A, B, ...), each in a fresh process
with its own embedded cluster, and times ``--steps`` steps after ``--warmup``; the result
is the median of the per-round ratios (this tree / baseline) with their spread, and the
first step's latency (trace + compile) of each. The baseline is checked out with
``git worktree`` into a temporary directory and runs on this tree's venv.

    python bench/train_ab.py --baseline f28f2ea [--rounds 5] [--steps 20]
        [--strategy dp|islands|pipeline|pipeline4] [--max-grad-norm 1.0]
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

from common import emit, median

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, importlib.util, pathlib
sys.path.insert(0, sys.argv[1])
import torch
import pathways_torch as pw
spec = importlib.util.spec_from_file_location("rc", pathlib.Path(sys.argv[2]) / "recipes" / "common.py")
rc = importlib.util.module_from_spec(spec); spec.loader.exec_module(rc)
batch, warmup, steps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
strategy = sys.argv[6]
kw = {"max_grad_norm": float(sys.argv[7])} if sys.argv[7] != "none" else {}
pw.init(devices_per_host=4) if strategy != "islands" else pw.init(islands=2, devices_per_host=2)
torch.manual_seed(0)
model = rc.gpt(seq=64)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
if strategy == "dp":
    tr = pw.Trainer(model, opt, rc.lm_loss, slice=pw.slice((4,), axis_names=("data",)),
                    parallelism=pw.DataParallel("data"), **kw)
elif strategy == "islands":
    par = pw.MultiIsland([pw.slice((2,), axis_names=("data",), island=i) for i in range(2)], "data")
    tr = pw.Trainer(model, opt, rc.lm_loss, parallelism=par, **kw)
elif strategy == "pipeline4":
    par = pw.Pipeline(4, 8, [pw.slice((1,)) for _ in range(4)])
    tr = pw.Trainer(model, opt, rc.lm_loss, parallelism=par, **kw)
else:
    par = pw.Pipeline(2, 4, [pw.slice((2,)), pw.slice((2,))])
    tr = pw.Trainer(model, opt, rc.lm_loss, parallelism=par, **kw)
batches = rc.text_batches(rc.stdlib_text(), batch, 64)
t0 = time.perf_counter()
first = float(tr.step(*next(batches)))
first_s = time.perf_counter() - t0
for _ in range(warmup):
    loss = tr.step(*next(batches))
float(loss)
t0 = time.perf_counter()
for _ in range(steps):
    loss = tr.step(*next(batches))
last = float(loss)
rate = steps / (time.perf_counter() - t0)
pw.shutdown()
print(json.dumps({"steps_per_s": rate, "first_step_s": first_s, "first_loss": first, "file": pw.__file__,
                  "last_loss": last}))
"""


def run(tree: pathlib.Path, batch: int, args) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", PATHWAYS_PROGRESS="0")
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(ROOT), str(batch),
                          str(args.warmup), str(args.steps), args.strategy,
                          str(args.max_grad_norm or "none")], env=env,
                         capture_output=True,
                         text=True, timeout=900, cwd=str(tree))
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="a git revision of this repository")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batches", default="64,16")
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="clip the gradient norm (both sides)")
    ap.add_argument("--strategy", choices=("dp", "islands", "pipeline", "pipeline4"),
                    default="dp",
                    help="dp: DataParallel on 4 devices; islands: MultiIsland over 2 "
                         "islands of 2; pipeline: 2 stages of 2 devices, 4 microbatches; "
                         "pipeline4: 4 stages of 1 device, 8 microbatches (issue 16's)")
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pw-baseline-"))
    base = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base),
                    args.baseline], check=True, capture_output=True)
    results = {}
    try:
        for batch in (int(b) for b in args.batches.split(",")):
            rows = []
            for r in range(args.rounds):
                a = run(base, batch, args)
                b = run(ROOT, batch, args)
                rows.append({"baseline": a, "this": b,
                             "ratio": b["steps_per_s"] / a["steps_per_s"]})
                print(f"batch {batch} round {r}: baseline {a['steps_per_s']:.2f}/s ({a['file']}), "
                      f"this {b['steps_per_s']:.2f}/s", file=sys.stderr)
            ratios = sorted(x["ratio"] for x in rows)
            results[str(batch)] = {
                "steps_per_s": {"baseline": round(median([x["baseline"]["steps_per_s"]
                                                          for x in rows]), 3),
                                "this": round(median([x["this"]["steps_per_s"]
                                                      for x in rows]), 3)},
                "ratio_median": round(median(ratios), 3),
                "ratio_min": round(ratios[0], 3), "ratio_max": round(ratios[-1], 3),
                "first_step_s": {"baseline": round(median([x["baseline"]["first_step_s"]
                                                           for x in rows]), 2),
                                 "this": round(median([x["this"]["first_step_s"]
                                                       for x in rows]), 2)},
                "first_loss": {"baseline": rows[0]["baseline"]["first_loss"],
                               "this": rows[0]["this"]["first_loss"]},
            }
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                       capture_output=True)
    emit({"benchmark": "train_ab", "baseline": args.baseline, "rounds": args.rounds,
          "steps": args.steps, "strategy": args.strategy, "max_grad_norm": args.max_grad_norm,
          "model": "gpt d128 L4 seq64, " + {"dp": "DataParallel on 4 devices",
                                            "islands": "MultiIsland over 2 islands of 2",
                                            "pipeline": "Pipeline 2 stages x 2 devices, "
                                                        "4 microbatches",
                                            "pipeline4": "Pipeline 4 stages x 1 device, "
                                                         "8 microbatches"}[args.strategy],
          "by_batch": results, "time": time.strftime("%Y-%m-%d %H:%M")})


if __name__ == "__main__":
    main()
