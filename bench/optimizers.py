"""What a generic optimizer's numbers cost a step, against torch.optim's own path.

The same model (``--layers`` Linear(64, 64) + Tanh, so 2 x layers parameters, each with
a Python step count for the hand-written Adam) trained by ``pw.Trainer`` with
``torch.optim.Adam`` (torch.optim's path: capturable, the step count as state on the
workers) and with a hand-written Adam whose step count is a Python int and whose bias
corrections use ``math.sqrt`` (the generic path, training/numbers.py: the numbers are
one float64 input, guards are checked and the numbers the step leaves are recomputed on
the client every step). Interleaved rounds (A, B, B, A, ...), each timing ``--steps``
cached steps (``float(loss)`` at the end, so execution is included) after two warm-up
steps; the result is the median per-round ratio generic / torch.optim of the seconds a
step takes, with its spread, and the client's own time per step in ``Trainer._numbers``
and ``_advance``.

    python bench/optimizers.py [--rounds 7] [--steps 30] [--layers 24]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from common import emit, interleaved, ratio_summary


class HandAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                size = group["lr"] * math.sqrt(1 - beta2 ** state["step"]) / (
                    1 - beta1 ** state["step"])
                p.addcdiv_(state["m"], state["v"].sqrt().add_(group["eps"]), value=-size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=24)
    args = ap.parse_args()
    start = time.perf_counter()

    import pathways_torch as pw
    pw.init(devices_per_host=4)
    s = pw.slice((2,), axis_names=("data",))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[m for _ in range(args.layers)
                                     for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())])

    trainers = {}
    for name, make in (("torch.optim", lambda ps: torch.optim.Adam(ps, lr=1e-3)),
                       ("generic", lambda ps: HandAdam(ps, lr=1e-3))):
        m = model()
        tr = pw.Trainer(m, make(m.parameters()), torch.nn.functional.mse_loss, slice=s)
        for _ in range(2):
            float(tr.step(x, y))
        trainers[name] = tr

    def timed(tr):
        def run():
            t = time.perf_counter()
            for _ in range(args.steps):
                loss = tr.step(x, y)
            float(loss)
            return (time.perf_counter() - t) / args.steps
        return run

    got = interleaved({n: timed(tr) for n, tr in trainers.items()}, args.rounds, warmup=1)
    gen = trainers["generic"]
    hyper, lrs = gen._hyper()
    t = time.perf_counter()
    n = 2000
    for _ in range(n):
        _, _, pending = gen._numbers(hyper, lrs)
        gen._book.advance(pending[0], pending[1], pending[2], [dict(g) for g in
                                                               gen.optimizer.param_groups])
    numbers_us = (time.perf_counter() - t) / n * 1e6
    emit({"benchmark": "generic_optimizer_step", "layers": args.layers,
          "params": 2 * args.layers, "steps": args.steps,
          "torch_optim_ms": round(1e3 * sorted(got["torch.optim"])[len(got["torch.optim"]) // 2], 3),
          "generic_ms": round(1e3 * sorted(got["generic"])[len(got["generic"]) // 2], 3),
          "generic_over_torch_optim": ratio_summary(got["generic"], got["torch.optim"]),
          "numbers_client_us_per_step": round(numbers_us, 1),
          "traces": {k: len(tr._programs["train_step"]._traces) for k, tr in trainers.items()},
          "wall_s": round(time.perf_counter() - start, 1)})
    pw.shutdown()


if __name__ == "__main__":
    main()
