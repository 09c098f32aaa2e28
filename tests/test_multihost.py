"""One SPMD program over two hosts' devices (issue 14, the backend: worker/multihost.py).

The client's capture (``client/capture.trace``, Decision 1) makes the HLO module of an
MLP's loss and gradients. Two real processes, each a host with 2 CPU devices, compile it
for a (2, 2) mesh whose "data" axis spans the hosts, feed only their own shards, and run
it with gloo collectives between them. The shards they return, put together, must be
torch's numbers on the CPU within 1e-5. When one member dies, the other's next program
raises ``MultiHostError`` at once rather than hanging in the collective.

The rendezvous port is found by binding port 0 and closing it: ``jax.distributed`` binds
the port it is given and cannot report one it picked.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from pathways_torch.client import capture

pytest.importorskip("jax")

MEMBER = os.path.join(os.path.dirname(__file__), "multihost_member.py")
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loss_and_grads(x, w1, w2):
    loss = torch.tanh(x @ w1).matmul(w2).pow(2).mean()
    g1, g2 = torch.autograd.grad(loss, (w1, w2))
    return loss, g1, g2


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """The traced program's HLO and its parameters (inputs and constants), saved."""
    torch.manual_seed(0)
    inputs = [torch.randn(8, 16), torch.randn(16, 32) * 0.3, torch.randn(32, 4) * 0.3]
    specs_of_input = [("data", None), (None, "model"), ("model", None)]
    traced = capture.trace(lambda x, w1, w2: _loss_and_grads(
        x, w1.requires_grad_(), w2.requires_grad_()), "mlp",
        [(tuple(t.shape), t.dtype) for t in inputs], lambda ts: (tuple(ts), {}))
    where = tmp_path_factory.mktemp("multihost")
    (where / "module.pb").write_bytes(traced.hlo)
    specs = []
    for i, (kind, k) in enumerate(traced.params):
        value = inputs[k] if kind == "i" else traced.constants[k]
        np.save(where / f"p{i}.npy", value.numpy())
        specs.append(list(specs_of_input[k]) if kind == "i" else [])
    (where / "specs.txt").write_text(repr(specs))
    w1, w2 = inputs[1].clone().requires_grad_(), inputs[2].clone().requires_grad_()
    want = [t.detach().numpy() for t in _loss_and_grads(inputs[0], w1, w2)]
    return where, want


def _members(where, what: str, timeout: float = 120):
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, MEMBER, address, str(rank), str(where),
                               what], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
             for rank in (0, 1)]
    try:
        return [p.communicate(timeout=timeout) + (p.returncode,) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _assemble(where, shapes):
    """Every output, put together from both members' shards."""
    outs = [np.full(s, np.nan, dtype=np.float32) for s in shapes]
    for rank in (0, 1):
        with np.load(where / f"out{rank}.npz") as z:
            for key in z.files:
                if key.endswith("_value"):
                    i = int(key[1:].split("_")[0])
                    bounds = z[key.replace("_value", "_bounds")]
                    index = tuple(slice(a, b) for a, b in bounds)
                    outs[i][index] = z[key]
    return outs


def test_a_program_over_two_hosts_gives_torchs_numbers(program):
    where, want = program
    results = _members(where, "run")
    for out, err, rc in results:
        assert rc == 0 and "DONE" in out, err[-3000:]
    got = _assemble(where, [w.shape for w in want])
    for g, w in zip(got, want):
        assert not np.isnan(g).any()            # every element came from some shard
        np.testing.assert_allclose(g, w, rtol=TOL, atol=TOL)


def test_a_dead_member_makes_the_others_program_raise_not_hang(program):
    where, _ = program
    (out0, err0, _), (out1, _, _) = _members(where, "die", timeout=60)
    assert "DYING" in out1
    assert "RAISED" in out0 and "failed" in out0, (out0, err0[-2000:])
