"""What a script reads from a ``pw.Trainer``'s module and optimizer: the trained values.

In a torch loop ``optimizer.step()`` updates the module in place; here the values live on
the workers. So every read the Trainer can see syncs first, when an update happened since
the last sync (one fetch then, none otherwise; a read of the module fetches what steps
updated, not the optimizer's state):

- ``model.state_dict()`` and ``optimizer.state_dict()`` (``torch.save`` at the end of
  training), and a forward on the client (generation, a quick eval): hooks;
- ``copy.deepcopy(model)`` (a best-model snapshot) and pickling the whole module
  (``torch.save(model)``): a marker at the front of each module's ``__dict__``, which
  copy and pickle reach before the parameters;
- building another Trainer on the same parameters (a linear probe, then a fine-tune
  with a new optimizer): the new one syncs the old first;
- any other read of the module's tensors: ``model.parameters()``, ``named_buffers()``,
  ``model.fc.weight``, ``model.to(...)``/``model.double()``, an EMA's
  ``update_parameters(model)``, ``parameters_to_vector``: each module's ``_parameters``
  and ``_buffers`` dicts are a ``dict`` subclass whose reads sync first (``Synced``).
  ``model.zero_grad()`` is let through: it reads gradients only; so is
  ``clip_grad_norm_(model.parameters())`` after a step, with a warning that it clips
  nothing (``max_grad_norm=`` does, inside the step);
- ``optimizer.state[p]``: the optimizer's ``state`` is a ``defaultdict`` subclass
  (``SyncedState``) whose reads sync the optimizer's state, and which notes the
  parameters whose state the script sets or removes (``opt.state.clear()``, a reset):
  follow.py puts those again.

An ``AveragedModel`` given as ``ema=`` is watched the same way (``SELF_READING``: its
owner, ema.py, syncs it).

Reads from the Trainer's own methods (``internal``) and from its traces are not the
script's and never sync. A tensor handed out by such a read may then be written in a way
torch's version counter does not see (``p.data.clamp_()``, the WGAN critic's clipping):
the Trainer takes a CRC-32 of each handed-out tensor (4 GB/s here) and compares it before
the next step (follow.py). A script that reads after every step fetches every step; at
the ``WARN_AT``-th step in a row a ``pw.SyncWarning`` points at the line.

None of this outlives the Trainer (weak references), and none of it is pickled or copied
with the module: the hook dicts pickle without the Trainer's hooks, the tensor dicts as
plain dicts and the marker as ``None``.

Example::

    trainer = pw.Trainer(model, opt, loss_fn, slice=s)
    for x, y in batches:
        trainer.step(x, y)
    best = copy.deepcopy(model)        # the trained weights, as in a torch loop
"""

from __future__ import annotations

import collections
import functools
import sys
import weakref
from typing import Any, Callable, List

import torch

from ..errors import SyncWarning, warn_at_caller
from . import optim as fopt

MARKER = "_pathways_sync"
WARN_AT = 5        # steps in a row after which a read synced: SyncWarning

_ALL = object()      # a read of every value of a tensor dict

# not empty while a Trainer's own method runs: its reads of the module are not the
# script's (a list: append and pop are atomic, so threads cannot corrupt the count)
_QUIET: List[int] = []


def internal(fn: Callable) -> Callable:
    """Mark a Trainer method whose reads of the module are its own (no sync)."""
    @functools.wraps(fn)
    def quietly(*args, **kwargs):
        _QUIET.append(1)
        try:
            return fn(*args, **kwargs)
        finally:
            _QUIET.pop()
    return quietly


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
                t._sync_if_stale(optimizer=False)

    def __deepcopy__(self, memo):
        self._sync()
        return None

    def __copy__(self):
        return None

    def __reduce__(self):
        self._sync()
        return (type(None), ())


