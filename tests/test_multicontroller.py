"""The TPU/GPU backend of slices that span hosts (worker/multicontroller.py): torch_xla's
multi-controller SPMD. Its environment for each kind is checked as pure logic; its
compile, puts from per-host blocks, runs and shard reads run here on CPU with one host
(torch_xla's CPU client has no collectives between processes, so the two-host run is
the device check in docs/architecture.md, Decision 18). Numbers: torch's within 1e-5.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pathways_torch.worker.multicontroller import multicontroller_env
from pathways_torch.worker.multihost import MultiHostError

MEMBER = os.path.join(os.path.dirname(__file__), "multicontroller_member.py")


def test_the_environment_torch_xla_reads_for_each_kind():
    gpu = multicontroller_env("CUDA", "10.0.0.1:8547", 2, 1, [0, 1, 2, 3], ())
    assert gpu == {"PJRT_DEVICE": "CUDA", "RANK": "1", "WORLD_SIZE": "2",
                   "LOCAL_RANK": "0", "PJRT_LOCAL_PROCESS_RANK": "0",
                   "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.1",
                   "XLA_COORDINATOR_PORT": "8547", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    tpu = multicontroller_env("TPU", "10.0.0.1:8476", 2, 0, [0, 1, 2, 3],
                              ["10.0.0.1", "10.0.0.2"])
    assert tpu["TPU_WORKER_ID"] == "0" and tpu["TPU_PROCESS_BOUNDS"] == "1,1,2"
    assert tpu["TPU_WORKER_HOSTNAMES"] == "10.0.0.1,10.0.0.2"
    assert tpu["TPU_PROCESS_ADDRESSES"] == "10.0.0.1:8476,10.0.0.2:8476"
    assert tpu["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,4"
    with pytest.raises(MultiHostError, match="jaxlib"):
        multicontroller_env("CPU", "127.0.0.1:1", 2, 0, [0, 1], ())


def test_torch_xla_member_runtime_on_one_cpu_host_matches_torch(tmp_path):
    from test_multihost import _loss_and_grads
    from pathways_torch.client import capture
    torch.manual_seed(0)
    inputs = [torch.randn(8, 16), torch.randn(16, 32) * 0.3, torch.randn(32, 4) * 0.3]
    specs_of_input = [("data", None), (None, "model"), ("model", None)]

    def step(x, w1, w2):
        return _loss_and_grads(x, w1.requires_grad_(), w2.requires_grad_())

    traced = capture.trace(step, "mlp", [(tuple(t.shape), t.dtype) for t in inputs],
                           lambda ts: (tuple(ts), {}))
    (tmp_path / "module.pb").write_bytes(traced.hlo)
    specs = []
    for i, (kind, k) in enumerate(traced.params):
        value = inputs[k] if kind == "i" else traced.constants[k]
        np.save(tmp_path / f"p{i}.npy", value.numpy())
        specs.append(specs_of_input[k] if kind == "i" else ())
    (tmp_path / "specs.txt").write_text(repr(specs))
    env = dict(os.environ, PJRT_DEVICE="CPU")
    p = subprocess.run([sys.executable, MEMBER, str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert "DONE" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    out = np.load(tmp_path / "out0.npz")
    want = _loss_and_grads(*[t.clone().requires_grad_() for t in inputs])
    for i, w in enumerate(want):
        np.testing.assert_allclose(out[f"o{i}"], w.detach().numpy(), rtol=1e-5, atol=1e-5)
