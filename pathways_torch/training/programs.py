"""The programs a Trainer's step runs, built from the model: forward + backward +
optimizer update in one (SPMD strategies), gradients alone, and the update alone
(``MultiIsland``, ``Pipeline``: gradients are exchanged or accumulated first)."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from . import optim as fopt


def _make_step_fn(model, loss_fn, group_of):
    """One SPMD step: forward, backward and the optimizer update."""
    def train_step(params, fixed, state, sc, inputs, targets, hyper):
        names = list(params)
        leaves = [params[n].requires_grad_() for n in names]
        loss = loss_fn(torch.func.functional_call(model, {**params, **fixed}, (inputs,)),
                       targets)
        grads = dict(zip(names, torch.autograd.grad(loss, leaves)))
        new_params, new_state = _apply(group_of, params, state, sc, [grads], hyper)
        return new_params, new_state, loss.detach()
    return train_step


def _make_grad_fn(model, loss_fn, flat: bool = False):
    def grads(params, fixed, inputs, targets):
        names = list(params)
        leaves = [params[n].requires_grad_() for n in names]
        loss = loss_fn(torch.func.functional_call(model, {**params, **fixed}, (inputs,)),
                       targets)
        gs = torch.autograd.grad(loss, leaves)
        if flat:
            return torch.cat([g.reshape(-1) for g in gs]), loss.detach()
        return dict(zip(names, gs)), loss.detach()
    return grads


def _unflatten(flat, shapes: Dict[str, tuple]) -> Dict[str, torch.Tensor]:
    out, at = {}, 0
    for n, shape in shapes.items():
        k = 1
        for d in shape:
            k *= d
        out[n] = flat[at:at + k].reshape(shape)
        at += k
    return out


def _apply(group_of, params, state, sc, grad_list, hyper):
    """The optimizer update with the mean of ``grad_list`` (summed in its order)."""
    kind, groups = hyper
    new_params, new_state = {}, {}
    for n, p in params.items():
        g = grad_list[0][n]
        for other in grad_list[1:]:
            g = g + other[n]
        if len(grad_list) > 1:
            g = g / len(grad_list)
        gi = group_of[n]
        new_params[n], new_state[n] = fopt.update(kind, dict(groups[gi]), sc[gi],
                                                  p.detach(), g, state[n])
    return new_params, new_state


def _make_apply_fn(group_of, flat_shapes: Optional[Dict[str, tuple]] = None):
    def apply(params, state, sc, grad_list, hyper):
        if flat_shapes is not None:
            total = grad_list[0]
            for other in grad_list[1:]:
                total = total + other
            grad_list = [_unflatten(total / len(grad_list), flat_shapes)]
        return _apply(group_of, params, state, sc, grad_list, hyper)
    return apply
