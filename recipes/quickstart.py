"""Quickstart: one client drives an SPMD program over a (4, 2) mesh of CPU XLA devices.

Run with ``make demo`` or ``python recipes/quickstart.py`` (an embedded local cluster
starts and stops by itself), or under ``pathways-run recipes/quickstart.py``.
"""

import json
import time

import torch

import pathways_torch as pw
from pathways_torch import P


def main() -> None:
    t0 = time.perf_counter()
    pw.init(devices_per_host=8)      # a coordinator and one worker with 8 CPU XLA devices
    print(f"cluster up in {time.perf_counter() - t0:.1f} s: {len(pw.devices())} devices")

    s = pw.slice((4, 2), axis_names=("data", "model"))
    torch.manual_seed(0)
    x_cpu, w_cpu = torch.randn(64, 128), torch.randn(128, 256)
    x = pw.put(x_cpu, s, P("data", None))
    w = pw.put(w_cpu, s, P(None, "model"))

    @pw.program
    def layer(x, w):
        return torch.relu(x @ w)

    y = layer(x, w)                  # returns at once: a pw.Array future
    assert y.shape == (64, 256)      # known before anything executes
    print(f"y = {y}")

    got = y.torch()
    want = torch.relu(x_cpu @ w_cpu)
    err = (got - want).abs().max().item()
    print(f"max |pathways - torch| = {err:.2e}")
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)

    # A chain of calls that feed each other, dispatched without waiting.
    @pw.program
    def step(h, w):
        return torch.tanh(h @ w)

    sq = pw.put(torch.eye(256) * 0.5, s, P(None, "model"))
    h = y
    t1 = time.perf_counter()
    for _ in range(50):
        h = step(h, sq)
    dispatched = time.perf_counter() - t1
    h.wait()
    total = time.perf_counter() - t1
    print(json.dumps({"max_abs_err": err, "chain_calls": 50,
                      "dispatch_ms": round(dispatched * 1e3, 2),
                      "chain_ms": round(total * 1e3, 2)}))
    pw.shutdown()


if __name__ == "__main__":
    main()
