"""``pw.Array``: a future for a sharded buffer that lives on a slice's devices.

Shape, dtype, sharding and slice are known the moment an Array exists; only
``torch()``, ``numpy()``, ``item()`` and ``wait()`` block. Dropping the last reference
frees the buffer on the worker (releases are batched onto the control stream).

Example::

    x = pw.put(torch.randn(64, 128), s, P("data", None))
    y = layer(x, w)          # returns at once
    y.shape, y.sharding      # known already
    y.torch()                # blocks until y exists, then copies it to the client
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils import _pytree as pytree

from .. import tracing
from .._ids import random_id
from .._trees import plain_batch
from ..errors import OutOfMemoryError, PathwaysError, PlacementError
from ..rpc import codec
from ..rpc import pathways_pb2 as pb
from ..sharding import (P, as_spec, member_blocks, move_plan, spec_to_proto, validate_spec,
                        whole)
from . import runtime
from . import graph as graph_mod
from .graph import SeqCell, seq_of


class Array:
    """A (possibly not yet computed) sharded tensor on a slice. Create with ``pw.put``."""

    __slots__ = ("shape", "dtype", "sharding", "slice", "_id", "_seq", "_conn", "_origin",
                 "hlo_sharding", "_donated", "_read_failed", "__weakref__")

    def __init__(self, slice_: "runtime.Slice", buffer_id: int, seq: int,
                 shape: Sequence[int], dtype: torch.dtype, sharding: Optional[P],
                 origin: str, hlo_sharding: str = "") -> None:
        self.slice = slice_
        self.shape = torch.Size(shape)
        self.dtype = dtype
        #: The partition spec over ``slice.axis_names`` (None if XLA chose a sharding
        #: that no partition spec describes; ``hlo_sharding`` then has it).
        self.sharding = sharding
        self.hlo_sharding = hlo_sharding
        self._id = buffer_id
        self._seq = seq
        self._conn = slice_._conn
        self._origin = origin
        self._donated = ""          # the program this Array was donated to, if any
        self._read_failed = False   # a read raised its error in the script
        if isinstance(seq, SeqCell):
            graph_mod.current().keep(self)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim: Optional[int] = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def _what(self) -> str:
        return f"Array{list(self.shape)} from {self._origin}"

    def _check_usable(self) -> None:
        runtime.check_alive(self.slice)
        if self._donated:
            raise PlacementError(
                f"{self._what()} was donated to program '{self._donated}', which reused its "
                "memory for its outputs; read those outputs instead")

    def torch(self, timeout: Optional[float] = None) -> torch.Tensor:
        """Block until the value exists and return it as a CPU tensor.

        Raises ``pw.TimeoutError`` past ``timeout`` seconds (default: ``pw.init``'s),
        ``pw.WorkerLostError`` if the worker that holds it (or one it waits on) died.
        """
        self._check_usable()
        try:
            return self._conn.fetch(self._id, seq_of(self._seq), self._what(), timeout,
                                    codec.nbytes(self.dtype, tuple(self.shape)))
        except PathwaysError:
            self._read_failed = True        # its error reached the script (Trainer)
            raise

    def numpy(self, timeout: Optional[float] = None) -> np.ndarray:
        """Block until the value exists and return it as a numpy array."""
        t = self.torch(timeout)
        return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()

    def item(self, timeout: Optional[float] = None):
        """Block until the value exists; return its one element as a Python number."""
        return self.torch(timeout).item()

    def cpu(self) -> torch.Tensor:
        """``torch()``: what ``loss.detach().cpu()`` in a torch loop asks for."""
        return self.torch()

    def detach(self) -> "Array":
        """This Array: it carries no autograd graph (``loss.detach().item()``)."""
        return self

    def backward(self, *args, **kwargs):
        raise TypeError(
            "pw.Array has no backward(): trainer.step already computed the gradients "
            "and applied the optimizer's update on the workers; remove loss.backward() "
            "and optimizer.step() from the loop (inside a @pw.program, call backward "
            "on the torch tensors it traces)")

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def wait(self, timeout: Optional[float] = None) -> "Array":
        """Block until the value exists (raises the program's error if it failed)."""
        try:
            wait([self], timeout)
        except PathwaysError:
            self._read_failed = True
            raise
        return self

    def to(self, slice_: "runtime.Slice", spec=None) -> "Array":
        """This Array on ``slice_`` with partition spec ``spec`` (default replicated).

        On the same slice it is a resharding program. To another slice the bytes go
        worker to worker (shared memory on one host, the data network between hosts
        and islands), never through the client; the call returns at once and the move
        starts as soon as this Array's producer finishes.
        """
        if isinstance(slice_, (str, torch.device)) and torch.device(slice_).type == "cpu":
            return self.torch()         # loss.to("cpu"), as a torch_xla script reads it
        if isinstance(slice_, (str, torch.device, torch.dtype)):
            raise TypeError(
                f"pw.Array.to takes a pw.Slice (and a spec), not {slice_!r}: read it with "
                ".to('cpu') / .torch(), cast it inside a @pw.program, or move it to "
                "another slice with .to(other_slice, spec)")
        self._check_usable()
        runtime.check_alive(slice_)
        spec = as_spec(spec)
        if slice_ is self.slice:
            from .program import reshard
            return reshard(self, spec)
        return transfer(self, slice_, spec)

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"pw.Array({dt}{list(self.shape)}, sharding={self.sharding!r}, {self.slice!r})"

    def __del__(self) -> None:
        try:
            if self._id is not None:        # None: its buffer was handed to another Array
                self._conn.release(self._id)
        except AttributeError:
            pass

    def __bool__(self):
        raise TypeError("the truth value of a pw.Array would block; use bool(a.item())")

    def __eq__(self, other):
        """Arrays compare by identity (as futures do: ``a in arrays``); against a number
        or a tensor, ``loss == 0`` would say False whatever the value, so it is refused."""
        if isinstance(other, (int, float, complex, torch.Tensor, np.ndarray, np.generic)):
            raise TypeError(
                "comparing a pw.Array with a value would block for its own: compare "
                "a.item() (a number) or a.torch() (a tensor), or compare inside a "
                "@pw.program")
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def _arithmetic(self, *_):
        """``val_loss < best``, ``running += loss``, ``loss / 4``: a torch_xla loop's
        lazy tensor arithmetic. An Array is a future of a device buffer; this would
        block for its value, so it says what to do (rather than Python's bare
        "unsupported operand")."""
        raise TypeError(
            "arithmetic and ordering on a pw.Array would block for its value: use "
            "a.item() or float(a) (a number: best = min(best, loss.item())), a.torch() "
            "(a tensor), or compute inside a @pw.program")

    __lt__ = __le__ = __gt__ = __ge__ = _arithmetic
    __add__ = __radd__ = __iadd__ = __sub__ = __rsub__ = __isub__ = _arithmetic
    __mul__ = __rmul__ = __imul__ = __truediv__ = __rtruediv__ = __itruediv__ = _arithmetic
    __floordiv__ = __rfloordiv__ = __pow__ = __rpow__ = __neg__ = __abs__ = _arithmetic
    __round__ = _arithmetic

    __hash__ = object.__hash__

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d pw.Array")     # as torch says for a tensor
        return self.shape[0]

    def __iter__(self):
        """``for row in a`` / ``a, b = arr`` would fetch the value: said, as arithmetic
        is (Python's own "not iterable" would read as if len() were wrong too)."""
        raise TypeError(
            "iterating over a pw.Array would block for its value: iterate over "
            "a.torch() (a tensor), or index inside a @pw.program")

    def __format__(self, spec: str) -> str:
        """``f"{loss:.4f}"`` of a 0-d Array formats its value, as for a 0-d tensor (it
        blocks until the value exists); other Arrays format as their repr (with a
        number's format spec, refused: a tensor refuses it too)."""
        if spec and not self.shape:
            return format(self.item(), spec)
        if spec and spec[-1:] in "eEfFgGn%d":
            raise TypeError(
                f"format spec {spec!r} on a pw.Array of shape {tuple(self.shape)}: only a "
                "0-d Array formats as a number (a loss); format a.torch().tolist() or "
                "its elements")
        return format(repr(self), spec)

    def __copy__(self) -> "Array":
        """This Array itself: a copy names the same buffer (an in-place update through
        a program is seen by both, as by a tensor and its shallow copy). Two Array
        objects owning one buffer would each free it."""
        return self

    def __deepcopy__(self, memo) -> "Array":
        """A new Array with the same values in a buffer of its own on the same slice
        (``copy.deepcopy(trainer.params)``): a copy program, queued in order after
        whatever updates this Array before it."""
        self._check_usable()
        from .program import copy_of
        out = copy_of(self)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a pw.Array cannot be pickled (torch.save, multiprocessing, pickle.dumps): "
            "it names a buffer on the cluster, not its values. Save a.torch() (the "
            "values on the client), or trainer.state_dict()/trainer.save() for training "
            "state")


def put(value: Union[torch.Tensor, np.ndarray], slice_: "runtime.Slice", spec=None) -> Array:
    """Copy a CPU tensor onto ``slice_`` with partition spec ``spec`` (default replicated).

    Returns at once; the bytes stream to the slice's executor in the background.

    Example::

        x = pw.put(torch.randn(64, 128), s, P("data", None))
    """
    runtime.get_state()
    runtime.check_alive(slice_)
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"pw.put takes a torch.Tensor or numpy array, got {type(value).__name__}")
    t0 = tracing.CLIENT.now() if tracing.CLIENT.on else 0
    if value.requires_grad or value.device.type != "cpu":
        value = value.detach().cpu()
    if value.is_conj() or value.is_neg():       # a lazy view (x.conj()): its values
        value = value.resolve_conj().resolve_neg()
    spec = as_spec(spec)
    validate_spec(spec, value.shape, slice_.axis_names, slice_.mesh_shape, "pw.put")
    msg = pb.Spec()
    spec_to_proto(spec, msg)
    codec.dtype_name(value.dtype)
    _check_budget(value, spec, slice_)
    bid, seq = slice_._conn.put(value, msg)
    if t0:
        tracing.CLIENT.add("put", "put", t0, buffer_ids=(bid,),
                           nbytes=value.numel() * value.element_size(), detail=slice_.id)
    return Array(slice_, bid, seq, value.shape, value.dtype, spec.normalized(value.dim()),
                 "pw.put")


