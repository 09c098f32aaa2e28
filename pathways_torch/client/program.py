"""``@pw.program``: a torch function compiled once per input signature, called as futures.

A call runs on the slice of its first ``pw.Array`` argument; Arrays from other slices
are moved there first (``Array.to``, worker to worker). Calling a program traces it on first use of a signature (shapes, dtypes, pytree
structure and static Python values), registers the HLO with the slice's executor once
per (program, slice, input shardings), then only queues an ``ExecuteOp`` on the slice's
control stream and returns ``pw.Array`` futures whose shapes, dtypes and shardings are
already known.

Example::

    @pw.program
    def layer(x, w):
        return torch.relu(x @ w)

    y = layer(x, w)                          # pw.Array, returns at once

    @pw.program(out_specs=P(None, None))     # force a replicated output
    def gather(x):
        return x * 2
"""

from __future__ import annotations

import functools
import itertools
import threading
import warnings
import weakref
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch
from torch.utils import _pytree as pytree

from .. import tracing
from ..errors import (PlacementError, RetraceWarning, ShardingError, TraceError,
                      warn_at_caller)
from ..rpc import codec
from ..rpc import pathways_pb2 as pb
from ..sharding import P, as_spec, spec_from_proto, spec_to_proto, validate_spec
from . import graph as graph_mod
from . import runtime, torch_paths
from .array import Array, put, wait
from . import capture
from .capture import TENSOR, Traced, trace

_STATIC_TYPES = (int, float, bool, str, type(None), complex, torch.dtype)
_program_ids = itertools.count(1)


class _Compiled:
    __slots__ = ("program_id", "out_specs", "out_hlo")

    def __init__(self, program_id, out_specs, out_hlo):
        self.program_id = program_id
        self.out_specs = out_specs
        self.out_hlo = out_hlo


class _Fast:
    """What a repeat call with the same Arrays (slice, shapes, dtypes, specs) needs:
    the compiled program, its outputs, and which inputs it donates or updates in place,
    so the call skips flattening, keys, tracing-cache and compile-cache lookups
    (docs/architecture.md, Decision 20)."""
    __slots__ = ("program_id", "outs", "kept", "origin", "single", "static", "tree",
                 "name", "donate", "mutated", "written", "puts", "rng", "traced", "carry")

    def __init__(self, traced: Traced, compiled: _Compiled, origin: str, name: str,
                 donate: tuple, puts: bool) -> None:
        self.program_id = compiled.program_id
        self.outs = list(zip(traced.out_avals, compiled.out_specs, compiled.out_hlo))
        self.kept = traced.kept_outputs
        self.origin = origin
        self.static, self.tree = traced.out_static, traced.out_tree
        self.single = (len(self.static) == 1 and self.static[0] is TENSOR and
                       self.tree.is_leaf())
        self.name = name
        self.donate = donate                    # input positions donated
        self.mutated = traced.mutated_inputs    # input positions updated in place
        self.written = traced.written_by        # output -> the input it updates
        self.carry = _carry(traced)
        self.puts = puts                        # CPU tensors among the inputs
        self.rng = traced.rng                   # a seed is drawn and put per call
        self.traced = traced if traced.sources else None    # to check for staleness

    def build(self, arrays: list):
        if self.single:
            return arrays[0]
        it = iter(arrays)
        return pytree.tree_unflatten([next(it) if s is TENSOR else s for s in self.static],
                                     self.tree)


def _carry(traced: Traced) -> List[int]:
    """ExecuteOp.carry: per output, 1 + the input it is the new value of, or 0 (empty
    for a program that updates no input in place)."""
    written = traced.written_by
    if not written:
        return []
    return [written[o] + 1 if o in written else 0 for o in range(len(traced.out_avals))]


_MISS = object()
_any_autocast = torch._C._is_any_autocast_enabled
_MAX_FAST = 4096        # remembered signatures per program and table


_KEYED_STATICS = frozenset((int, float, bool, str, complex, torch.dtype))


