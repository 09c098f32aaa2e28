"""Dynamic loss scaling for ``precision="fp16"``: torch.amp.GradScaler, inside a step.

float16 gradients underflow where bfloat16 ones do not, so torch's fp16 recipe scales
the loss before the backward, unscales the gradients before the update, skips the
update when a gradient is not finite, and grows or shrinks the scale::

    with torch.autocast(device, torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)                  # then clip, if at all
    scaler.step(opt)                      # skipped when a gradient is inf or nan
    scaler.update()

A Trainer step runs the same arithmetic on the workers, with no value read back: the
scale and its growth tracker are Arrays the step updates in place, and a skipped update
is a select between the parameters and optimizer state before and after it. The
functions here are traced inside the step (client/capture.py); each follows the torch
kernel it names, so the scale, the skipped steps and the gradients are torch's.

Example::

    tr = pw.Trainer(model, opt, loss_fn, slice=s, precision="fp16")
    tr.step(x, y)
    tr.loss_scale          # 65536.0, or half that after a step that overflowed
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch



@dataclasses.dataclass(frozen=True)
class LossScaling:
    """GradScaler's settings (part of a step's program: another value traces again)."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    @staticmethod
    def of(scaler: Optional["torch.amp.GradScaler"]) -> "LossScaling":
        """The settings of ``scaler`` (GradScaler's defaults when None)."""
        if scaler is None:
            return LossScaling()
        return LossScaling(float(scaler.get_growth_factor()),
                           float(scaler.get_backoff_factor()),
                           int(scaler.get_growth_interval()))


def initial(scaler: Optional["torch.amp.GradScaler"]) -> Dict[str, torch.Tensor]:
    """The scale and growth tracker to start from: ``scaler``'s (a resumed run's
    ``load_state_dict`` included), or GradScaler's initial 2**16 and 0."""
    if scaler is None:
        scaler = torch.amp.GradScaler("cpu")
    sd = scaler.state_dict()
    return {"scale": torch.tensor(float(sd.get("scale", scaler.get_scale())),
                                  dtype=torch.float32),
            "growth": torch.tensor(int(sd.get("_growth_tracker", 0)), dtype=torch.int32)}


def scale_loss(loss: torch.Tensor, state: Dict[str, torch.Tensor]) -> torch.Tensor:
    """``GradScaler.scale``: the loss times the scale (float32, 0-d)."""
    return loss * state["scale"]


def unscale(grads: Dict[str, Optional[torch.Tensor]], state: Dict[str, torch.Tensor]
            ) -> Tuple[Dict[str, Optional[torch.Tensor]], torch.Tensor]:
    """``GradScaler.unscale_``: every gradient times the scale's reciprocal (taken in
    float64 and rounded to float32, as torch does), and 1.0 when any gradient holds an
    inf or a nan, else 0.0 (``_amp_foreach_non_finite_check_and_unscale_``)."""
    inv = state["scale"].double().reciprocal().float()
    present = [g for g in grads.values() if g is not None]
    found = torch.stack([(~torch.isfinite(g)).any() for g in present]).any().float()
    return {n: (g * inv if g is not None else None) for n, g in grads.items()}, found


def non_finite(grads: List[Optional[torch.Tensor]]) -> torch.Tensor:
    """1.0 when any of ``grads`` holds an inf or a nan, else 0.0 (float32, 0-d)."""
    present = [g for g in grads if g is not None]
    if not present:
        return torch.zeros(())
    return torch.stack([(~torch.isfinite(g)).any() for g in present]).any().float()


def kept(params: Dict[str, torch.Tensor], states: Dict[str, Dict[str, torch.Tensor]]):
    """Copies of the parameters and optimizer state an update is about to change, for
    ``skip_if``."""
    return ({n: p.detach().clone() for n, p in params.items()},
            {n: {k: v.detach().clone() for k, v in st.items()
                 if isinstance(v, torch.Tensor)} for n, st in states.items()})


def skip_if(found: torch.Tensor, before, params, states) -> None:
    """``GradScaler.step``: where ``found``, the update did not happen (the parameters
    and the state it changed are put back as they were), without reading ``found``."""
    old_params, old_states = before
    skip = found > 0
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(torch.where(skip, old_params[n], p))
        for n, st in states.items():
            for k, old in old_states[n].items():
                st[k].copy_(torch.where(skip, old, st[k]))


def update_scale(state: Dict[str, torch.Tensor], found: torch.Tensor,
                 settings: LossScaling) -> None:
    """``GradScaler.update`` (``_amp_update_scale_``), in place: after an overflow the
    scale times ``backoff_factor`` and the tracker 0; otherwise the tracker counts up,
    and at ``growth_interval`` the scale grows by ``growth_factor`` (if that stays
    finite) and the tracker restarts."""
    scale, growth = state["scale"], state["growth"]
    with torch.no_grad():
        wide = scale.double()
        backed = (wide * settings.backoff_factor).float()
        grown = (wide * settings.growth_factor).float()
        successful = growth + 1
        at_interval = successful == settings.growth_interval
        overflow = found > 0
        new_scale = torch.where(overflow, backed, torch.where(
            at_interval & torch.isfinite(grown), grown, scale))
        new_growth = torch.where(overflow | at_interval, torch.zeros_like(growth),
                                 successful)
        scale.copy_(new_scale)
        growth.copy_(new_growth)
