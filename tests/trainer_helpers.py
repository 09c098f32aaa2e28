"""Small models, data and comparisons shared by the Trainer's tests against torch.

``mlp`` and ``batches`` are the same model and data in every module that imports them
(a seed each); ``fp16_*`` are the loss-scaling tests' model, data and torch recipe; the
assertions compare with plain torch within ``TOL`` (1e-5, absolute
and relative) unless a test states otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

TOL = 1e-5


def mlp(seed=0, d_in=8, hidden=16, d_out=4):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                         nn.GELU(), nn.Linear(hidden, d_out))


def batches(n, batch=8, d_in=8, classes=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g),
             torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]


def assert_losses(got, want, rtol=TOL, atol=TOL):
    assert len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), rtol=rtol, atol=atol,
                               msg=lambda m: f"losses {got} vs torch {want}: {m}")


def assert_same_model(trained, ref, atol=TOL, buffers=True):
    for (n, a), (_, b) in zip(trained.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=TOL, atol=atol,
                                   msg=lambda m, n=n: f"{n}: {m}")
    if buffers:
        for (n, a), (_, b) in zip(trained.named_buffers(), ref.named_buffers()):
            if a.is_floating_point():
                torch.testing.assert_close(a, b, rtol=TOL, atol=atol,
                                           msg=lambda m, n=n: f"{n}: {m}")
            else:
                assert torch.equal(a, b), (n, a, b)


def fp16_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 4))


def fp16_batches():
    """Batches whose first and fourth overflow float16 (inputs of 1e4: inf gradients
    at a scale of 2**15 or more), so two updates are skipped, the first of them
    before the optimizer has any state."""
    data = batches(7, seed=11)
    return [(x * 1e4, y) if i in (0, 3) else (x, y) for i, (x, y) in enumerate(data)]


def torch_fp16_train(model, opt, data, scaler, clip=None, accumulate=1):
    """torch's fp16 recipe: autocast, GradScaler (scale, unscale_ before clipping, step,
    update); with ``accumulate=k`` the scaled losses of k batches divided by k."""
    losses, scales = [], []
    model.train()
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss / accumulate).backward()
        losses.append(loss.item())
        if (i + 1) % accumulate:
            continue
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return losses, scales
