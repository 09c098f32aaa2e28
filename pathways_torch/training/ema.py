"""An average of the weights kept on the workers: ``pw.Trainer(..., ema=averaged)``.

Diffusion models, detectors and vision transformers evaluate an exponential moving
average of the weights, updated after every optimizer step with torch's
``AveragedModel``::

    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    ...
    optimizer.step()
    ema.update_parameters(model)

That call reads every parameter, which under a ``pw.Trainer`` fetches the trained
weights after every step. Given to the Trainer, the same ``AveragedModel`` is updated
after every update on the workers, where the weights are, by a program that runs its
own ``avg_fn`` / ``multi_avg_fn`` (SWA's running mean without either), with the first
update a copy and ``n_averaged`` counting, as ``update_parameters`` does. Nothing
crosses to the client until the script reads ``ema`` (a forward, ``ema.state_dict()``,
``ema.module.parameters()``), which syncs it as a Trainer's reads sync its module;
checkpoints (``save``/``load``, ``state_dict``, ``fit``) hold it. Example::

    trainer = pw.Trainer(model, opt, loss_fn, slice=s, ema=ema)
    for x, y in batches:
        trainer.step(x, y)               # and ema's update, on the workers
    evaluate(ema)                        # the averaged weights
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List

import torch

from ..client.array import Array, put
from ..client.program import program
from ..errors import PathwaysError
from . import reads


def _groups(tensors: List[torch.Tensor]) -> Dict[Any, List[int]]:
    """Indices of ``tensors`` by dtype (``update_parameters`` calls ``multi_avg_fn``
    once per device and dtype)."""
    out: Dict[Any, List[int]] = {}
    for i, t in enumerate(tensors):
        out.setdefault(t.dtype, []).append(i)
    return out


def _make_update(avg_fn, multi_avg_fn, first: bool):
    """The body of ``AveragedModel.update_parameters`` on lists of tensors, traced."""
    def update(avg: Dict[str, torch.Tensor], cur: Dict[str, torch.Tensor],
               n: torch.Tensor) -> torch.Tensor:
        names = list(avg)
        a, c = [avg[k] for k in names], [cur[k] for k in names]
        with torch.no_grad():
            if first:
                for x, y in zip(a, c):
                    x.copy_(y)
            elif multi_avg_fn is not None:
                for idx in _groups(a).values():
                    multi_avg_fn([a[i] for i in idx], [c[i] for i in idx], n)
            elif avg_fn is None:       # SWA's running mean (its foreach form reads n)
                w = 1.0 / (n + 1)
                for x, y in zip(a, c):
                    if x.is_floating_point() or x.is_complex():
                        x.lerp_(y, w.to(x.dtype))
                    else:
                        x.add_(((y - x) / (n + 1)).to(x.dtype))
            else:
                for x, y in zip(a, c):
                    x.copy_(avg_fn(x, y, n))
        return n + 1
    return update


class Averaged:
    """The workers' copy of an ``AveragedModel`` of a Trainer's model, updated after
    every update; reads of the ``AveragedModel`` sync it (reads.py)."""

    def __init__(self, trainer: Any, averaged: torch.nn.Module) -> None:
        if not isinstance(averaged, torch.optim.swa_utils.AveragedModel):
            raise PathwaysError(
                f"ema= takes a torch.optim.swa_utils.AveragedModel of the model, got "
                f"{type(averaged).__name__}: build it as AveragedModel(model, "
                "multi_avg_fn=get_ema_multi_avg_fn(0.999))")
        self.trainer = weakref.ref(trainer)
        self.averaged = averaged
        own = dict(averaged.module.named_parameters())
        if averaged.use_buffers:
            own.update(averaged.module.named_buffers())
        theirs = {**trainer.replicas[0], **trainer.fixed[0]}
        wrong = [n for n, t in own.items()
                 if n not in theirs or tuple(theirs[n].shape) != tuple(t.shape)]
        if wrong:
            raise PathwaysError(
                f"ema= is an AveragedModel of another model ({', '.join(wrong[:4])} "
                "differ from the Trainer's): build it from the model you pass to "
                "pw.Trainer, AveragedModel(model, ...)")
        self.names = list(own)
        self.n = int(averaged.n_averaged)
        self.arrays: Dict[str, Array] = {
            n: put(t.detach(), trainer._homes[0](n), trainer.param_specs[n])
            for n, t in own.items()}
        self._programs: Dict[bool, Any] = {}
        self._version = self._synced = 0
        self._marked: List = []
        self._self_ref = weakref.ref(self)
        reads.cover(self, averaged)      # reads of the AveragedModel sync it
        weakref.finalize(self, reads._remove, [], self._marked, self._self_ref)

    @property
    def _closed(self) -> bool:
        t = self.trainer()
        return t is None or t._closed

    def update(self) -> None:
        """After an update of the Trainer: average its parameters into ours."""
        tr = self.trainer()
        held = {**tr.replicas[0], **tr.fixed[0]}
        gone = [n for n in self.names if n not in held]
        if gone:
            raise PathwaysError(
                f"{', '.join(gone[:4])} of the AveragedModel given as ema= are no longer "
                "in the Trainer's model: build a new AveragedModel and pw.Trainer after "
                "changing the model's parameters")
        first = self.n == 0
        if first not in self._programs:
            a = self.averaged
            self._programs[first] = program(
                _make_update(a.avg_fn, a.multi_avg_fn, first),
                name=f"ema_update_{type(tr.model).__name__}")
        # one call per slice that holds weights: a pipeline stage's beside it (under
        # MultiIsland the first island's replica, which every island's equals)
        by_slice: Dict[int, List[str]] = {}
        for n in self.names:
            by_slice.setdefault(id(self.arrays[n].slice), []).append(n)
        for names in by_slice.values():
            self._programs[first]({n: self.arrays[n] for n in names},
                                  {n: held[n] for n in names}, torch.tensor(self.n))
        self.n += 1
        self._version += 1

    # -- what reads.py asks of the owner of watched tensor dicts
    def read(self, d, key) -> None:
        if key is reads._ALL and reads.updating_average(self.averaged):
            raise PathwaysError(
                "ema.update_parameters(model) in the loop: pw.Trainer(ema=ema) already "
                "updates the AveragedModel after every step, on the workers. Remove the "
                "call (or build the Trainer without ema= to update it yourself, which "
                "fetches the weights every step)")
        if self._synced != self._version:
            self._sync_if_stale()

    @reads.internal
    def _sync_if_stale(self, optimizer: bool = False) -> None:
        if self._synced == self._version or self._closed or \
                torch.compiler.is_compiling():
            return
        a, tr = self.averaged, self.trainer()
        tensors = dict(a.module.named_parameters())
        tensors.update(a.module.named_buffers())
        with torch.no_grad():
            for n in self.names:
                tensors[n].copy_(self.arrays[n].torch())
            if not a.use_buffers:      # update_parameters copies the model's buffers
                fixed = tr.fixed[0]
                for n, b in a.module.named_buffers():
                    if n in fixed:
                        b.copy_(fixed[n].torch())
            a.n_averaged.fill_(self.n)
        self._synced = self._version

    # -- checkpoints
    def state(self) -> Dict[str, Any]:
        return {"tensors": {n: a.torch() for n, a in self.arrays.items()}, "n": self.n}

    def load_state(self, st: Dict[str, Any]) -> None:
        tr = self.trainer()
        self.arrays = {n: put(st["tensors"][n], tr._homes[0](n), tr.param_specs[n])
                       for n in self.names}
        self.n = int(st["n"])
        self._version += 1

    def checkpoint_arrays(self) -> Dict[str, Array]:
        return {f"ema.{n}": a for n, a in self.arrays.items()}

    def wanted(self) -> Dict[str, tuple]:
        tr = self.trainer()
        return {f"ema.{n}": (tr._homes[0](n), a.shape, a.dtype, tr.param_specs[n])
                for n, a in self.arrays.items()}

    def loaded(self, got: Dict[str, Array], n: int) -> None:
        self.arrays = {k: got[f"ema.{k}"] for k in self.names}
        self.n = n
        self._version += 1


reads.SELF_READING.add(Averaged)
