"""The host side of ``pw.DataLoader``: batches built beside the devices, a few ahead.

The client names a dataset factory (``"package.module:factory"``, imported here: code
the hosts can import, never a pickled callable) and how batches are cut. Each epoch's
order is a seeded permutation of every index, the same on every host, so the batches do
not depend on how many hosts load them. A slice loads its row blocks (``mine`` of
``parts``) of each global batch through a ``torch.utils.data.DataLoader`` over exactly
those indices, and a thread turns each into device buffers ahead of the ``BatchOp``
that takes it (what torch_xla's ``MpDeviceLoader`` does for a multi-controller script).

An ``IterableDataset`` has no indices: every host runs torch's own ``DataLoader`` over
the whole stream (so the batches are torch's, whatever ``num_workers`` does to the
stream) and keeps its rows of each batch; an epoch ends where the stream does, which
the client learns by asking (``peek``) before it names a batch.

The DataLoader's worker processes come from a fork server, never a fork of this
process: its gRPC threads make a forked child hang in gRPC's at-fork handler, or garble
torch's descriptor hand-off. Each worker builds the dataset and collate function from
their names, as this host did (so they need not be picklable), and lives as long as
the loader (``persistent_workers``): one start per loader, not per epoch.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import multiprocessing
import os
import queue
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from .. import _proc
from .._trees import plain_batch
from ..rpc import codec

log = logging.getLogger("pathways.loader")


class LoaderError(Exception):
    """A dataset, factory or collate function failed (the message names what and where)."""


ALLOW_ENV = "PATHWAYS_IMPORT_ALLOW"


def import_named(name: str, what: str) -> Callable:
    """``"package.module:attr"`` -> the attribute; a LoaderError that says what to fix.

    A client that holds the cluster token may name any importable function here, so
    the token is what guards the workers; ``PATHWAYS_IMPORT_ALLOW`` on a worker
    (comma-separated packages) narrows what its loaders and colocated calls may import.
    """
    mod, sep, attr = name.partition(":")
    if not sep or not mod or not attr:
        raise LoaderError(f"{what} {name!r} is not 'package.module:name'")
    allow = [p.strip() for p in os.environ.get(ALLOW_ENV, "").split(",") if p.strip()]
    if allow and not any(mod == p or mod.startswith(p + ".") for p in allow):
        raise LoaderError(f"{what} {name!r} is not allowed on this host: "
                          f"{ALLOW_ENV}={','.join(allow)} (the packages its loaders and "
                          "colocated functions may import)")
    try:
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as e:
        raise LoaderError(f"{what} {name!r} cannot be imported on this host "
                          f"({type(e).__name__}: {e}); the module must be importable by "
                          "the workers (installed, or on their PYTHONPATH)") from None
    if not callable(obj):
        raise LoaderError(f"{what} {name!r} is not callable")
    return obj


def permutation(length: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """The order of the epoch's samples: the same on every host (and the client)."""
    if not shuffle:
        return torch.arange(length)
    g = torch.Generator()
    g.manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(length, generator=g)


def batch_rows(length: int, batch_size: int, drop_last: bool, index: int) -> Tuple[int, int]:
    """The positions ``[start, stop)`` in the epoch's order of batch ``index``."""
    start = index * batch_size
    return start, min(start + batch_size, length) if not drop_last else start + batch_size


def num_batches(length: int, batch_size: int, drop_last: bool) -> int:
    return length // batch_size if drop_last else -(-length // batch_size)


END = -1        # peek's answer where a stream ended before the batch asked for


def part_rows(size: int, parts: int, k: int) -> Tuple[int, int]:
    """Rows of part ``k`` when a batch of ``size`` is cut into ``parts`` equal blocks."""
    step = size // parts
    return k * step, (k + 1) * step


class _Batch:
    """One host batch: (epoch, index), and per part its leaves on the device, or an
    error; ``rows``: the whole batch's rows; ``end``: the stream ended before it."""

    __slots__ = ("epoch", "index", "tensors", "error", "rows", "end")

    def __init__(self, epoch: int, index: int, tensors=None, error: str = "",
                 rows: int = 0, end: bool = False) -> None:
        self.epoch, self.index, self.tensors, self.error = epoch, index, tensors, error
        self.rows, self.end = rows, end


