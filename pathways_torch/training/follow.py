"""What a script does to a ``pw.Trainer``'s module and optimizer between steps.

In a torch loop the module and the optimizer *are* the training state. A script that
loads pretrained weights after building everything, restores its optimizer from a
checkpoint, re-initialises a layer, swaps in a new head, adds a param group to unfreeze
a backbone or clips a critic's weights between steps gets exactly that in its next step.
Here the state lives on the workers, so before each step (and ``evaluate``, ``predict``,
``state_dict``, ``save``, ``sync_to``) the Trainer looks at what changed since the module
last agreed with the workers, and follows it:

- **values**: a parameter or buffer written in place (``load_state_dict``,
  ``nn.init``, ``with torch.no_grad(): p.clamp_(...)``, ``p.data = ...``) is put again;
  torch's version counter and the storage pointer say which, for about 0.3 µs a tensor;
- **structure**: a parameter, buffer or submodule assigned (a new head), a param group
  added, ``requires_grad`` flipped, or the optimizer's state replaced
  (``optimizer.load_state_dict``): the Trainer lays its workers out again, keeping the
  arrays of everything unchanged (the new programs trace and compile once);
- **attributes**: a module's Python numbers, flags and strings (ProGAN's fade-in
  ``alpha``, a dropout rate schedule, a config's field), which a trace keeps as
  constants: a change traces again (``Attributes``).

After a step the module holds, of what that step updated (trained parameters,
BatchNorm's statistics), the values of before it until something reads it: every read
through the module syncs first (reads.py). A tensor changed in place without such a read
(through a reference kept from before the step, or the optimizer's ``param_groups``) was
computed from old numbers: the next step raises ``StaleModuleError`` rather than train
on them or drop the change. ``model.load_state_dict`` is exempt (it replaces what it
loads, whatever was there), and so is what no step writes (a frozen encoder, a GAN's
discriminator inside the generator's Trainer synced from its own Trainer, a temperature
buffer): the workers' buffer ids say which.

A change through ``p.data`` (``p.data.clamp_()``) bypasses torch's version counter: it
is seen for tensors the script read through the module since the last record (their
CRC-32 changed), not through a reference kept from before. ``del module.attr`` is not
seen.
"""

from __future__ import annotations

import functools
import itertools
import types
import warnings
import weakref
import zlib
from typing import Dict, List, Optional, Set, Tuple

import torch

from ..client.array import put
from ..errors import PathwaysError, RetraceWarning, StaleModuleError, warn_at_caller
from ..parallel.strategies import Pipeline
from . import leaks, optim as fopt, reads


# Trainers' watches, told by torch's global registration hooks when a module they
# watch gets a parameter, buffer or submodule assigned
_WATCHES: "weakref.WeakSet[Watch]" = weakref.WeakSet()
_HOOKED = False


def _assigned(module, name, value):
    if torch.compiler.is_compiling():     # the Trainer's own tracing swaps tensors in
        return None
    for w in list(_WATCHES):
        if id(module) in w.module_ids:
            w.reshaped = True
    return None


def _hook_registrations() -> None:
    global _HOOKED
    if not _HOOKED:
        from torch.nn.modules import module as m
        m.register_module_parameter_registration_hook(_assigned)
        m.register_module_buffer_registration_hook(_assigned)
        m.register_module_module_registration_hook(_assigned)
        _HOOKED = True


_MISSING = object()
_INTERNAL: frozenset = frozenset()     # nn.Module's own attributes (filled at first use)
_SKIP = (torch.nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType,
         types.BuiltinFunctionType, types.ModuleType, functools.partial)


