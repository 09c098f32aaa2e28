"""Train a small ResNet on images made on the worker hosts, fed by ``pw.DataLoader``.

The dataset (``pathways_torch.datasets:synthetic_images``: a class pattern plus noise,
each image a function of its index) is built on the hosts; the client only names
batches, whose bytes go from the hosts' loaders straight into their devices. At the
end the same steps run in plain PyTorch on the same batches: the first losses agree to
float32 rounding (later ones drift apart slowly, as any two float32 runs that sum in
another order do).

    python recipes/train_resnet.py [--steps 40] [--islands 2]
    pathways-run --devices-per-host 4 recipes/train_resnet.py
"""

import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import pathways_torch as pw
from common import Progress
from pathways_torch.datasets import SyntheticImages


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ResNet(nn.Module):
    """A ResNet-8: a stem, three stages of one basic block, global pooling."""

    def __init__(self, num_classes: int = 10, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(BasicBlock(width, width),
                                    BasicBlock(width, 2 * width, 2),
                                    BasicBlock(2 * width, 4 * width, 2))
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        h = self.stages(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--islands", type=int, default=1,
                    help="train data parallel over this many islands (MultiIsland), "
                         "each loading its share of every batch")
    ap.add_argument("--num-workers", type=int, default=1)
    args = ap.parse_args()
    data_kwargs = {"size": args.images, "image_size": args.image_size, "seed": 0,
                   "noise": 2.0}

    pw.init(islands=args.islands, devices_per_host=4 if args.islands == 1 else 2)
    torch.manual_seed(0)
    model = ResNet()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    loss_fn = F.cross_entropy
    if args.islands == 1:
        trainer = pw.Trainer(model, opt, loss_fn, slice=pw.slice((4,), axis_names=("data",)),
                             parallelism=pw.DataParallel("data"))
    else:
        slices = [pw.slice((2,), axis_names=("data",), island=i)
                  for i in range(args.islands)]
        trainer = pw.Trainer(model, opt, loss_fn,
                             parallelism=pw.MultiIsland(slices, "data"))
    loader = pw.DataLoader("pathways_torch.datasets:synthetic_images",
                           dataset_kwargs=data_kwargs, batch_size=args.batch,
                           slice=trainer, shuffle=True, seed=0, drop_last=True,
                           num_workers=args.num_workers)
    bar = Progress(args.steps)
    losses = trainer.fit(loader, steps=args.steps, progress=False, on_step=bar.update)

    # Held-out accuracy, on images no step saw (indices past the training set).
    trainer.sync_to(model)
    model.eval()
    test = SyntheticImages(**dict(data_kwargs, size=args.images + 512))
    xt = torch.stack([test[i][0] for i in range(args.images, args.images + 512)])
    yt = torch.stack([test[i][1] for i in range(args.images, args.images + 512)])
    with torch.no_grad():
        acc = (model(xt).argmax(1) == yt).float().mean().item()

    # The same steps in plain PyTorch, on the same batches in the same order.
    ds = SyntheticImages(**data_kwargs)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.02, momentum=0.9)
    ref_losses, epoch = [], 0
    while len(ref_losses) < args.steps:
        # pw.DataLoader's documented order: randperm seeded with seed * 1_000_003 + epoch
        order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(
            0 * 1_000_003 + epoch))
        for x, y in torch.utils.data.DataLoader(ds, batch_size=args.batch,
                                                sampler=order.tolist(), drop_last=True):
            if len(ref_losses) == args.steps:
                break
            ref_opt.zero_grad()
            # MultiIsland: each island's replica sees its share of the batch (BatchNorm
            # statistics per share, as DDP without SyncBatchNorm), gradients averaged
            loss = sum(loss_fn(reference(xs), ys) for xs, ys in
                       zip(x.chunk(args.islands), y.chunk(args.islands))) / args.islands
            loss.backward()
            ref_opt.step()
            ref_losses.append(loss.item())
        epoch += 1
    bar.summary(
        recipe="train_resnet", first_loss=round(losses[0], 6), final_loss=round(losses[-1], 6),
        torch_final_loss=round(ref_losses[-1], 6),
        # float32 sums in another order drift apart over many BatchNorm+SGD steps;
        # the first steps must agree closely
        early_loss_diff=max(abs(a - b) for a, b in zip(losses[:5], ref_losses[:5])),
        test_accuracy=round(acc, 4), islands=args.islands, steps=len(losses))
    pw.shutdown()


if __name__ == "__main__":
    main()
