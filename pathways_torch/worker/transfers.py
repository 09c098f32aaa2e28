"""Bytes in and out of an executor's devices: puts from the client, transfers from
other slices (received on the data plane, resolved into device buffers when first
needed), sends to other slices, and reads of buffers for fetches and pulls.

Example (what a RecvOp's first reader does)::

    service._resolve(entry)               # waits for the bytes, makes the device buffer
"""

from __future__ import annotations

import logging
import threading
import time

from ..rpc import codec, validate
from ..sharding import P, device_block, spec_from_proto
from .dataplane import listening
from .ready import waits_alone
from .store import Entry

log = logging.getLogger("pathways.executor")


def _nbytes(meta) -> int:
    from ..rpc import codec
    return codec.nbytes(codec.dtype_from_name(meta.dtype), tuple(meta.shape))


class Transfers:
    """Puts, transfers and reads of device buffers (a mixin of ExecutorService)."""

    def _put(self, op) -> None:
        rec = self.rec
        if rec.on:
            t0 = rec.now()
            self._put_now(op)
            rec.add("put", "put", t0, buffer_ids=(op.buffer_id,), nbytes=len(op.data),
                    detail="" if op.last else "chunk")
        else:
            self._put_now(op)

    def _put_now(self, op) -> None:
        parts = self._puts.get(op.buffer_id)
        bad = parts[2] if parts is not None and parts[0] is None else None
        if bad is None:
            others = sum(_nbytes(p[0]) for p in self._puts.values()
                         if p[0] is not None) if parts is None and self._puts else 0
            try:
                validate.check_put(op, parts, others, self.axis_names, self._cap(),
                                   self.store.entries.__contains__)
            except validate.InvalidMessage as e:
                bad = e
        if bad is not None:     # the rest of a refused put is dropped as it comes
            if op.last:
                self._puts.pop(op.buffer_id, None)
                self._reject("put", [op.buffer_id], bad)
            else:
                self._puts[op.buffer_id] = (None, None, bad)
            return
        if not op.last:
            if parts is None:
                self._puts[op.buffer_id] = (op.meta, op.spec, [op.data])
            else:
                parts[2].append(op.data)
            return
        if parts is not None:
            del self._puts[op.buffer_id]
            meta, spec, chunks = parts
            data = b"".join(chunks + [op.data])
        else:
            meta, spec, data = op.meta, op.spec, op.data
        err = self._room_for(len(data), spec, f"the put of buffer {op.buffer_id}",
                             {op.buffer_id})
        if err is not None:
            self.store.put(op.buffer_id, Entry(error=err))
            return
        try:
            cpu = codec.from_bytes(data, meta.dtype, meta.shape)
            p = spec_from_proto(spec)
            t = self._to_device(cpu, p)
            entry = Entry(t, None, len(data), "", None, self._shards(p))
        except Exception as e:
            entry = Entry(error=self._err("input", f"put of buffer {op.buffer_id} failed: {e}"))
        self.store.put(op.buffer_id, entry)

    def _to_device(self, cpu, spec):
        """A CPU tensor onto the slice's devices with ``spec``. Sharded, each device
        gets only its shard, copied from ``cpu`` (which may be freed after): 2x
        faster here than a whole copy that ``mark_sharding`` then cuts."""
        if not self.spmd:
            return self._device_data(cpu)
        if cpu.numel() == 0:
            t = cpu.to(self.device)
            self._shard(t, spec)
            return t
        padded = self._padded(spec, cpu.dim())
        shape = tuple(cpu.shape)
        shards = []
        for k in range(len(self.mesh.device_ids)):
            block = device_block(shape, P(*padded), self.axis_names, self.mesh_shape, k)
            shards.append(cpu[tuple(slice(a, b) for a, b in block)])
        return self.torch_xla._XLAC._global_tensor_from_cpu_shards(
            shards, self.mesh.get_op_sharding(padded), list(shape))

    def _device_data(self, cpu):
        """A one-device buffer holding ``cpu``'s values: always a buffer of its own.
        (``cpu.to(device)`` turns a 0-dim 0 or 1 into a constant of the next graph and
        shares other scalars through a cache: neither can be launched cached, nor
        donated.)"""
        return self.torch_xla._XLAC._xla_tensors_from_aten([cpu], [str(self.device)])[0]

    def _readable(self, request):
        """The entry ``request`` names, ready and held for reading (``end_read`` it
        after), or (None, the FetchChunk that says why not)."""
        pb = self.pb
        timeout = request.timeout_s or 600.0
        try:
            entry = self.store.wait_for(request.buffer_id, request.after_seq, timeout)
        except TimeoutError:
            return None, pb.FetchChunk(has_error=True, error=self._err(
                "timeout", f"buffer {request.buffer_id} was not produced within {timeout} s"))
        if entry is None:
            return None, pb.FetchChunk(has_error=True, error=self._err(
                "unknown_buffer", f"buffer {request.buffer_id} does not exist on this slice "
                "(released, or never created)"))
        self._resolve(entry)
        if entry.error is not None:
            return None, pb.FetchChunk(has_error=True, error=entry.error)
        if not self.store.begin_read(entry):
            return None, pb.FetchChunk(has_error=True, error=self._err(
                "donated", f"buffer {request.buffer_id} was donated to a program"))
        return entry, None

    def _read_parts(self, request):
        """The buffer ``request`` names, held for reading (``end_read`` it after the
        parts are used) and on the host (``_host_parts``): (entry, parts, None), or
        (None, None, the FetchChunk that says why not)."""
        entry, err = self._readable(request)
        if err is not None:
            return None, None, err
        try:
            return entry, self._host_parts(entry), None
        except Exception as e:  # an asynchronous execution failure surfaces here
            self.store.end_read(entry)
            return None, None, self.pb.FetchChunk(has_error=True,
                                                  error=self._read_failed(entry, e))

    def _read_failed(self, entry, e: Exception, what: str = "a put"):
        """The BufferError of a buffer whose producer failed (seen when it is read)."""
        what = f"program '{entry.origin}'" if entry.origin else what
        return self._err("program", f"{what} failed on {self.where}: {e}", entry.origin)

    def _host_parts(self, entry) -> list:
        """``entry``'s buffer on the host, as contiguous CPU tensors whose bytes, one
        after the other, are the whole tensor's (row-major), with as few copies as the
        runtime allows: a one-device buffer is viewed in place (DLPack; CPU device
        memory is host memory, other devices copy once); a sharded one is read shard
        by shard (torch_xla's gather of ``.cpu()`` is 3x slower here), once per
        distinct shard, and only put together when its shards are not row blocks."""
        torch, XLAC = self.torch, self.torch_xla._XLAC
        t = entry.tensor
        if t.device.type != "xla":          # a status a save wrote: already on the host
            return [t.contiguous()]
        if not self.spmd and not entry.done and waits_alone(t):
            # A small one-device buffer still being computed: .cpu() waits for it alone,
            # not for the programs launched after it (worker/ready.py), for one copy.
            return [t.cpu().contiguous()]
        # the views below need the device work that produces ``t`` done (.cpu() waits
        # on its own); an execution's failure surfaces here
        if not entry.done:
            XLAC._xla_wait_device_ops([])
        if not self.spmd:
            if t.numel():
                from torch_xla.utils import dlpack
                try:
                    view = torch.utils.dlpack.from_dlpack(dlpack.to_dlpack(t))
                except Exception:
                    view = None
                if view is not None and view.device.type == "cpu":
                    return [view]
                # another device kind's memory (a CUDA view): copy to the host below
            return [t.cpu().contiguous()]
        if XLAC._get_xla_sharding_spec(t) in ("", "{replicated}") or not t.numel():
            # one replica's bytes; .cpu() makes one more host copy than this (1.3x slower)
            return [XLAC._xla_get_cpu_tensors([t])[0].contiguous()]
        shards = XLAC._get_local_shards([t])[0]
        places = XLAC._get_local_shard_replica_and_indices([t])[0]
        blocks = {}
        for (cpu, _), (replica, index) in zip(shards, places):
            if replica == 0 and index is not Ellipsis:
                start = tuple(i.start for i in index)
                blocks[start] = cpu[tuple(slice(0, i.stop - i.start) for i in index)]
        shape = tuple(t.shape)
        order = sorted(blocks)
        if all(tuple(b.shape[1:]) == shape[1:] for b in blocks.values()):
            return [blocks[k].contiguous() for k in order]    # row blocks, in order
        whole = torch.empty(shape, dtype=t.dtype)
        for start, b in blocks.items():
            whole[tuple(slice(s, s + n) for s, n in zip(start, b.shape))] = b
        return [whole]

    def _host_whole(self, entry):
        """``entry``'s buffer as one CPU tensor: ``_host_parts``, joined (a one-device
        buffer may still be a view of device memory: use it while the read is held)."""
        parts = self._host_parts(entry)
        return parts[0] if len(parts) == 1 else self.torch.cat(parts)

    def _host_copy(self, entry):
        """``_host_whole`` as a tensor of its own (no view of device memory, so it
        outlives the read). Twice as fast as ``.cpu()`` on a buffer split over
        devices, 1.3x on a replicated one."""
        whole, t = self._host_whole(entry), entry.tensor
        shares = t.device.type == "xla" and whole.numel() and not self.spmd and \
            whole.data_ptr() == self.torch_xla._XLAC._unsafe_buffer_pointer(t)
        return whole.clone() if shares else whole

    def _discard_recv(self, r) -> None:
        """Drop the bytes of a transfer (all its pieces), now or when they come."""
        self.dataplane.discard(r.transfer_id)
        for piece in r.pieces:
            self.dataplane.discard(piece.transfer_id)

    def _resolve(self, entry) -> None:
        """Turn a received transfer into a device buffer (waits for its bytes)."""
        if entry.pending is None:
            return
        rec = self.rec
        t0 = rec.now() if rec.on else 0
        r = entry.pending
        if self._resolve_now(entry) and t0:
            rec.add("transfer", "recv to device", t0, transfer_id=r.transfer_id,
                    nbytes=entry.nbytes,
                    detail="waits for the bytes, then host to device (resharded)")

    def _resolve_now(self, entry) -> bool:
        # One thread resolves each transfer; others wait for that one alone. (A lock
        # held over the wait deadlocked: a relay's send waited for it while the
        # execution thread held it, waiting for bytes only that relay unblocks.)
        with self._resolve_lock:
            r = entry.pending
            if r is None:
                return False
            done = self._resolving.get(r.transfer_id)
            if done is None:
                done = self._resolving[r.transfer_id] = threading.Event()
                mine = True
            else:
                mine = False
        if not mine:
            done.wait()
            return False
        try:
            if r.pieces:
                self._resolve_pieces(entry, r)
                return True
            arrival, lost = self._take(r.transfer_id, r.src_data_address, r.src_host)
            try:
                if lost:
                    entry.error = self._err("lost", lost)
                elif arrival is None:
                    entry.error = self._err(
                        "timeout", f"transfer {r.transfer_id} did not arrive within "
                        f"{self.transfer_timeout:.0f} s")
                elif arrival.error is not None:
                    err = self.pb.BufferError()
                    err.ParseFromString(arrival.error)
                    entry.error = err            # the original failure, unchanged
                else:
                    want = _nbytes(r.meta)
                    if arrival.nbytes != want:
                        raise ValueError(f"transfer brought {arrival.nbytes} bytes, "
                                         f"{r.meta.dtype}{list(r.meta.shape)} needs {want}")
                    dtype = codec.dtype_from_name(r.meta.dtype)
                    shape = tuple(r.meta.shape)
                    if want == 0:
                        cpu = self.torch.empty(shape, dtype=dtype)
                    else:
                        cpu = self.torch.frombuffer(arrival.payload, dtype=self.torch.uint8)
                        cpu = cpu.view(dtype).reshape(shape)
                    entry.tensor = self._to_device(cpu, spec_from_proto(r.spec))
                    del cpu
            except Exception as e:
                entry.error = self._err("input", f"receiving transfer {r.transfer_id} "
                                        f"failed: {type(e).__name__}: {e}")
            finally:
                if arrival is not None and hasattr(arrival.payload, "close"):
                    arrival.payload.close()
                entry.pending = None
        finally:
            with self._resolve_lock:
                del self._resolving[r.transfer_id]
            done.set()
        return True

    def _resolve_pieces(self, entry, r) -> None:
        """A move from a slice that spans hosts: each host's piece fills its blocks of
        the whole tensor, which then becomes a device buffer with the wanted spec."""
        torch = self.torch
        dtype = codec.dtype_from_name(r.meta.dtype)
        full = torch.empty(tuple(r.meta.shape), dtype=dtype)
        try:
            for k, piece in enumerate(r.pieces):
                arrival, lost = self._take(piece.transfer_id, piece.src_data_address,
                                           piece.src_host)
                if lost or arrival is None or arrival.error is not None:
                    for rest in r.pieces[k + 1:]:
                        self.dataplane.discard(rest.transfer_id)
                if lost:
                    entry.error = self._err("lost", lost)
                    return
                if arrival is None:
                    entry.error = self._err("timeout", f"transfer {piece.transfer_id} did "
                                            f"not arrive within {self.transfer_timeout:.0f} s")
                    return
                try:
                    if arrival.error is not None:
                        err = self.pb.BufferError()
                        err.ParseFromString(arrival.error)
                        entry.error = err        # the original failure, unchanged
                        return
                    flat = torch.frombuffer(arrival.payload, dtype=torch.uint8) \
                        if arrival.nbytes else torch.empty(0, dtype=torch.uint8)
                    at = 0
                    for b in piece.blocks:
                        n = codec.nbytes(dtype, tuple(b.shape))
                        if at + n > arrival.nbytes:
                            raise ValueError(f"piece {piece.transfer_id} brought "
                                             f"{arrival.nbytes} bytes, too few for its blocks")
                        index = tuple(slice(s, s + m) for s, m in zip(b.start, b.shape))
                        full[index] = flat[at:at + n].view(dtype).reshape(tuple(b.shape))
                        at += n
                    del flat
                finally:
                    if hasattr(arrival.payload, "close"):
                        arrival.payload.close()
            entry.tensor = self._to_device(full, spec_from_proto(r.spec))
        except Exception as e:
            entry.error = self._err("input", f"receiving transfer {r.transfer_id} "
                                    f"failed: {type(e).__name__}: {e}")
        finally:
            entry.pending = None

    def _take(self, transfer_id: int, src_address: str, src_host: str):
        """Wait for a transfer's bytes; (arrival, "") or (None, why the sender is
        gone). While waiting, check each second that the sender still listens, so a
        transfer from a dead worker fails within seconds instead of at the timeout."""
        deadline = time.monotonic() + self.transfer_timeout
        misses = 0
        while True:
            left = deadline - time.monotonic()
            arrival = self.dataplane.take(transfer_id, min(max(left, 0.0), 1.0))
            if arrival is not None or left <= 1.0:
                return arrival, ""
            if not src_address:
                continue
            misses = 0 if listening(src_address) else misses + 1
            if misses >= 2:
                src = src_host or src_address
                return None, (f"transfer {transfer_id} from {src} cannot arrive: {src} "
                              "no longer listens (its worker died, or its slice was "
                              "released before the transfer was sent)")

    def _send(self, op) -> None:
        entry = self.store.get(op.buffer_id)
        if entry is None:
            err = self._err("unknown_buffer", f"buffer {op.buffer_id} to send does not exist")
            entry = Entry(error=err)
        held = entry.pending.transfer_id if entry.pending is not None else None
        if held is not None:        # a relay: the send resolves it, even once released
            with self._sending_lock:
                self._sending[held] = self._sending.get(held, 0) + 1
        self.dataplane.send_async(self._send_now, entry, op, held)

    def _send_now(self, entry, op, held=None) -> None:
        payload, error, reading = None, None, False
        rec = self.rec
        t0 = rec.now() if rec.on else 0
        try:
            try:
                self._resolve(entry)
            finally:
                if held is not None:
                    with self._sending_lock:
                        n = self._sending.pop(held) - 1
                        if n:
                            self._sending[held] = n
            if entry.error is not None:
                error = entry.error.SerializeToString()
            elif not self.store.begin_read(entry):
                error = self._err("donated", "the buffer to send was donated to a "
                                  "program").SerializeToString()
            else:
                reading = True      # until sent: the payload may view device memory
                if op.blocks:       # a piece of a move to a slice that spans hosts
                    cpu = self._host_whole(entry)
                    validate.check_blocks(op.blocks, tuple(cpu.shape), "send")
                    payload = [codec.byte_view(
                        cpu[tuple(slice(s, s + n) for s, n in zip(b.start, b.shape))]
                        .contiguous()) for b in op.blocks]
                else:
                    payload = [codec.byte_view(p) for p in self._host_parts(entry)]
        except Exception as e:
            error = self._read_failed(entry, e, "a transfer").SerializeToString()
            payload = None
        if t0:
            rec.add("transfer", "read for send", t0, program=entry.origin,
                    buffer_ids=(op.buffer_id,), transfer_id=op.transfer_id,
                    nbytes=sum(map(len, payload)) if payload is not None else 0,
                    detail="waits for the producer, then device to host")
        try:
            self.dataplane.send(op.dst_data_address, op.transfer_id,
                                payload if error is None else None, error, op.same_host)
        except OSError as e:
            log.error("transfer %d to %s failed: %s", op.transfer_id, op.dst_data_address, e)
        finally:
            if reading:
                self.store.end_read(entry)
