"""``pw.colocated``: run an importable Python function beside a slice's devices.

For custom preprocessing, metrics or I/O next to the data: the function runs on the
worker host that holds the Arrays, on their values as CPU torch tensors, and only what
it returns comes back: tensors as new Arrays on the same slice (their bytes stay on the
host), other values (numbers, strings, lists, dicts) to the client as JSON. The function
is named by import path, as the host imports it: no callable is ever pickled.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Sequence

import grpc
from torch.utils import _pytree as pytree

from ..errors import PlacementError
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
    region of each input (what its devices hold) and returns values, not tensors:
    the call gives a list of the hosts' results, in host order. Blocks until ``fn``
    has run (its inputs are ready first). A function that raises gives
    ``pw.ColocatedError`` naming the host; the slice stays usable.

    Example (``mypkg/metrics.py`` on the workers' path)::

        def summarize(logits, labels, top=1):
            return {"accuracy": (logits.argmax(-1) == labels).float().mean().item()}

        stats = pw.colocated("mypkg.metrics:summarize")(logits, labels, top=1)
        print(stats["accuracy"])
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
                rep = member.stub.Colocated(req, timeout=t + 5)
            except grpc.RpcError as e:
                raise member._rpc_error(e, what, t) from None
            if rep.has_error:
                raise_buffer_error(rep.error, what)
            return rep

        if s.spans_hosts:           # every host on its own region; values, per host
            return [pytree.tree_unflatten(json.loads(rep.values_json or "[]"),
                                          pytree.treespec_loads(rep.treespec))
                    for rep in conn._each(ask)]
        rep = ask(conn)
        values = iter(json.loads(rep.values_json or "[]"))
        metas = iter(enumerate(rep.tensors))
        leaves = []
        for is_tensor in rep.is_tensor:
            if not is_tensor:
                leaves.append(next(values))
                continue
            k, meta = next(metas)
            spec = specs[k] if k < len(specs) else as_spec(None)
            shape = tuple(meta.shape)
            leaves.append(Array(s, ids[k], conn.seq, shape, codec.dtype_from_name(meta.dtype),
                                spec.normalized(len(shape)), f"pw.colocated({fn!r})"))
        return pytree.tree_unflatten(leaves, pytree.treespec_loads(rep.treespec))

    call.__name__ = fn.rpartition(":")[2]
    call.__doc__ = f"Runs {fn} on the host of its Array arguments (pw.colocated)."
    return call