def _static_key(v):
    """A static argument as a cache key: floats by their bits, so that -0.0 is not 0.0
    (1 / x differs) and NaN finds its own trace (NaN != NaN)."""
    t = type(v)
    if t is float:
        return v.hex()
    if t is complex:
        return (v.real.hex(), v.imag.hex())
    return v


def _static_value(part):
    """The value of a static key part ("S", type name, _static_key(value))."""
    v = part[2]
    if part[1] == "float":
        return float.fromhex(v)
    if part[1] == "complex":
        return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    return v


def _tree_key(obj, leaves: list, key: list) -> bool:
    """Walk ``obj`` as torch's pytree flattens it, for Arrays, CPU tensors and static
    values in dicts, lists and tuples: the Arrays and tensors go to ``leaves`` in order,
    and the structure, each leaf's (shape, dtype, spec) and each static value to
    ``key``. False for anything else (another container or leaf type): the call then
    takes the general path, which handles every pytree."""
    t = type(obj)
    if t is Array:
        leaves.append(obj)
        key.append((obj.shape, obj.dtype, obj.sharding))
        return True
    if t is dict:
        key.append(("d", tuple(obj)))
        items = obj.values()
    elif t is tuple or t is list:
        key.append((t, len(obj)))
        items = obj
    elif t is torch.Tensor:
        leaves.append(obj)
        key.append(("T", obj.shape, obj.dtype))
        return True
    elif t in _KEYED_STATICS:
        key.append(("S", t, _static_key(obj)))
        return True
    elif obj is None:
        key.append(None)
        return True
    else:
        return False
    for v in items:
        if not _tree_key(v, leaves, key):
            return False
    return True


def _flat_signature(args) -> Optional[tuple]:
    """(key, slice) of a call whose arguments are all Arrays on one slice, none donated;
    None otherwise. The key: the slice and each Array's (shape, dtype, spec)."""
    try:
        slice_ = args[0].slice
    except (IndexError, AttributeError):
        return None
    key = [slice_.uid]
    for a in args:
        if type(a) is not Array or a.slice is not slice_ or a._donated:
            return None
        key.append((a.shape, a.dtype, a.sharding))
    return tuple(key), slice_


def _tree_signature(args, kwargs) -> Optional[tuple]:
    """(inputs, key, slice) of a call that ``_tree_key`` walks whose Arrays are on one
    slice, none donated; None otherwise."""
    leaves: list = []
    key: list = []
    if not _tree_key((args, kwargs), leaves, key):
        return None
    slice_ = next((a.slice for a in leaves if type(a) is Array), None)
    if slice_ is None:
        return None
    for a in leaves:
        if type(a) is Array and (a.slice is not slice_ or a._donated):
            return None
    key.append(slice_.uid)
    return leaves, tuple(key), slice_


