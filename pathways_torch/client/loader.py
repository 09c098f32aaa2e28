"""``pw.DataLoader``: input pipelines that run on the hosts that own the devices.

The client only names batches. Each slice that takes part imports the dataset factory
by name, builds a ``torch.utils.data.DataLoader`` over its share of each batch, and
writes that share straight into its devices' buffers, a few batches ahead
(worker/loader.py). A batch here is the collate function's structure (a tuple, a dict)
with ``pw.Array`` leaves whose bytes never reach the client.

Where a batch goes:

- ``slice=s`` (a Slice) with ``spec=P("data")``: dimension 0 of every leaf split over
  the mesh axis ``data`` (``spec=None``: replicated on every device).
- ``slice=trainer`` (a ``pw.Trainer``): wherever its strategy wants inputs: its slice
  and batch axis (DataParallel, FSDP, TensorParallel); each island its share
  (MultiIsland); the first stage the inputs and the last the targets, cut into
  microbatches (Pipeline). The loader follows the Trainer's slices after
  ``fit(max_restarts=)`` replaced them.

The order of epoch ``e`` is ``torch.randperm(len(dataset), generator=torch.Generator()
.manual_seed(seed * 1_000_003 + e))`` (``shuffle=True``; else ``0..len-1``), the same
wherever it is computed, so the batches do not depend on how many hosts load them, and
batch ``i`` is positions ``i * batch_size`` to ``(i + 1) * batch_size`` of that order:
what torch's DataLoader gives with that order as its sampler.

A factory may also return a ``torch.utils.data.IterableDataset`` (a stream: files read
in order, a generator). There is no order to choose: each loading host runs torch's own
DataLoader over the whole stream and keeps its rows of each batch, so the batches are
exactly torch's, and the stream is read once per host. An epoch ends where the stream
does: before naming a batch the client asks one host whether it exists.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Dict, List, Optional

import grpc
from torch.utils import _pytree as pytree

from ..errors import DataLoaderError, ShardingError
from .._ids import random_id
from ..rpc import codec
from ..rpc import pathways_pb2 as pb
from ..sharding import P, as_spec, member_blocks
from . import runtime
from .array import Array
from .connection import raise_buffer_error


# How long a stream's loader waits for its host's push of a batch it expects before it
# asks (a PeekLoader RPC, which also restarts the host's loader where needed).
PUSH_WAIT_S = 0.5


_ORIGIN = "pw.DataLoader"        # how the Arrays a loader makes name their origin


def made_by_loader(leaf: Any) -> bool:
    """A batch leaf a ``pw.DataLoader`` made (an Array, or Parts of them)."""
    arrays = leaf.parts if isinstance(leaf, Parts) else [leaf]
    return any(isinstance(a, Array) and f"of {_ORIGIN}(" in a._origin for a in arrays)


class Parts:
    """One leaf of a batch cut into equal row blocks on several slices (MultiIsland's
    islands, a Pipeline's microbatches): ``parts[k]`` is an Array. Trainers split
    a batch of these without moving a byte."""

    __slots__ = ("parts",)

    def __init__(self, parts: List[Array]) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return len(self.parts)

    def __repr__(self) -> str:
        return f"Parts({self.parts!r})"


class _Target:
    """One slice's share of every batch: row blocks ``mine`` of ``parts``, of the
    top-level items ``items`` (empty: all), split over mesh axis ``axis``."""

    def __init__(self, slice_, parts: int, mine: List[int], items: List[int],
                 axis: Optional[str]) -> None:
        self.slice, self.parts, self.mine, self.items, self.axis = \
            slice_, parts, mine, items, axis
        self.info: Optional[pb.LoaderInfo] = None


class DataLoader:
    """Batches built on the worker hosts, as ``pw.Array`` pytrees.

    ``dataset``: ``"package.module:factory"``, importable on the workers, called there
    with ``dataset_kwargs`` (JSON values) to make a map-style dataset
    (``__getitem__``/``__len__``) or a ``torch.utils.data.IterableDataset`` (then
    ``shuffle`` is refused, as torch refuses it, and ``len()`` is the dataset's if it
    has one; an epoch ends where its stream does). ``collate_fn``:
    ``"package.module:fn"`` or None for torch's ``default_collate``; every leaf of a
    batch must be a tensor with the samples along dimension 0, the same dtypes and
    per-sample shapes in every batch.
    ``num_workers``: torch DataLoader worker processes on each host; ``prefetch``:
    batches each host keeps ready on its devices.

    Iterating gives one epoch from the current position (a loop left early goes on
    where it stopped); the next loop is the next epoch, with its own permutation.
    ``state_dict()``/``load_state_dict()`` save and restore the position; ``fit``
    replays exactly the batches of the steps it replays.

    Example::

        loader = pw.DataLoader("mypkg.data:make_dataset", dataset_kwargs={"split": "train"},
                               batch_size=256, slice=s, spec=P("data"), shuffle=True,
                               seed=0, num_workers=2, collate_fn="mypkg.data:collate")
        for x, y in loader:
            trainer.step(x, y)
        state = loader.state_dict()
    """

    def __init__(self, dataset: str, *, batch_size: int, slice: Any,
                 dataset_kwargs: Optional[Dict[str, Any]] = None, spec: Any = None,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 num_workers: int = 0, collate_fn: Optional[str] = None,
                 prefetch: int = 2) -> None:
        for name, value in (("dataset", dataset), ("collate_fn", collate_fn or "m:f")):
            if not isinstance(value, str) or ":" not in value:
                raise TypeError(f"pw.DataLoader's {name} is the import path of a function "
                                "on the workers, 'package.module:name' (a callable would "
                                f"have to be pickled, which never crosses the wire), got "
                                f"{value!r}")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"pw.DataLoader: batch_size must be a positive int, got "
                             f"{batch_size!r}")
        try:
            kwargs_json = json.dumps(dataset_kwargs or {})
        except (TypeError, ValueError) as e:
            raise TypeError(f"pw.DataLoader: dataset_kwargs travel as JSON: {e}") from None
        self._spec = pb.LoaderSpec(
            loader_id=random_id(), dataset=dataset,
            dataset_kwargs_json=kwargs_json, collate=collate_fn or "",
            batch_size=batch_size, shuffle=shuffle, seed=int(seed), drop_last=drop_last,
            num_workers=int(num_workers), prefetch=max(1, int(prefetch)))
        self._where = slice
        self._data_spec = as_spec(spec)
        self._targets: List[_Target] = []
        self._bound: tuple = ()         # the slices the targets were opened on
        self._length: Optional[int] = None
        self._iterable = False
        self._ahead: Dict[tuple, int] = {}     # a stream's batches a host said it made
        self._ahead_cond = threading.Condition()
        self._next_pos: Optional[tuple] = None  # the position after the last one asked
        self._pushed = False                    # the asked host's pushes are arriving
        self._tree = None
        self._items: List[int] = []
        self._samples: List[tuple] = []
        self.epoch, self.index = 0, 0   # the next batch: index ``index`` of ``epoch``
        self._closer = None
        self._open()

    # ------------------------------------------------------------------ placement
    def _plan(self) -> List[_Target]:
        from ..parallel.strategies import MultiIsland, Pipeline
        from ..training.trainer import Trainer
        w = self._where
        if isinstance(w, runtime.Slice):
            spec = self._data_spec
            axes = spec.axes(0) if len(spec) else ()
            if len(spec) > 1 or len(axes) > 1:
                raise ShardingError(f"pw.DataLoader splits dimension 0 of a batch over "
                                    f"one mesh axis: spec=P('data') or None, got {spec}")
            return [_Target(w, 1, [0], [], axes[0] if axes else None)]
        if not isinstance(w, Trainer):
            raise TypeError(f"pw.DataLoader(slice=...) takes a pw.Slice or a pw.Trainer, "
                            f"got {type(w).__name__}")
        par, slices = w.parallelism, w.slices
        if isinstance(par, MultiIsland):
            n = len(slices)
            return [_Target(s, n, [r], [], par.axis) for r, s in enumerate(slices)]
        if isinstance(par, Pipeline):
            m = par.microbatches
            first, last = slices[0], slices[-1]
            if first is last:
                return [_Target(first, m, list(range(m)), [], par.axis)]
            return [_Target(first, m, list(range(m)), [0], par.axis),
                    _Target(last, m, list(range(m)), [1], par.axis)]
        return [_Target(slices[0], 1, [0], [], getattr(par, "batch_axis", None))]

    def _current_slices(self) -> tuple:
        from ..training.trainer import Trainer
        w = self._where
        return tuple(w.slices) if isinstance(w, Trainer) else (w,)

    def _open(self) -> None:
        """Open the loader on every target slice (again after the Trainer's slices
        changed) and learn the batches' structure."""
        targets = self._plan()
        sp = self._spec
        for t in targets:
            s = t.slice
            runtime.check_alive(s)
            msg = pb.LoaderSpec()
            msg.CopyFrom(sp)
            msg.parts, msg.axis = t.parts, t.axis or ""
            msg.mine.extend(t.mine)
            msg.leaves.extend(t.items)
            for k, (conn, subs) in enumerate(zip(s._conn.parts(), _host_rows(s, t.axis))):
                # a slice that spans hosts: each host loads its own devices' rows
                one = pb.LoaderSpec()
                one.CopyFrom(msg)
                one.push_made = t is targets[0] and k == 0     # the host a stream asks
                if s.spans_hosts and t.axis:
                    one.sub = s.axis_size(t.axis)
                    one.sub_mine.extend(subs)
                try:
                    t.info = conn.stub.OpenLoader(one, timeout=conn.timeout)
                except grpc.RpcError as e:
                    if e.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                    grpc.StatusCode.INVALID_ARGUMENT):
                        raise DataLoaderError(f"pw.DataLoader({sp.dataset!r}): "
                                              f"{e.details()}", host=conn.where) from None
                    raise conn._rpc_error(e, f"opening pw.DataLoader({sp.dataset!r})") \
                        from None
        info = targets[0].info
        self._length, self._iterable = info.length, info.iterable
        self._tree = pytree.treespec_loads(info.treespec)
        self._items = list(info.leaf_items)
        self._samples = [(codec.dtype_from_name(m.dtype), tuple(m.shape))
                         for m in info.samples]
        self._targets = targets
        self._bound = self._current_slices()
        # dropping the loader (or opening it again elsewhere) closes it on those hosts
        conns = [t.slice._conn for t in targets]
        if self._closer is not None:
            self._closer()
        self._closer = weakref.finalize(self, _close_on, conns, sp.loader_id)
        if self._iterable:
            # the asked host pushes what it makes; a weak reference, so that dropping
            # the loader still closes it
            on_made = weakref.WeakMethod(self._on_made)
            self._asked().watch_loader(sp.loader_id,
                                       lambda m: (on_made() or _ignore)(m))
            with self._ahead_cond:
                self._next_pos, self._pushed = None, False
        self._check_sizes()

    def _check_sizes(self) -> None:
        """Every batch (the last one too) must cut into equal blocks per device; a
        stream's last batch is checked when it comes."""
        sp = self._spec
        self._check_rows(sp.batch_size, last=False)
        if not self._iterable and not sp.drop_last and self._length % sp.batch_size:
            self._check_rows(self._length % sp.batch_size, last=True)

    def _check_rows(self, rows: int, last: bool) -> None:
        for t in self._targets:
            ways = t.parts * (t.slice.axis_size(t.axis) if t.axis else 1)
            if rows % ways:
                what = "the last batch" if last else "a batch"
                if last and rows != self._spec.batch_size:
                    cause = (f"the dataset's {self._length} samples leave {rows} after "
                             f"the full batches of {self._spec.batch_size}" if
                             not self._iterable else "the stream ends there")
                    fix = ("pass drop_last=True, or a dataset whose length leaves a "
                           f"multiple of {ways} (or none) after the full batches")
                else:
                    cause, fix = "", f"use a batch_size divisible by {ways}"
                raise ShardingError(
                    f"pw.DataLoader: {what} of {rows} samples does not cut into {ways} "
                    f"equal blocks ({t.parts} part(s) x the devices of axis "
                    f"{t.axis!r} on {t.slice!r})" + (f": {cause}" if cause else "") +
                    f"; {fix}")

    # ------------------------------------------------------------------ batches
    def __len__(self) -> int:
        sp = self._spec
        n = self._length
        if n < 0:
            raise TypeError(f"pw.DataLoader({sp.dataset!r}) streams an IterableDataset "
                            "without __len__, so it has no length: iterate it to the "
                            "stream's end (fit(loader) does), or give the dataset __len__")
        return n // sp.batch_size if sp.drop_last else -(-n // sp.batch_size)

    @property
    def dataset_length(self) -> Optional[int]:
        """Samples in the dataset (as the hosts built it); None for a stream that has
        no ``len()``."""
        return self._length if self._length >= 0 else None

    @property
    def is_stream(self) -> bool:
        """Whether the dataset is an ``IterableDataset`` (epochs end where it ends)."""
        return self._iterable

    def __iter__(self):
        while True:
            epoch, index = self.epoch, self.index
            rows = self._rows(epoch, index)
            if rows is None:
                break
            self.index += 1
            yield self._batch(epoch, index, rows)
        self.epoch, self.index = self.epoch + 1, 0

    def at(self, position: int) -> Any:
        """The batch at ``position`` counted over epochs (``epoch * len + index``);
        the loader then stands after it. What ``fit`` uses to replay steps (a stream,
        whose epochs have no known length, is replayed by ``take``)."""
        epoch, index = divmod(int(position), len(self))
        self.epoch, self.index = (epoch, index + 1) if index + 1 < len(self) \
            else (epoch + 1, 0)
        return self._batch(epoch, index, self._rows(epoch, index))

    def take(self, epoch: int, index: int) -> Optional[Any]:
        """Batch ``index`` of ``epoch``, or None past the epoch's end; the loader then
        stands after it."""
        rows = self._rows(epoch, index)
        return None if rows is None else self._take(epoch, index, rows)

    def _take(self, epoch: int, index: int, rows: int) -> Any:
        self.epoch, self.index = epoch, index + 1
        return self._batch(epoch, index, rows)

    @property
    def position(self) -> int:
        """The next batch, counted over epochs (``epoch * len(self) + index``)."""
        return self.epoch * len(self) + self.index

    def _rows(self, epoch: int, index: int) -> Optional[int]:
        """The rows of batch ``index`` of ``epoch``; None if the epoch ends before it."""
        sp = self._spec
        if not self._iterable:
            if index >= len(self):
                return None
            return min(sp.batch_size, self._length - index * sp.batch_size)
        self._ensure_open()
        pos = (epoch, index)
        with self._ahead_cond:
            if pos not in self._ahead and self._pushed and pos == self._next_pos:
                # the host's prefetcher is on its way there: its push will say
                self._ahead_cond.wait_for(lambda: pos in self._ahead, PUSH_WAIT_S)
            rows = self._ahead.pop(pos, None)
            for passed in [k for k in self._ahead if k < pos]:
                del self._ahead[passed]
        if rows is None:
            rows = self._peek(epoch, index, jump=pos != self._next_pos)
        with self._ahead_cond:
            self._next_pos = (epoch + 1, 0) if rows < 0 else (epoch, index + 1)
        if rows < 0:
            return None
        rows = rows or sp.batch_size        # a batch that failed: its Arrays say why
        if rows != sp.batch_size:
            self._check_rows(rows, last=True)
        return rows

    def _asked(self):
        """The host a stream's loader asks (and that pushes what it makes)."""
        return self._targets[0].slice._conn.parts()[0]

    def _on_made(self, made: pb.LoaderMade) -> None:
        """A position the asked host's prefetcher made (the stream's reader thread)."""
        pos = (made.epoch, made.index)
        with self._ahead_cond:
            self._pushed = True
            self._learn(pos, made.rows)
            self._ahead_cond.notify_all()

    def _learn(self, pos: tuple, rows: int) -> None:
        """Keep what a host said of a batch until the client gets there (``_rows``
        drops what it has passed); called with ``_ahead_cond`` held."""
        if len(self._ahead) > 1024:
            self._ahead.clear()
        self._ahead[pos] = rows

    def _peek(self, epoch: int, index: int, jump: bool) -> int:
        """Ask one host for a stream's batch: its rows, or -1 past the stream's end.
        The host also says which batches after it it has made (``next_rows``): the
        next questions are answered from those."""
        sp = self._spec
        conn = self._asked()
        what = f"batch {index} of epoch {epoch} of pw.DataLoader({sp.dataset!r})"
        try:
            rep = conn.stub.PeekLoader(pb.LoaderPeek(
                loader_id=sp.loader_id, epoch=epoch, index=index, timeout_s=conn.timeout,
                jump=jump), timeout=conn.timeout + 5)
        except grpc.RpcError as e:
            raise conn._rpc_error(e, what) from None
        if rep.has_error:
            raise_buffer_error(rep.error, what)
        with self._ahead_cond:
            for k, rows in enumerate(rep.next_rows, start=1):
                self._learn((epoch, index + k), rows)
        return rep.rows if rep.exists else -1

    def _ensure_open(self) -> None:
        if self._current_slices() != self._bound:
            self._open()

    def _batch(self, epoch: int, index: int, size: int) -> Any:
        self._ensure_open()
        sp = self._spec
        origin = f"batch {index} of epoch {epoch} of {_ORIGIN}({sp.dataset!r})"
        n = len(self._samples)
        # per leaf, per part of the whole batch: its Array (None where no target has it)
        placed: List[List[Optional[Array]]] = [[None] * self._targets[0].parts
                                               for _ in range(n)]
        for t in self._targets:
            keep = [j for j in range(n) if not t.items or self._items[j] in t.items]
            conn = t.slice._conn
            ids = [conn.new_id() for _ in t.mine for _ in keep]
            seq = conn.send(pb.Op(batch=pb.BatchOp(loader_id=sp.loader_id, epoch=epoch,
                                                   index=index, outputs=ids)))
            rows = size // t.parts
            k = 0
            for part in t.mine:
                for j in keep:
                    dtype, sample = self._samples[j]
                    spec = P(t.axis) if t.axis else P()
                    shape = (rows,) + sample
                    placed[j][part] = Array(t.slice, ids[k], seq, shape, dtype,
                                            spec.normalized(len(shape)), origin)
                    k += 1
        leaves = [p[0] if len(p) == 1 else Parts(p) for p in placed]
        return pytree.tree_unflatten(leaves, self._tree)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, int]:
        """The position (the next batch) and what fixes the order: resume with
        ``load_state_dict`` on a loader built the same way."""
        sp = self._spec
        return {"epoch": self.epoch, "index": self.index, "seed": sp.seed,
                "batch_size": sp.batch_size, "shuffle": int(sp.shuffle),
                "length": self._length}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Go to the position ``state_dict()`` saved; a loader whose order would differ
        (another seed, batch size, shuffle or dataset length) is refused."""
        sp = self._spec
        mine = {"seed": sp.seed, "batch_size": sp.batch_size, "shuffle": int(sp.shuffle),
                "length": self._length}
        bad = [f"{k} (saved {state[k]}, here {v})" for k, v in mine.items()
               if k in state and state[k] != v]
        if bad:
            raise ValueError(f"pw.DataLoader.load_state_dict: the saved loader differs in "
                             f"{', '.join(bad)}; build the loader as it was built when saved")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])

    def close(self) -> None:
        """Stop the hosts' loaders now (their prefetched batches and worker processes);
        dropping the loader does the same."""
        if self._closer is not None:
            self._closer()

    def __repr__(self) -> str:
        sp = self._spec
        size = "a stream" if self._length < 0 else f"{len(self)} batches an epoch"
        return (f"pw.DataLoader({sp.dataset!r}, batch_size={sp.batch_size}, {size}, "
                f"at epoch {self.epoch} batch {self.index})")


def _ignore(_made) -> None:
    """What a dropped loader's push watcher calls."""


def _close_on(conns, loader_id: int) -> None:
    for conn in conns:
        conn.close_loader(loader_id)


def _host_rows(s, axis: Optional[str]) -> List[List[int]]:
    """Per host of ``s``: which of the ``axis``-size row blocks its devices hold (in
    the order its member lays them out); one host: all of them, as one block."""
    if not s.spans_hosts or not axis:
        return [[0]] * len(s._conn.parts())
    n = s.axis_size(axis)
    out = []
    for k in range(len(s.hosts)):
        blocks, _ = member_blocks((n,), P(axis), s.axis_names, s.mesh_shape, k,
                                  len(s.hosts))
        out.append([b[0][0] for b in blocks])
    return out
