"""Train an MLP with data parallelism over 4 devices; compare with plain PyTorch at the end.

    python recipes/train_mlp.py [--steps 200]
    pathways-run --devices-per-host 4 recipes/train_mlp.py
"""

import argparse
import copy
import math

import torch

import pathways_torch as pw
from common import Progress


def spirals(n: int, seed: int):
    """Three interleaved spirals in 2-D: a classification task an MLP must work for."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 3, (n,), generator=g)
    r = torch.rand(n, generator=g)
    theta = r * 1.5 * math.pi + k * 2 * math.pi / 3 + torch.randn(n, generator=g) * 0.1
    return torch.stack([r * torch.cos(theta), r * torch.sin(theta)], 1), k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    pw.init(devices_per_host=4)
    s = pw.slice((4,), axis_names=("data",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 3))
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = torch.nn.functional.cross_entropy
    trainer = pw.Trainer(model, opt, loss_fn, slice=s, parallelism=pw.DataParallel("data"))
    data = [spirals(args.batch, seed=i) for i in range(args.steps)]
    bar = Progress(args.steps)
    for i, (x, y) in enumerate(data, 1):
        bar.update(i, trainer.step(x, y))
    trainer.sync_to(model)
    xt, yt = spirals(2000, seed=10_000)
    with torch.no_grad():
        acc = (model(xt).argmax(1) == yt).float().mean().item()
    # the same steps in plain PyTorch: the final losses must agree
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in data:
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
    bar.summary(recipe="train_mlp", test_accuracy=round(acc, 4),
                torch_final_loss=round(ref_loss.item(), 6))
    pw.shutdown()


if __name__ == "__main__":
    main()
