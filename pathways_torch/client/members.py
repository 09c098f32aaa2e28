"""The client's link to a slice that spans hosts: one stream per host, driven as one.

Every host of such a slice runs a member executor (``worker/member.py``). Their
programs contain collectives across hosts, so every member must run the same ops in
the same order: ``MembersConnection`` sends each op to every member under one lock, so
no other thread's op can come between the copies. A put is the exception in content,
not in order: each member receives only the shards of its own devices
(``sharding.member_blocks``), padded to the same number of chunk ops so that the op
numbering (``after_seq``) is the same on every member. A fetch asks every member for
its shards and assembles the tensor here.

Example (what ``pw.slice`` does when the slice spans hosts)::

    conn = MembersConnection(reply, timeout=600.0)
    bid, seq = conn.put(torch.ones(8, 4), spec_msg)    # host 0 gets rows 0-3, host 1 4-7
    value = conn.fetch(bid, seq, "x")
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence

import numpy as np
import torch

from ..errors import TimeoutError, WorkerLostError
from .._ids import random_id
from ..rpc import codec
from ..rpc import pathways_pb2 as pb
from ..sharding import member_blocks, spec_from_proto
from . import graph as graph_mod
from . import connection
from .connection import ExecutorConnection, raise_buffer_error


class PerMember:
    """An op whose content differs per member (a put's chunk): ``ops[k]`` for member k."""

    __slots__ = ("ops",)

    def __init__(self, ops: List[pb.Op]) -> None:
        self.ops = ops


class MembersConnection:
    """The ``ExecutorConnection`` interface over the members of a slice that spans
    hosts (see the module docstring)."""

    _pool: Optional[ThreadPoolExecutor] = None
    _pool_lock = threading.Lock()

    def __init__(self, reply: pb.AllocateSliceReply, mesh_shape, axis_names,
                 timeout: float) -> None:
        self.slice_id = reply.slice_id
        self.mesh_shape, self.axis_names = tuple(mesh_shape), tuple(axis_names)
        hosts = [m.host for m in reply.members]
        self.where = f"island {reply.island} hosts {', '.join(map(str, hosts))}"
        self.timeout = timeout
        self.members = [ExecutorConnection(m.executor_address,
                                           f"island {m.island} host {m.host}", timeout,
                                           reply.slice_id, reply.slice_key, m.data_address)
                        for m in reply.members]
        self.address = self.members[0].address
        self.stub = self.members[0].stub
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # ------------------------------------------------------------- state
    @property
    def closed(self) -> bool:
        return self.members[0].closed

    @property
    def broken(self) -> Optional[str]:
        return next((m.broken for m in self.members if m.broken), None)

    @property
    def seq(self) -> int:
        return self.members[0].seq

    def parts(self) -> List[ExecutorConnection]:
        """The member connections (``pw.wait`` over many slices waits on each)."""
        return self.members

    def _check(self) -> None:
        why = self.broken
        if why is not None:
            self._lose_all(why)
        for m in self.members:
            m._check()

    def _lose_all(self, why: str) -> None:
        """One host of the slice is gone: so is the slice (one failure domain), on every
        member's stream at once, whether or not the coordinator has said so yet."""
        for m in self.members:
            if not m.broken and not m.closed:
                m.mark_lost(f"another host of slice {self.slice_id} failed: {why}")

    @classmethod
    def _threads(cls) -> ThreadPoolExecutor:
        with cls._pool_lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(8, thread_name_prefix="pw-members")
            return cls._pool

    def _each(self, fn) -> list:
        """``fn(member)`` on every member at once; raises the first failure."""
        futs = [self._threads().submit(fn, m) for m in self.members]
        out, first = [], None
        for f in futs:
            try:
                out.append(f.result())
            except Exception as e:      # noqa: BLE001 (every member answers first)
                first = first or e
        if first is not None:
            if isinstance(first, WorkerLostError):
                self._lose_all(str(first))
            raise first
        return out

    # ------------------------------------------------------------- ordered ops
    def new_id(self) -> int:
        return next(self._ids)

    def send(self, op, direct: bool = False):
        """Queue ``op`` (or a ``PerMember``) on every member, in the same place of each
        member's order; returns the sequence number (the same on every member)."""
        self._check()
        if not direct:
            g = graph_mod.current()
            if g is not None:
                return g.record(self, op)
        with self._lock:
            for k, m in enumerate(self.members):
                seq = m.send(op.ops[k] if isinstance(op, PerMember) else op, direct=True)
        return seq

    def send_gang(self, position: int, slice_seq: int, ops: list,
                  host_seqs: Sequence[int] = ()):
        with self._lock:
            for k, m in enumerate(self.members):
                mine = [o.ops[k] if isinstance(o, PerMember) else o for o in ops]
                seq = m.send_gang(position, slice_seq, mine, host_seqs[k:k + 1])
        return seq

    def release(self, buffer_id: int) -> None:
        for m in self.members:
            m.release(buffer_id)

    def close_loader(self, loader_id: int) -> None:
        for m in self.members:
            m.close_loader(loader_id)

    def put(self, tensor: torch.Tensor, spec_msg: pb.Spec):
        """Send each member its own shards of ``tensor``; returns (buffer id, seq)."""
        bid = self.new_id()
        shape = tuple(tensor.shape)
        spec = spec_from_proto(spec_msg)
        value = tensor.numpy() if tensor.dtype != torch.bfloat16 else tensor
        meta = pb.TensorMeta(dtype=codec.dtype_name(tensor.dtype), shape=list(shape))
        each = [member_blocks(shape, spec, self.axis_names, self.mesh_shape, k,
                              len(self.members))[0] for k in range(len(self.members))]
        planes = [m._plane(tensor.numel() * tensor.element_size(),
                            connection.PUT_MIN_BYTES)
                  for m in self.members]
        if all(planes):
            # each host's blocks on its data plane, then a RecvOp with that one piece
            recvs = []
            for m, plane, blocks in zip(self.members, planes, each):
                tid = m.send_bulk(plane, [codec.byte_view(_block(tensor, b))
                                          for b in blocks])
                r = pb.RecvOp(buffer_id=bid, meta=meta, spec=spec_msg,
                              transfer_id=random_id())
                r.pieces.add(transfer_id=tid, src_host="the client",
                             blocks=shard_blocks(blocks))
                recvs.append(pb.Op(recv=r))
            return bid, self.send(PerMember(recvs))
        chunks = []
        for blocks in each:
            data = b"".join(_block_bytes(value, b) for b in blocks)
            chunks.append(codec.chunks(data) or (memoryview(b""),))
        n = max(len(c) for c in chunks)
        seq = 0
        for i in range(n):
            last = i == n - 1
            ops = [pb.Op(put=pb.PutOp(
                buffer_id=bid, meta=meta if i == 0 or last else None, spec=spec_msg,
                data=bytes(c[i]) if i < len(c) else b"", last=last)) for c in chunks]
            seq = self.send(PerMember(ops))
        return bid, seq

    # ------------------------------------------------------------- blocking calls
    def barrier(self, timeout: Optional[float] = None) -> None:
        with self._lock:
            evs = [m.barrier_start() for m in self.members]
        for m, ev in zip(self.members, evs):
            m.barrier_finish(ev, timeout)

    def wait(self, buffer_ids: List[int], after_seq: int, what: str,
             timeout: Optional[float] = None) -> None:
        self._each(lambda m: m.wait(buffer_ids, after_seq, what, timeout))

    def fetch(self, buffer_id: int, after_seq: int, what: str,
              timeout: Optional[float] = None, nbytes: Optional[int] = None
              ) -> torch.Tensor:
        """Every member's shards, assembled into the whole tensor."""
        self._check()
        t = timeout or self.timeout
        parts = self._each(lambda m: _local_shards(m, buffer_id, after_seq, what, t))
        meta = parts[0][0]
        out = np.empty(tuple(meta.shape), dtype=_np_dtype(meta.dtype))
        for _, blocks, data in parts:
            flat = np.frombuffer(data, out.dtype)
            at = 0
            for b in blocks:
                n = int(np.prod(b.shape))
                index = tuple(slice(s, s + k) for s, k in zip(b.start, b.shape))
                out[index] = flat[at:at + n].reshape(tuple(b.shape))
                at += n
        return codec.from_bytes(out.tobytes(), meta.dtype, meta.shape)

    def fetch_each(self, buffer_id: int, after_seq: int, what: str,
                   timeout: Optional[float] = None) -> List[np.ndarray]:
        """Each member's first shard of a buffer (values that differ per host, such
        as the bytes each wrote to a checkpoint)."""
        t = timeout or self.timeout
        out = []
        for meta, blocks, data in self._each(
                lambda m: _local_shards(m, buffer_id, after_seq, what, t)):
            n = int(np.prod(blocks[0].shape)) if blocks else 0
            out.append(np.frombuffer(data, _np_dtype(meta.dtype))[:n]
                       .reshape(tuple(blocks[0].shape) if blocks else (0,)))
        return out

    def compile(self, req: pb.CompileRequest, name: str) -> pb.CompileReply:
        return self._each(lambda m: m.compile(req, name))[0]

    def stats(self) -> pb.StatsReply:
        """Member 0's counters (every member runs the same programs)."""
        return self.members[0].stats()

    def mark_lost(self, reason: str) -> None:
        for m in self.members:
            m.mark_lost(reason)

    def close(self) -> None:
        for m in self.members:
            m.close()


def shard_blocks(blocks) -> List[pb.ShardBlock]:
    """Blocks ((start, stop) per dimension) as ShardBlock messages."""
    return [pb.ShardBlock(start=[a for a, _ in b], shape=[e - a for a, e in b])
            for b in blocks]


def _block(tensor: torch.Tensor, block) -> torch.Tensor:
    """The contiguous CPU tensor of ``block`` ((start, stop) per dimension)."""
    return tensor[tuple(slice(a, b) for a, b in block)].contiguous()


def _block_bytes(value, block) -> bytes:
    index = tuple(slice(a, b) for a, b in block)
    part = value[index]
    if isinstance(part, torch.Tensor):
        return codec.to_bytes(part.contiguous())
    return np.ascontiguousarray(part).tobytes()


def _np_dtype(name: str) -> np.dtype:
    from ..worker.member import np_dtype
    return np_dtype(name)


def _local_shards(m: ExecutorConnection, buffer_id: int, after_seq: int, what: str,
                  t: float):
    """(meta, blocks, bytes) of one member's shards of a buffer (a pull on its data
    plane where it has one)."""
    import grpc
    m._check()
    plane = m._plane(None, connection.FETCH_MIN_BYTES)
    if plane is not None:
        req = pb.FetchRequest(buffer_id=buffer_id, after_seq=after_seq, timeout_s=t,
                              local_shards=True, slice_key=m._key,
                              same_host=m._same_host())
        reply, payload = m._pull_reply(plane, req, what, t)
        return reply.meta, list(reply.blocks), memoryview(payload.numpy())
    chunks = m.stub.Fetch(pb.FetchRequest(buffer_id=buffer_id, after_seq=after_seq,
                                          timeout_s=t, local_shards=True), timeout=t + 5)
    m._inflight.add(chunks)
    try:
        meta, blocks, data = None, None, []
        for c in chunks:
            if c.has_error:
                raise_buffer_error(c.error, what)
            if meta is None:
                meta, blocks = c.meta, list(c.blocks)
            data.append(c.data)
    except grpc.RpcError as e:
        raise m._rpc_error(e, what, t) from None
    finally:
        m._inflight.discard(chunks)
    if meta is None:
        raise TimeoutError(f"{what}: {m.where} answered nothing")
    return meta, blocks, b"".join(data)
