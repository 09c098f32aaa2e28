"""The host side of ``pw.colocated``: an importable function run beside the devices.

The client names the function (``"package.module:fn"``; never a pickled callable) and
the buffers it takes. Here the buffers are read to the host as CPU tensors, the function
runs on them, and what it returns goes back by kind: tensors become buffers of the slice
under ids the client reserved, other values (numbers, strings, lists, dicts) travel as
JSON. Only the tensors' metadata crosses the wire. On a slice that spans hosts each
host runs the function on its own region of the inputs, and each tensor it returns is
its region of that output: the hosts' regions make one Array.
"""

from __future__ import annotations

import json
import traceback
import zlib

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ..rpc import codec
from ..errors import ShardingError
from ..sharding import P, host_box, member_blocks, member_region, spec_from_proto
from .loader import LoaderError, import_named
from .store import Entry


def _call(ex, req, inputs):
    """Import and run the function on ``inputs``: (result, None) or (None, the
    ColocatedReply that says why not)."""
    pb = ex.pb
    try:
        fn = import_named(req.fn, "the colocated function")
        kwargs = json.loads(req.kwargs_json or "{}")
    except (LoaderError, ValueError) as e:
        return None, pb.ColocatedReply(has_error=True,
                                       error=ex._err("colocated", str(e), req.fn))
    try:
        return fn(*inputs, **kwargs), None
    except Exception as e:
        tb = traceback.format_exc(limit=-3)
        return None, pb.ColocatedReply(has_error=True, error=ex._err(
            "colocated", f"{req.fn} raised on {ex.where}: {type(e).__name__}: {e}\n{tb}",
            req.fn))


def _split(ex, req, out):
    """The result's structure, its tensor leaves, and a reply holding the rest."""
    pb = ex.pb
    leaves, tree = pytree.tree_flatten(out)
    try:
        treespec = pytree.treespec_dumps(tree)
    except Exception as e:
        return None, pb.ColocatedReply(has_error=True, error=ex._err(
            "colocated", f"{req.fn} returned a {type(out).__name__}, whose structure "
            f"cannot travel ({e}); return tensors, numbers, strings, and tuples, lists or "
            "dicts of them", req.fn))
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
    try:
        values_json = json.dumps(values)
    except (TypeError, ValueError) as e:
        return None, pb.ColocatedReply(has_error=True, error=ex._err(
            "colocated", f"{req.fn} returned a value JSON cannot carry ({e}); return "
            "tensors for array data", req.fn))
    return tensors, pb.ColocatedReply(treespec=treespec, values_json=values_json,
                                      is_tensor=is_tensor)


def _abandoned(context) -> bool:
    """The client gave up on the call (its deadline passed, or it went away) while the
    function ran: nobody will hold its outputs' Arrays, so they are not placed."""
    return context is not None and not context.is_active()


