"""CTC loss (``F.ctc_loss``, ``nn.CTCLoss``) as a static recursion, which XLA compiles.

torch's CTC kernel reads the input and target lengths as Python numbers (a value read
in a trace) and torch_xla has no lowering for it. Here the lengths are tensors used as
masks: the forward (alpha) recursion runs over every frame of the padded batch, one
step per frame unrolled in the graph (T steps of a few ops), and frames past a sample's
input length leave its alphas unchanged. The gradient comes from autograd through the
recursion, plus exp(log_probs) over each sample's frames: torch's kernel returns that
(the gradient with respect to the logits through a ``log_softmax``, whose backward
leaves it as is), so log-probabilities that are not normalized get torch's gradient
too. Float64 within 1e-15 of torch, values and gradients; impossible alignments give
inf, or 0 with ``zero_infinity``.

Example::

    loss = ctc.ctc_loss(logits.log_softmax(-1), targets, input_lengths, target_lengths)
"""

from __future__ import annotations

import math

import torch


def _logsumexp0(v):
    """logsumexp over dim 0 with a zero gradient where every term is -inf."""
    m = v.amax(0).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    total = torch.exp(v - m).sum(0)
    ok = total > 0
    return torch.where(ok, m + torch.log(torch.where(ok, total, torch.ones_like(total))),
                       torch.full_like(total, -math.inf))


def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean",
             zero_infinity=False):
    """F.ctc_loss: the forward (alpha) recursion over the extended label sequence, one
    step per frame, frames past a sample's input length leaving its alphas as they
    are; -log p of the two end states at its target length. Targets padded [N, S] or
    concatenated (each row gathered from its offset, the cumulative target lengths)."""
    if reduction not in ("mean", "sum", "none"):
        return NotImplemented
    unbatched = log_probs.dim() == 2
    if unbatched:
        log_probs = log_probs.unsqueeze(1)
        targets = targets.unsqueeze(0)
    T, N, C = log_probs.shape
    dev = log_probs.device
    il = torch.as_tensor(input_lengths, device=dev).reshape(N).long()
    tl = torch.as_tensor(target_lengths, device=dev).reshape(N).long()
    if targets.dim() == 2:
        tgt = targets.long()
    else:                                     # concatenated: each row from its offset
        if isinstance(target_lengths, torch.Tensor):
            S = targets.shape[0]              # the longest a row can be
        else:
            S = max(int(v) for v in target_lengths)
        offsets = torch.cumsum(tl, 0) - tl
        idx = (offsets.unsqueeze(1) + torch.arange(S, device=dev)).clamp(max=max(targets.shape[0] - 1, 0))
        tgt = targets.long()[idx]
    S = tgt.shape[1]
    K = 2 * S + 1
    blanks = torch.full_like(tgt, blank)
    ext = torch.cat([torch.stack([blanks, tgt], -1).reshape(N, 2 * S),
                     torch.full((N, 1), blank, dtype=tgt.dtype, device=dev)], 1)
    skip = torch.zeros(N, K, dtype=torch.bool, device=dev)
    if K > 2:
        skip = torch.cat([skip[:, :2], (ext[:, 2:] != blank) & (ext[:, 2:] != ext[:, :-2])], 1)
    lp = log_probs.gather(2, ext.unsqueeze(0).expand(T, N, K))
    ninf = torch.full((N, 1), -math.inf, dtype=log_probs.dtype, device=dev)
    pos = torch.arange(K, device=dev)
    alpha = torch.where(pos < 2, lp[0], ninf)
    for t in range(1, T):
        a1 = torch.cat([ninf, alpha[:, :-1]], 1)
        a2 = torch.where(skip, torch.cat([ninf, ninf, alpha[:, :-2]], 1), ninf)
        new = _logsumexp0(torch.stack([alpha, a1, a2])) + lp[t]
        alpha = torch.where((t < il).unsqueeze(1), new, alpha)
    end = (2 * tl).unsqueeze(1)
    last = alpha.gather(1, end)
    prev = torch.where((tl > 0).unsqueeze(1), alpha.gather(1, (end - 1).clamp_min(0)), ninf)
    loss = -_logsumexp0(torch.cat([last, prev], 1).T)
    # torch's kernel returns exp(log_probs) minus the alignments' occupancy as the
    # gradient, autograd of the recursion the occupancy alone: a term of value 0 whose
    # gradient is exp(log_probs) over each sample's frames makes them agree on any input
    e = log_probs.exp()
    frames = (torch.arange(T, device=dev).unsqueeze(1) < il).unsqueeze(2)
    loss = loss + torch.where(frames, e - e.detach(), torch.zeros_like(e)).sum((0, 2))
    if zero_infinity:
        loss = torch.where(torch.isinf(loss), torch.zeros_like(loss), loss)
    if reduction == "mean":
        return (loss / tl.clamp_min(1).to(loss.dtype)).mean()
    if reduction == "sum":
        return loss.sum()
    return loss[0] if unbatched else loss