class Program:
    """A compiled, sharded function. Create with the ``@pw.program`` decorator."""

    def __init__(self, fn: Callable, out_specs: Any = None, name: Optional[str] = None,
                 donate_argnums: Tuple[int, ...] = (),
                 seeds: Optional[Callable[[], int]] = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "program")
        self.out_specs = out_specs
        self.donate_argnums = tuple(donate_argnums)
        # Where a call that draws random numbers gets its seed (default: the session's
        # stream, pw.init(seed=)); pw.Trainer passes its own, which its checkpoints hold.
        self._seeds = seeds
        self._traces: dict = {}
        self._static_seen: dict = {}    # static leaf -> values it took (RetraceWarning)
        self._static_warned: set = set()
        self._compiled: dict = {}
        self._fast: dict = {}       # (slice uid, (shape, dtype, spec) per arg) -> _Fast
        self._fast_tree: dict = {}  # (slice uid, _tree_key of (args, kwargs)) -> _Fast
        self._lock = threading.Lock()
        self._stale_traces = 0          # traces a changed outside tensor caused
        self._bound: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._bound_by_id: dict = {}            # (object, program) of unhashable ones

    def __get__(self, obj, objtype=None):
        """``@pw.program`` on a method: the program bound to ``obj``, one per object.
        What it reads from ``obj`` is taken as a closure's values are: tensors are read
        again when changed in place, Python attributes are fixed at the trace (pass
        what changes as an argument). ``donate_argnums`` count ``self`` as 0, as the
        method's signature does."""
        if obj is None:
            return self
        try:
            bound = self._bound.get(obj)
        except TypeError:                       # an unhashable object
            bound = self._bound_by_id.get(id(obj), (None, None))[1]
        if bound is None:
            bound = Program(functools.partial(self.fn, obj), out_specs=self.out_specs,
                            name=self.name, seeds=self._seeds,
                            donate_argnums=tuple(k - 1 for k in self.donate_argnums if k))
            try:
                self._bound[obj] = bound
            except TypeError:
                self._bound_by_id[id(obj)] = (obj, bound)
        return bound

    def draws_random(self) -> bool:
        """Whether a trace of this program draws random numbers (takes a seed per call)."""
        return any(t.rng for t in self._traces.values())

    # ------------------------------------------------------------------ call
    def __call__(self, *args, **kwargs):
        if capture.tracing_now():
            # called from inside another program (or a Trainer's model): part of that
            # trace, as a nested jax.jit is part of its caller's
            return self.fn(*args, **kwargs)
        rec = tracing.CLIENT
        if not rec.on:
            return self._call(args, kwargs)
        t0 = rec.now()
        out = self._call(args, kwargs)
        arrays = [a for a in pytree.tree_leaves(out) if isinstance(a, Array)]
        rec.add("dispatch", self.name, t0, program=self.name,
                buffer_ids=[a._id for a in arrays],
                detail=arrays[0].slice.id if arrays else "")
        return out

    def _call(self, args, kwargs):
        if _any_autocast():             # traced and keyed with the autocast state
            return self._slow_call(args, kwargs)
        if self._fast and not kwargs:
            out = self._fast_call(args)
            if out is not _MISS:
                return out
        if self._fast_tree:
            out = self._tree_call(args, kwargs)
            if out is not _MISS:
                return out
        return self._slow_call(args, kwargs)

    def _fast_call(self, args):
        """A call whose arguments are all Arrays on one slice, with a signature called
        before: only ids, one message and the output Arrays. _MISS otherwise."""
        sig = _flat_signature(args)
        f = self._fast.get(sig[0]) if sig is not None else None
        if f is None:
            return _MISS
        return self._launch_fast(f, sig[1], args)

    def _tree_call(self, args, kwargs):
        """The same for Arrays and CPU tensors in dicts, lists and tuples, beside static
        values (a model's parameters, an optimizer's state and hyperparameters): one
        walk over the arguments gives the inputs and the key."""
        sig = _tree_signature(args, kwargs)
        f = self._fast_tree.get(sig[1]) if sig is not None else None
        if f is None:
            return _MISS
        return self._launch_fast(f, sig[2], sig[0])

    def _launch_fast(self, f: _Fast, slice_, inputs):
        """Queue ``f``'s program on ``inputs`` (Arrays on ``slice_``, CPU tensors to put
        there); its outputs, with torch's in-place updates written back, as the general
        path does. _MISS when an input to donate is passed twice (the general path then
        donates neither)."""
        if f.traced is not None and f.traced.stale():
            return _MISS                # the general path traces again
        donate = f.donate
        if donate:
            ids = [id(a) for a in inputs if type(a) is Array]
            if len(set(ids)) != len(ids):
                return _MISS
        runtime.check_alive(slice_)
        if f.puts:
            inputs = [put(a, slice_, P()) if type(a) is torch.Tensor else a
                      for a in inputs]
        if f.rng:
            seed = self._seeds() if self._seeds is not None else runtime.next_seed()
            inputs = list(inputs)
            inputs.append(put(torch.tensor(seed, dtype=torch.int64), slice_, P()))
        g = graph_mod.current()
        if g is not None:
            g.keep(*inputs)
        conn = slice_._conn
        new_id = conn.new_id
        out_ids = [new_id() for _ in f.outs]
        x = pb.ExecuteOp(program_id=f.program_id, inputs=[a._id for a in inputs],
                         outputs=out_ids, donate=donate)
        if f.carry:
            x.carry.extend(f.carry)
        seq = conn.send(pb.Op(execute=x))
        for k in donate:
            if k not in f.mutated:
                _mark_donated(inputs[k], f.name, g)
        origin = f.origin
        arrays = [Array(slice_, b, seq, shape, dtype, spec, origin, hlo)
                  for b, ((shape, dtype), spec, hlo) in zip(out_ids, f.outs)]
        if not f.written:
            return f.build(arrays[:f.kept])   # (extra outputs are dropped: released)
        kept, written = [], f.written
        for o, new in enumerate(arrays):
            if o in written:
                self._write_back(inputs[written[o]], new)
            elif o < f.kept:
                kept.append(new)
        return f.build(kept)

    #: distinct values of one static argument that make a warning (``RetraceWarning``)
    RETRACE_WARN_AT = 3
    #: distinct sets of input shapes that make one (a full and a last partial batch,
    #: training and evaluation, are two or three)
    SHAPES_WARN_AT = 4

    def _note_shapes(self, key, args, kwargs) -> None:
        """Warn once when the same call traces for its ``SHAPES_WARN_AT``-th set of
        input shapes: a sequence length that changes every batch compiles every batch
        (tens of seconds a length for a small transformer), silently otherwise."""
        tree, parts, autocast = key
        if "shapes" in self._static_warned:
            return
        statics = [p for p in parts if p[0] != "A"]
        shapes = {tuple(p for p in other[1] if p[0] == "A") for other in self._traces
                  if other[0] == tree and other[2] == autocast
                  and [p for p in other[1] if p[0] != "A"] == statics}
        shapes.add(tuple(p for p in parts if p[0] == "A"))
        if len(shapes) < self.SHAPES_WARN_AT:
            return
        self._static_warned.add("shapes")
        mine = [p[1] for p in parts if p[0] == "A"]
        now = [list(shape) for i, shape in enumerate(mine)     # the ones that vary
               if len({len(other) > i and other[i][1] for other in shapes}) > 1][:4]
        warn_at_caller(
            f"program '{self.name}' is traced and compiled again for each new set of "
            f"input shapes ({len(shapes)} so far, now {now}): each costs a trace and an "
            "XLA compile, seconds to minutes. If the lengths vary from batch to batch, "
            "pad them to a few fixed lengths (buckets; a DataLoader collate_fn that pads "
            "to the next multiple of 32 or 64), so the compiled programs are reused",
            RetraceWarning)

    def _note_retrace(self, key, args, kwargs) -> None:
        """Before a new trace: if traces of the same structure and tensor shapes exist,
        count the values each static leaf has taken, and warn once per leaf when one
        reaches ``RETRACE_WARN_AT`` (a Python number that changes every call, say an
        annealed temperature, costs a trace and a compile per value)."""
        tree, parts, autocast = key
        shapes = [p for p in parts if p[0] == "A"]
        seen, warned = self._static_seen, self._static_warned
        for other in self._traces:
            if other[0] != tree or other[2] != autocast or len(other[1]) != len(parts) or \
                    [p for p in other[1] if p[0] == "A"] != shapes:
                continue
            for i, (mine, theirs) in enumerate(zip(parts, other[1])):
                if mine[0] == "S" and mine != theirs and \
                        not getattr(mine[2], "warns_itself", False):
                    values = seen.setdefault(i, {theirs[2]})
                    values.add(mine[2])
                    # (the strings of a batch's list of ids: one warning, not one each)
                    once = "str" if mine[1] == "str" else i
                    if len(values) >= self.RETRACE_WARN_AT and once not in warned:
                        warned.add(once)
                        warnings.warn(
                            f"program '{self.name}' is traced and compiled again for "
                            f"each value of the Python {mine[1]} "
                            f"{self._leaf_name(args, kwargs, i)} ({len(values)} values "
                            f"so far, now {_static_value(mine)!r}): " + (
                                "leave it out of the arguments if the function does not "
                                "use it (a sample's id in a batch dict)"
                                if mine[1] == "str" else
                                "pass it as a tensor (torch.tensor(value)) to make it an "
                                "input"),
                            RetraceWarning, stacklevel=5)

    def _check_no_aliased_update(self, tensors, mutated) -> None:
        """torch sees an in-place update of an argument through every other argument
        that is the same tensor; a program traces them as separate inputs, so it would
        compute with the old value there: refused (the fast paths never take a call
        whose input to update is passed twice)."""
        for k in mutated:
            a = tensors[k]
            if isinstance(a, Array) and sum(b is a for b in tensors) > 1:
                raise TraceError(
                    f"program '{self.name}' updates its input {k} in place, and the same "
                    "pw.Array is passed as another input too: torch would see the update "
                    "through both, the program traces two tensors. Pass it once")

    def _note_stale(self) -> None:
        """Count the traces a changed outside tensor caused; warn once at
        ``RETRACE_WARN_AT`` (a class-weight tensor a ``loss_fn`` closes over, updated
        in place every step, traced and compiled the step every step, silently)."""
        self._stale_traces += 1
        if self._stale_traces == self.RETRACE_WARN_AT:
            warnings.warn(
                f"program '{self.name}' is traced and compiled again each time a CPU "
                "tensor it reads from outside its arguments (a closure's, a global, a "
                f"module attribute) changes in place ({self._stale_traces} times so far): "
                "pass that tensor as an argument instead (for a pw.Trainer's loss_fn or "
                "model: a buffer of the model, model.register_buffer(name, t), read "
                "through the model and updated in place), which makes it an input. A "
                "model a pw.Trainer trains, called in a program or in another Trainer's "
                "loss_fn (a teacher): compute its outputs with that Trainer's predict() "
                "(before the step, and pass them in as targets)",
                RetraceWarning, stacklevel=4)

    def _leaf_name(self, args, kwargs, i: int) -> str:
        """Flat leaf ``i`` of ``(args, kwargs)`` as the function names it: "tau",
        "inputs[1]", "batch['temperature']"."""
        path = pytree.tree_flatten_with_path((args, kwargs))[0][i][0]
        head, rest = path[1], pytree.keystr(path[2:])
        if path[0].idx == 1:
            return f"{head.key}{rest}"
        try:
            import inspect
            names = [p.name for p in inspect.signature(self.fn).parameters.values()]
            return f"{names[head.idx]}{rest}"
        except (TypeError, ValueError, IndexError):
            return f"argument {head.idx}{rest}"

    def _slow_call(self, args, kwargs):
        state = runtime.get_state()
        capture.register_dataclasses((args, kwargs))    # dataclass inputs: pytree nodes
        leaves, tree = pytree.tree_flatten((args, kwargs))
        donated_leaves = self._donated_leaves(args)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, np.generic):         # np.float32(0.5): a Python number,
                leaves[i] = leaf.item()               # as torch takes it
        slice_ = next((leaf.slice for leaf in leaves if isinstance(leaf, Array)), None)
        if slice_ is None:
            bad = next((leaf for leaf in leaves if not isinstance(
                leaf, (torch.Tensor, np.ndarray) + _STATIC_TYPES)), None)
            raise PlacementError(
                f"program '{self.name}' got no pw.Array input, so it does not know which "
                "slice to run on: pw.put one of its inputs first" + (
                    "" if bad is None else
                    f" (an argument of type {type(bad).__name__} is opaque to it: pass "
                    "tensors and Arrays in dicts, lists, tuples or dataclasses)"))
        runtime.check_alive(slice_)

        key_parts, dyn_pos, avals = [], [], []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, np.ndarray):
                leaf = leaves[i] = torch.from_numpy(leaf)
            if isinstance(leaf, (Array, torch.Tensor)):
                dyn_pos.append(i)
                avals.append((tuple(leaf.shape), leaf.dtype))
                key_parts.append(("A", tuple(leaf.shape), leaf.dtype))
            elif isinstance(leaf, _STATIC_TYPES):
                key_parts.append(("S", type(leaf).__name__, _static_key(leaf)))
            else:
                raise TraceError(
                    f"program '{self.name}': argument of type {type(leaf).__name__} is "
                    "neither a tensor/pw.Array nor a static Python value (int, float, bool, "
                    "str, None, torch.dtype); pass tensors, or pytrees of them")
        autocast = torch_paths.autocast_state()
        key = (repr(tree), tuple(key_parts), autocast)
        traced = self._traces.get(key)
        if traced is not None and traced.stale():
            # a tensor it read from outside its arguments changed in place: torch would
            # compute with the new values, so trace again (and forget the fast paths)
            traced = None
            self._fast.clear()
            self._fast_tree.clear()
            self._note_stale()
        if traced is None:
            self._note_retrace(key, args, kwargs)
            self._note_shapes(key, args, kwargs)
            t0 = tracing.CLIENT.now() if tracing.CLIENT.on else 0
            traced = self._trace(leaves, tree, dyn_pos, avals)
            self._traces[key] = traced
            tracing.CLIENT.add("trace", self.name, t0, program=self.name)

        mutated = traced.mutated_inputs
        if mutated:
            self._check_no_aliased_update([leaves[i] for i in dyn_pos], mutated)
        inputs, donate = [], []
        for k, i in enumerate(dyn_pos):
            leaf = leaves[i]
            if isinstance(leaf, Array) and leaf._donated:
                raise PlacementError(
                    f"program '{self.name}': an input {leaf!r} was donated to program "
                    f"'{leaf._donated}' and no longer exists; pass that program's output")
            if (i in donated_leaves or k in mutated) and isinstance(leaf, Array):
                donate.append(len(inputs))
            if isinstance(leaf, torch.Tensor):
                if k in mutated:
                    raise TraceError(
                        f"program '{self.name}' updates its input {k} in place, a CPU "
                        "tensor that the call copies to the slice; pw.put it first and "
                        "pass the pw.Array, which then holds the update")
                leaf = put(leaf, slice_, P())        # implicit put, replicated
            elif leaf.slice is not slice_:
                leaf = leaf.to(slice_, self._spec_on(leaf, slice_))
            runtime.check_alive(leaf.slice)
            inputs.append(leaf)
        if traced.rng:
            seed = self._seeds() if self._seeds is not None else runtime.next_seed()
            inputs.append(put(torch.tensor(seed, dtype=torch.int64), slice_, P()))
        if state.dispatch == "sequential":
            wait(inputs)            # the baseline: wait for predecessors, then dispatch
        g = graph_mod.current()
        if g is not None:
            g.keep(*inputs)

        out_specs = self._resolve_out_specs(traced, slice_)
        in_specs = tuple(a.sharding for a in inputs)
        wanted = len(donate)
        donate = tuple(k for k in donate if inputs[k].slice is slice_ and
                       sum(a is inputs[k] for a in inputs) == 1)
        compiled = self._compile(traced, slice_, inputs, in_specs, out_specs, donate)

        # Keyed before the call (writing updates back may change the inputs' specs), and
        # not when an input passed twice kept its donation from this call.
        fast = (self._fast_key(args, kwargs, [leaves[i] for i in dyn_pos], slice_)
                if state.dispatch != "sequential" and len(donate) == wanted
                and not autocast else None)
        conn = slice_._conn
        out_ids = [conn.new_id() for _ in traced.out_avals]
        seq = conn.send(pb.Op(execute=pb.ExecuteOp(
            program_id=compiled.program_id, inputs=[a._id for a in inputs],
            outputs=out_ids, donate=donate, carry=_carry(traced))))
        written = traced.written_by
        for k in donate:
            if k not in mutated:
                _mark_donated(inputs[k], self.name, graph_mod.current())
        origin = f"program '{self.name}'"
        arrays = []
        for o, (bid, (shape, dtype), spec, hlo) in enumerate(zip(
                out_ids, traced.out_avals, compiled.out_specs, compiled.out_hlo)):
            new = Array(slice_, bid, seq, shape, dtype, spec, origin, hlo)
            if o in written:
                self._write_back(leaves[dyn_pos[written[o]]], new)
            elif o < traced.kept_outputs:
                arrays.append(new)          # (an extra output is dropped: released)
        if fast is not None:
            table = fast[0]
            if len(table) >= _MAX_FAST:     # signatures that keep changing (a float
                table.clear()               # argument drawn anew per call) stay bounded
            table[fast[1]] = _Fast(traced, compiled, origin, self.name, donate, fast[2])
        arrays = iter(arrays)
        flat = [next(arrays) if s is TENSOR else s for s in traced.out_static]
        return pytree.tree_unflatten(flat, traced.out_tree)

    @staticmethod
    def _write_back(target: Array, new: Array) -> None:
        """torch's in-place semantics: the input Array now holds the updated value.

        On the program's slice the input was donated (its memory holds the update, XLA
        aliases it); an input moved from another slice gets the update moved back."""
        if new.slice is not target.slice:
            new = new.to(target.slice, target.sharding)
        old, old_seq, old_origin = target._id, target._seq, target._origin
        old_sharding, old_hlo = target.sharding, target.hlo_sharding
        # take over new's buffer: new must not release it when it is dropped
        target._id, target._seq, target._origin = new._id, new._seq, new._origin
        target.sharding, target.hlo_sharding = new.sharding, new.hlo_sharding
        new._id = None
        # The old id (memory that XLA reused, or the value before the update) is
        # released as a dropped Array would be: inside pw.graph() only after submission.
        husk = Array.__new__(Array)
        husk._conn, husk._id = target._conn, old
        g = graph_mod.current()
        if g is not None:
            g.keep(husk)
            before = (old, old_seq, old_origin, old_sharding, old_hlo)

            def undo():         # the block raised: the update will never run
                (target._id, target._seq, target._origin, target.sharding,
                 target.hlo_sharding) = before
                husk._id = None
            g.on_abort(undo)

    # ------------------------------------------------------------------ helpers
    def _fast_key(self, args, kwargs, dynamic: list, slice_) -> Optional[tuple]:
        """Where later calls with this signature find it, skipping the general path:
        (``_fast``, key, False) for flat Array arguments, (``_fast_tree``, key, whether
        CPU tensors are put) for Arrays, tensors and static values in dicts, lists and
        tuples; None for anything else, which only the general path handles.
        ``dynamic``: the general path's tensor leaves, which the walk must find too."""
        sig = None if kwargs else _flat_signature(args)
        if sig is not None and sig[1] is slice_:
            return self._fast, sig[0], False
        sig = _tree_signature(args, kwargs)
        if (sig is None or sig[2] is not slice_ or len(sig[0]) != len(dynamic)
                or any(a is not b for a, b in zip(sig[0], dynamic))):
            return None
        return self._fast_tree, sig[1], any(type(a) is torch.Tensor for a in sig[0])

    @staticmethod
    def _spec_on(a: Array, slice_) -> P:
        """The input's spec if it is valid on the program's slice, else replicated."""
        if a.sharding is None:
            return P()
        try:
            validate_spec(a.sharding, a.shape, slice_.axis_names, slice_.mesh_shape)
            return a.sharding
        except ShardingError:
            return P()

    def _trace(self, leaves, tree, dyn_pos, avals) -> Traced:
        def build(placeholders):
            new = list(leaves)
            for i, ph in zip(dyn_pos, placeholders):
                new[i] = ph
            return pytree.tree_unflatten(new, tree)

        return trace(self.fn, self.name, avals, build)

    def _resolve_out_specs(self, traced: Traced, slice_) -> Optional[tuple]:
        if self.out_specs is None:
            return None
        n = len(traced.out_avals)
        if isinstance(self.out_specs, P):
            specs = [self.out_specs] * n
        else:
            specs = pytree.tree_flatten(
                self.out_specs, is_leaf=lambda x: isinstance(x, P) or x is None)[0]
            specs = [as_spec(s) for s in specs]
            if len(specs) != n:
                raise ShardingError(
                    f"program '{self.name}': out_specs gives {len(specs)} specs for "
                    f"{n} tensor outputs; give one P, or one per output")
        for k, (spec, (shape, _)) in enumerate(zip(specs, traced.out_avals)):
            validate_spec(spec, shape, slice_.axis_names, slice_.mesh_shape,
                          f"output {k} of program '{self.name}'")
        return tuple(specs)

    def _donated_leaves(self, args) -> set:
        """Flat leaf positions (of ``(args, kwargs)``) under the donated arguments."""
        if not self.donate_argnums:
            return set()
        out, at = set(), 0
        for i, a in enumerate(args):
            n = len(pytree.tree_flatten(a)[0])
            if i in self.donate_argnums:
                out.update(range(at, at + n))
            at += n
        return out

    def _compile(self, traced: Traced, slice_, inputs, in_specs, out_specs,
                 donate=()) -> _Compiled:
        # slice_.uid, not slice_.id: a new cluster (pw.shutdown(); pw.init()) hands out
        # the same slice ids again, to executors that never saw this program.
        key = (traced.fingerprint, slice_.uid, in_specs, out_specs, donate)
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                return compiled
            program_id = f"{self.name}-{traced.fingerprint[:10]}-{next(_program_ids)}"
            req = pb.CompileRequest(program_id=program_id, name=self.name, hlo=traced.hlo,
                                    has_out_specs=out_specs is not None, donate=donate)
            for src, k in traced.params:
                req.params.add(**({"input": k} if src == "i" else {"constant": k}))
            for c in traced.constants:
                req.constants.add(meta=pb.TensorMeta(dtype=codec.dtype_name(c.dtype),
                                                      shape=list(c.shape)),
                                  data=codec.to_bytes(c))
            for a, spec in zip(inputs, in_specs):
                req.inputs.add(dtype=codec.dtype_name(a.dtype), shape=list(a.shape))
                spec_to_proto(spec or P(), req.input_specs.add())
            for spec in out_specs or ():
                spec_to_proto(spec, req.out_specs.add())
            t0 = tracing.CLIENT.now() if tracing.CLIENT.on else 0
            rep = slice_._conn.compile(req, self.name)
            tracing.CLIENT.add("compile", self.name, t0, program=self.name,
                               detail=slice_.id)
            specs = [spec_from_proto(s) if known else None
                     for s, known in zip(rep.out_specs, rep.out_spec_known)]
            specs = [s.normalized(len(shape)) if s is not None else None
                     for s, (shape, _) in zip(specs, traced.out_avals)]
            compiled = _Compiled(program_id, specs, list(rep.out_hlo_shardings))
            self._compiled[key] = compiled
            return compiled

    def __repr__(self) -> str:
        return f"pw.program({self.name})"