def _plain(v) -> bool:
    """A value a forward may branch on or compute with, kept as a constant by a trace."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype)):
        return True
    return isinstance(v, (tuple, list)) and len(v) <= 16 and all(
        x is None or isinstance(x, (bool, int, float, str)) for x in v)


class Attributes:
    """What a traced step keeps as constants and a script may change between steps:
    the Python attributes of the model's modules (numbers, flags, strings, short
    tuples), and of plain objects they hold (a Hugging Face config): ProGAN's fade-in
    ``alpha``, an annealed temperature, a dropout or drop-path rate schedule
    (``m.p = ...``); a tensor a module holds as a plain attribute, assigned anew
    (``model.mask = new_mask``); and what the ``loss_fn`` and the modules' forwards
    read from outside (a global ``ALPHA``, a closure's class weights assigned anew, a
    loss module's ``label_smoothing`` or ``weight``). A change traces the programs again
    (``RetraceWarning`` once one has taken ``WARN_AT`` values: keep such a value in a
    buffer, updated in place, which a step takes as an input). Tensors count by
    identity: one changed in place is the trace's own concern (``Traced.stale``)."""

    WARN_AT = 3

    def __init__(self, model: torch.nn.Module, loss_fn=None) -> None:
        global _INTERNAL
        if not _INTERNAL:
            _INTERNAL = frozenset(torch.nn.Module().__dict__)
        self.model, self.loss_fn = model, loss_fn
        self.seen: Dict[str, set] = {}
        self.warned: Set[str] = set()
        self.traces = -1
        self.record()

    def record(self) -> None:
        slots, dicts, held, prefixes = [], [], set(), []
        fakes = leaks._fake_types()
        # tensors torch's older reparametrizations recompute in each forward (weight_norm)
        hooked = {(id(m), name) for m, name, _ in leaks._reparametrized(self.model)}
        roots = [("model", self.model)]
        if isinstance(self.loss_fn, torch.nn.Module) and self.loss_fn is not self.model:
            roots.append(("loss_fn", self.loss_fn))
        for root, module in roots:
            for name, m in module.named_modules():
                d = m.__dict__
                dicts.append(d)
                prefixes.append(f"{root}.{name}" if name else root)
                for k, v in d.items():
                    if k in _INTERNAL:
                        continue
                    path = f"{root}.{name}.{k}" if name else f"{root}.{k}"
                    if _plain(v) or (isinstance(v, torch.Tensor) and
                                     not isinstance(v, fakes) and (id(m), k) not in hooked):
                        # (a tensor the traced forward stored is its output, not read)
                        slots.append((d, k, path))
                    elif hasattr(v, "__dict__") and not isinstance(v, _SKIP) \
                            and not callable(v) and id(v) not in held:
                        held.add(id(v))
                        inner = vars(v)
                        dicts.append(inner)
                        prefixes.append(None)
                        slots += [(inner, k2, f"{path}.{k2}") for k2, v2 in inner.items()
                                  if _plain(v2)]
                if root == "loss_fn":           # its weights are constants of the step
                    for kind in ("_parameters", "_buffers"):
                        table = d[kind]
                        dicts.append(table)
                        prefixes.append(None)
                        slots += [(table, k, f"loss_fn.{name + '.' if name else ''}{k}")
                                  for k in table]
        cells = list(_outside_reads(self.model, self.loss_fn))
        self.slots, self.dicts, self.cells = slots, dicts, cells
        self.sizes = [len(d) for d in dicts]
        self.keys = [set(d) if prefix else None for d, prefix in zip(dicts, prefixes)]
        self.prefixes = prefixes
        self.values = [d.get(k, _MISSING) for d, k, _ in slots]
        self.cell_values = [get() for get, _ in cells]

    def _now(self):
        """(path, recorded value, current value) of every watched place."""
        for (d, k, path), v in zip(self.slots, self.values):
            yield path, v, d.get(k, _MISSING)
        for (get, path), v in zip(self.cells, self.cell_values):
            yield path, v, get()

    def changed(self) -> List[str]:
        """Paths of the attributes changed since record (or one added or removed)."""
        if [len(d) for d in self.dicts] != self.sizes:
            return ["an attribute added or deleted"]
        return [path for path, v, x in self._now() if not _same(x, v)]

    def counted(self) -> List[Tuple[str, Optional[int], int]]:
        """Integer attributes changed since record, with their values then and now,
        when only a trace ran since: what the forward updates in Python (a call count,
        ``self.calls += 1``; a ring buffer's position, ``self.ptr = (self.ptr + B) %
        K``), which only the trace ran."""
        out = [(path, v, d.get(k)) for (d, k, path), v in zip(self.slots, self.values)
               if type(v) is int and type(d.get(k)) is int and d.get(k) != v]
        for d, keys, prefix in zip(self.dicts, self.keys, self.prefixes):
            if prefix is not None and len(d) != len(keys):       # set in the forward
                out += [(f"{prefix}.{k}", None, v) for k, v in list(d.items())
                        if k not in keys and type(v) is int]
        return out

    def note(self, paths: List[str]) -> None:
        """Count the values each changed attribute has taken; warn at ``WARN_AT``."""
        for path, old, now in self._now():
            if path not in paths:
                continue
            values = self.seen.setdefault(path, {_shown(old)})
            values.add(_shown(now))
            if len(values) >= self.WARN_AT and path not in self.warned:
                self.warned.add(path)
                name = path.rsplit(".", 1)[-1]
                warnings.warn(
                    f"pw.Trainer: {path} changed between steps ({len(values)} values "
                    f"so far, now {_shown(now)}): a traced step keeps what the model and "
                    "loss_fn read from Python as constants, so each value traces and "
                    "compiles the step again. Keep a value that changes often in a "
                    f"buffer of the model (model.register_buffer({name!r}, "
                    "torch.tensor(value)), updated in place with .fill_() or .copy_() "
                    "and read through the model): each step then takes it as an input, "
                    "without a trace", RetraceWarning, stacklevel=4)


def _same(now, before) -> bool:
    if now is before:
        return True
    if isinstance(now, torch.Tensor) or isinstance(before, torch.Tensor):
        return False                    # a tensor assigned anew
    try:
        return bool(now == before)
    except Exception:
        return False


def _shown(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor {tuple(v.shape)} at {id(v):#x}"
    return repr(v)


_GLOBALS: Dict[object, Tuple[str, ...]] = {}


def _global_names(code) -> Tuple[str, ...]:
    """The globals a function's code (and the functions and lambdas it defines) reads:
    its LOAD_GLOBAL names, not attribute names (``co_names`` holds both)."""
    names = _GLOBALS.get(code)
    if names is None:
        import dis
        found = []
        for ins in dis.get_instructions(code):
            if ins.opname == "LOAD_GLOBAL":
                found.append(ins.argval)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                found += _global_names(c)
        names = _GLOBALS[code] = tuple(dict.fromkeys(found))
    return names


def _watched(v) -> bool:
    return _plain(v) or isinstance(v, torch.Tensor)


def _outside_reads(model: torch.nn.Module, loss_fn):
    """(getter, path) for each value the ``loss_fn`` and the model's forwards read
    from outside: closure cells, globals, a bound method's object's attributes."""
    fns = []
    if loss_fn is not None:
        fns.append(("loss_fn", loss_fn))
    kinds = {type(m) for m in model.modules()}
    if isinstance(loss_fn, torch.nn.Module):
        kinds |= {type(m) for m in loss_fn.modules()}
    for cls in kinds:
        fwd = getattr(cls, "forward", None)
        if fwd is not None and getattr(fwd, "__module__", "").split(".")[0] != "torch":
            fns.append((f"{cls.__name__}.forward", fwd))
    for where, fn in fns:
        if isinstance(fn, functools.partial):
            fn = fn.func
        if getattr(fn, "__module__", None) and fn.__module__.split(".")[0] == "torch":
            continue                    # torch's own functions (F.cross_entropy)
        if isinstance(fn, torch.nn.Module):
            fn = type(fn).forward
        owner = getattr(fn, "__self__", None)
        if owner is not None and not isinstance(owner, torch.nn.Module) and \
                hasattr(owner, "__dict__"):
            d = vars(owner)
            for k, v in list(d.items()):
                if _watched(v):
                    yield (lambda d=d, k=k: d.get(k, _MISSING)), f"{where}: self.{k}"
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is None:
            continue
        for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if _watched(v):
                yield (lambda c=cell: _cell(c)), f"{where}: {name}"
        g = getattr(fn, "__globals__", {})
        for name in _global_names(code):
            if name in g and _watched(g[name]):
                yield (lambda g=g, n=name: g.get(n, _MISSING)), f"{where}: global {name}"


def _cell(c):
    try:
        return c.cell_contents
    except ValueError:
        return _MISSING


def _traces(tr) -> int:
    return sum(len(p._traces) for p in tr._programs.values())


def after_call(tr) -> None:
    """After a step's programs ran: a trace that happened may have set attributes (a
    forward caching a flag); those values are the ones the programs now hold. And it
    may have left traced tensors where the script keeps values (leaks.py)."""
    a = tr._watch.attributes
    n = _traces(tr)
    if n != a.traces:
        warned = tr._watch.warned
        for path, old, now in a.counted():
            if f"count:{path}" not in warned:
                warned.add(f"count:{path}")
                attr = path.rsplit('.', 1)[-1]
                how = f"was set to {now}" if old is None else f"went from {old} to {now}"
                warn_at_caller(
                    f"pw.Trainer: {path} {how} while the step was "
                    "traced: the forward updates a Python attribute (a count, a "
                    "position in a queue), which runs only while tracing, so later steps "
                    "leave it as it is (in torch every forward updates it). Keep it in a "
                    f"buffer (self.register_buffer({attr!r}, torch.tensor({old or 0})), then "
                    f"self.{attr} += 1 or self.{attr}.copy_(...) in the forward, indexing "
                    "with the tensor): the step updates it every call", UserWarning)
        leaks.check(tr)           # a traced tensor kept by the script's Python
        a.record()
        a.traces = n
        tr._watch.foreign = _foreign_watches(tr)


def _foreign_watches(tr) -> list:
    """The watches of other Trainers whose module's tensors ``tr``'s traced programs
    read as constants: a teacher that its own Trainer trains, called in this one's
    ``loss_fn`` (knowledge distillation)."""
    read = {id(t) for p in tr._programs.values() for traced in p._traces.values()
            for t, _ in traced.sources}
    if not read:
        return []
    return [weakref.ref(w) for w in list(_WATCHES)
            if w is not tr._watch and not read.isdisjoint(w.ids)]


def _refresh_foreign(tr) -> None:
    """Before a step: bring the modules of ``_foreign_watches`` (and, before the first
    trace tells which, of other Trainers' modules the ``loss_fn`` reaches) up to their
    Trainers' latest steps. Their tensors change in place then, which makes the
    programs that read them trace again with the new values, as torch's step reads
    them."""
    watches = [ref() for ref in tr._watch.foreign]
    reached = tr._watch.reached
    if reached is None:
        reached = tr._watch.reached = frozenset(
            id(v) for _, v in leaks._reach(tr.loss_fn) if isinstance(v, torch.nn.Module))
    if reached:
        watches += [w for w in list(_WATCHES)
                    if w is not tr._watch and not reached.isdisjoint(w.module_ids)]
    for w in watches:
        other = w.owner() if w is not None else None
        if other is not None and w.stale_names(other):
            other._sync(None, optimizer=False)


def _tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _optimizer_layout(optimizer) -> tuple:
    """Which state dicts and groups the optimizer has: ``load_state_dict`` replaces
    them, ``add_param_group`` adds one, a group's params list can grow."""
    return tuple((id(o.state), tuple((id(g), len(g["params"])) for g in o.param_groups))
                 for o in fopt.members(optimizer))


class Watch:
    """The module's tensors and the optimizer's layout as of the last time the module
    and the workers agreed (``record``), and what changed since."""

    def __init__(self, model: torch.nn.Module, optimizer, arrays: Dict[str, int],
                 loss_fn=None) -> None:
        self.model, self.optimizer = model, optimizer
        self.reshaped = False            # something was assigned into the module
        self.loaded: Set[str] = set()    # written by model.load_state_dict since record
        self.buffers_touched = False     # a forward in train mode on the client
        self.owner = lambda: None        # the Trainer, weakly (set by it)
        self.attributes = Attributes(model, loss_fn)
        # the torch optimizer's state tensors as of its last sync (record_state)
        self.opt_record: Dict[str, Dict[str, tuple]] = {}
        self.warned: Set[str] = set()    # what the Trainer warned about, once each
        self.foreign: list = []          # other Trainers' watches its programs read
        self.reached = None              # ids of the modules its loss_fn reaches
        _hook_registrations()
        _WATCHES.add(self)
        self.record(arrays)

    def record(self, arrays: Dict[str, int]) -> None:
        """The module and optimizer agree with the workers now, whose buffers are
        ``arrays`` (name -> the Array's buffer id: a step that updates one in place
        gives it a new id, which makes the module's copy stale)."""
        self.arrays = arrays
        named = _tensors(self.model)
        self.tensors: List[Tuple[str, torch.Tensor, int, int]] = [
            (n, t, t._version, t.data_ptr()) for n, t in named.items()]
        self.kinds = {n: (id(t), t.dtype, tuple(t.shape)) for n, t in named.items()}
        self.ids = frozenset(id(t) for t in named.values())
        self.module_ids = frozenset(id(m) for m in self.model.modules())
        self.layout = _optimizer_layout(self.optimizer)
        self.reshaped, self.buffers_touched = False, False
        self.loaded = set()
        self.exposed: Set[int] = set()        # ids of tensor dicts the script read
        self.prints: Dict[int, int] = {}      # id(tensor) -> its CRC-32 when read
        self._stale: Tuple[int, Set[int]] = (-1, set())      # (update count, ids)

    def record_state(self, tr) -> None:
        """The torch optimizer's state was just synced: its tensors and their version
        counters, so an in-place change before the next step shows (state_changes)."""
        self.opt_record = {}
        for n in tr.states[0]:
            st = _torch_state(tr, n)
            if st:
                self.opt_record[n] = {k: (v, v._version) for k, v in st.items()
                                      if isinstance(v, torch.Tensor)}

    def stale_names(self, tr) -> Set[str]:
        """Names of the module's tensors that a step updated since record (their worker
        Arrays changed): the ones a read must fetch."""
        now = array_ids(tr)
        return {n for n in now if now[n] != self.arrays.get(n)}

    def stale(self, tr) -> Set[int]:
        """``stale_names`` as ids of the module's tensors, kept for the update count."""
        if self._stale[0] != tr._version:
            names = self.stale_names(tr)
            self._stale = (tr._version, {id(t) for n, t, _, _ in self.tensors if n in names})
        return self._stale[1]

    def expose(self, d: dict) -> None:
        """The script read the tensor dict ``d`` (reads.py): fingerprint its tensors
        once, so a write through ``.data`` shows at the next step."""
        if id(d) in self.exposed:
            return
        self.exposed.add(id(d))
        for t in dict.values(d):
            if t is not None:
                self.prints[id(t)] = _crc(t)

    def written(self) -> List[str]:
        """Names of the tensors changed in place (or given new storage) since record."""
        out = [n for n, t, v, p in self.tensors if t._version != v or t.data_ptr() != p
               or (id(t) in self.prints and _crc(t) != self.prints[id(t)])]
        if self.buffers_touched:
            out += [n for n, _ in self.model.named_buffers() if n not in out]
        return out

    def retyped(self, written: List[str]) -> bool:
        """Whether a written tensor changed dtype or shape (``model.bfloat16()`` swaps
        each parameter's ``.data``): the layout, the state and the programs change."""
        names = set(written)
        return any(self.kinds.get(n) != (id(t), t.dtype, tuple(t.shape))
                   for n, t, _, _ in self.tensors if n in names)

    def structure_changed(self) -> bool:
        """A tensor assigned into the module (new, replaced, another dtype or shape) or
        the optimizer's groups or state replaced since record."""
        if self.layout != _optimizer_layout(self.optimizer):
            return True
        if not self.reshaped:
            return False
        named = _tensors(self.model)
        if {n: (id(t), t.dtype, tuple(t.shape)) for n, t in named.items()} != self.kinds:
            return True
        self.module_ids = frozenset(id(m) for m in self.model.modules())
        self.reshaped = False            # assigned the same tensors again: nothing to do
        return False

    def on_load(self, state_dict, prefix: str) -> None:
        """``model.load_state_dict(state_dict)`` is about to replace these tensors."""
        self.loaded |= {k[len(prefix):] for k in state_dict if k.startswith(prefix)}


_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _crc(t: torch.Tensor) -> int:
    """A CRC-32 of the tensor's bytes (a write through ``.data`` changes it)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous().reshape(-1)
    view = _VIEWS.get(t.element_size())
    if view is None or t.device.type != "cpu":
        return 0
    return zlib.crc32(t.view(view).numpy())


def _torch_state(tr, n: str):
    """The torch optimizer's state of trained parameter ``n`` (no read hook), or None."""
    p = tr._held[n]
    for o in fopt.members(tr.optimizer):
        st = dict.get(o.state, p)
        if st is not None:
            return st
    return None


def state_changes(tr) -> Tuple[List[str], Dict[str, List[str]]]:
    """What the script did to the torch optimizer's state of trained parameters since
    it was synced: parameters whose state it removed or emptied (``opt.state.clear()``,
    ``opt.state[p] = {}``: a reset, as torch's next step starts it again), and state
    tensors it replaced or changed in place (``exp_avg.zero_()``)."""
    w = tr._watch
    touched: set = set()
    for o in fopt.members(tr.optimizer):
        got = getattr(o.state, "touched", None)
        if got:
            touched |= got
            got.clear()
    reset, changed = [], {}
    if not touched and not w.opt_record:
        return reset, changed
    everything = reads._ALL in touched
    for n in tr.states[0]:
        st = _torch_state(tr, n)
        rec = w.opt_record.get(n)
        if everything or id(tr._held[n]) in touched:
            if not st:
                reset.append(n)
            else:
                changed[n] = [k for k, v in st.items() if isinstance(v, torch.Tensor)]
        elif rec:
            if not st or set(rec) - set(st):
                reset.append(n)
            else:
                keys = [k for k, (t, v) in rec.items() if st[k] is not t or t._version != v]
                if keys:
                    changed[n] = keys
    w.opt_record = {}             # compared once: a read before the next step records again
    return reset, changed


def push_state(tr, reset: List[str], changed: Dict[str, List[str]]) -> None:
    """Put on the workers what ``state_changes`` found."""
    if not (reset or changed) or tr._book is not None:
        return
    fresh = tr._initial_states(reset) if reset else {}
    for r, home_of in enumerate(tr._homes):
        for n in reset:
            tr.states[r][n] = {k: put(t, home_of(n), tr._state_spec(n, t))
                               for k, t in fresh[n].items()}
        for n, keys in changed.items():
            st = _torch_state(tr, n)
            for k in keys:
                v, old = st[k], tr.states[r][n].get(k)
                t = (v.detach().clone() if isinstance(v, torch.Tensor) else
                     torch.tensor(v, dtype=old.dtype if old is not None else None))
                check_state_shapes(n, tr._held[n], {k: t})
                tr.states[r][n][k] = put(t, home_of(n), tr._state_spec(n, t))


def follow(tr, *, discard_stale: bool = False) -> None:
    """Bring ``tr``'s workers up to what the script did to its module and optimizer.

    With ``discard_stale`` (an explicit ``sync_to``, which overwrites the module),
    values changed in place on a stale module are left for the fetch to overwrite
    instead of raising."""
    w = tr._watch
    _sync_sharers(tr)
    _refresh_foreign(tr)
    push_state(tr, *state_changes(tr))      # the optimizer's state, reset or changed
    attrs = w.attributes.changed()
    if attrs:                      # a traced step holds them as constants: trace again
        w.attributes.note(attrs)
        w.attributes.record()
        tr._programs.clear()
        w.attributes.traces = 0
    written = w.written()
    # the fingerprints of what the script read were compared once; a read before the
    # next step takes them again (keeping them would cost a pass a step)
    w.prints, w.exposed = {}, set()
    reshaped = w.structure_changed() or (bool(written) and w.retyped(written))
    flags = _flags(tr._held)
    if not (written or reshaped or flags != tr._flags):
        return
    # stale in the module: what a step updated since (trained parameters, BatchNorm's
    # statistics), not what no step writes (a frozen parameter, a constant buffer)
    now = array_ids(tr)
    old = w.arrays
    bad = [n for n in written if now.get(n) != w.arrays.get(n) and n not in w.loaded]
    if bad and not discard_stale:
        raise StaleModuleError(
            f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''} of the module "
            f"changed in place after trainer.step, while the module held the values from "
            "before that step (the trained values live on the workers; reads through the "
            "module fetch them, but this write came through a reference kept from "
            "before, or the optimizer's param_groups): the change was computed from old "
            "numbers. Call trainer.sync_to() (or read the tensors through the module) "
            "before changing them; the next step then takes the module's values")
    fresh = [n for n in written if n not in bad]
    was = {}                       # a trained parameter's name -> its name before
    if reshaped or [f[0] for f in flags] != [f[0] for f in tr._flags]:
        was = renamed(tr)
        relayout(tr, fresh, was)
    else:
        if flags != tr._flags:     # only the gradient hooks changed: trace again
            tr._flags = flags
            tr._programs.clear()
        push(tr, fresh)
    # what stays stale in the module (not put from it here) stays marked so; ``bad``
    # ones are overwritten by the fetch that follows
    ids = {}
    for n, i in array_ids(tr).items():
        b = was.get(n, n)                   # its name when ``now`` and ``old`` were taken
        ids[n] = old.get(b) if i == now.get(b) and i != old.get(b) else i
    w.record(ids)


def renamed(tr) -> Dict[str, str]:
    """Trained parameters now under another name (new name -> old): the same object
    moved, as ``torch.nn.utils.prune`` moves ``weight`` to ``weight_orig`` and
    ``prune.remove`` moves it back. torch's optimizer state belongs to the object, so
    it goes on from where it was."""
    w = tr._watch
    by_object = {id(p): n for n, p in tr._held.items()}
    tensors = _tensors(tr.model)
    out = {}
    for n, t in tensors.items():
        o = by_object.get(id(t))
        if (o is not None and o != n and tensors.get(o) is not t
                and w.kinds.get(n, (None,))[0] != id(t)
                and w.kinds.get(o) == (id(t), t.dtype, tuple(t.shape))):
            out[n] = o
    return out


def _rename(tr, was: Dict[str, str]) -> None:
    """Move the workers' Arrays (value, optimizer state, accumulated gradient) of the
    parameters in ``was`` (new name -> old) to their new names."""
    w = tr._watch
    per_replica = [tr.replicas, tr.fixed, tr.states, tr._parked]
    if tr.options.accumulate > 1:
        per_replica.append(tr.acc)
    for n, o in was.items():
        for dicts in per_replica:
            for d in dicts:
                if o in d:
                    d[n] = d.pop(o)
        w.kinds[n] = w.kinds.pop(o)
        tr._held[n] = tr._held.pop(o)
        if tr._book is not None and o in tr._book.mirror:
            tr._book.mirror[n] = tr._book.mirror.pop(o)


def _sync_sharers(tr) -> None:
    """Other live Trainers that updated tensors of this one's module since they last
    synced (a GAN's discriminator, trained by its own Trainer and held fixed in the
    generator's) copy them into the module first: this step then takes them, as the
    generator's step in a torch loop sees the discriminator's last update."""
    if id(tr) in _SHARING:
        return
    _SHARING.add(id(tr))
    try:
        newer = []
        for other in list(_WATCHES):
            t = other.owner()
            if t is None or id(t) in _SHARING or t._closed:
                continue
            if t._synced != t._version and other.stale(t) & tr._watch.ids:
                t._sync_if_stale(optimizer=False)
            if t._step_clock > tr._state_clock:
                newer.append(t)
        # One optimizer for both (a second Trainer on the same model and optimizer):
        # its state is the last update's, whichever Trainer made it, as in a torch loop.
        for t in sorted(newer, key=lambda t: t._step_clock):
            shared = _shared_state(t, tr)
            if shared:
                push_state(tr, [], shared)
                tr._state_clock = t._step_clock
    finally:
        _SHARING.discard(id(tr))


_CLOCK = itertools.count(1)


def tick() -> int:
    """A number larger than every earlier one: when a Trainer stepped, or took the
    optimizer's state (``_step_clock``, ``_state_clock``)."""
    return next(_CLOCK)


def _shared_state(t, tr) -> Dict[str, List[str]]:
    """The parameters of ``tr`` that ``t`` trains with the same torch optimizer, with
    the keys of their state (after ``t`` synced it into that optimizer)."""
    theirs = {id(o) for o in fopt.members(t.optimizer)}
    if not any(id(o) in theirs for o in fopt.members(tr.optimizer)):
        return {}
    held = {id(p) for p in t._held.values()}
    names = [n for n in tr.states[0] if id(tr._held[n]) in held]
    if not names:
        return {}
    t._sync_if_stale(optimizer=True)
    out = {}
    for n in names:
        st = _torch_state(tr, n)
        if st:
            out[n] = [k for k, v in st.items() if isinstance(v, torch.Tensor)]
    return out


_SHARING: Set[int] = set()     # Trainers in _sync_sharers (two that share, in turn)


def array_ids(tr) -> Dict[str, int]:
    """Each trained or fixed tensor's buffer on the workers (the first replica)."""
    return {n: a._id for d in (tr.replicas[0], tr.fixed[0]) for n, a in d.items()}


def record(tr, *, stale: bool = False) -> None:
    """The Trainer's module and workers agree now (built, synced), or, with ``stale``,
    the workers hold other values of every tensor (a checkpoint loaded): a read
    fetches them, and a change of the module's old values raises."""
    tr._watch.record({} if stale else array_ids(tr))


def push(tr, names: List[str]) -> None:
    """Put the module's current values of ``names`` on every replica's slices."""
    if not names:
        return
    named = _tensors(tr.model)
    for r, home_of in enumerate(tr._homes):
        for n in names:
            where = tr.replicas[r] if n in tr.replicas[r] else tr.fixed[r]
            where[n] = put(named[n].detach(), home_of(n), tr.param_specs[n])


def relayout(tr, fresh: List[str], was: Optional[Dict[str, str]] = None) -> None:
    """Lay the workers out as the module and optimizer are now: train what is in the
    optimizer and requires grad, hold the rest fixed. Arrays of tensors that are the
    same objects as before and not in ``fresh`` stay where they are (moved between
    trained and fixed as needed); new or replaced tensors and ``fresh`` ones are put
    from the module. A parameter frozen keeps its optimizer state, parked; one
    trained again takes it back, or the optimizer's state (a loaded one), or what
    torch's first step would create. A parameter renamed (``was``: new name -> old)
    keeps its Arrays."""
    w = tr._watch
    was = was or {}
    _rename(tr, was)
    specs = {n: tr.param_specs[o] for n, o in was.items()}
    new_name = {o: n for n, o in was.items()}
    fresh = [new_name.get(n, n) for n in fresh]   # prune.remove also writes its .data
    named = dict(tr.model.named_parameters())
    tensors = _tensors(tr.model)
    same = {n for n, t in tensors.items()
            if w.kinds.get(n) == (id(t), t.dtype, tuple(t.shape)) and n not in fresh}
    layout_changed = w.layout != _optimizer_layout(tr.optimizer)
    replaced = [n for n, t in tensors.items() if w.kinds.get(n) != (id(t), t.dtype, tuple(t.shape))]
    if isinstance(tr.parallelism, Pipeline) and (replaced or set(w.kinds) - set(tensors)):
        raise PathwaysError(
            "the model's parameters or buffers were replaced after pw.Trainer was built "
            "with pw.Pipeline, whose stages were cut from the model as it was: build the "
            "Trainer after changing the model")
    ids = {id(p): gi for gi, g in enumerate(tr.optimizer.param_groups) for p in g["params"]}
    held = {n: p for n, p in named.items() if id(p) in ids}
    now = [n for n, p in held.items() if p.requires_grad]
    if tr.micro:
        raise PathwaysError(
            f"the trained parameters changed (requires_grad, the optimizer's groups or the "
            f"module's parameters) after {tr.micro} of the {tr.options.accumulate} step "
            f"calls of an accumulation; change them after the update (the "
            f"{tr.options.accumulate}-th call)")
    if not now:
        raise PathwaysError("no parameter of the optimizer requires grad any more: "
                            "use trainer.evaluate / predict, or unfreeze one")
    replacing_state = layout_changed and _states_replaced(w, tr.optimizer)
    for n in now if not replacing_state else ():
        check_state_shapes(n, held[n], {**tr._parked[0].get(n, {}), **tr.states[0].get(n, {})})
    if isinstance(tr.optimizer, fopt.Chain):
        tr.optimizer.refresh()
    _keep_replaced(tr, tensors)
    tr._held = held
    tr._group_of = {n: ids[id(p)] for n, p in held.items() if p.requires_grad}
    tr._groups = [[n for n in now if tr._group_of[n] == gi]
                  for gi in range(len(tr.optimizer.param_groups))]
    tr._shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    tr._floats = fopt.floats(tr.optimizer)
    tr.opt = dict(fopt.describe(tr.optimizer, tr._dynamic), book=tr._book)
    tr._place(tr.slices)
    for n in [n for n, spec in specs.items() if tr.param_specs[n] != spec]:
        _lay_out_again(tr, n)       # a layout by name (a tensor-parallel plan)
    # the optimizer's state replaces the workers' where the script replaced it. A
    # parameter converted in place (``model.double()`` reassigns each ``.data``: the
    # same object, another dtype) keeps its state in torch, as it was: the workers'
    # is that where steps ran since the optimizer's here was synced (before any step
    # torch has no state, and its first step makes it in the new dtype)
    converted = {n for n, t in tensors.items() if n not in same
                 and w.kinds.get(n, (None,))[0] == id(t) and w.kinds[n][2] == tuple(t.shape)
                 } if tr._opt_synced != tr._version else set()
    keep_state = set() if replacing_state else same | converted
    if keep_state is not same:
        tr.steps = next((int(st["step"]) for st in tr.optimizer.state.values()
                         if "step" in st), tr.steps)
        if tr._book is not None:
            tr._book.mirror = {}
    first = tr._initial_states([n for n in now if not (n in keep_state and (
        n in tr.states[0] or n in tr._parked[0]))])
    for r, home_of in enumerate(tr._homes):
        arrays = {**tr.fixed[r], **tr.replicas[r]}
        states = {**tr._parked[r], **tr.states[r]}

        def value(n):
            if n in same and n in arrays:
                return arrays[n]
            return put(tensors[n].detach(), home_of(n), tr.param_specs[n])

        def state(n):
            if n in keep_state and n in states:
                return states[n]
            return {k: put(t, home_of(n), tr._state_spec(n, t)) for k, t in first[n].items()}

        tr.replicas[r] = {n: value(n) for n in now}
        tr.fixed[r] = {n: value(n) for n in tensors if n not in tr._group_of}
        tr.states[r] = {n: state(n) for n in now}
        tr._parked[r] = {n: states[n] if n in keep_state else
                         {k: put(t.detach().clone(), home_of(n), tr._state_spec(n, t))
                          for k, t in tr.optimizer.state.get(held[n], {}).items()
                          if isinstance(t, torch.Tensor)}
                         for n in held if n not in tr._group_of and (
                             n in states if n in keep_state else n in tr.optimizer.state)}
        if tr.options.accumulate > 1:
            tr.acc[r] = {n: tr.acc[r][n] if n in tr.acc[r] and n in same else
                         put(torch.zeros(tensors[n].shape, dtype=tensors[n].dtype),
                             home_of(n), tr.param_specs[n]) for n in now}
    tr._flags = _flags(held)
    tr._modules = list(tr.model.modules())
    tr._modes = modes(tr._modules)
    reads.cover(tr)               # new submodules: their reads sync too
    reads.cover_state(tr)         # a state dict loaded into the optimizer: likewise
    tr._programs.clear()          # their update names the trained parameters
    w.attributes.record()         # of the modules there are now


def _lay_out_again(tr, n: str) -> None:
    """Put the Arrays of ``n`` again, laid out as ``tr.param_specs`` says now."""
    for r, home_of in enumerate(tr._homes):
        for dicts in (tr.replicas, tr.fixed, tr.acc if tr.options.accumulate > 1 else []):
            if n in dicts[r]:
                dicts[r][n] = put(dicts[r][n].torch(), home_of(n), tr.param_specs[n])
        for dicts in (tr.states, tr._parked):
            if n in dicts[r]:
                dicts[r][n] = {k: put(t := a.torch(), home_of(n), tr._state_spec(n, t))
                               for k, a in dicts[r][n].items()}


def _keep_replaced(tr, tensors: Dict[str, torch.Tensor]) -> None:
    """A trained parameter the script replaced in the module (``old = m.head;
    m.head = nn.Linear(...)``) is dropped from the workers: first its trained value
    and optimizer state go into the old tensor and ``optimizer.state`` of it, which
    held those of the last sync. In torch the old head keeps what it learned, and
    putting it back (``m.head = old``) trains on from there."""
    stale = tr._watch.stale_names(tr)
    state_stale = tr._opt_synced != tr._version
    gone = {n: p for n, p in tr._held.items()
            if tensors.get(n) is not p and n in tr.replicas[0]
            and (n in stale or state_stale)}
    for n, p in gone.items():
        value = tr.replicas[0][n].torch()
        if value.shape != p.shape or value.dtype != p.dtype:
            continue
        if n in stale:
            with torch.no_grad():
                p.copy_(value)
        # (its state too when only the values were read since: weight_norm applied
        # mid-training reads the weight it replaces, torch's optimizer keeps the state)
        st = tr.states[0].get(n)
        if st and state_stale:
            tr.optimizer.state[p].update({k: a.torch().clone() for k, a in st.items()})


def check_state_shapes(name: str, p: torch.Tensor, state) -> None:
    """The optimizer's state of ``p`` (tensors or the workers' Arrays) has ``p``'s
    shape; torch's next step would fail otherwise (a parameter resized in place, as
    Hugging Face's ``resize_token_embeddings`` does), and so does this."""
    wrong = [f"{k} {list(v.shape)}" for k, v in state.items()
             if hasattr(v, "shape") and len(v.shape) and tuple(v.shape) != tuple(p.shape)]
    if wrong:
        raise PathwaysError(
            f"{name} is {list(p.shape)} but the optimizer's state for it is "
            f"{', '.join(wrong)}: the parameter changed shape after the optimizer "
            "stepped it (Hugging Face's resize_token_embeddings resizes in place), and "
            "torch's next optimizer.step() would fail the same way. Build a new optimizer "
            "(and pw.Trainer) after resizing, or resize before building them")


def _states_replaced(w: Watch, optimizer) -> bool:
    """Whether an optimizer's state dict was replaced (``load_state_dict``), not only
    its groups extended."""
    return any(old[0] != new[0] for old, new in zip(w.layout, _optimizer_layout(optimizer)))


def modes(modules: List[torch.nn.Module]) -> tuple:
    """Each module's train/eval flag: a training step traces the modes the user set."""
    return tuple(m.training for m in modules)


def _flags(held: Dict[str, torch.Tensor]) -> tuple:
    """What decides a step program besides shapes: which parameters require grad, and
    the gradient hooks registered on them."""
    return tuple((p.requires_grad, tuple(p._backward_hooks or ())) for p in held.values())
