"""Checkpoints written and read by the executors, in torch.distributed.checkpoint format.

The bytes never pass through the client: each slice's executor writes the buffers it holds
into its own part directory (``<path>/part-<k>/``; each host of a slice that spans hosts
writes the blocks it is the first to hold as chunks, into ``<path>/part-<k>/m<j>/``),
and the client merges the parts' metadata into ``<path>/.metadata``, so that plain ``torch.distributed.checkpoint.load``
reads the whole directory. Loading sends each executor the keys it needs; it reads them
straight from the files. ``path`` must be a filesystem that every host and the client see
(one machine here; a shared mount on a cluster), as for any DCP checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Dict, Mapping, Tuple

import torch

from ..errors import CheckpointError
from ..rpc import codec
from ..rpc import pathways_pb2 as pb
from ..sharding import P, as_spec, spec_to_proto, validate_spec
from . import runtime
from .array import Array

_PART = "part-{}"


def save_arrays(path: str, arrays: Mapping[str, Array]) -> int:
    """Have the executors write ``arrays`` under their keys into the checkpoint ``path``.

    Blocks until every part is written and the metadata merged; returns the bytes written.
    The write is ordered after every op already sent to each slice, so it sees the values
    of the steps dispatched before it.
    """
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    by_conn: Dict[int, Tuple[object, list]] = {}
    for key, a in arrays.items():
        a._check_usable()
        by_conn.setdefault(id(a._conn), (a._conn, []))[1].append((key, a))
    statuses, spanning = [], []
    for k, (conn, items) in enumerate(by_conn.values()):
        sid = conn.new_id()
        seq = conn.send(pb.Op(save=pb.SaveOp(
            path=os.path.join(path, _PART.format(k)), keys=[key for key, _ in items],
            buffer_ids=[a._id for _, a in items], status_id=sid)), direct=True)
        slice_ = items[0][1].slice
        if slice_.spans_hosts:      # each host wrote its own blocks: add them up
            spanning.append((conn, sid, seq))
        else:
            statuses.append(Array(slice_, sid, seq, (1,), torch.int64, P(),
                                  "checkpoint save"))
    written = sum(int(s.torch()[0]) for s in statuses) + sum(
        int(v[0]) for conn, sid, seq in spanning
        for v in conn.fetch_each(sid, seq, "checkpoint save"))
    _merge_metadata(path, len(by_conn))
    return written


def load_arrays(path: str, wanted: Mapping[str, Tuple["runtime.Slice", torch.Size,
                                                        torch.dtype, P]]) -> Dict[str, Array]:
    """Have the executors read ``wanted`` keys of checkpoint ``path`` into new Arrays.

    ``wanted`` maps each key to (slice, shape, dtype, spec). Shapes and dtypes are checked
    against the checkpoint's metadata first, so a mismatch fails here, not on a worker.
    """
    path = os.path.abspath(path)
    meta = _read_metadata(path)
    by_slice: Dict[int, Tuple["runtime.Slice", list]] = {}
    for key, (slice_, shape, dtype, spec) in wanted.items():
        md = meta.state_dict_metadata.get(key)
        if md is None:
            raise CheckpointError(f"checkpoint {path} has no entry '{key}'; it has "
                                  f"{sorted(meta.state_dict_metadata)[:8]}...")
        if tuple(md.size) != tuple(shape) or md.properties.dtype != dtype:
            raise CheckpointError(
                f"checkpoint entry '{key}' is {md.properties.dtype}{list(md.size)}, the "
                f"trainer expects {dtype}{list(shape)}; was it saved from another model?")
        spec = as_spec(spec)
        validate_spec(spec, shape, slice_.axis_names, slice_.mesh_shape, "checkpoint load")
        if id(slice_) not in by_slice:
            runtime.check_alive(slice_)
            by_slice[id(slice_)] = (slice_, [])
        by_slice[id(slice_)][1].append((key, shape, dtype, spec))
    out: Dict[str, Array] = {}
    for slice_, items in by_slice.values():
        conn = slice_._conn
        op = pb.LoadOp(path=path)
        ids = []
        for key, shape, dtype, spec in items:
            ids.append(conn.new_id())
            op.keys.append(key)
            op.metas.append(pb.TensorMeta(dtype=codec.dtype_name(dtype), shape=list(shape)))
            spec_to_proto(spec, op.specs.add())
        op.buffer_ids.extend(ids)
        seq = conn.send(pb.Op(load=op), direct=True)
        for bid, (key, shape, dtype, spec) in zip(ids, items):
            out[key] = Array(slice_, bid, seq, shape, dtype, spec.normalized(len(shape)),
                             f"checkpoint {key}")
    return out


def entries(path: str) -> Dict[str, Tuple[torch.Size, torch.dtype]]:
    """Every key of checkpoint ``path`` with its shape and dtype."""
    meta = _read_metadata(os.path.abspath(path))
    return {k: (torch.Size(md.size), md.properties.dtype)
            for k, md in meta.state_dict_metadata.items() if hasattr(md, "size")}


def _read_metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader
    try:
        return FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint (no .metadata file); write one "
                              "with trainer.save(path)") from None


def _read_metadata_of_part(path: str, part: str):
    """A part's metadata; a slice that spans hosts wrote one directory per host
    (``m<j>/``), each holding chunks of the same keys: their chunks are put together."""
    where = os.path.join(path, part)
    if os.path.exists(os.path.join(where, ".metadata")):
        return _read_metadata(where)
    hosts = sorted((d for d in os.listdir(where) if d.startswith("m")),
                   key=lambda d: int(d[1:]))
    merged = None
    for h in hosts:
        md = _read_metadata(os.path.join(where, h))
        storage = {idx: dataclasses.replace(info, relative_path=f"{h}/{info.relative_path}")
                   for idx, info in md.storage_data.items()}
        if merged is None:
            merged = dataclasses.replace(md, state_dict_metadata={}, storage_data={},
                                         planner_data={})
        for key, entry in md.state_dict_metadata.items():
            have = merged.state_dict_metadata.get(key)
            if have is None:
                merged.state_dict_metadata[key] = dataclasses.replace(
                    entry, chunks=list(entry.chunks))
            else:
                have.chunks.extend(entry.chunks)
        merged.storage_data.update(storage)
        merged.planner_data.update(md.planner_data or {})
    if merged is None:
        raise CheckpointError(f"{where} holds no checkpoint part")
    return merged


def _merge_metadata(path: str, parts: int) -> None:
    """Combine the parts' metadata into one, with file paths relative to ``path``."""
    merged = None
    for k in range(parts):
        part = _PART.format(k)
        md = _read_metadata_of_part(path, part)
        storage = {idx: dataclasses.replace(info, relative_path=f"{part}/{info.relative_path}")
                   for idx, info in md.storage_data.items()}
        if merged is None:
            merged = dataclasses.replace(md, state_dict_metadata=dict(md.state_dict_metadata),
                                         storage_data=storage,
                                         planner_data=dict(md.planner_data or {}))
            if merged.storage_meta is not None:
                merged.storage_meta = dataclasses.replace(merged.storage_meta,
                                                          checkpoint_id=path)
        else:
            clash = set(merged.state_dict_metadata) & set(md.state_dict_metadata)
            if clash:
                raise CheckpointError(f"two slices saved the same keys {sorted(clash)[:4]}")
            merged.state_dict_metadata.update(md.state_dict_metadata)
            merged.storage_data.update(storage)
            merged.planner_data.update(md.planner_data or {})
    # DCP's own on-disk metadata format (a pickle on the shared filesystem, read by DCP);
    # nothing here crosses the wire.
    tmp = os.path.join(path, ".metadata.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(merged, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, ".metadata"))