class Synced(dict):
    """A watched module's ``_parameters`` or ``_buffers``: reading a value (what
    ``parameters()``, ``named_buffers()``, ``module.weight``, ``_apply`` and
    ``state_dict`` do) syncs the Trainers that train it first. Pickles and copies as a
    plain ``dict``."""

    __slots__ = ("refs",)

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.refs: List = []

    def _read(self, key=_ALL) -> None:
        # under torch.compile the module's forward pre-hook syncs, outside the graph
        if _QUIET or torch.compiler.is_dynamo_compiling():
            return
        for r in self.refs:
            t = r()
            if t is not None:
                _on_read(t, self, key)

    def __getitem__(self, key):       # module.weight: kept short, a forward's path
        if self.refs and not _QUIET and not torch.compiler.is_dynamo_compiling():
            for r in self.refs:
                t = r()
                if t is not None and (t._synced != t._version
                                      or type(t) in SELF_READING
                                      or id(self) not in t._watch.exposed):
                    _on_read(t, self, key)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        if self.refs:
            self._read(key)
        return dict.get(self, key, default)

    def items(self):
        if self.refs:
            self._read()
        return dict.items(self)

    def values(self):
        if self.refs:
            self._read()
        return dict.values(self)

    def __reduce__(self):
        return (dict, (), None, None, iter(dict.items(self)))


class SyncedState(collections.defaultdict):
    """A watched optimizer's ``state`` (parameter -> its state): reading it
    (``optimizer.state[p]["exp_avg"]``, a logger of Adam's step count) syncs the
    Trainer's optimizer state first. Pickles and copies as a plain defaultdict."""

    __slots__ = ("refs", "touched")

    def __init__(self, state, refs: List) -> None:
        super().__init__(dict, state)
        self.refs = refs                # the Trainers of this optimizer (weak references)
        self.touched: set = set()       # ids of parameters whose state the script set

    def _touch(self, key) -> None:
        if not _QUIET:
            self.touched.add(key if key is _ALL else id(key))

    def __missing__(self, key):         # a read of a parameter without state: no reset
        value: dict = {}
        collections.defaultdict.__setitem__(self, key, value)
        return value

    def __setitem__(self, key, value) -> None:      # opt.state[p] = {} (a reset)
        self._touch(key)
        collections.defaultdict.__setitem__(self, key, value)

    def __delitem__(self, key) -> None:
        self._touch(key)
        collections.defaultdict.__delitem__(self, key)

    def pop(self, key, *default):
        self._touch(key)
        return collections.defaultdict.pop(self, key, *default)

    def clear(self) -> None:                        # opt.state.clear()
        self._touch(_ALL)
        collections.defaultdict.clear(self)

    def _read(self) -> None:
        if _QUIET or torch.compiler.is_dynamo_compiling():
            return
        live = [t for t in (r() for r in self.refs) if t is not None]
        if live:            # the state is that of the Trainer that stepped last
            t = max(live, key=lambda t: t._step_clock)
            if t._opt_synced != t._version:
                t._sync_if_stale()

    def __getitem__(self, key):
        self._read()
        return collections.defaultdict.__getitem__(self, key)

    def get(self, key, default=None):
        self._read()
        return collections.defaultdict.get(self, key, default)

    def items(self):
        self._read()
        return collections.defaultdict.items(self)

    def values(self):
        self._read()
        return collections.defaultdict.values(self)

    def __reduce__(self):
        return (collections.defaultdict, (dict,), None, None,
                iter(collections.defaultdict.items(self)))


def cover_state(trainer: Any) -> None:
    """Watch the reads of each of the optimizer's ``state`` (again after
    ``optimizer.load_state_dict`` replaced it)."""
    for o in fopt.members(trainer.optimizer):
        if not isinstance(o.state, SyncedState):
            o.state = SyncedState(o.state, [trainer._self_ref])
        elif all(r is not trainer._self_ref for r in o.state.refs):
            o.state.refs[:] = [r for r in o.state.refs if r() is not None]
            o.state.refs.append(trainer._self_ref)


def _grad_readers() -> dict:
    """Code objects of torch's functions that read the module's gradients only."""
    import inspect
    from torch.nn.utils import clip_grad
    out = {torch.nn.Module.zero_grad.__code__: "zero_grad"}
    for name in ("clip_grad_norm_", "clip_grad_value_", "get_total_norm"):
        fn = getattr(clip_grad, name, None)
        if fn is not None:
            out[inspect.unwrap(fn).__code__] = name
    return out


