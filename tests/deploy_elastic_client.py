"""The client of the elastic deployment tests (TorchX local_cwd, the Slurm harness).

Trains a small model with ``Trainer.fit(max_restarts=1)`` over two islands, writing the
number of each finished step to ``--progress`` (the test kills a worker agent once it
reads 3 there) and sleeping ``--step-delay`` seconds per step so the kill lands mid-run.
Its last line is JSON: ``restarts`` (how many times fit resumed), ``losses`` and
``torch_losses`` (the same steps in plain PyTorch on the CPU) and ``match`` (every step
within 1e-4 relative). Exit code 0 only when the run resumed as asked and matched.

    pathways-run --address HOST:PORT tests/deploy_elastic_client.py --steps 12 \\
        --checkpoint-dir /tmp/ckpt --progress /tmp/progress
"""

import argparse
import copy
import json
import os
import sys
import time

import torch

import pathways_torch as pw


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--progress", required=True)
    ap.add_argument("--step-delay", type=float, default=1.0)
    ap.add_argument("--expect-restarts", type=int, default=1)
    args = ap.parse_args()

    pw.init(islands=2, devices_per_host=2, timeout=120)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    slices = [pw.slice((2,), axis_names=("data",), island=i) for i in range(2)]
    trainer = pw.Trainer(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                         torch.nn.functional.mse_loss,
                         parallelism=pw.MultiIsland(slices, "data"))
    data = batches(args.steps)

    def on_step(i, loss):
        tmp = args.progress + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(i))
        os.replace(tmp, args.progress)
        time.sleep(args.step_delay)

    losses = trainer.fit(data, checkpoint_dir=args.checkpoint_dir, checkpoint_every=2,
                         max_restarts=args.expect_restarts, on_step=on_step,
                         wait_timeout=180, progress=False)

    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    torch_losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        torch_losses.append(loss.item())
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, torch_losses))
    out = {"restarts": len(trainer.restarts), "losses": losses,
           "torch_losses": torch_losses, "max_rel_diff": worst, "match": worst <= 1e-4,
           "resumed_from": [r.resumed_from for r in trainer.restarts]}
    print(json.dumps(out), flush=True)
    pw.shutdown()
    return 0 if out["match"] and out["restarts"] == args.expect_restarts else 1


if __name__ == "__main__":
    sys.exit(main())