def _check_budget(value: torch.Tensor, spec: P, slice_: "runtime.Slice") -> None:
    """Refuse at once a put that cannot fit in the slice's per-device budget, ever."""
    budget = slice_.memory_budget
    if not budget:
        return
    shards = 1
    for d in range(len(spec)):
        for axis in spec.axes(d):
            shards *= slice_.axis_size(axis)
    per_device = value.numel() * value.element_size() // shards
    if per_device <= budget:
        return
    try:
        free = f"{max(0, budget - slice_.stats(sync=False).device_bytes) / 2**20:.1f} MiB"
    except Exception:
        free = "unknown"
    raise OutOfMemoryError(
        f"pw.put of a {str(value.dtype).replace('torch.', '')}{list(value.shape)} tensor "
        f"asks {per_device / 2**20:.1f} MiB per device, more than the whole per-device "
        f"buffer budget of {budget / 2**20:.1f} MiB of {slice_!r} ({free} free now); shard "
        "it over more devices (a partition spec), use a bigger slice, or raise the "
        "budget (pw.init(memory_budget=...))", host=f"island {slice_.island} host "
        f"{slice_.host}")


def transfer(a: Array, dst: "runtime.Slice", spec: P) -> Array:
    """Move ``a`` to another slice with ``spec``: a SendOp on its slice, a RecvOp on dst."""
    t0 = tracing.CLIENT.now() if tracing.CLIENT.on else 0
    state = runtime.get_state()
    validate_spec(spec, a.shape, dst.axis_names, dst.mesh_shape, "Array.to")
    if state.dispatch == "sequential":
        wait([a])
    if a.slice.spans_hosts or dst.spans_hosts:
        return _move_pieces(a, dst, spec, t0)
    g = graph_mod.current()
    if g is not None:
        g.keep(a)
    msg = pb.Spec()
    spec_to_proto(spec, msg)
    tid = random_id()
    dst_conn = dst._conn
    bid = dst_conn.new_id()
    seq = dst_conn.send(pb.Op(recv=pb.RecvOp(
        buffer_id=bid, transfer_id=tid, spec=msg,
        meta=pb.TensorMeta(dtype=codec.dtype_name(a.dtype), shape=list(a.shape)),
        src_data_address=a.slice.data_address,
        src_host=f"island {a.slice.island} host {a.slice.host}")))
    same_host = (a.slice.island, a.slice.host) == (dst.island, dst.host)
    a._conn.send(pb.Op(send=pb.SendOp(buffer_id=a._id, dst_data_address=dst.data_address,
                                      transfer_id=tid, same_host=same_host)))
    if t0:
        tracing.CLIENT.add("dispatch", "transfer", t0, buffer_ids=(a._id, bid),
                           transfer_id=tid, nbytes=codec.nbytes(a.dtype, tuple(a.shape)),
                           detail=f"{a.slice.id} -> {dst.id}")
    return Array(dst, bid, seq, a.shape, a.dtype, spec.normalized(a.ndim),
                 f"a transfer of {a._origin}")


