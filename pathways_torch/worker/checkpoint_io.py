"""Checkpoint I/O on an executor: save and load ops write and read a slice's buffers
(DCP-style per-shard files) in the stream's order (docs/architecture.md, Decision 7).

Example (the ops the client's pw.save / pw.load send)::

    service._save(op.save); service._load(op.load)
"""

from __future__ import annotations

import logging
import warnings

from ..rpc import codec
from ..sharding import spec_from_proto
from .store import Entry

log = logging.getLogger("pathways.executor")


class CheckpointIO:
    """Save and load ops (a mixin of ExecutorService)."""

    def _save(self, op) -> None:
        """Write buffers into a torch.distributed.checkpoint directory (one per executor;
        the client merges the metadata of all executors into the checkpoint's)."""
        import torch.distributed.checkpoint as dcp
        flat, err = {}, None
        for key, b in zip(op.keys, op.buffer_ids):
            e = self.store.get(b)
            if e is None:
                err = self._err("unknown_buffer", f"buffer {b} to save as '{key}' does "
                                "not exist (released or never created)")
                break
            self._resolve(e)
            if e.error is not None:
                err = e.error
                break
            if not self.store.begin_read(e):
                err = self._err("donated", f"buffer {b} to save as '{key}' was donated")
                break
            try:
                flat[key] = self._host_copy(e)
            except Exception as ex:
                err = self._err("program", f"computing '{key}' failed on {self.where}: {ex}",
                                e.origin)
                break
            finally:
                self.store.end_read(e)
        if err is None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")     # "no process group": by design
                    dcp.save(flat, checkpoint_id=op.path, no_dist=True)
                nbytes = sum(t.numel() * t.element_size() for t in flat.values())
                self.store.put(op.status_id, Entry(self.torch.tensor([nbytes]), None, 8))
                return
            except Exception as ex:
                err = self._err("io", f"writing checkpoint {op.path} on {self.where} "
                                f"failed: {type(ex).__name__}: {ex}")
        self.store.put(op.status_id, Entry(error=err))

    def _load(self, op) -> None:
        """Read keys of a torch.distributed.checkpoint directory into new buffers."""
        import torch.distributed.checkpoint as dcp
        torch = self.torch
        try:
            flat = {k: torch.empty(tuple(m.shape), dtype=codec.dtype_from_name(m.dtype))
                    for k, m in zip(op.keys, op.metas)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(flat, checkpoint_id=op.path, no_dist=True)
            for k, b, spec in zip(op.keys, op.buffer_ids, op.specs):
                p = spec_from_proto(spec)
                t = self._to_device(flat[k], p)
                self.store.put(b, Entry(t, None, codec.nbytes(t.dtype, t.shape), "", None,
                                        self._shards(p)))
        except Exception as ex:
            err = self._err("io", f"reading checkpoint {op.path} on {self.where} failed: "
                            f"{type(ex).__name__}: {ex}")
            for b in op.buffer_ids:
                self.store.put(b, Entry(error=err))
