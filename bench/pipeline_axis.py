"""Pipeline x data parallelism: 2 stages on 2-device slices, with and without ``axis=``.

The recipes' GPT (recipes/common.py, AdamW) under ``pw.Pipeline(2, microbatches)`` on
two (2,) "data" slices of one 4-device host, trained three ways in one process:

- *replicated*: ``Pipeline(2, m, slices)``: each stage's 2 devices compute the whole
  micro-batch (what a 2-device stage did before ``axis=``);
- *axis*: ``Pipeline(2, m, slices, axis="data")``: each micro-batch split over the
  stage's devices;
- *dp4*: ``DataParallel`` on a 4-device slice, the reference the issues compare with.

Interleaved rounds (order reversed every other round), each timing ``--steps`` steps
after a warm-up round; the result is steps/s and the median of the per-round ratios of
seconds a step, with its spread. The slices are made anew for each variant's turn
(the dp4 slice needs the devices the stages hold).

    python bench/pipeline_axis.py [--rounds 5] [--steps 10] [--batch 64]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time
import warnings

import torch

from common import emit, interleaved, ratio_summary

_spec = importlib.util.spec_from_file_location(
    "recipes_common", pathlib.Path(__file__).resolve().parents[1] / "recipes" / "common.py")
rc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    start = time.perf_counter()

    import pathways_torch as pw
    warnings.simplefilter("ignore")     # the replicated variant's, a released slice's
    pw.init(devices_per_host=4)
    batches = rc.text_batches(rc.stdlib_text(), args.batch, 64)
    data = [next(batches) for _ in range(args.steps)]
    first = {}

    def variant(name):
        def run():
            if name == "dp4":
                slices = [pw.slice((4,), axis_names=("data",))]
                par = pw.DataParallel("data")
                kw = dict(slice=slices[0], parallelism=par)
            else:
                slices = [pw.slice((2,), axis_names=("data",)) for _ in range(2)]
                kw = dict(parallelism=pw.Pipeline(2, args.microbatches, slices,
                                                  axis="data" if name == "axis" else None))
            model = rc.gpt(seq=64)
            tr = pw.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), rc.lm_loss,
                            **kw)
            first.setdefault(name, float(tr.step(*data[0])))    # compiles
            float(tr.step(*data[1]))
            t = time.perf_counter()
            for x, y in data:
                loss = tr.step(x, y)
            float(loss)
            took = (time.perf_counter() - t) / len(data)
            del tr
            for s in slices:
                s.release()
            return took
        return run

    got = interleaved({n: variant(n) for n in ("replicated", "axis", "dp4")}, args.rounds)
    emit({"benchmark": "pipeline_axis", "batch": args.batch,
          "microbatches": args.microbatches, "steps": args.steps,
          "steps_per_s": {k: round(1 / sorted(v)[len(v) // 2], 2) for k, v in got.items()},
          "first_loss": first,
          "axis_speedup_over_replicated": ratio_summary(got["replicated"], got["axis"]),
          "axis_over_dp4_throughput": ratio_summary(got["dp4"], got["axis"]),
          "wall_s": round(time.perf_counter() - start, 1)})
    pw.shutdown()


if __name__ == "__main__":
    main()