def _host_blocks(s: "runtime.Slice", shape, spec: P) -> list:
    """The blocks of an array of ``shape`` under ``spec`` each host of ``s`` holds."""
    if not s.spans_hosts:
        return [[whole(shape)]]
    return [member_blocks(shape, spec, s.axis_names, s.mesh_shape, k, len(s.hosts))[0]
            for k in range(len(s.hosts))]


def _move_pieces(a: Array, dst: "runtime.Slice", spec: P, t0: int) -> Array:
    """A move from or to a slice that spans hosts, host to host: each source host sends
    each destination host the parts of its shards that host needs (``move_plan``), as
    one piece on the data plane; the destination assembles them and reshards."""
    from .members import PerMember, shard_blocks
    shape = tuple(a.shape)
    src, dsts = a.slice, _host_blocks(dst, shape, spec)
    plan = move_plan(shape, _host_blocks(src, shape, a.sharding), dsts)
    g = graph_mod.current()
    if g is not None:
        g.keep(a)
    meta = pb.TensorMeta(dtype=codec.dtype_name(a.dtype), shape=list(shape))
    msg = pb.Spec()
    spec_to_proto(spec, msg)
    tids = [[random_id() if plan[k][j] else 0 for j in range(len(dsts))]
            for k in range(len(plan))]

    bid = dst._conn.new_id()
    recvs = []
    for j in range(len(dsts)):
        r = pb.RecvOp(buffer_id=bid, meta=meta, spec=msg, transfer_id=random_id())
        for k in range(len(plan)):
            if plan[k][j]:
                r.pieces.add(transfer_id=tids[k][j], blocks=shard_blocks(plan[k][j]),
                             src_data_address=src.data_addresses[k],
                             src_host=f"island {src.island} host {src.hosts[k]}")
        recvs.append(pb.Op(recv=r))
    seq = dst._conn.send(PerMember(recvs) if dst.spans_hosts else recvs[0])
    for j in range(len(dsts)):
        sends = [pb.Op(send=pb.SendOp(
            buffer_id=a._id, dst_data_address=dst.data_addresses[j], transfer_id=tids[k][j],
            same_host=(src.island, src.hosts[k]) == (dst.island, dst.hosts[j]),
            blocks=shard_blocks(plan[k][j]))) for k in range(len(plan))]
        if src.spans_hosts:
            a._conn.send(PerMember(sends))
        elif tids[0][j]:
            a._conn.send(sends[0])
    if t0:
        tracing.CLIENT.add("dispatch", "transfer", t0, buffer_ids=(a._id, bid),
                           nbytes=codec.nbytes(a.dtype, shape),
                           detail=f"{src.id} -> {dst.id}, {sum(map(bool, sum(tids, [])))} "
                           "pieces host to host")
    return Array(dst, bid, seq, a.shape, a.dtype, spec.normalized(a.ndim),
                 f"a transfer of {a._origin}")


