"""Feeding a trainer: batches put by the client against batches built on the hosts.

Each round trains a tiny model (so that feeding is the bottleneck) on
``SyntheticImages`` (3 x S x S float32 images, made per index) for ``--steps`` steps,
three ways, in turn:

- ``client``: the client loads the batches (torch's DataLoader with ``--workers``
  worker processes, in the client) and ``trainer.step`` puts them: every byte goes
  through the client.
- ``host1``: ``pw.DataLoader`` on one host (a DataParallel trainer on island 0): the
  host builds its batches and puts them on its devices; the client names them.
- ``host2``: ``pw.DataLoader`` on two hosts (a MultiIsland trainer over islands 0 and
  1): each host loads half of every batch.
- with ``--stream``, also ``stream1`` and ``stream2``: the same images as an
  ``IterableDataset`` (``SyntheticImageStream``) on one and two hosts. A stream has
  no indices, so each loading host reads all of it and keeps its half.

Reports samples/s (median over rounds), the median of the per-round ratios to ``client``
with their spread (``common.ratio_summary``), and the client process's CPU time per batch. Every loader (the client's and the
hosts') has ``--workers`` worker processes. On one machine the "hosts" share its cores
with the client, so the ratios here understate what separate hosts give; the client's
CPU per batch is what does not depend on that.

    python bench/input.py [--rounds 3] [--steps 30] [--image 64] [--batch 64] [--stream]
"""

from __future__ import annotations

import argparse
import time

from common import emit, median, ratio_summary

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402
from pathways_torch.datasets import SyntheticImages  # noqa: E402


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(),
                               torch.nn.Linear(48, 10))


def trainer_on(slices) -> "pw.Trainer":
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss = torch.nn.functional.cross_entropy
    if len(slices) == 1:
        return pw.Trainer(model, opt, loss, slice=slices[0],
                          parallelism=pw.DataParallel("data"))
    return pw.Trainer(model, opt, loss, parallelism=pw.MultiIsland(slices, "data"))


def run(trainer, batches, steps: int) -> tuple:
    """Samples/s over ``steps`` steps after one warm-up step (compiles, first batch),
    and the client process's own CPU milliseconds per batch (its threads, not its
    children: the DataLoader workers of the client path are left out, in its favour)."""
    it = iter(batches)
    x, y = next(it)
    float(trainer.step(x, y))
    c0 = time.process_time()
    t0 = time.perf_counter()
    n = 0
    loss = None
    for _ in range(steps):
        x, y = next(it)
        loss = trainer.step(x, y)
        n += len(y) if isinstance(y, torch.Tensor) else sum(p.shape[0] for p in
                                                            getattr(y, "parts", [y]))
    float(loss)
    return n / (time.perf_counter() - t0), (time.process_time() - c0) * 1e3 / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--stream", action="store_true",
                    help="also stream1/stream2: the images as an IterableDataset")
    args = ap.parse_args()
    kw = {"size": 100_000, "image_size": args.image, "seed": 0}
    pw.init(islands=2, devices_per_host=2, timeout=300)
    order = ["client", "host1", "host2"] + (["stream1", "stream2"] if args.stream else [])
    rates: dict = {w: [] for w in order}
    cpu: dict = {w: [] for w in order}
    try:
        slices = [pw.slice((2,), axis_names=("data",), island=i) for i in range(2)]
        for r in range(args.rounds):
            for way in order if r % 2 == 0 else order[::-1]:
                if way == "client":
                    trainer = trainer_on(slices[:1])
                    batches = torch.utils.data.DataLoader(
                        SyntheticImages(**kw), batch_size=args.batch, shuffle=True,
                        num_workers=args.workers, drop_last=True)
                elif way.startswith("stream"):
                    trainer = trainer_on(slices[:1] if way == "stream1" else slices)
                    batches = pw.DataLoader(
                        "pathways_torch.datasets:synthetic_image_stream",
                        dataset_kwargs=kw, batch_size=args.batch, slice=trainer,
                        drop_last=True, num_workers=args.workers)
                else:
                    trainer = trainer_on(slices[:1] if way == "host1" else slices)
                    batches = pw.DataLoader("pathways_torch.datasets:synthetic_images",
                                            dataset_kwargs=kw, batch_size=args.batch,
                                            slice=trainer, shuffle=True, seed=r,
                                            drop_last=True, num_workers=args.workers)
                rate, ms = run(trainer, batches, args.steps)
                rates[way].append(rate)
                cpu[way].append(ms)
                del batches, trainer
    finally:
        pw.shutdown()

    def ratio(way):
        return ratio_summary(rates[way], rates["client"])

    emit({"benchmark": "input_pipelines", "rounds": args.rounds, "steps": args.steps,
          "image": args.image, "batch": args.batch, "workers": args.workers,
          "sample_mib": round(3 * args.image ** 2 * 4 / 2 ** 20, 3),
          **{f"{w}_samples_per_s": round(median(v), 1) for w, v in rates.items()},
          **{f"{w}_client_cpu_ms_per_batch": round(median(v), 2) for w, v in cpu.items()},
          "host1_over_client": ratio("host1"), "host2_over_client": ratio("host2"),
          **({"stream1_over_host1": ratio_summary(rates["stream1"], rates["host1"]),
              "stream2_over_host2": ratio_summary(rates["stream2"], rates["host2"])}
             if args.stream else {})})


if __name__ == "__main__":
    main()
