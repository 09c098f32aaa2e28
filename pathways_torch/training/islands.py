"""``pw.MultiIsland``: one replica per island, gradients exchanged over DCN transfers."""

from __future__ import annotations

import torch

from ..client.array import Array
from ..client.graph import graph
from .batches import _moved, _place_batch, split_pair
from .programs import make_apply_fn, make_grad_fn


def multi_island_step(trainer, inputs, targets, lrs, hyper) -> Array:
    """One step of ``trainer`` (a MultiIsland Trainer), recorded as one dataflow graph:
    each island's gradients, every island's update with all of them, the mean loss."""
    n = len(trainer.slices)
    axis = trainer.parallelism.axis
    xs, ys = split_pair(inputs, targets, n, "islands")
    # Gradients travel as one flat buffer per island: one transfer, not one per tensor.
    grad_prog = trainer._program("grads", make_grad_fn(trainer.model, trainer.loss_fn,
                                                       trainer.options, flat=True))
    shapes = {n: tuple(a.shape) for n, a in trainer.replicas[0].items()}
    apply_prog = trainer._program("apply_flat", make_apply_fn(
        trainer.opt, trainer._groups, trainer.options, shapes))
    mean_prog = trainer._program("mean", lambda ls: torch.stack(ls).mean())
    with graph():
        grads, losses = [], []
        for r, s in enumerate(trainer.slices):
            g, l = grad_prog(trainer.replicas[r], trainer.fixed[r],
                             _place_batch(xs[r], s, axis), _place_batch(ys[r], s, axis),
                             trainer._scalers[r] or None)
            grads.append(g)
            losses.append(l)
        created = []
        for r, s in enumerate(trainer.slices):
            # every replica sums the same gradients in the same order: identical updates
            gathered = [_moved(g, s) for g in grads]
            # parameters and state are updated in place (written back to their Arrays)
            created.append(apply_prog(trainer.replicas[r], trainer.states[r], lrs,
                                      gathered, hyper, scaler=trainer._scalers[r] or None))
        loss = mean_prog([l if i == 0 else l.to(trainer.slices[0])
                          for i, l in enumerate(losses)])
    for r, c in enumerate(created):     # (under loss scaling, kept if the update was
        trainer._store_created(r, c)    # not skipped: a read, after the graph is sent)
    return loss