def wait(arrays: Any, timeout: Optional[float] = None) -> None:
    """Block until every Array exists; raise the first failure (with its program's name).

    ``arrays`` is one Array or any nesting of lists, tuples and dicts of them (what a
    program returned), as JAX's ``block_until_ready`` takes. ``timeout`` (seconds,
    default ``pw.init``'s) bounds the whole call; past it, ``pw.TimeoutError`` says
    which Array was not ready.

    Example::

        pw.wait([y, z], timeout=30)
        pw.wait(step(params, batch))          # a dict of Arrays
    """
    groups: dict = {}
    for a in pytree.tree_leaves(plain_batch(arrays)):
        if not isinstance(a, Array):
            raise TypeError(f"pw.wait takes pw.Arrays (one, or lists, tuples and dicts "
                            f"of them), got {type(a).__name__}")
        a._check_usable()
        g = groups.setdefault(id(a._conn), {"conn": a._conn, "ids": [], "seq": 0,
                                            "what": a._what()})
        g["ids"].append(a._id)
        g["seq"] = max(g["seq"], seq_of(a._seq))
    if not groups:
        return                      # nothing to wait for (as block_until_ready([]))
    if len(groups) == 1:
        (g,) = groups.values()
        g["conn"].wait(g["ids"], g["seq"], g["what"], timeout)
        return
    # Many slices (or hosts of one slice): every Wait goes out at once.
    from .connection import wait_many
    wait_many([(c, g["ids"], g["seq"], g["what"]) for g in groups.values()
               for c in g["conn"].parts()], timeout)
