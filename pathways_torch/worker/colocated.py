"""The host side of ``pw.colocated``: an importable function run beside the devices.

The client names the function (``"package.module:fn"``; never a pickled callable) and
the buffers it takes. Here the buffers are read to the host as CPU tensors, the function
runs on them, and what it returns goes back by kind: tensors become buffers of the slice
under ids the client reserved, other values (numbers, strings, lists, dicts) travel as
JSON. Only the tensors' metadata crosses the wire.
"""

from __future__ import annotations

import json
import traceback

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ..rpc import codec
from ..sharding import spec_from_proto, P
from .loader import LoaderError, import_named
from .store import Entry


def run_colocated(ex, req):
    """Serve one Colocated call on executor ``ex``; returns a ColocatedReply."""
    pb = ex.pb

    def fail(kind: str, message: str):
        return pb.ColocatedReply(has_error=True, error=ex._err(kind, message, req.fn))

    try:
        fn = import_named(req.fn, "the colocated function")
        kwargs = json.loads(req.kwargs_json or "{}")
    except (LoaderError, ValueError) as e:
        return fail("colocated", str(e))
    inputs = []
    for bid in req.inputs:
        entry, err = ex._readable(pb.FetchRequest(buffer_id=bid, after_seq=req.after_seq,
                                                  timeout_s=req.timeout_s))
        if err is not None:
            return pb.ColocatedReply(has_error=True, error=err.error)
        try:
            inputs.append(entry.tensor.cpu())
        except Exception as e:
            return fail("program", f"buffer {bid} failed on {ex.where}: {e}")
        finally:
            ex.store.end_read(entry)
    try:
        out = fn(*inputs, **kwargs)
    except Exception as e:
        tb = traceback.format_exc(limit=-3)
        return fail("colocated", f"{req.fn} raised on {ex.where}: {type(e).__name__}: {e}\n"
                    f"{tb}")
    leaves, tree = pytree.tree_flatten(out)
    try:
        treespec = pytree.treespec_dumps(tree)
    except Exception as e:
        return fail("colocated", f"{req.fn} returned a {type(out).__name__}, whose "
                    f"structure cannot travel ({e}); return tensors, numbers, strings, "
                    "and tuples, lists or dicts of them")
    tensors, values, is_tensor = [], [], []
    for leaf in leaves:
        if isinstance(leaf, np.ndarray):
            leaf = torch.from_numpy(leaf)
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf.detach().cpu().contiguous())
            is_tensor.append(True)
        else:
            values.append(leaf)
            is_tensor.append(False)
    if len(tensors) > len(req.out_ids):
        return fail("colocated", f"{req.fn} returned {len(tensors)} tensors; a colocated "
                    f"call takes at most {len(req.out_ids)} (max_outputs=)")
    try:
        values_json = json.dumps(values)
    except (TypeError, ValueError) as e:
        return fail("colocated", f"{req.fn} returned a value JSON cannot carry ({e}); "
                    "return tensors for array data")
    reply = pb.ColocatedReply(treespec=treespec, values_json=values_json,
                              is_tensor=is_tensor)
    for k, t in enumerate(tensors):
        try:
            codec.dtype_name(t.dtype)
            spec = spec_from_proto(req.out_specs[k]) if k < len(req.out_specs) else P()
            dev = ex._to_device(t, spec)
        except Exception as e:
            ex.store.release(list(req.out_ids[:k]))
            return fail("colocated", f"output {k} of {req.fn} ({t.dtype}{list(t.shape)}) "
                        f"cannot be placed on the slice: {e}")
        ex.store.put(req.out_ids[k], Entry(dev, None, codec.nbytes(t.dtype, tuple(t.shape)),
                                           req.fn, None, ex._shards(spec)))
        reply.tensors.add(dtype=codec.dtype_name(t.dtype), shape=list(t.shape))
    return reply
