"""The device check of slices that span hosts on TPU or GPU (issue 14, part 2).

Run on an accelerator machine (it is not run here: these machines have none)::

    PJRT_DEVICE=CUDA python bench/device_multihost.py --hosts 1 --devices-per-host 1
    PJRT_DEVICE=CUDA python bench/device_multihost.py --hosts 2 --devices-per-host 1  # 2 GPUs
    PJRT_DEVICE=TPU  python bench/device_multihost.py --hosts 1 --devices-per-host 4  # a v4-8

It traces an MLP's loss and gradients with the client's capture (Decision 1), starts
``--hosts`` processes on this machine, each a host of one slice on torch_xla's
multi-controller runtime (``worker/multicontroller.py``: the environment each PJRT
plugin reads, ``xr.use_spmd()``), with the batch split over hosts; each puts only its
blocks, runs the program twice and writes its shards. The shards put together must be
torch's numbers on the CPU within 1e-4 (accelerator matmuls round differently), and no
element may be missing. Prints one JSON line: ``ok``, the largest error, each host's
output. Two GPUs on one machine stand in for two hosts (NCCL between processes is the
same path as between machines); hosts on two machines run the member script on each
with the same rendezvous (``tests/multicontroller_member.py DIR ADDR RANK HOSTS L KIND``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMBER = os.path.join(ROOT, "tests", "multicontroller_member.py")


def loss_and_grads(x, w1, w2):
    loss = torch.tanh(x @ w1).matmul(w2).pow(2).mean()
    g1, g2 = torch.autograd.grad(loss, (w1, w2))
    return loss, g1, g2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--devices-per-host", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    kind = os.environ.get("PJRT_DEVICE", "CUDA")
    from pathways_torch.client import capture
    torch.manual_seed(0)
    n = args.hosts * args.devices_per_host
    inputs = [torch.randn(8 * n, 16), torch.randn(16, 32) * 0.3, torch.randn(32, 4) * 0.3]
    specs_of_input = [("data", None), (None, "model"), ("model", None)]

    def step(x, w1, w2):
        return loss_and_grads(x, w1.requires_grad_(), w2.requires_grad_())

    traced = capture.trace(step, "mlp", [(tuple(t.shape), t.dtype) for t in inputs],
                           lambda ts: (tuple(ts), {}))
    where = tempfile.mkdtemp(prefix="pw-device-")
    with open(os.path.join(where, "module.pb"), "wb") as f:
        f.write(traced.hlo)
    specs = []
    for i, (k_, k) in enumerate(traced.params):
        value = inputs[k] if k_ == "i" else traced.constants[k]
        np.save(os.path.join(where, f"p{i}.npy"), value.numpy())
        specs.append(specs_of_input[k] if k_ == "i" else ())
    with open(os.path.join(where, "specs.txt"), "w") as f:
        f.write(repr(specs))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        rendezvous = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [subprocess.Popen([sys.executable, MEMBER, where, rendezvous, str(r),
                               str(args.hosts), str(args.devices_per_host), kind],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(args.hosts)]
    logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    want = [w.detach().numpy() for w in loss_and_grads(
        *[t.clone().requires_grad_() for t in inputs])]
    ok, err = all("DONE" in log for log in logs), 0.0
    if ok:
        outs = [np.load(os.path.join(where, f"out{r}.npz")) for r in range(args.hosts)]
        for i, w in enumerate(want):
            got = np.full(w.shape, np.nan, np.float32)
            for o in outs:
                v = o[f"o{i}"]
                got = np.where(np.isnan(got), v, got)
            err = max(err, float(np.nanmax(np.abs(got - w))) if got.size else 0.0)
            ok = ok and not np.isnan(got).any()
        ok = ok and err <= 1e-4
    print(json.dumps({"benchmark": "device_multihost", "kind": kind, "hosts": args.hosts,
                      "devices_per_host": args.devices_per_host, "ok": bool(ok),
                      "max_abs_err": err, "logs": [log[-1500:] for log in logs]}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
