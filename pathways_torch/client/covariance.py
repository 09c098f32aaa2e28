"""``torch.cov`` and ``torch.corrcoef`` as formulas a trace can hold.

torch's kernel checks its weights and its degrees of freedom by reading values
(``is_scalar_tensor_true``: no negative weight, a nonzero sum, a correction smaller than
the observations), which a program traced on shapes cannot do: capture refused both, so
a CORAL or whitening loss could not train. The formulas below compute the same numbers
with the checks a trace can make (shapes and dtypes) and the degrees of freedom clamped
at zero as torch does (it warns, then divides by zero).

Example::

    c = covariance.cov(features.T, correction=1)       # [dims, dims]
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch


def cov(input: torch.Tensor, *, correction: int = 1,
        fweights: Optional[torch.Tensor] = None,
        aweights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch.cov: rows are variables, columns observations (a 1-d input is one
    variable); ``fweights`` (integer frequencies) and ``aweights`` (observation
    weights) multiply."""
    if input.dim() > 2 or input.dtype == torch.bool or input.is_complex():
        return NotImplemented                  # torch's own error, or its complex path
    x = input.view(1, -1) if input.dim() < 2 else input
    n = x.shape[1]
    w = fweights
    if aweights is not None:
        w = aweights if w is None else w * aweights
    if w is None:
        avg = x.sum(1) / torch.tensor(n, dtype=torch.long)
        if n - correction <= 0:
            warnings.warn("cov(): degrees of freedom is <= 0. Correction should be "
                          "strictly less than the number of observations.")
        norm = max(n - correction, 0)
        x = x - avg.unsqueeze(1)
        return torch.true_divide(x @ x.t(), norm).squeeze()
    w_sum = w.sum()
    avg = (x * w).sum(1) / w_sum
    if aweights is not None and correction != 0:
        norm = w_sum - correction * (w * aweights).sum() / w_sum
    else:
        norm = w_sum - correction
    norm = torch.where(norm <= 0, torch.zeros_like(norm), norm)
    x = x - avg.unsqueeze(1)
    return torch.true_divide(x @ (x * w).t(), norm).squeeze()


def corrcoef(input: torch.Tensor) -> torch.Tensor:
    """torch.corrcoef: the covariance over the outer product of the standard
    deviations, clipped to [-1, 1]."""
    c = cov(input)
    if c is NotImplemented:
        return NotImplemented
    if c.dim() == 0:
        return c / c
    std = c.diagonal().sqrt()
    c = c / std.view(-1, 1)
    c = c / std.view(1, -1)
    return c.clip(-1, 1)
