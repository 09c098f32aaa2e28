"""Data parallel over two islands: each island trains SPMD on its half of every batch,
gradients cross between islands over the data network (the paper's two-island run).

    python recipes/two_islands.py [--steps 100] [--check]
    pathways-run --islands 2 --devices-per-host 2 recipes/two_islands.py

``--check`` trains a copy of the model in plain PyTorch on the CPU beside it (same
initial weights, same batches, same optimizer), reports its losses as ``torch_losses``
and exits 1 when a step's loss differs by more than 1e-4 relative (what the deployment
tests of TorchX and Slurm run as their client).
"""

import argparse
import copy
import sys

import torch

import pathways_torch as pw
from common import Progress, gpt, lm_loss, stdlib_text, text_batches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--devices", type=int, default=2, help="devices per island")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--check", action="store_true",
                    help="train the same model in plain torch alongside and compare losses")
    args = ap.parse_args()
    pw.init(islands=2, devices_per_host=args.devices)
    slices = [pw.slice((args.devices,), axis_names=("data",), island=i) for i in range(2)]
    model = gpt(seq=args.seq)
    ref = copy.deepcopy(model) if args.check else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    trainer = pw.Trainer(model, opt, lm_loss, parallelism=pw.MultiIsland(slices, "data"))
    if ref is not None:
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    batches = text_batches(stdlib_text(), args.batch, args.seq)
    bar = Progress(args.steps)
    losses, torch_losses = [], []
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        loss = trainer.step(x, y)
        bar.update(step, loss)
        if ref is not None:
            ref_opt.zero_grad()
            ref_loss = lm_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            losses.append(float(loss))
            torch_losses.append(ref_loss.item())
    dcn = sum(s.stats().bytes_received for s in slices)
    extra = {}
    if ref is not None:
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, torch_losses))
        # which parameters differ most (read through the module: the trained values),
        # so a mismatch says where it comes from
        theirs = dict(ref.named_parameters())
        params = sorted(((float((p - theirs[n]).abs().max() / theirs[n].abs().max()), n)
                         for n, p in model.named_parameters()), reverse=True)[:3]
        extra = dict(torch_final_loss=torch_losses[-1], torch_losses=torch_losses,
                     losses=losses, max_rel_diff=worst, match=worst <= 1e-4,
                     params_most_off={n: d for d, n in params})
    bar.summary(recipe="two_islands", islands=2, devices_per_island=args.devices,
                dcn_bytes=dcn, **extra)
    pw.shutdown()
    if extra and not extra["match"]:
        print(f"two_islands: losses differ from plain torch by {worst:.2e} (relative; "
              "the bar is 1e-4)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