def run_colocated_member(m, req, context=None):
    """Serve one Colocated call on member ``m`` of a slice that spans hosts.

    The function gets this host's region of each input (the box its devices' shards
    cover) and returns, for each tensor, this host's region of that output under
    ``out_specs[k]`` (all of it when replicated). Each host places its region on its own
    devices as its part of one global Array; the reply says which region it was and its
    CRC-32, so that the client can check hosts holding the same region agree."""
    from .member import _Buf, _to_numpy, _to_torch, np_dtype
    pb = m.pb
    inputs = []
    for bid in req.inputs:
        buf, err = m._ready_buf(bid, req.after_seq, req.timeout_s)
        if err is not None:
            return pb.ColocatedReply(has_error=True, error=err)
        blocks = m.rt.local_blocks(buf.array)
        try:
            box = host_box([tuple((a, a + n) for a, n in zip(st, v.shape))
                            for st, v in blocks], f"input buffer {bid}")
        except ShardingError as e:
            return pb.ColocatedReply(has_error=True, error=m._err("colocated", str(e),
                                                                  req.fn))
        region = np.empty([b - a for a, b in box], dtype=blocks[0][1].dtype)
        for st, v in blocks:
            region[tuple(slice(a - o, a - o + n)
                         for a, (o, _), n in zip(st, box, v.shape))] = v
        inputs.append(_to_torch(torch, region))
    out, err = _call(m, req, inputs)
    if err is not None or _abandoned(context):
        return err or pb.ColocatedReply()
    tensors, reply = _split(m, req, out)
    if tensors is None:
        return reply
    if len(tensors) > len(req.out_ids):
        return _too_many(m, req, len(tensors))
    for k, t in enumerate(tensors):
        spec = spec_from_proto(req.out_specs[k]) if k < len(req.out_specs) else P()
        try:
            dtype = codec.dtype_name(t.dtype)
            shape, start = member_region(tuple(t.shape), spec, m.axis_names, m.mesh_shape,
                                         m.member, m.members, f"output {k} of {req.fn}")
            blocks, _ = member_blocks(shape, spec, m.axis_names, m.mesh_shape,
                                      m.member, m.members)
            value = _to_numpy(t, np_dtype(dtype))
            array = m._global(shape, spec, [
                value[tuple(slice(a - o, b - o) for (a, b), o in zip(blk, start))]
                for blk in blocks])
        except Exception as e:
            _drop(m, req.out_ids[:k])
            return pb.ColocatedReply(has_error=True, error=m._err(
                "colocated", f"output {k} of {req.fn} ({t.dtype}{list(t.shape)} on "
                f"{m.where}) cannot be placed as this host's part of an Array under "
                f"{spec!r}: {e}", req.fn))
        with m.cond:    # computed already: not the op loop's _put_buf bookkeeping
            m.store[req.out_ids[k]] = _Buf(array, None, value.nbytes)
            m.cond.notify_all()
        reply.tensors.add(dtype=dtype, shape=list(shape))
        reply.regions.add(start=list(start), shape=list(t.shape))
        flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        reply.crcs.append(zlib.crc32(flat))
    return reply


def _drop(m, ids) -> None:
    with m.cond:
        for b in ids:
            m.store.pop(b, None)


def _too_many(ex, req, n: int):
    return ex.pb.ColocatedReply(has_error=True, error=ex._err(
        "colocated", f"{req.fn} returned {n} tensors; a colocated call takes at most "
        f"{len(req.out_ids)} (max_outputs=)", req.fn))


def run_colocated(ex, req, context=None):
    """Serve one Colocated call on executor ``ex``; returns a ColocatedReply."""
    pb = ex.pb
    inputs = []
    for bid in req.inputs:
        entry, err = ex._readable(pb.FetchRequest(buffer_id=bid, after_seq=req.after_seq,
                                                  timeout_s=req.timeout_s))
        if err is not None:
            return pb.ColocatedReply(has_error=True, error=err.error)
        try:
            inputs.append(ex._host_copy(entry))
        except Exception as e:
            return pb.ColocatedReply(has_error=True, error=ex._read_failed(entry, e))
        finally:
            ex.store.end_read(entry)
    out, err = _call(ex, req, inputs)
    if err is not None or _abandoned(context):
        return err or pb.ColocatedReply()
    tensors, reply = _split(ex, req, out)
    if tensors is None:
        return reply
    if len(tensors) > len(req.out_ids):
        return _too_many(ex, req, len(tensors))
    for k, t in enumerate(tensors):
        try:
            codec.dtype_name(t.dtype)
            spec = spec_from_proto(req.out_specs[k]) if k < len(req.out_specs) else P()
            dev = ex._to_device(t, spec)
        except Exception as e:
            ex.store.release(list(req.out_ids[:k]))
            return pb.ColocatedReply(has_error=True, error=ex._err(
                "colocated", f"output {k} of {req.fn} ({t.dtype}{list(t.shape)}) cannot be "
                f"placed on the slice: {e}", req.fn))
        ex.store.put(req.out_ids[k], Entry(dev, None, codec.nbytes(t.dtype, tuple(t.shape)),
                                           req.fn, None, ex._shards(spec)))
        reply.tensors.add(dtype=codec.dtype_name(t.dtype), shape=list(t.shape))
    return reply
