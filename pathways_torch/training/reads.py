"""What a script reads from a ``pw.Trainer``'s module and optimizer: the trained values.

In a torch loop ``optimizer.step()`` updates the module in place; here the values live on
the workers. So every read the Trainer can see syncs first, when an update happened since
the last sync (one fetch then, none otherwise):

- ``model.state_dict()`` and ``optimizer.state_dict()`` (``torch.save`` at the end of
  training), and a forward on the client (generation, a quick eval): hooks;
- ``copy.deepcopy(model)`` (a best-model snapshot) and pickling the whole module
  (``torch.save(model)``): a marker at the front of each module's ``__dict__``, which
  copy and pickle reach before the parameters;
- building another Trainer on the same parameters (a linear probe, then a fine-tune
  with a new optimizer): the new one syncs the old first.

Reads of ``model.parameters()`` or ``model.fc.weight`` cannot be seen: call
``trainer.sync_to()`` before them. None of this outlives the Trainer (weak references),
and none of it is pickled or copied with the module: the hook dicts pickle without the
Trainer's hooks and the marker pickles as ``None``.

Example::

    trainer = pw.Trainer(model, opt, loss_fn, slice=s)
    for x, y in batches:
        trainer.step(x, y)
    best = copy.deepcopy(model)        # the trained weights, as in a torch loop
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, List

import torch

from . import optim as fopt

MARKER = "_pathways_sync"


class _Hook:
    """A hook of a Trainer on its module or optimizer; it holds the Trainer weakly."""

    def __init__(self, fn, ref) -> None:
        self.fn, self.ref = fn, ref

    def __call__(self, owner, *args, **kwargs):
        if torch.compiler.is_dynamo_compiling():
            # the user's torch.compile(model) traces the hook: a graph break, so the
            # sync runs when the compiled forward runs, not once while it compiles
            return _eagerly()(self, owner, *args, **kwargs)
        return self.run(owner, *args, **kwargs)

    def run(self, owner, *args, **kwargs):
        t = self.ref()
        # a copy of the module or optimizer made before the hook dicts dropped it (or
        # the user's own copy of the dict) is not the Trainer's business
        if t is not None and (owner is t.model or any(
                owner is o for o in fopt.members(t.optimizer))):
            self.fn(t, owner, *args, **kwargs)
        return None


_EAGER = None


def _eagerly():
    """``_Hook.run``, never traced by dynamo (made on first use: dynamo is loaded then)."""
    global _EAGER
    if _EAGER is None:
        _EAGER = torch.compiler.disable(_Hook.run)
    return _EAGER


def _ours(v) -> bool:
    return isinstance(v, _Hook) or isinstance(getattr(v, "hook", None), _Hook)


class _Hooks(collections.OrderedDict):
    """A module's or optimizer's hook dict that copies and pickles without the
    Trainer's hooks, as a plain OrderedDict (loading needs no pathways_torch)."""

    def __reduce__(self):
        return (collections.OrderedDict, (), None, None,
                iter([(k, v) for k, v in self.items() if not _ours(v)]))


def _own_hooks(owner, attr: str) -> None:
    d = getattr(owner, attr)
    if not isinstance(d, _Hooks):
        owner.__dict__[attr] = _Hooks(d)


class _CopySync:
    """At the front of a module's ``__dict__``: ``copy.deepcopy`` and pickle reach it
    before the parameters, and sync the Trainers of the module. Copies and pickles as
    ``None``."""

    __slots__ = ("refs",)

    def __init__(self) -> None:
        self.refs: List = []

    def _sync(self) -> None:
        for r in list(self.refs):
            t = r()
            if t is not None:
                t._sync_if_stale()

    def __deepcopy__(self, memo):
        self._sync()
        return None

    def __copy__(self):
        return None

    def __reduce__(self):
        self._sync()
        return (type(None), ())


def install(trainer: Any) -> None:
    """Sync ``trainer`` before the reads listed above; removed when it is dropped."""
    ref = weakref.ref(trainer)
    model = trainer.model

    def forward(t, owner, *_args, **_kwargs):
        if not torch.compiler.is_compiling():
            t._sync_if_stale()
            # a forward in train mode updates BatchNorm's statistics, in place without
            # torch's version counter: the next step takes the module's buffers
            t._watch.buffers_touched |= owner.training

    def sync(t, owner, *_args, **_kwargs):
        t._sync_if_stale()

    def load(t, owner, state_dict, prefix, *_args):
        t._watch.on_load(state_dict, prefix)      # follow.py: what load replaces

    for attr in ("_forward_pre_hooks", "_state_dict_pre_hooks",
                 "_load_state_dict_pre_hooks"):
        _own_hooks(model, attr)
    handles = [model.register_state_dict_pre_hook(_Hook(sync, ref)),
               model.register_forward_pre_hook(_Hook(forward, ref)),
               model.register_load_state_dict_pre_hook(_Hook(load, ref))]
    for o in fopt.members(trainer.optimizer):
        _own_hooks(o, "_optimizer_state_dict_pre_hooks")
        handles.append(o.register_state_dict_pre_hook(_Hook(sync, ref)))
    marked = []
    for m in model.modules():
        d = m.__dict__
        if not isinstance(d.get(MARKER), _CopySync):
            rest = [(k, v) for k, v in d.items() if k != MARKER]
            d.clear()
            d[MARKER] = _CopySync()
            d.update(rest)
        d[MARKER].refs.append(ref)
        marked.append(weakref.ref(m))
    weakref.finalize(trainer, _remove, handles, marked, ref)


def _remove(handles, marked: List, ref) -> None:
    for h in handles:
        h.remove()
    for r in marked:
        m = r()
        marker = m.__dict__.get(MARKER) if m is not None else None
        if isinstance(marker, _CopySync):
            marker.refs = [x for x in marker.refs if x is not ref]
            if not marker.refs:
                del m.__dict__[MARKER]


def sync_others(model: torch.nn.Module, watches) -> None:
    """Before a new Trainer reads ``model``: every live Trainer that trains one of its
    parameters copies its trained values in (two Trainers in sequence on one model)."""
    mine = {id(p) for p in model.parameters()}
    for w in list(watches):
        t = w.owner()
        if t is not None and any(id(p) in mine for p in t._held.values()):
            t._sync_if_stale()
