"""Data parallel over two islands: each island trains SPMD on its half of every batch,
gradients cross between islands over the data network (the paper's two-island run).

    python recipes/two_islands.py [--steps 100]
    pathways-run --islands 2 --devices-per-host 2 recipes/two_islands.py
"""

import argparse

import torch

import pathways_torch as pw
from common import Progress, gpt, lm_loss, stdlib_text, text_batches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--devices", type=int, default=2, help="devices per island")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    pw.init(islands=2, devices_per_host=args.devices)
    slices = [pw.slice((args.devices,), axis_names=("data",), island=i) for i in range(2)]
    model = gpt(seq=args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    trainer = pw.Trainer(model, opt, lm_loss, parallelism=pw.MultiIsland(slices, "data"))
    batches = text_batches(stdlib_text(), args.batch, args.seq)
    bar = Progress(args.steps)
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        bar.update(step, trainer.step(x, y))
    dcn = sum(s.stats().bytes_received for s in slices)
    bar.summary(recipe="two_islands", islands=2, devices_per_island=args.devices,
                dcn_bytes=dcn)
    pw.shutdown()


if __name__ == "__main__":
    main()