_GRAD_READERS: dict = {}


def _grad_reader() -> str:
    """The name of the torch function reading gradients only (``Module.zero_grad``,
    ``clip_grad_norm_``) that this read comes from, or ``""``."""
    if not _GRAD_READERS:
        _GRAD_READERS.update(_grad_readers())
    f = sys._getframe(3)
    for _ in range(8):
        if f is None:
            return ""
        name = _GRAD_READERS.get(f.f_code)
        if name:
            return name
        f = f.f_back
    return ""


def _warn_clipping(t: Any, name: str) -> None:
    if "clip" in t._watch.warned:
        return
    t._watch.warned.add("clip")
    knob = "max_grad_value" if name == "clip_grad_value_" else "max_grad_norm"
    warn_at_caller(
        f"pw.Trainer: torch.nn.utils.{name} on the module after trainer.step clips "
        "nothing: the step computed the gradients and applied the update on the workers "
        "(the module's .grad are not the step's: none, or those of a backward run on the "
        f"CPU before). Pass {knob}= to pw.Trainer, which clips "
        "inside each step as torch's clipping before optimizer.step() does", UserWarning)


#: owners of watched tensor dicts other than Trainers, which handle reads themselves
#: (``owner.read(d, key)``): ema.py's Averaged
SELF_READING: set = set()


def keep_trained(tensors: List[torch.Tensor]):
    """``capture.KEEPERS``'s entry: when a program read tensors of a module that a
    Trainer trains (``@pw.program def infer(x): return model(x)`` between steps), sync
    that module now and before each later call, so the program computes with the
    trained values (a program traced again when they changed) instead of those of the
    module's last sync. None when no Trainer's module holds any of ``tensors``."""
    from . import follow
    ids = {id(t) for t in tensors}
    owners = [weakref.ref(tr) for tr in (w.owner() for w in list(follow._WATCHES)
                                         if w.ids & ids) if tr is not None]
    if not owners:
        return None

    def keep() -> None:
        for ref in owners:
            tr = ref()
            if tr is not None and tr._synced != tr._version:
                tr._sync_if_stale(optimizer=False)
    keep()
    return keep


def _on_read(t: Any, d: Synced, key) -> None:
    """The script reads ``d[key]`` (or all of ``d``): if a step updated one of those
    tensors since the module last agreed with the workers, sync ``t`` first; then
    fingerprint them (a write the version counter misses shows at the next step)."""
    if type(t) in SELF_READING:
        t.read(d, key)
        return
    w = t._watch
    if t._synced == t._version and id(d) in w.exposed:
        return                          # read since the last sync and fingerprinted
    if t._closed or torch.compiler.is_compiling():
        return
    if t._synced != t._version:
        stale = w.stale(t)
        if key is _ALL:
            hit = any(id(v) in stale for v in dict.values(d))
        else:
            hit = id(dict.get(d, key)) in stale
        reader = _grad_reader() if hit else ""
        if reader:                      # gradients only: nothing to fetch
            if reader != "zero_grad":
                _warn_clipping(t, reader)
            return
        if hit:
            t._read_syncs = t._read_syncs + 1 if t._read_synced == t._version - 1 else 1
            t._read_synced = t._version
            if t._read_syncs == WARN_AT:
                _warn_every_step(w, stale)
            t._sync_if_stale(optimizer=False)
    w.expose(d)


def updating_average(averaged: Any = None) -> bool:
    """Whether ``AveragedModel.update_parameters`` (of ``averaged``, or of any) is on
    the stack: the script's own EMA update reads the module."""
    code = torch.optim.swa_utils.AveragedModel.update_parameters.__code__
    f = sys._getframe(2)
    while f is not None:
        if f.f_code is code and (averaged is None or f.f_locals.get("self") is averaged):
            return True
        f = f.f_back
    return False