class HostLoader:
    """One loader on one slice: the dataset, and a thread that keeps ``prefetch``
    batches ready on the devices, from the position the client last asked for."""

    def __init__(self, spec, where: str, to_device: Callable,
                 made: Optional[Callable[[int, int, int], None]] = None) -> None:
        self.spec = spec
        self.where = where
        # ``made(epoch, index, rows)``: tell the client each position the prefetcher
        # makes (a stream's loader with push_made), so that it need not peek
        self._made_hook = made if spec.push_made else None
        # ({sub-block: cpu rows}, batch axis, the part's rows) -> (buffer, shards)
        self._to_device = to_device
        self.source = _Source(spec.dataset, spec.dataset_kwargs_json, spec.collate, where)
        self.dataset, self.collate = self.source.made()
        self.iterable = isinstance(self.dataset, torch.utils.data.IterableDataset)
        if self.iterable and spec.shuffle:
            raise LoaderError(f"the dataset of {spec.dataset!r} is an IterableDataset, "
                              "which has no indices to shuffle (torch's DataLoader refuses "
                              "shuffle=True for one too): shuffle inside the stream (a "
                              "shuffle buffer), or make a map-style dataset")
        try:
            self.length = len(self.dataset)
        except TypeError:
            if not self.iterable:
                raise LoaderError(f"the dataset of {spec.dataset!r} has no len(): "
                                  "pw.DataLoader needs a map-style dataset (__getitem__ "
                                  "and __len__) or a torch IterableDataset") from None
            self.length = -1
        # A stream's positions the prefetcher has made and not yet handed over:
        # (epoch, index) -> the batch's rows, or END: what peek answers from.
        self._made: Dict[Tuple[int, int], int] = {}
        self._made_cond = threading.Condition()
        self._from: Tuple[int, int] = (0, 0)       # where the prefetcher started
        self._last: Optional[Tuple[int, int]] = None   # the last position it made
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._ready: "queue.Queue" = queue.Queue(maxsize=max(1, spec.prefetch))
        self._expect: Tuple[int, int] = (-1, -1)   # the batch the prefetcher makes next
        self._lock = threading.Lock()
        self.samples: list = []             # per leaf (dtype name, sample shape)
        # torch's DataLoader with persistent worker processes (num_workers > 0), made
        # at the first epoch; the plan each next iteration of it loads
        self._dl: Optional[torch.utils.data.DataLoader] = None
        self._plan = _Plan()

    # ------------------------------------------------------------------ structure
    def describe(self):
        """The batch's structure: (treespec JSON, per leaf (dtype, sample shape), per
        leaf the top-level item), from the first two samples, collated."""
        if self.iterable:
            batch = collate_checked(self.collate, self._first_samples(2), self.where, 0, 0)
        else:
            n = min(2, self.length)
            if n == 0:
                raise LoaderError(f"the dataset of {self.spec.dataset!r} is empty")
            try:
                batch = self._collate([0, 1][:n], epoch=0, index=0)
            except LoaderError as e:
                batch = self._first_loadable(e)
        leaves, tree = pytree.tree_flatten(batch)
        items = _leaf_items(batch)
        self.samples = [(codec.dtype_name(leaf.dtype), tuple(leaf.shape[1:]))
                        for leaf in leaves]
        return pytree.treespec_dumps(tree), self.samples, items

    def _first_loadable(self, failed: LoaderError, tries: int = 64):
        """Two samples that load, collated, when the first two do not: torch's
        DataLoader reads nothing until it is iterated, so a bad sample 0 fails its
        batch, not the loader (``failed`` is raised when none of ``tries`` loads)."""
        good: List[int] = []
        for i in range(min(self.length, tries)):
            try:
                self._collate([i], epoch=0, index=0)
            except LoaderError:
                continue
            good.append(i)
            if len(good) == 2:
                break
        if not good:
            raise failed
        return self._collate(good, epoch=0, index=0)

    def _collate(self, indices: List[int], epoch: int, index: int):
        return _Rows(self.source).load((epoch, index, indices))

    def _first_samples(self, n: int) -> list:
        out: list = []
        try:
            it = iter(self.dataset)
            while len(out) < n:
                out.append(next(it))
        except StopIteration:
            pass
        except Exception as e:
            raise LoaderError(f"the dataset {self.spec.dataset!r} raised on {self.where} "
                              f"for its first samples: {type(e).__name__}: {e}") from None
        if not out:
            raise LoaderError(f"the dataset of {self.spec.dataset!r} is empty")
        return out

    # ------------------------------------------------------------------ batches
    def take(self, epoch: int, index: int, timeout: float) -> _Batch:
        """Batch ``index`` of ``epoch``: the next one the prefetcher made, or, after
        a jump (a load_state_dict, a replay), the first it makes from there."""
        with self._lock:
            if not self._continues(epoch, index):
                self._restart(epoch, index)
            if self.iterable:
                self._expect = (epoch, index + 1)
            else:
                n = num_batches(self.length, self.spec.batch_size, self.spec.drop_last)
                self._expect = (epoch, index + 1) if index + 1 < n else (epoch + 1, 0)
            ready = self._ready
        b = self._next(ready, epoch, timeout)
        if b is None:
            return _Batch(epoch, index, error=f"batch {index} of epoch {epoch} was not "
                          f"ready on {self.where} within {timeout:.0f} s")
        with self._made_cond:
            self._made.pop((b.epoch, b.index), None)
        if b.end and (b.epoch, b.index) == (epoch, index):
            return _Batch(epoch, index, error=f"the stream of {self.spec.dataset!r} on "
                          f"{self.where} ended before batch {index} of epoch {epoch}, which "
                          "another host's stream has: every host must iterate the same "
                          "samples in the same order")
        if (b.epoch, b.index) != (epoch, index):       # the hosts' streams differ
            return _Batch(epoch, index, error=f"the loader on {self.where} made batch "
                          f"{b.index} of epoch {b.epoch}, not {index} of {epoch}")
        return b

    def peek(self, epoch: int, index: int, timeout: float,
             jump: bool = False) -> Optional[List[int]]:
        """A stream's batch ``index`` of ``epoch``: its rows once the prefetcher made
        it, END if the stream ended before it, None if neither within ``timeout``; then
        the rows of the batches after it that the prefetcher has made too (up to END).

        Takes nothing off the queue: the ``BatchOp`` that follows takes the batch, in
        the op loop's order. The prefetcher runs ahead of those by ``prefetch``
        batches, so a client asks in order, each batch after one it learned was made
        and named (``fit``'s resume names the batches it skips). Anything else is a
        ``jump``: the prefetcher starts again there unless it made that batch."""
        pos = (epoch, index)
        with self._lock:
            with self._made_cond:
                made = pos in self._made
                passed = not made and self._last is not None and self._last >= pos
            if self._thread is None or pos < self._from or passed or (jump and not made):
                self._restart(epoch, index)
                self._expect = pos
        with self._made_cond:
            if not self._made_cond.wait_for(lambda: pos in self._made, timeout):
                return None
            out = [self._made[pos]]
            while out[-1] != END and (epoch, index + len(out)) in self._made:
                out.append(self._made[(epoch, index + len(out))])
            return out

    def _record(self, stop: threading.Event, epoch: int, index: int, rows: int) -> None:
        with self._made_cond:
            if stop.is_set():
                return
            self._made[(epoch, index)] = rows
            self._last = (epoch, index)
            self._made_cond.notify_all()
        if self._made_hook is not None:
            self._made_hook(epoch, index, rows)

    def _continues(self, epoch: int, index: int) -> bool:
        """Whether the prefetcher's next batch is the one asked for. A stream's next
        epoch follows the last batch taken: the end between them is skipped."""
        if self._thread is None:
            return False
        return self._expect == (epoch, index) or (
            self.iterable and index == 0 and self._expect[0] == epoch - 1)

    @staticmethod
    def _next(ready: "queue.Queue", epoch: int, timeout: float) -> Optional[_Batch]:
        """The prefetcher's next batch, past the ends of earlier epochs."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                b = ready.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if not (b.end and b.epoch < epoch):
                return b

    def _restart(self, epoch: int, index: int) -> None:
        self._halt()
        with self._made_cond:
            self._made.clear()
            self._from, self._last = (epoch, index), None
        self._stop = threading.Event()
        self._ready = queue.Queue(maxsize=max(1, self.spec.prefetch))
        run = self._run_stream if self.iterable else self._run
        self._thread = threading.Thread(target=run, args=(epoch, index, self._stop,
                                                          self._ready),
                                        name=f"pw-loader-{self.spec.loader_id}", daemon=True)
        self._thread.start()

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            try:            # unblock a put on a full queue
                while True:
                    self._ready.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=30)
            if self._thread.is_alive():     # still inside the DataLoader: not shared
                log.warning("loader %d: the prefetcher did not stop within 30 s",
                            self.spec.loader_id)
                self._drop_workers(wait=False)
            self._thread = None

    def close(self) -> None:
        with self._lock:
            self._halt()
            self._drop_workers()

    def _workers_iter(self, make: Callable[[], torch.utils.data.DataLoader]):
        """A new pass of the loader's DataLoader, whose worker processes persist
        between passes (``make`` builds it once); in this process if num_workers=0."""
        if self.spec.num_workers == 0:
            return iter(make())
        if self._dl is None:
            self._dl = make()
        return iter(self._dl)

    def _drop_workers(self, wait: bool = True) -> None:
        """Forget the DataLoader; with ``wait``, stop its worker processes now."""
        dl, self._dl = self._dl, None
        it = getattr(dl, "_iterator", None)
        if wait and it is not None:
            it._shutdown_workers()

    def _subs(self) -> Tuple[int, List[int]]:
        sp = self.spec
        return (sp.sub, list(sp.sub_mine)) if sp.sub > 1 else (1, [0])

    def _positions(self, rows: int) -> List[int]:
        """This host's rows of a batch of ``rows``: of each of its parts, its
        sub-blocks' rows, in order."""
        sp = self.spec
        sub, subs = self._subs()
        out: List[int] = []
        for k in sp.mine:
            a, b = part_rows(rows, sp.parts, k)
            for s in subs:
                c, d = part_rows(b - a, sub, s)
                out.extend(range(a + c, a + d))
        return out

    def _indices(self, epoch: int, index: int, perm: torch.Tensor) -> List[int]:
        """This host's sample indices of batch ``index``."""
        sp = self.spec
        start, stop = batch_rows(self.length, sp.batch_size, sp.drop_last, index)
        order = perm[start:stop].tolist()
        return [order[p] for p in self._positions(len(order))]

    def _run(self, epoch: int, index: int, stop: threading.Event, ready: "queue.Queue"):
        sp = self.spec
        n = num_batches(self.length, sp.batch_size, sp.drop_last)
        while not stop.is_set():
            if index >= n:
                epoch, index = epoch + 1, 0
                continue
            perm = permutation(self.length, sp.shuffle, sp.seed, epoch)
            plan = [(epoch, i, self._indices(epoch, i, perm)) for i in range(index, n)]
            try:
                self._epoch(plan, stop, ready)
            except Exception:
                log.error("loader %d: %s", sp.loader_id, traceback.format_exc())
                return
            epoch, index = epoch + 1, 0

    def _run_stream(self, epoch: int, index: int, stop: threading.Event,
                    ready: "queue.Queue") -> None:
        """An IterableDataset's epochs from batch ``index`` of ``epoch``: torch's
        DataLoader over the whole stream, this host's rows of each batch, and an end
        marker where the stream ends (or after a batch whose loading raised: the
        stream cannot go on from there)."""
        sp = self.spec
        while not stop.is_set():
            i = 0
            try:
                it = self._workers_iter(lambda: torch.utils.data.DataLoader(
                    _Stream(self.source), batch_size=sp.batch_size,
                    drop_last=sp.drop_last, collate_fn=_Collate(self.source),
                    **_worker_options(sp.num_workers)))
                while not stop.is_set():
                    try:
                        batch = next(it)
                    except StopIteration:
                        break
                    if i >= index:
                        b = self._place_stream(epoch, i, batch)
                        self._record(stop, epoch, i, b.rows)
                        if not _offer(ready, stop, b):
                            return
                    i += 1
            except Exception as e:
                self._drop_workers()       # a pass that raised cannot go on
                i = max(i, index)
                err = f"the stream of {sp.dataset!r} raised on {self.where} in batch " \
                      f"{i} of epoch {epoch}: {type(e).__name__}: {e}"
                self._record(stop, epoch, i, 0)
                if not _offer(ready, stop, _Batch(epoch, i, error=err)):
                    return
                i += 1
            i = max(i, index)
            self._record(stop, epoch, i, END)
            if not _offer(ready, stop, _Batch(epoch, i, end=True)):
                return
            epoch, index = epoch + 1, 0

    def _place_stream(self, epoch: int, index: int, batch) -> _Batch:
        """This host's rows of a whole batch of the stream, on the devices."""
        batch = plain_batch(batch)
        try:
            check_leaves(batch, epoch, index)
        except LoaderError as e:
            return _Batch(epoch, index, error=str(e))
        leaves = pytree.tree_leaves(batch)
        rows = leaves[0].shape[0]
        keep = self._positions(rows)
        if keep != list(range(rows)):
            batch = pytree.tree_map(lambda t: t[keep], batch)
        b = self._place(epoch, index, batch)
        b.rows = rows
        return b

    def _epoch(self, plan, stop: threading.Event, ready: "queue.Queue") -> None:
        """Load the batches of ``plan`` in order with torch's DataLoader (its workers
        read samples in parallel), each to the devices, each into ``ready``."""
        def make():
            return torch.utils.data.DataLoader(
                _Rows(self.source), sampler=self._plan, batch_size=None,
                collate_fn=_identity, **_worker_options(self.spec.num_workers))

        self._plan.items = plan
        it = self._workers_iter(make)
        for k, (epoch, index, _) in enumerate(plan):
            if stop.is_set():
                return
            try:
                loaded = next(it)
            except StopIteration:
                return
            except Exception as e:      # the workers' machinery, not the dataset
                loaded = f"loading batch {index} of epoch {epoch} on " \
                                   f"{self.where} failed: {type(e).__name__}: {e}"
                self._drop_workers()
                self._plan.items = plan[k + 1:]
                it = self._workers_iter(make)
            if isinstance(loaded, str):
                b = _Batch(epoch, index, error=loaded)
            else:
                b = self._place(epoch, index, loaded)
            if not _offer(ready, stop, b):
                return

    def _place(self, epoch: int, index: int, batch) -> _Batch:
        """Cut a loaded batch into this slice's parts and put each leaf on the devices."""
        sp = self.spec
        try:
            items = _leaf_items(batch)
            leaves = pytree.tree_leaves(batch)
            keep = [j for j, it in enumerate(items) if not sp.leaves or it in sp.leaves]
            rows = leaves[0].shape[0] if leaves else 0
            got = [(codec.dtype_name(t.dtype), tuple(t.shape[1:])) for t in leaves]
            if got != self.samples or any(t.shape[0] != rows for t in leaves):
                return _Batch(epoch, index, error=(
                    f"batch {index} of epoch {epoch} on {self.where} has leaves "
                    f"{[(d, [t.shape[0], *s]) for (d, s), t in zip(got, leaves)]}, but the "
                    f"loader's first samples gave {[(d, ['batch', *s]) for d, s in self.samples]}"
                    ": every batch must have the same structure, dtypes and per-sample "
                    "shapes (pad or crop in the dataset or collate_fn)"))
            sub, subs = self._subs()
            step = rows // (len(sp.mine) * len(subs))     # rows of one sub-block
            parts, at = [], 0
            for _ in sp.mine:
                blocks = {}
                for s in subs:
                    blocks[s] = at
                    at += step
                # each leaf of the part: {sub-block: its rows}, and the part's rows
                parts.append([self._to_device(
                    {s: leaves[j][a:a + step].contiguous() for s, a in blocks.items()},
                    sp.axis, step * sub) for j in keep])
            return _Batch(epoch, index, parts)
        except Exception as e:
            return _Batch(epoch, index, error=f"placing batch {index} of epoch {epoch} on "
                          f"{self.where} failed: {type(e).__name__}: {e}")


