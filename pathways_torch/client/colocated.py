"""``pw.colocated``: run an importable Python function beside a slice's devices.

For custom preprocessing, metrics or I/O next to the data: the function runs on the
worker host that holds the Arrays, on their values as CPU torch tensors, and only what
it returns comes back: tensors as new Arrays on the same slice (their bytes stay on the
hosts; on a slice that spans hosts each host's tensor is its region of the Array),
other values (numbers, strings, lists, dicts) to the client as JSON. The function is
named by import path, as the host imports it: no callable is ever pickled.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Sequence

import grpc
from torch.utils import _pytree as pytree

from ..errors import ColocatedError, PlacementError
from ..rpc import codec
from ..rpc import pathways_pb2 as pb
from ..sharding import as_spec, spec_to_proto
from . import graph as graph_mod
from . import runtime
from .array import Array
from .connection import raise_buffer_error


def colocated(fn: str, *, out_specs: Optional[Sequence] = None, max_outputs: int = 16,
              timeout: Optional[float] = None) -> Callable[..., Any]:
    """A callable that runs ``fn`` (``"package.module:function"``) on the host of its
    Array arguments; keyword arguments travel as JSON.

    Returns ``fn``'s result with each tensor in it an Array on the same slice
    (replicated, or ``out_specs[k]`` for the k-th tensor) and everything else as
    ``fn`` returned it. On a slice that spans hosts, each host runs ``fn`` on its own
    region of each input (what its devices hold), and the call gives a list of the
    hosts' results, in host order. There each tensor a host returns is its region of
    that output under ``out_specs[k]``: the hosts' regions make one Array, the same
    Array in every host's result (so a replicated output must be the same on every
    host, and is checked to be). Blocks until ``fn`` has run (its inputs are ready
    first). A function that raises gives ``pw.ColocatedError`` naming the host; the
    slice stays usable.

    Example (``mypkg/metrics.py`` on the workers' path)::

        def summarize(logits, labels, top=1):
            return {"accuracy": (logits.argmax(-1) == labels).float().mean().item()}

        stats = pw.colocated("mypkg.metrics:summarize")(logits, labels, top=1)
        print(stats["accuracy"])

    On a slice whose "data" axis crosses 2 hosts, a function returning
    ``(x - x.mean(0)).contiguous()`` for a host's 4 rows of an (8, 6) ``x``::

        per_host = pw.colocated("mypkg.prep:center", out_specs=[P("data")])(x)
        centered = per_host[0]        # one (8, 6) Array; rows 0-3 from host 0
    """
    if not isinstance(fn, str):
        raise TypeError("pw.colocated takes the function's import path as a string, "
                        "'package.module:function', importable on the workers: a "
                        f"{type(fn).__name__} would have to be pickled, which never "
                        "crosses the wire")
    if ":" not in fn:
        raise ValueError(f"pw.colocated({fn!r}): name the function as "
                         "'package.module:function'")

    def call(*arrays: Array, **kwargs: Any) -> Any:
        runtime.get_state()
        if graph_mod.current() is not None:
            raise PlacementError("pw.colocated blocks until the function has run, so it "
                                 "cannot be recorded in pw.graph(); call it outside")
        if not arrays or not all(isinstance(a, Array) for a in arrays):
            raise TypeError(f"pw.colocated({fn!r}) takes pw.Arrays as positional "
                            "arguments (put tensors first with pw.put) and JSON values "
                            "as keyword arguments")
        s = arrays[0].slice
        if any(a.slice is not s for a in arrays):
            raise PlacementError(f"pw.colocated({fn!r}): the Arrays live on different "
                                 "slices; move them to one first (Array.to)")
        runtime.check_alive(s)
        for a in arrays:
            a._check_usable()
        try:
            kwargs_json = json.dumps(kwargs)
        except (TypeError, ValueError) as e:
            raise TypeError(f"pw.colocated({fn!r}): keyword arguments travel as JSON: "
                            f"{e}") from None
        conn = s._conn
        specs = [as_spec(x) for x in (out_specs or ())]
        t = timeout or conn.timeout
        ids = [conn.new_id() for _ in range(max(max_outputs, len(specs)))]
        req = pb.ColocatedRequest(fn=fn, inputs=[a._id for a in arrays],
                                  after_seq=max(int(a._seq) for a in arrays),
                                  kwargs_json=kwargs_json, out_ids=ids, timeout_s=t)
        for sp in specs:
            spec_to_proto(sp, req.out_specs.add())
        what = f"pw.colocated({fn!r})"

        def ask(member) -> pb.ColocatedReply:
            try:
                # a little past t, so that the host's own error for inputs that were
                # not ready within t (which names them) usually arrives first
                rep = member.stub.Colocated(req, timeout=t + min(5.0, max(0.5, t / 10)))
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not member.broken:
                    raise TimeoutError(
                        f"{what} did not finish within {t} s on {member.where}; a "
                        "function still running goes on there and its outputs are "
                        "dropped. Pass a larger timeout= if it needs longer") from None
                raise member._rpc_error(e, what, t) from None
            if rep.has_error:
                raise_buffer_error(rep.error, what)
            return rep

        if s.spans_hosts:           # every host on its own region of everything
            try:
                reps = conn._each(ask)
                return _per_host(s, fn, reps, ids, specs)
            except BaseException:
                for i in ids:       # the hosts that succeeded placed their regions
                    conn.release(i)
                raise
        rep = ask(conn)
        arrays = [_array(s, fn, ids[k], meta, specs, k)
                  for k, meta in enumerate(rep.tensors)]
        return _result(rep, arrays)

    call.__name__ = fn.rpartition(":")[2]
    call.__doc__ = f"Runs {fn} on the host of its Array arguments (pw.colocated)."
    return call



def _spec(specs: list, k: int):
    """Output ``k``'s partition spec: ``out_specs[k]``, else replicated."""
    return specs[k] if k < len(specs) else as_spec(None)


def _array(s, fn: str, bid: int, meta: pb.TensorMeta, specs: list, k: int) -> Array:
    """The Array output ``k`` of a colocated call became (buffer ``bid``)."""
    spec = _spec(specs, k)
    shape = tuple(meta.shape)
    return Array(s, bid, s._conn.seq, shape, codec.dtype_from_name(meta.dtype),
                 spec.normalized(len(shape)), f"pw.colocated({fn!r})")


def _result(rep: pb.ColocatedReply, arrays: list) -> Any:
    """One host's result: its values, with ``arrays`` where it returned tensors."""
    values, tensors = iter(json.loads(rep.values_json or "[]")), iter(arrays)
    leaves = [next(tensors) if is_tensor else next(values) for is_tensor in rep.is_tensor]
    return pytree.tree_unflatten(leaves, pytree.treespec_loads(rep.treespec))


def _per_host(s, fn: str, reps: list, ids: list, specs: list) -> list:
    """The hosts' results on a slice that spans hosts, in host order; the k-th tensor
    each returned is its region of one Array, the same Array in every result.

    Checks that the hosts agree on what that Array is (its dtype and global shape), and
    that hosts holding the same region (a replicated output, or a dimension not split
    across hosts) returned the same bytes: otherwise the Array's copies would differ."""
    what = f"pw.colocated({fn!r})"
    hosts = s.hosts
    counts = {len(r.tensors) for r in reps}
    if len(counts) > 1:
        got = ", ".join(f"host {h}: {len(r.tensors)}" for h, r in zip(hosts, reps))
        raise ColocatedError(f"{what}: the hosts returned different numbers of tensors "
                             f"({got}); every host must return the same tensors, each "
                             "its own region of the output", program=fn)
    arrays = []
    for k in range(counts.pop()):
        metas = {(r.tensors[k].dtype, tuple(r.tensors[k].shape)) for r in reps}
        if len(metas) > 1:
            raise ColocatedError(
                f"{what}: the hosts' tensor {k} are not regions of one array ("
                + ", ".join(f"host {h}: {r.tensors[k].dtype}{list(r.regions[k].shape)} "
                            f"of {list(r.tensors[k].shape)}" for h, r in zip(hosts, reps))
                + "); each host returns its own region of the output under out_specs",
                program=fn)
        by_region: dict = {}
        for h, r in zip(hosts, reps):
            region = (tuple(r.regions[k].start), tuple(r.regions[k].shape))
            first = by_region.setdefault(region, (h, r.crcs[k]))
            if first[1] != r.crcs[k]:
                raise ColocatedError(
                    f"{what}: hosts {first[0]} and {h} hold the same region of tensor {k} "
                    f"under {_spec(specs, k)!r} but returned different values; return the same "
                    "values there, or give out_specs that split the output across hosts",
                    program=fn)
        arrays.append(_array(s, fn, ids[k], reps[0].tensors[k], specs, k))
    return [_result(r, arrays) for r in reps]