def _warn_every_step(w: Any, stale) -> None:
    nbytes = sum(x.numel() * x.element_size() for _, x, _, _ in w.tensors if id(x) in stale)
    if updating_average():
        warn_at_caller(
            f"pw.Trainer: AveragedModel.update_parameters(model) after each of the last "
            f"{WARN_AT} steps copied the trained values ({nbytes / 2**20:.2f} MiB) from "
            "the workers every step. Give the AveragedModel to the Trainer instead, "
            "pw.Trainer(..., ema=ema), and remove the call: it is then updated after "
            "every step on the workers, and reading it syncs it", SyncWarning)
        return
    warn_at_caller(
        f"pw.Trainer: the module's trained tensors were read after each of the last "
        f"{WARN_AT} steps: each read after a step copies the "
        f"trained values ({nbytes / 2**20:.2f} MiB) from the workers, as "
        "trainer.sync_to() does, so the loop waits for every step to finish. Read them "
        "less often (a log line every N steps), or compute what you need on the workers "
        "(a metric in loss_fn's result)", SyncWarning)


def install(trainer: Any) -> None:
    """Sync ``trainer`` before the reads listed above; removed when it is dropped."""
    ref = weakref.ref(trainer)
    model = trainer.model
    trainer._read_syncs, trainer._read_synced = 0, -1

    def forward(t, owner, *_args, **_kwargs):
        if not torch.compiler.is_compiling():
            t._sync_if_stale(optimizer=False)
            # a forward in train mode updates BatchNorm's statistics, in place without
            # torch's version counter: the next step takes the module's buffers
            t._watch.buffers_touched |= owner.training

    def sync(t, owner, *_args, **_kwargs):         # the optimizer's state_dict()
        t._sync_if_stale()

    def sync_module(t, owner, *_args, **_kwargs):  # the module's state_dict()
        t._sync_if_stale(optimizer=False)

    def load(t, owner, state_dict, prefix, *_args):
        t._watch.on_load(state_dict, prefix)      # follow.py: what load replaces

    for attr in ("_forward_pre_hooks", "_state_dict_pre_hooks",
                 "_load_state_dict_pre_hooks"):
        _own_hooks(model, attr)
    handles = [model.register_state_dict_pre_hook(_Hook(sync_module, ref)),
               model.register_forward_pre_hook(_Hook(forward, ref)),
               model.register_load_state_dict_pre_hook(_Hook(load, ref))]
    for o in fopt.members(trainer.optimizer):
        _own_hooks(o, "_optimizer_state_dict_pre_hooks")
        handles.append(o.register_state_dict_pre_hook(_Hook(sync, ref)))
    trainer._marked, trainer._self_ref = [], ref
    cover(trainer)
    cover_state(trainer)
    weakref.finalize(trainer, _remove, handles, trainer._marked, ref)


_TENSOR_DICTS = ("_parameters", "_buffers")


def cover(trainer: Any, model: Any = None) -> None:
    """Watch every module of ``trainer.model`` (or ``model``, for another owner of
    watched tensors: ema.py) as it is now (again after a new submodule is
    assigned): the copy marker and the tensor dicts."""
    ref = trainer._self_ref
    for m in (trainer.model if model is None else model).modules():
        d = m.__dict__
        marker = d.get(MARKER)
        if not isinstance(marker, _CopySync):
            rest = [(k, v) for k, v in d.items() if k != MARKER]
            d.clear()
            d[MARKER] = marker = _CopySync()
            d.update(rest)
        if any(r is ref for r in marker.refs):
            continue
        marker.refs.append(ref)
        for attr in _TENSOR_DICTS:
            if not isinstance(d[attr], Synced):
                d[attr] = Synced(d[attr])
            d[attr].refs.append(ref)
        trainer._marked.append(weakref.ref(m))


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
        for attr in _TENSOR_DICTS if m is not None else ():
            d = m.__dict__.get(attr)
            if isinstance(d, Synced):
                d.refs = [x for x in d.refs if x is not ref]
                if not d.refs:
                    m.__dict__[attr] = dict(d)


def sync_others(model: torch.nn.Module, watches) -> None:
    """Before a new Trainer reads ``model``: every live Trainer that trains one of its
    parameters copies its trained values in (two Trainers in sequence on one model)."""
    mine = {id(p) for p in model.parameters()}
    for w in list(watches):
        t = w.owner()
        if t is not None and any(id(p) in mine for p in t._held.values()):
            t._sync_if_stale()
