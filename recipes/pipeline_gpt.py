"""Train the small GPT as a GPipe pipeline: 4 stages x 8 micro-batches over 4 slices.

    python recipes/pipeline_gpt.py [--steps 100]
    pathways-run --devices-per-host 4 recipes/pipeline_gpt.py
"""

import argparse

import torch

import pathways_torch as pw
from common import Progress, gpt, lm_loss, stdlib_text, text_batches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    pw.init(devices_per_host=args.stages)
    slices = [pw.slice((1,)) for _ in range(args.stages)]
    model = gpt(seq=args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    trainer = pw.Trainer(model, opt, lm_loss,
                         parallelism=pw.Pipeline(args.stages, args.microbatches, slices))
    batches = text_batches(stdlib_text(), args.batch, args.seq)
    bar = Progress(args.steps)
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        bar.update(step, trainer.step(x, y))
    bar.summary(recipe="pipeline_gpt", stages=args.stages, microbatches=args.microbatches,
                tokens_per_step=args.batch * args.seq)
    pw.shutdown()


if __name__ == "__main__":
    main()
