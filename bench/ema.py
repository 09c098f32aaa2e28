"""What an EMA of the weights costs a step: ``ema=`` against the script's own call.

The same model (``--layers`` Linear(``--width``) + Tanh, AdamW) trained by
``pw.Trainer``, with torch's ``AveragedModel`` (EMA, decay 0.999) updated after every
step in two ways:

- *script*: ``ema.update_parameters(model)`` after ``trainer.step``, as in a torch loop
  (the call reads the parameters, which fetches the trained weights every step);
- *ema=*: ``pw.Trainer(..., ema=ema)``, which updates it on the workers.

and a *none* baseline without an EMA. Interleaved rounds (order reversed every other
round), each timing ``--steps`` steps after a warm-up round; the result is the median of
the per-round ratios of seconds a step, with its spread, and the bytes each script
step fetched.

    python bench/ema.py [--rounds 7] [--steps 20] [--layers 8] [--width 512]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from common import emit, interleaved, ratio_summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    args = ap.parse_args()
    start = time.perf_counter()

    import pathways_torch as pw
    swa = torch.optim.swa_utils
    warnings.simplefilter("ignore", pw.SyncWarning)
    pw.init(devices_per_host=4)
    s = pw.slice((2,), axis_names=("data",))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, args.width, generator=g)
    y = torch.randn(64, args.width, generator=g)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[m for _ in range(args.layers) for m in
                                     (torch.nn.Linear(args.width, args.width),
                                      torch.nn.Tanh())])

    cases = {}
    for name in ("none", "script", "ema="):
        m = model()
        ema = swa.AveragedModel(m, multi_avg_fn=swa.get_ema_multi_avg_fn(0.999))
        tr = pw.Trainer(m, torch.optim.AdamW(m.parameters(), lr=1e-4),
                        torch.nn.functional.mse_loss, slice=s,
                        ema=ema if name == "ema=" else None)

        def run(tr=tr, m=m, ema=ema, name=name):
            t = time.perf_counter()
            for _ in range(args.steps):
                loss = tr.step(x, y)
                if name == "script":
                    ema.update_parameters(m)
            float(loss)
            return (time.perf_counter() - t) / args.steps
        run()
        cases[name] = run

    got = interleaved(cases, args.rounds, warmup=1)
    nbytes = sum(p.numel() * p.element_size() for p in model().parameters())
    emit({"benchmark": "ema_update", "layers": args.layers, "width": args.width,
          "param_mib": round(nbytes / 2**20, 2), "steps": args.steps,
          "ms_per_step": {k: round(1e3 * sorted(v)[len(v) // 2], 2) for k, v in got.items()},
          "script_over_ema=": ratio_summary(got["script"], got["ema="]),
          "ema=_over_none": ratio_summary(got["ema="], got["none"]),
          "script_fetch_mib_per_step": round(nbytes / 2**20, 2),
          "wall_s": round(time.perf_counter() - start, 1)})
    pw.shutdown()


if __name__ == "__main__":
    main()
