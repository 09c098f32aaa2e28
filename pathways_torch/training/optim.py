"""Functional optimizer updates that match torch.optim's single-tensor formulas.

The Trainer's step program applies these to lazy tensors inside the trace, so the
update runs on the workers, in the same compiled program as forward and backward.
Per-step quantities that torch computes in Python (bias corrections) come in as 0-d
tensors, so a learning-rate schedule or the step count never forces a retrace.
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch

from ..errors import PathwaysError


class UnsupportedOptimizer(PathwaysError, TypeError):
    """pw.Trainer knows SGD (with momentum), Adam and AdamW."""


def describe(opt: torch.optim.Optimizer) -> Dict:
    """The optimizer's kind and static hyperparameters, per parameter group."""
    kind = type(opt).__name__
    if kind not in ("SGD", "Adam", "AdamW"):
        raise UnsupportedOptimizer(
            f"pw.Trainer supports torch.optim.SGD, Adam and AdamW, not {kind}")
    groups = []
    for g in opt.param_groups:
        if g.get("maximize") or g.get("amsgrad") or g.get("nesterov"):
            raise UnsupportedOptimizer(
                f"{kind} with maximize/amsgrad/nesterov is not supported by pw.Trainer")
        if kind == "SGD":
            groups.append(dict(momentum=float(g["momentum"]),
                               dampening=float(g["dampening"]),
                               weight_decay=float(g["weight_decay"])))
        else:
            b1, b2 = g["betas"]
            groups.append(dict(beta1=float(b1), beta2=float(b2), eps=float(g["eps"]),
                               weight_decay=float(g["weight_decay"])))
    return {"kind": kind, "groups": groups}


def state_names(kind: str, momentum: float = 0.0) -> List[str]:
    if kind == "SGD":
        return ["momentum_buffer"] if momentum else []
    return ["exp_avg", "exp_avg_sq"]


def scalars(kind: str, group: Dict, lr: float, step: int) -> Dict[str, float]:
    """The per-step Python numbers torch.optim would compute, for one group."""
    if kind == "SGD":
        return {"lr": lr}
    bc1 = 1 - group["beta1"] ** step
    bc2 = 1 - group["beta2"] ** step
    out = {"step_size": lr / bc1, "bc2_sqrt": math.sqrt(bc2), "lr": lr}
    if kind == "AdamW":
        out["decay"] = 1 - lr * group["weight_decay"]
    return out


def update(kind: str, group: Dict, sc: Dict[str, torch.Tensor], p: torch.Tensor,
           g: torch.Tensor, st: Dict[str, torch.Tensor]):
    """One parameter's update; returns (new param, new state). Mirrors torch.optim."""
    if kind == "SGD":
        wd, mom = group["weight_decay"], group["momentum"]
        d_p = g + p * wd if wd else g
        new_st = {}
        if mom:
            # buffer starts at zero: 0 * momentum + d_p is torch's clone on step 1
            buf = st["momentum_buffer"] * mom + d_p * (1 - group["dampening"]) \
                if group["dampening"] else st["momentum_buffer"] * mom + d_p
            new_st["momentum_buffer"] = buf
            d_p = buf
        return p - d_p * sc["lr"], new_st
    b1, b2, eps, wd = group["beta1"], group["beta2"], group["eps"], group["weight_decay"]
    if kind == "AdamW":
        p = p * sc["decay"]
    elif wd:
        g = g + p * wd
    exp_avg = torch.lerp(st["exp_avg"], g, 1 - b1)
    exp_avg_sq = st["exp_avg_sq"] * b2 + g * g * (1 - b2)
    denom = exp_avg_sq.sqrt() / sc["bc2_sqrt"] + eps
    p = p - exp_avg / denom * sc["step_size"]
    return p, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