def program(fn: Optional[Callable] = None, *, out_specs: Any = None,
            name: Optional[str] = None, donate_argnums: Tuple[int, ...] = ()):
    """Decorate a torch function so that calls run as compiled programs on a slice.

    ``out_specs`` fixes the output shardings (one ``P`` for all outputs, or one per
    output); without it XLA's sharding propagation chooses them. ``donate_argnums``
    names positional arguments whose Arrays the call consumes: their device memory may
    hold the outputs (an in-place update, as JAX's donation), and reading them
    afterwards raises ``PlacementError``.
    """
    if fn is None:
        return lambda f: Program(f, out_specs=out_specs, name=name,
                                 donate_argnums=donate_argnums)
    return Program(fn, out_specs=out_specs, name=name, donate_argnums=donate_argnums)


_reshards: dict = {}


def _mark_donated(a: Array, program: str, g) -> None:
    """``a`` was given to ``program`` to reuse its memory: later uses are refused (in a
    graph block that raises, the mark is taken back)."""
    before = a._donated
    a._donated = program
    if g is not None:
        g.on_abort(lambda: setattr(a, "_donated", before))


def copy_of(a: Array) -> Array:
    """A copy of ``a`` in a new buffer on its slice, with its sharding (``copy.deepcopy``)."""
    return _copy(a)


def reshard(a: Array, spec: P) -> Array:
    """``a`` with partition spec ``spec`` on the same slice."""
    prog = _reshards.get(spec)
    if prog is None:
        prog = _reshards[spec] = Program(lambda x: x.clone(), out_specs=spec,
                                         name="reshard")
    return prog(a)


_copy = Program(lambda x: x.clone(), name="copy")
