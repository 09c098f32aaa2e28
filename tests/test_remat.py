"""Activation checkpointing lowers a step's peak device memory, with torch's numbers.

The peak inside a step is XLA's memory plan for the step program (arguments, outputs and
temporaries on one device), which executors report per program in
``Slice.stats().planned_bytes`` when the workers run with ``PATHWAYS_MEMORY_REPORT=1``:
this module starts its own cluster with it. Losses and parameters are compared with
plain torch on the CPU within 1e-5; the plans with and without checkpointing of one
model are compared with each other (the bar: at least 25% smaller; measured 38%).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pathways_torch as pw
from pathways_torch.worker.memory import REPORT_ENV

TOL = 1e-5


@pytest.fixture(scope="module")
def s2():
    before = os.environ.get(REPORT_ENV)
    os.environ[REPORT_ENV] = "1"            # the workers inherit it
    try:
        pw.init(devices_per_host=2, timeout=120)
    finally:
        if before is None:
            del os.environ[REPORT_ENV]
        else:
            os.environ[REPORT_ENV] = before
    try:
        s = pw.slice((2,), axis_names=("data",))
        yield s
        s.release()
    finally:
        pw.shutdown()


class Deep(nn.Module):
    """``blocks`` blocks of ``layers`` Linear+Tanh, each block optionally checkpointed."""

    def __init__(self, ckpt: bool, width=512, blocks=6, layers=4):
        super().__init__()
        self.ckpt = ckpt
        self.blocks = nn.ModuleList(
            nn.Sequential(*[m for _ in range(layers)
                            for m in (nn.Linear(width, width), nn.Tanh())])
            for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(x)


class Checkpointed(Deep):
    """Its own class, so its step program has its own name in ``planned_bytes``."""


def loss_fn(out, _):
    return out.float().pow(2).mean()


def train(s, ckpt, x, steps=2):
    torch.manual_seed(0)
    model = (Checkpointed if ckpt else Deep)(ckpt)
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), loss_fn, slice=s)
    got = [float(tr.step(x)) for _ in range(steps)]
    tr.sync_to(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    want = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(ref(x), None)
        loss.backward()
        opt.step()
        want.append(float(loss))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=TOL, atol=TOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=TOL, atol=TOL, msg=name)
    plans = dict(s.stats().planned_bytes)
    del tr
    return got, plans


def test_checkpointing_lowers_the_planned_peak_and_keeps_the_numbers(s2):
    x = torch.randn(2048, 512)
    plain, plans_plain = train(s2, False, x)
    ckpt, plans_ckpt = train(s2, True, x)
    assert plain == pytest.approx(ckpt, rel=TOL)
    without = plans_plain["train_step_Deep"]
    with_ = plans_ckpt["train_step_Checkpointed"]
    print(f"planned step memory per device: {without / 2**20:.1f} MiB without "
          f"checkpointing, {with_ / 2**20:.1f} MiB with")
    # the parameters alone are 24 x 1 MiB per device (replicated): the plan holds more
    assert without > 24 * 2**20
    assert with_ < 0.75 * without, (with_, without)


def test_a_block_on_the_program_input_is_checkpointed_too(s2):
    """A region whose only inputs are the program's own (the batch and the weights) is
    tied on those: its recomputation is kept, and the numbers match torch."""
    torch.manual_seed(1)
    block = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    ref = copy.deepcopy(block)

    @pw.program
    def grads(w1, b1, w2, b2, x):
        params = {k: v.detach().requires_grad_() for k, v in
                  zip(("0.weight", "0.bias", "2.weight", "2.bias"), (w1, b1, w2, b2))}
        ps = list(params.values())
        out = checkpoint(lambda t: torch.func.functional_call(block, params, (t,)), x,
                         use_reentrant=False)
        return torch.autograd.grad(out.pow(2).sum(), ps)

    x = torch.randn(32, 64)
    ps = [p.detach() for p in block.parameters()]
    got = grads(*[pw.put(t, s2) for t in ps], pw.put(x, s2))
    for p in ref.parameters():
        p.requires_grad_(True)
    ref(x).pow(2).sum().backward()
    for g, p in zip(got, ref.parameters()):
        torch.testing.assert_close(g.torch(), p.grad, rtol=TOL, atol=TOL)


def test_tie_regions_ties_each_recomputed_region_once():
    """Pure graph logic: two checkpointed blocks give two regions; the first reads only
    the program's inputs (tied on them), the second the first block's output."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from pathways_torch.client import remat

    w = torch.randn(8, 8)

    def fn(x, w):
        w = w.detach().requires_grad_()
        h = checkpoint(lambda t: torch.tanh(t @ w), x, use_reentrant=False)
        y = checkpoint(lambda t: torch.tanh(t @ w), h, use_reentrant=False)
        return torch.autograd.grad(y.sum(), w)

    with remat.tagging():
        gm = make_fx(fn)(torch.randn(4, 8), w)
    assert remat.tie_regions(gm) == 2
    ties = [n for n in gm.graph.nodes if n.target is remat.tie_op()]
    assert len(ties) == 2
    tied = [[a.name for a in t.args[0][:-1]] for t in ties]
    # backward order: the second block first, tied on the first block's output alone
    # (not on the weight); then the first block, which reads only the program's inputs
    assert tied == [["tanh"], ["x_1", "detach_1"]], tied
    x = torch.randn(4, 8)
    torch.testing.assert_close(gm(x, w)[0], fn(x, w)[0])


class NormedBlocks(nn.Module):
    """Checkpointed Linear + BatchNorm + ReLU blocks: torchvision's DenseNet with
    ``memory_efficient=True`` and timm's ``set_grad_checkpointing()`` checkpoint batch
    norms like this."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.stem = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(16, 3)
        self.reentrant = reentrant

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_batch_norm_statistics_under_checkpointing_update_as_in_torch(s2, reentrant):
    """torch's recomputation runs a checkpointed batch norm's forward again in the
    backward, so its running statistics move twice a step and ``num_batches_tracked``
    counts 2. Before stop 36 the recomputation read the statistics through its ``tie``
    copy, and its update was lost: one update a step, running means up to 2x off."""
    torch.manual_seed(2)
    model = NormedBlocks(reentrant)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(3)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                    nn.functional.cross_entropy, slice=s2,
                    parallelism=pw.DataParallel("data"))
    got = [float(tr.step(x, y)) for x, y in data]
    assert got == pytest.approx(want, rel=TOL)
    assert int(ref.blocks[0][1].num_batches_tracked) == 6      # torch's own count
    mine, theirs = model.state_dict(), ref.state_dict()
    for k, v in theirs.items():
        torch.testing.assert_close(mine[k], v, rtol=TOL, atol=TOL, msg=k)
