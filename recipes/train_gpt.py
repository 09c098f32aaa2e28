"""Train a small GPT (byte-level) on the Python standard library's source, data parallel.

The loss starts at ln(256) = 5.5 and falls below 3 within a few hundred steps on this
CPU. Runs on an embedded cluster, or under pathways-run.

    python recipes/train_gpt.py [--steps 300] [--devices 4]
    python recipes/train_gpt.py --devices 4 --hosts 2   # one slice over 2 hosts x 2
    pathways-run --devices-per-host 4 recipes/train_gpt.py
"""

import argparse

import torch

import pathways_torch as pw
from common import Progress, gpt, lm_loss, stdlib_text, text_batches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--hosts", type=int, default=1,
                    help="spread the slice over this many hosts (one SPMD program)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--fsdp", action="store_true", help="shard parameters and optimizer state")
    ap.add_argument("--checkpoint", default="", help="save a checkpoint here at the end")
    args = ap.parse_args()
    if args.devices % args.hosts:
        ap.error(f"--devices {args.devices} must be a multiple of --hosts {args.hosts}")
    pw.init(hosts_per_island=args.hosts, devices_per_host=args.devices // args.hosts)
    s = pw.slice((args.devices,), axis_names=("data",),
                 hosts=args.hosts if args.hosts > 1 else None)
    model = gpt(seq=args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    strategy = (pw.FullyShardedDataParallel("data") if args.fsdp else pw.DataParallel("data"))
    trainer = pw.Trainer(model, opt, lm_loss, slice=s, parallelism=strategy)
    batches = text_batches(stdlib_text(), args.batch, args.seq)
    bar = Progress(args.steps)
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        bar.update(step, trainer.step(x, y))
    if args.checkpoint:
        trainer.save(args.checkpoint)
    bar.summary(recipe="train_gpt", parameters=sum(p.numel() for p in model.parameters()),
                devices=args.devices, hosts=len(s.hosts),
                tokens_per_step=args.batch * args.seq,
                strategy=type(strategy).__name__)
    pw.shutdown()


if __name__ == "__main__":
    main()