def _offer(ready: "queue.Queue", stop: threading.Event, b: _Batch) -> bool:
    """Queue ``b`` once there is room; False if the loader stopped first."""
    while not stop.is_set():
        try:
            ready.put(b, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False


def _identity(x):
    return x


@functools.lru_cache(maxsize=None)
def _fork_server() -> multiprocessing.context.BaseContext:
    """The context of the DataLoader workers: a fork server (started at the first
    worker, torch preloaded, so a worker starts in milliseconds)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def _die_with(executor: int, worker_id: int) -> None:
    """A worker's ``worker_init_fn``: exit when the executor does. torch's check only
    watches the worker's parent, the fork server, which lives while its workers hold
    the executor's end of its pipe; and it runs between samples, not during a long
    ``__getitem__``."""
    threading.Thread(target=_proc.exit_when_gone, args=(executor,), daemon=True,
                     name="pw-die-with-executor").start()


def _worker_options(num_workers: int) -> dict:
    if num_workers == 0:
        return {"num_workers": 0}
    return {"num_workers": num_workers, "prefetch_factor": 2, "persistent_workers": True,
            "multiprocessing_context": _fork_server(),
            "worker_init_fn": functools.partial(_die_with, os.getpid())}


class _Source:
    """The loader's dataset and collate function, and their names: a DataLoader
    worker process gets only the names and builds both as the host did, so neither
    need be picklable (a class defined inside its factory, a lambda collate)."""

    def __init__(self, dataset: str, kwargs_json: str, collate: str, where: str) -> None:
        self.names = (dataset, kwargs_json or "{}", collate)
        self.where = where
        self._made: Optional[tuple] = None

    def __getstate__(self) -> dict:
        return {"names": self.names, "where": self.where}

    def __setstate__(self, state: dict) -> None:
        self.names, self.where, self._made = state["names"], state["where"], None

    def made(self) -> tuple:
        """(dataset, collate function), built at the first call."""
        if self._made is None:
            dataset, kwargs_json, collate = self.names
            factory = import_named(dataset, "the dataset factory")
            try:
                built = factory(**json.loads(kwargs_json))
            except Exception as e:
                raise LoaderError(f"the dataset factory {dataset!r} raised on "
                                  f"{self.where}: {type(e).__name__}: {e}") from None
            self._made = (built, import_named(collate, "the collate function")
                          if collate else torch.utils.data.default_collate)
        return self._made


class _Plan(torch.utils.data.Sampler):
    """The batches the next pass of the map-style DataLoader loads: items
    (epoch, index, this host's sample indices), set before each pass."""

    def __init__(self) -> None:
        self.items: list = []

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class _Rows(torch.utils.data.Dataset):
    """Item (epoch, index, indices): that batch loaded and collated (what each
    DataLoader worker runs); a failure comes back as its message, so one bad sample
    fails one batch only."""

    def __init__(self, source: _Source) -> None:
        self.source = source

    def __getitem__(self, item):
        try:
            return self.load(item)
        except LoaderError as e:
            return str(e)

    def load(self, item):
        """Load and collate a batch; a LoaderError naming the sample that failed."""
        epoch, index, indices = item
        dataset, collate = self.source.made()
        samples = []
        for i in indices:
            try:
                samples.append(dataset[int(i)])
            except Exception as e:
                raise LoaderError(
                    f"the dataset {self.source.names[0]!r} raised on {self.source.where} "
                    f"for index {int(i)} (batch {index} of epoch {epoch}): "
                    f"{type(e).__name__}: {e}") from None
        return collate_checked(collate, samples, self.source.where, epoch, index)


class _Stream(torch.utils.data.IterableDataset):
    """The loader's IterableDataset, built in each worker from its name."""

    def __init__(self, source: _Source) -> None:
        self.source = source

    def __iter__(self):
        return iter(self.source.made()[0])


class _Collate:
    """The loader's collate function, imported in each worker by its name."""

    def __init__(self, source: _Source) -> None:
        self.source = source

    def __call__(self, samples):
        return self.source.made()[1](samples)


def collate_checked(collate, samples: list, where: str, epoch: int, index: int):
    """``collate(samples)``, a batch whose every leaf has the samples along dimension 0;
    a LoaderError that says which batch and why not."""
    try:
        batch = plain_batch(collate(samples))
    except Exception as e:
        raise LoaderError(f"collating batch {index} of epoch {epoch} on {where} "
                          f"failed: {type(e).__name__}: {e}") from None
    check_leaves(batch, epoch, index)
    return batch


def check_leaves(batch, epoch: int, index: int) -> None:
    for leaf in pytree.tree_leaves(batch):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            kind = type(leaf).__name__ + (" (0-d)" if isinstance(leaf, torch.Tensor)
                                          else "")
            raise LoaderError(
                f"batch {index} of epoch {epoch} has a leaf of type {kind}: every leaf "
                "of a pw.DataLoader batch must be a tensor with the samples along "
                "dimension 0 (drop other fields in collate_fn)")


def _leaf_items(batch) -> List[int]:
    """For each leaf of ``batch``, the top-level item it belongs to (a tuple or list
    batch: its position; anything else: 0)."""
    if isinstance(batch, (tuple, list)):
        out: List[int] = []
        for k, item in enumerate(batch):
            out.extend([k] * len(pytree.tree_leaves(item)))
        return out
    return [0] * len(pytree.tree_leaves(batch))


def open_loader(service, request, context, to_device) -> None:
    """The OpenLoader RPC of an executor or a member (``service``): build the loader
    here, keep it in ``service.loaders``, answer with its batches' structure."""
    import grpc
    from ..rpc import validate
    try:
        validate.check_loader(request, service.axis_names)
    except validate.InvalidMessage as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    def made(epoch: int, index: int, rows: int) -> None:
        # on the slice's Dispatch stream, where the client's reader takes it
        service._events.put(service.pb.DispatchEvent(made=[service.pb.LoaderMade(
            loader_id=request.loader_id, epoch=epoch, index=index, rows=rows)]))

    try:
        loader = HostLoader(request, service.where, to_device, made)
        tree, samples, items = loader.describe()
    except LoaderError as e:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    old = service.loaders.pop(request.loader_id, None)
    if old is not None:
        old.close()
    service.loaders[request.loader_id] = loader
    reply = service.pb.LoaderInfo(length=loader.length, treespec=tree, leaf_items=items,
                                  iterable=loader.iterable)
    for dtype, shape in samples:
        reply.samples.add(dtype=dtype, shape=list(shape))
    return reply


def peek_loader(service, req):
    """The PeekLoader RPC: does batch ``req.index`` of ``req.epoch`` of a stream exist
    (and how many rows it has); answers once this host's prefetcher got there."""
    pb = service.pb
    loader = service.loaders.get(req.loader_id)
    if loader is None or not loader.iterable:
        why = "is not open" if loader is None else "is not over an IterableDataset"
        return pb.LoaderPeekReply(has_error=True, error=service._err(
            "data", f"loader {req.loader_id} {why} on {service.where}"))
    rows = loader.peek(req.epoch, req.index, req.timeout_s, req.jump)
    if rows is None:
        return pb.LoaderPeekReply(has_error=True, error=service._err(
            "data", f"batch {req.index} of epoch {req.epoch} was not ready on "
            f"{service.where} within {req.timeout_s:.0f} s"))
    return pb.LoaderPeekReply(exists=rows[0] != END, rows=max(rows[0], 0),
                              next_rows=rows[1:])


def close_loaders(service, ids) -> None:
    """A ReleaseOp's loader ids: stop those loaders (their threads, workers, batches)."""
    for i in ids:
        loader = service.loaders.pop(i, None)
        if loader is not None:
            loader.close()


def take_batch(service, op, timeout: float):
    """A BatchOp on ``service``: (the placed buffers, in the op's order, or None;
    the BufferError that fails every output instead, or None)."""
    loader = service.loaders.get(op.loader_id)
    if loader is None:
        return None, service._err("data", f"loader {op.loader_id} is not open on "
                                  f"{service.where}")
    b = loader.take(op.epoch, op.index, timeout)
    if b.error:
        return None, service._err("data", b.error)
    placed = [x for part in b.tensors for x in part]
    if len(placed) != len(op.outputs):
        return None, service._err("data", f"the loader made {len(placed)} buffers for "
                                  f"batch {op.index}, the client asked for "
                                  f"{len(op.outputs)}")
    return placed, None
