"""What every RPC handler checks before it trusts a message.

Pure functions over the generated messages (no gRPC, no torch_xla): each raises
:class:`InvalidMessage` (a ``ValueError``) whose text says what was wrong, with the
gRPC status the handler should answer with (``code``) and, for ops of the executor's
Dispatch stream, the ``BufferError.kind`` their outputs get (``kind``). Handlers call
them before they hand anything to the resource manager, the zygote or torch_xla: an XLA
CHECK failure aborts the whole process, so what cannot be checked is refused.

Limits are generous for real use and exist so that absurd values (a 2**62-element
shape, a NaN share, a million mesh axes) fail here with a message instead of deep
inside XLA. ``docs/architecture.md`` (Decision 13) lists them with the message-size
limit.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Iterable, Sequence

MAX_RANK = 16                    # tensor dimensions
MAX_DIM = 1 << 40                # elements along one dimension
MAX_ISLAND = 1 << 16             # island and host numbers
MAX_DEVICES = 4096               # devices of one host; devices of one slice
MAX_MESH_RANK = 8                # mesh axes of a slice
MAX_NAME = 256                   # names: sessions, programs, axes, slice ids, kinds
MAX_PATH = 4096                  # checkpoint paths
MIN_SHARE, MAX_SHARE = 1e-6, 1e6
MAX_TIMEOUT_S = 366 * 86400.0    # Fetch/Wait timeouts (0 means the default)
MAX_PROGRAM_NAME = 1024          # program ids and names (user-given names end up in ids)
MAX_WAIT_IDS = 1 << 20           # buffer ids of one Wait

# torch dtype names on the wire (rpc/codec.py) -> bytes per element, XLA PrimitiveType
DTYPES: dict[str, tuple[int, int]] = {
    "bool": (1, 1), "int8": (1, 2), "int16": (2, 3), "int32": (4, 4), "int64": (8, 5),
    "uint8": (1, 6), "float16": (2, 10), "float32": (4, 11), "float64": (8, 12),
    "complex64": (8, 15), "bfloat16": (2, 16),
}
_XLA_TUPLE = 13
_XLA_NOT_ARRAYS = (13, 14, 17)   # TUPLE, OPAQUE_TYPE, TOKEN

_ID_RE = re.compile(r"[\w.:@+\-]+")          # slice and program ids, kinds
# host names: dot-separated labels of letters, digits, - and _ (container names use it)
_HOST_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_\-]{0,61}[A-Za-z0-9_])?"
                      r"(\.[A-Za-z0-9_]([A-Za-z0-9_\-]{0,61}[A-Za-z0-9_])?)*")
_HLO_NAME_RE = re.compile(r"[\w.\-]+")


class InvalidMessage(ValueError):
    """A message that a handler refuses; ``str(e)`` says what was wrong.

    ``code``: the grpc.StatusCode name to answer with. ``kind``: the BufferError kind
    for the outputs of a refused Dispatch op ("input", or "oom" past the memory budget).
    """

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT",
                 kind: str = "input") -> None:
        super().__init__(message)
        self.code = code
        self.kind = kind


def abort(context, e: InvalidMessage) -> None:
    """Answer a gRPC call with ``e``'s status (raises, as ``context.abort`` does)."""
    import grpc
    context.abort(getattr(grpc.StatusCode, e.code), str(e))


def guard(context, check: Callable, *args) -> None:
    """``check(*args)``, answering the call with the error's status if it raises."""
    try:
        check(*args)
    except InvalidMessage as e:
        abort(context, e)


def _bad(msg: str, code: str = "INVALID_ARGUMENT") -> InvalidMessage:
    return InvalidMessage(msg, code)


# ------------------------------------------------------------------ scalars and strings
def check_name(value: str, what: str, *, empty_ok: bool = False, limit: int = MAX_NAME,
               pattern: re.Pattern | None = None) -> str:
    if not value:
        if empty_ok:
            return value
        raise _bad(f"{what} is empty")
    if len(value) > limit:
        raise _bad(f"{what} has {len(value)} characters, at most {limit} are allowed")
    if pattern is not None and not pattern.fullmatch(value):
        raise _bad(f"{what} {value[:64]!r} may hold only letters, digits and . _ - : @ +")
    if not value.isprintable():
        raise _bad(f"{what} {value[:64]!r} holds unprintable characters")
    return value


def check_int(value: int, what: str, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise _bad(f"{what} is {value}; it must be in [{lo}, {hi}]")
    return value


def check_float(value: float, what: str, lo: float, hi: float) -> float:
    if not (math.isfinite(value) and lo <= value <= hi):
        raise _bad(f"{what} is {value}; it must be a finite number in [{lo}, {hi}]")
    return value


def check_timeout(value: float, default: float = 600.0) -> float:
    """A Fetch/Wait timeout in seconds: 0 means ``default``; negative, NaN or more than a
    year is refused."""
    if value == 0:
        return default
    return check_float(value, "timeout_s", 0.0, MAX_TIMEOUT_S)


def check_wait(req) -> None:
    check_timeout(req.timeout_s)
    if len(req.buffer_ids) > MAX_WAIT_IDS:
        raise _bad(f"{len(req.buffer_ids)} buffer ids in one Wait, at most {MAX_WAIT_IDS}")


def check_address(address: str, what: str = "address") -> tuple[str, int]:
    """``host:port`` with a hostname, an IPv4 address or an IPv6 address (bracketed or
    not) and a port in 1..65535; returns (host, port)."""
    if not address or len(address) > 300 or ":" not in address:
        raise _bad(f"{what} {address[:64]!r} is not host:port")
    host, _, port_s = address.rpartition(":")
    if not (port_s.isascii() and port_s.isdigit() and len(port_s) <= 5) or \
            not 1 <= int(port_s) <= 65535:
        raise _bad(f"{what} {address[:64]!r} has no port in 1..65535")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
    except ValueError:
        if not _HOST_RE.fullmatch(host) or len(host) > 253:
            raise _bad(f"{what} {address[:64]!r} has no valid host name") from None
    return host, int(port_s)


# ------------------------------------------------------------------ coordinator
def check_register_worker(req) -> None:
    check_int(req.island, "island", 0, MAX_ISLAND)
    check_int(req.host, "host", 0, MAX_ISLAND)
    check_int(req.num_devices, "num_devices", 1, MAX_DEVICES)
    check_name(req.kind, "device kind", limit=64, pattern=_ID_RE)
    check_address(req.address, "worker address")
    check_int(req.pid, "pid", 0, 1 << 31)


def check_open_session(req) -> None:
    check_name(req.name, "session name", empty_ok=True)
    check_int(req.pid, "pid", 0, 1 << 31)
    check_float(req.share, "share", MIN_SHARE, MAX_SHARE)


def check_mesh(mesh_shape: Sequence[int], axis_names: Sequence[str],
               max_devices: int = MAX_DEVICES) -> int:
    """A slice's mesh: 1..8 positive axes with as many distinct non-empty names;
    returns the number of devices."""
    if not 1 <= len(mesh_shape) <= MAX_MESH_RANK:
        raise _bad(f"mesh shape {list(mesh_shape)[:16]} must have 1 to {MAX_MESH_RANK} "
                   "axes")
    for m in mesh_shape:
        check_int(m, f"mesh shape {list(mesh_shape)}: axis size", 1, max_devices)
    n = math.prod(mesh_shape)
    if n > max_devices:
        raise _bad(f"mesh shape {list(mesh_shape)} needs {n} devices, more than "
                   f"{max_devices}")
    if len(axis_names) != len(mesh_shape):
        raise _bad(f"mesh shape {list(mesh_shape)} has {len(mesh_shape)} axes but "
                   f"{len(axis_names)} axis names were given")
    for a in axis_names:
        check_name(a, "axis name", limit=64)
    if len(set(axis_names)) != len(axis_names):
        raise _bad(f"axis names {list(axis_names)} are not distinct")
    return n


def check_allocate(req) -> None:
    n = check_mesh(list(req.mesh_shape), list(req.axis_names))
    if req.hosts:
        check_int(req.hosts, "hosts", 1, n)
        if n % req.hosts:
            raise _bad(f"a slice of {n} devices cannot give each of {req.hosts} hosts "
                       "the same number: ask for a number of hosts that divides it")
    if not req.any_island:
        check_int(req.island, "island", 0, MAX_ISLAND)


def check_ids(ids: Sequence[str], what: str) -> None:
    if not ids:
        raise _bad(f"no {what} given")
    for i in ids:
        check_name(i, what, pattern=_ID_RE)
    if len(set(ids)) != len(ids):
        raise _bad(f"{what}s {list(ids)[:16]} repeat")


def check_profile(req, active: Callable[[int], bool]) -> None:
    """CLOCK, START, or STOP of a session that ``active`` knows."""
    if req.action not in (0, 1, 2):
        raise _bad(f"profile action {req.action} is none of CLOCK, START, STOP")
    if req.action == 2 and not active(req.session):
        raise _bad(f"profile session {req.session} is not open here", "NOT_FOUND")


# ------------------------------------------------------------------ worker agent
def check_start_executor(req, num_devices: int) -> None:
    """A slice's executor: what the zygote would fork must make sense on this host."""
    check_name(req.slice_id, "slice id", pattern=_ID_RE)
    devs = list(req.device_indices)
    if not devs:
        raise _bad("no device indices given")
    for d in devs:
        check_int(d, "device index", 0, num_devices - 1)
    if len(set(devs)) != len(devs):
        raise _bad(f"device indices {devs[:16]} repeat")
    members = max(1, req.num_members)
    check_int(members, "members", 1, MAX_DEVICES)
    check_int(req.member, "member", 0, members - 1)
    if req.rendezvous:
        check_address(req.rendezvous, "rendezvous")
    n = check_mesh(list(req.mesh_shape), list(req.axis_names), num_devices * members)
    if n != len(devs) * members:
        raise _bad(f"mesh shape {list(req.mesh_shape)} has {n} devices but {len(devs)} "
                   f"device indices on each of {members} hosts were given")
    check_name(req.client_id, "client id", empty_ok=True, pattern=_ID_RE)
    if req.share != 0:
        check_float(req.share, "share", MIN_SHARE, MAX_SHARE)


def check_executor_ready(req) -> None:
    check_int(req.pid, "pid", 1, 1 << 31)
    if not req.error:
        check_address(req.address, "executor address")
        if req.rendezvous:      # a member of a slice that spans hosts: no data socket
            check_address(req.rendezvous, "rendezvous")
        else:
            check_address(req.data_address, "data address")


# ------------------------------------------------------------------ tensors and specs
def tensor_meta(meta, what: str = "tensor", budget: int | None = None
                ) -> tuple[str, tuple[int, ...], int]:
    """(dtype name, shape, bytes) of a TensorMeta; past ``budget`` bytes it is refused
    with kind "oom"."""
    if meta.dtype not in DTYPES:
        raise _bad(f"{what}: unknown dtype {meta.dtype[:32]!r}; one of {sorted(DTYPES)}")
    shape = tuple(meta.shape)
    if len(shape) > MAX_RANK:
        raise _bad(f"{what}: rank {len(shape)} is more than {MAX_RANK}")
    for s in shape:
        if not 0 <= s <= MAX_DIM:
            raise _bad(f"{what}: shape {list(shape)} has a dimension outside "
                       f"[0, {MAX_DIM}]")
    nbytes = math.prod(shape) * DTYPES[meta.dtype][0]
    if budget is not None and nbytes > budget:
        raise InvalidMessage(
            f"{what}: {meta.dtype}{list(shape)} needs {_size(nbytes)}, more than the "
            f"{_size(max(budget, 0))} of buffers the slice's devices can still hold",
            "RESOURCE_EXHAUSTED", "oom")
    return meta.dtype, shape, nbytes


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_spec(spec, rank: int | None, axis_names: Sequence[str], what: str = "spec"):
    """The P of a Spec message: known axes, each used once, at most ``rank`` entries.
    (Uneven splits are left to the client, which refuses them; XLA pads them.)"""
    from ..sharding import spec_from_proto
    if rank is not None and len(spec.dims) > max(rank, 0):
        raise _bad(f"{what}: {len(spec.dims)} spec entries for rank {rank}")
    if len(spec.dims) > MAX_RANK:
        raise _bad(f"{what}: {len(spec.dims)} spec entries, at most {MAX_RANK}")
    seen = set()
    for d in spec.dims:
        for a in d.axes:
            if a not in axis_names:
                raise _bad(f"{what}: unknown mesh axis {a[:64]!r}; the slice's axes are "
                           f"{list(axis_names)}")
            if a in seen:
                raise _bad(f"{what}: mesh axis {a!r} is used twice")
            seen.add(a)
    return spec_from_proto(spec)


# ------------------------------------------------------------------ Dispatch ops
def op_outputs(op) -> list[int]:
    """The buffer ids an op of the Dispatch stream creates (a gang: its ops')."""
    which = op.WhichOneof("kind")
    if which == "execute":
        return list(op.execute.outputs)
    if which == "put":
        return [op.put.buffer_id] if op.put.last else []
    if which == "recv":
        return [op.recv.buffer_id]
    if which == "load":
        return list(op.load.buffer_ids)
    if which == "save":
        return [op.save.status_id]
    if which == "batch":
        return list(op.batch.outputs)
    if which == "gang":
        return [b for inner in op.gang.ops for b in op_outputs(inner)]
    return []


def check_new_ids(ids: Iterable[int], live: Callable[[int], bool], what: str) -> None:
    """Output ids must be distinct and name no live buffer (which would be overwritten)."""
    ids = list(ids)
    if len(set(ids)) != len(ids):
        raise _bad(f"{what}: output buffer ids {ids[:16]} repeat")
    for b in ids:
        if live(b):
            raise _bad(f"{what}: output buffer {b} already exists; each op must create "
                       "new buffer ids")


def check_execute(op, prog, entries) -> None:
    """``prog``: the compiled program (None: unknown id), with ``in_avals`` (torch dtype,
    shape tuple) per input and ``out_nbytes`` per output; ``entries``: the object store's
    dict. Checks counts, ids and the inputs' dtypes and shapes against the program.
    On the path of every execution: a few microseconds, messages built only on failure."""
    if prog is None:
        raise _bad(f"unknown program id {op.program_id[:MAX_NAME]!r}: Compile it on this "
                   "slice first")
    want, inputs, outputs = prog.in_avals, op.inputs, op.outputs
    if len(inputs) != len(want) or len(outputs) != len(prog.out_nbytes):
        raise _bad(f"program '{prog.name}' takes {len(want)} inputs and returns "
                   f"{len(prog.out_nbytes)} outputs; the op gives {len(inputs)} inputs and "
                   f"names {len(outputs)} outputs")
    for b in outputs:
        if b in entries or b in inputs:
            raise _bad(f"program '{prog.name}': output buffer {b} already exists or is "
                       "an input; each op must create new buffer ids")
    if len(outputs) > 1 and len(set(outputs)) != len(outputs):
        raise _bad(f"program '{prog.name}': output buffer ids {list(outputs)[:16]} repeat")
    if op.donate:
        donate = list(op.donate)
        if len(set(donate)) != len(donate) or max(donate) >= len(want):
            raise _bad(f"program '{prog.name}': donated positions {donate[:16]} repeat or "
                       f"exceed the {len(want)} inputs")
    if op.carry and (len(op.carry) != len(outputs) or max(op.carry) > len(want)):
        raise _bad(f"program '{prog.name}': carry names {len(op.carry)} outputs' inputs "
                   f"(up to {max(op.carry)}); it needs one entry per output, each at most "
                   f"the {len(want)} inputs")
    for k, b in enumerate(inputs):
        e = entries.get(b)
        if e is None or e.error is not None:
            continue              # unknown or failed: the execution reports it
        t = e.tensor
        if t is not None:
            if t.dtype == want[k][0] and t.shape == want[k][1]:
                continue
            got = (t.dtype, tuple(t.shape))
        elif e.pending is not None:
            from .codec import dtype_from_name
            m = e.pending.meta
            got = (dtype_from_name(m.dtype), tuple(m.shape))
            if got == want[k]:
                continue
        else:
            continue
        raise _bad(f"program '{prog.name}': input {k} (buffer {b}) is {_aval(got)}, the "
                   f"program was compiled for {_aval(want[k])}")


def _aval(a) -> str:
    return f"{str(a[0]).replace('torch.', '')}{list(a[1])}"


def check_put(op, first, partial_bytes: int, axis_names: Sequence[str], budget: int,
              live: Callable[[int], bool]) -> None:
    """One PutOp chunk. ``first``: the first chunk's (meta, spec, chunks) when this one
    continues a chunked put, else None; ``partial_bytes``: bytes announced by the other
    unfinished chunked puts (together they must fit the budget)."""
    what = f"put of buffer {op.buffer_id}"
    if first is None:
        _, shape, want = tensor_meta(op.meta, what, budget - partial_bytes)
        check_spec(op.spec, len(shape), axis_names, what)
        if live(op.buffer_id):
            raise _bad(f"{what}: buffer {op.buffer_id} already exists")
        got = len(op.data)
    else:
        meta, _, chunks = first
        want = math.prod(meta.shape) * DTYPES[meta.dtype][0]
        got = sum(len(c) for c in chunks) + len(op.data)
        if op.last and op.HasField("meta") and op.meta != meta:
            raise _bad(f"{what}: the last chunk's meta {op.meta.dtype}{list(op.meta.shape)}"
                       f" differs from the first's {meta.dtype}{list(meta.shape)}")
    if got > want or (op.last and got != want):
        meta = op.meta if first is None else first[0]
        raise _bad(f"{what}: {'the chunks bring' if first else 'the payload has'} {got} "
                   f"bytes, but {meta.dtype}{list(meta.shape)} needs {want}")


def check_recv(op, axis_names: Sequence[str], budget: int, live) -> None:
    what = f"receive into buffer {op.buffer_id}"
    _, shape, _ = tensor_meta(op.meta, what, budget)
    check_spec(op.spec, len(shape), axis_names, what)
    check_new_ids([op.buffer_id], live, what)
    src = getattr(op, "src_data_address", "")
    if src:
        check_address(src, f"{what}: sender's data address")
    if len(op.pieces) > MAX_DEVICES:
        raise _bad(f"{what}: {len(op.pieces)} pieces")
    for k, p in enumerate(op.pieces):
        check_int(p.transfer_id, f"{what}: piece {k}'s transfer id", 1, (1 << 64) - 1)
        if p.src_data_address:
            check_address(p.src_data_address, f"{what}: piece {k}'s sender")
        check_blocks(p.blocks, shape, f"{what}: piece {k}")


def check_blocks(blocks, shape: Sequence[int], what: str) -> None:
    """Blocks (ShardBlock) of a tensor of ``shape``: each inside it."""
    if len(blocks) > MAX_DEVICES:
        raise _bad(f"{what}: {len(blocks)} blocks")
    for b in blocks:
        if len(b.start) != len(shape) or len(b.shape) != len(shape) or any(
                s < 0 or n < 0 or s + n > d for s, n, d in zip(b.start, b.shape, shape)):
            raise _bad(f"{what}: block at {list(b.start)[:8]} of shape "
                       f"{list(b.shape)[:8]} is not inside {list(shape)[:8]}")


def check_send(op) -> None:
    check_address(op.dst_data_address, f"send of buffer {op.buffer_id}: destination")


def check_save(op, live) -> None:
    what = f"checkpoint save to {op.path[:64]!r}"
    check_name(op.path, "checkpoint path", limit=MAX_PATH)
    if len(op.keys) != len(op.buffer_ids):
        raise _bad(f"{what}: {len(op.keys)} keys for {len(op.buffer_ids)} buffers")
    for k in op.keys:
        check_name(k, "checkpoint key", limit=MAX_PATH)
    if len(set(op.keys)) != len(op.keys):
        raise _bad(f"{what}: keys repeat")
    check_new_ids([op.status_id], live, what)


def check_load(op, axis_names: Sequence[str], budget: int, live) -> None:
    what = f"checkpoint load from {op.path[:64]!r}"
    check_name(op.path, "checkpoint path", limit=MAX_PATH)
    n = len(op.keys)
    if not len(op.buffer_ids) == len(op.metas) == len(op.specs) == n:
        raise _bad(f"{what}: {n} keys, {len(op.buffer_ids)} buffers, {len(op.metas)} "
                   f"metas and {len(op.specs)} specs; give one of each per key")
    for k in op.keys:
        check_name(k, "checkpoint key", limit=MAX_PATH)
    if len(set(op.keys)) != n:
        raise _bad(f"{what}: keys repeat")
    total = 0
    for k, m, s in zip(op.keys, op.metas, op.specs, strict=True):
        _, shape, nbytes = tensor_meta(m, f"{what}: key {k!r}", budget - total)
        total += nbytes
        check_spec(s, len(shape), axis_names, f"{what}: key {k!r}")
    check_new_ids(op.buffer_ids, live, what)


# ------------------------------------------------------------------ Compile
def check_compile(req, axis_names: Sequence[str], budget: int) -> list:
    """Everything about a CompileRequest that can be checked before torch_xla sees it;
    returns the flat inputs' (dtype name, shape)."""
    check_name(req.program_id, "program id", limit=MAX_PROGRAM_NAME)
    check_name(req.name, "program name", empty_ok=True, limit=MAX_PROGRAM_NAME)
    if len(req.input_specs) != len(req.inputs):
        raise _bad(f"{len(req.inputs)} inputs but {len(req.input_specs)} input specs")
    if req.has_out_specs:
        for k, s in enumerate(req.out_specs):
            check_spec(s, None, axis_names, f"output spec {k}")
    elif len(req.out_specs):
        raise _bad("out_specs are given but has_out_specs is false")
    inputs, total = [], 0
    for k, (m, s) in enumerate(zip(req.inputs, req.input_specs, strict=True)):
        dtype, shape, nbytes = tensor_meta(m, f"input {k}", budget - total)
        total += nbytes
        check_spec(s, len(shape), axis_names, f"input {k} spec")
        inputs.append((dtype, shape))
    consts = []
    for k, c in enumerate(req.constants):
        dtype, shape, nbytes = tensor_meta(c.meta, f"constant {k}", budget - total)
        total += nbytes
        if len(c.data) != nbytes:
            raise _bad(f"constant {k}: {len(c.data)} bytes, but {dtype}{list(shape)} "
                       f"needs {nbytes}")
        consts.append((dtype, shape))
    donate = list(req.donate)
    if len(set(donate)) != len(donate) or any(d >= len(inputs) for d in donate):
        raise _bad(f"donated inputs {donate[:16]} repeat or exceed the {len(inputs)} "
                   "inputs")
    params = []
    for k, p in enumerate(req.params):
        src = p.WhichOneof("source")
        if src == "input" and 0 <= p.input < len(inputs):
            params.append(inputs[p.input])
        elif src == "constant" and 0 <= p.constant < len(consts):
            params.append(consts[p.constant])
        else:
            n = len(inputs) if src == "input" else len(consts)
            raise _bad(f"HLO parameter {k} comes from {src or 'nowhere'} "
                       f"{getattr(p, src) if src else ''}, but there are {n} of those")
    check_hlo(req.hlo, params)
    return inputs


# ------------------------------------------------------------------ HLO modules
_HLO = None


def _hlo_classes():
    """Message classes for the part of xla's HloModuleProto (xla/service/hlo.proto) that
    is checked here; other fields are kept as unknown fields."""
    global _HLO
    if _HLO is not None:
        return _HLO
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="pathways_hlo_subset.proto",
                                            package="pathways_hlo", syntax="proto3")
    I64, I32, STR, MSG, BOOL, BYTES = (F.TYPE_INT64, F.TYPE_INT32, F.TYPE_STRING,
                                       F.TYPE_MESSAGE, F.TYPE_BOOL, F.TYPE_BYTES)
    one, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    schema = {
        "Shape": [(2, "element_type", I32, one), (3, "dimensions", I64, rep),
                  (4, "tuple_shapes", "Shape", rep),
                  (6, "is_dynamic_dimension", BOOL, rep)],
        "ProgramShape": [(1, "parameters", "Shape", rep), (2, "result", "Shape", one)],
        "Instruction": [(1, "name", STR, one), (2, "opcode", STR, one),
                        (3, "shape", "Shape", one), (9, "parameter_number", I64, one),
                        (35, "id", I64, one), (36, "operand_ids", I64, rep),
                        (37, "control_predecessor_ids", I64, rep),
                        (38, "called_computation_ids", I64, rep),
                        (40, "sharding", BYTES, one)],
        "Computation": [(1, "name", STR, one), (2, "instructions", "Instruction", rep),
                        (4, "program_shape", "ProgramShape", one), (5, "id", I64, one),
                        (6, "root_id", I64, one)],
        "Module": [(1, "name", STR, one), (2, "entry_computation_name", STR, one),
                   (3, "computations", "Computation", rep),
                   (4, "host_program_shape", "ProgramShape", one),
                   (6, "entry_computation_id", I64, one)],
    }
    for name, fields in schema.items():
        m = fd.message_type.add(name=name)
        for number, fname, typ, label in fields:
            f = m.field.add(name=fname, number=number, label=label)
            if isinstance(typ, str):
                f.type, f.type_name = MSG, f".pathways_hlo.{typ}"
            else:
                f.type = typ
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    module = pool.FindMessageTypeByName("pathways_hlo.Module")
    _HLO = message_factory.GetMessageClass(module)
    return _HLO


def _array_shape(s, what: str, wire: bool = True) -> tuple[str, tuple[int, ...]]:
    """An array shape: of a dtype that travels (``wire``), or of any array type XLA has
    (results may be of dtypes that stay on the devices)."""
    names = {xla: name for name, (_, xla) in DTYPES.items()}
    known = s.element_type in names if wire else \
        0 < s.element_type < 64 and s.element_type not in _XLA_NOT_ARRAYS
    if not known or len(s.tuple_shapes):
        travels = " of a dtype that travels" if wire else ""
        raise _bad(f"HLO: {what} is not an array{travels} (XLA type {s.element_type})")
    dims = tuple(s.dimensions)
    if len(dims) > MAX_RANK or any(not 0 <= d <= MAX_DIM for d in dims):
        raise _bad(f"HLO: {what} has shape {list(dims)[:20]}")
    if any(s.is_dynamic_dimension):
        raise _bad(f"HLO: {what} has dynamic dimensions")
    return names.get(s.element_type, str(s.element_type)), dims


def check_hlo(hlo: bytes, params: Sequence[tuple[str, tuple[int, ...]]]) -> None:
    """``hlo`` must parse as an HloModuleProto whose entry computation takes exactly
    ``params`` (dtype name, shape), in order, and whose structure is what torch_xla
    emits: named instructions, ids that resolve, operands before their users, called
    computations before their callers, array (or tuple of array) results, no shardings.
    These are the things XLA checks with CHECK (a process abort) rather than an error."""
    from google.protobuf.message import DecodeError
    if not hlo:
        raise _bad("the HLO module is empty")
    try:
        mod = _hlo_classes().FromString(hlo)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise _bad(f"the HLO module does not parse as an HloModuleProto: {e}") from None
    if not mod.HasField("host_program_shape") or not len(mod.computations):
        raise _bad("the HLO module has no program shape or no computations")
    comps = {}
    names = set()
    for c in mod.computations:
        _check_hlo_name(c.name, "computation", names)
        if c.id in comps:
            raise _bad(f"HLO: computation id {c.id} repeats")
        comps[c.id] = c
    entry = comps.get(mod.entry_computation_id)
    if entry is None or entry.name != mod.entry_computation_name:
        raise _bad("HLO: the entry computation is missing")
    ids, done = set(), set()
    for c in mod.computations:
        _check_computation(c, comps, done, ids, names)
        done.add(c.id)
    shape = mod.host_program_shape
    if len(shape.parameters) != len(params):
        raise _bad(f"HLO: the entry computation takes {len(shape.parameters)} parameters, "
                   f"the request gives {len(params)} params")
    for k, (s, want) in enumerate(zip(shape.parameters, params, strict=True)):
        got = _array_shape(s, f"parameter {k}")
        if got != (want[0], tuple(want[1])):
            raise _bad(f"HLO: parameter {k} is {got[0]}{list(got[1])}, its source is "
                       f"{want[0]}{list(want[1])}")
    if entry.program_shape.SerializeToString(deterministic=True) != \
            shape.SerializeToString(deterministic=True):
        raise _bad("HLO: the entry computation's program shape differs from the module's")
    res = shape.result
    for k, s in enumerate(res.tuple_shapes if res.element_type == _XLA_TUPLE else [res]):
        _array_shape(s, f"result {k}", wire=False)


def hlo_shapes(hlo: bytes):
    """(dtype name, shape) of a checked HLO module's parameters, and of its results."""
    shape = _hlo_classes().FromString(hlo).host_program_shape
    res = shape.result
    return ([_array_shape(s, f"parameter {k}") for k, s in enumerate(shape.parameters)],
            [_array_shape(s, f"result {k}", wire=False) for k, s in enumerate(
                res.tuple_shapes if res.element_type == _XLA_TUPLE else [res])])


def _check_hlo_name(name: str, what: str, names: set) -> None:
    if not name or len(name) > MAX_NAME or "." not in name or \
            not _HLO_NAME_RE.fullmatch(name):
        raise _bad(f"HLO: {what} name {name[:64]!r} is not of the form base.number")
    if name in names:
        raise _bad(f"HLO: name {name!r} repeats")
    names.add(name)


def _check_computation(c, comps, done, ids, names) -> None:
    local = set()
    params = set()
    for ins in c.instructions:
        _check_hlo_name(ins.name, "instruction", names)
        if not ins.opcode or len(ins.opcode) > 64:
            raise _bad(f"HLO: instruction {ins.name!r} has no opcode")
        if ins.id in ids:
            raise _bad(f"HLO: instruction id {ins.id} repeats")
        if ins.sharding:
            raise _bad(f"HLO: instruction {ins.name!r} carries a sharding; shardings "
                       "travel as partition specs, not in the module")
        for o in list(ins.operand_ids) + list(ins.control_predecessor_ids):
            if o not in local:
                raise _bad(f"HLO: instruction {ins.name!r} uses {o}, which is not an "
                           f"earlier instruction of computation {c.name!r}")
        for k in ins.called_computation_ids:
            if k not in done:
                raise _bad(f"HLO: instruction {ins.name!r} calls computation {k}, which "
                           "is not an earlier computation of the module")
        if ins.opcode == "parameter":
            if not 0 <= ins.parameter_number < len(c.program_shape.parameters) or \
                    ins.parameter_number in params:
                raise _bad(f"HLO: parameter number {ins.parameter_number} of computation "
                           f"{c.name!r} is out of range or repeats")
            params.add(ins.parameter_number)
        ids.add(ins.id)
        local.add(ins.id)
    if len(params) != len(c.program_shape.parameters):
        raise _bad(f"HLO: computation {c.name!r} declares "
                   f"{len(c.program_shape.parameters)} parameters, has {len(params)}")
    if c.root_id not in local:
        raise _bad(f"HLO: the root of computation {c.name!r} is not one of its "
                   "instructions")


def check_loader(spec, axis_names) -> None:
    """A LoaderSpec (pw.DataLoader) whose numbers make sense for this slice."""
    if not spec.dataset or len(spec.dataset) > 1024:
        raise _bad("a loader needs a dataset factory name ('package.module:factory')")
    if len(spec.dataset_kwargs_json) > (1 << 20) or len(spec.collate) > 1024:
        raise _bad("a loader's dataset_kwargs or collate name is too large")
    if not 0 < spec.batch_size <= (1 << 31):
        raise _bad(f"a loader's batch_size must be positive, got {spec.batch_size}")
    if not 0 < spec.parts <= spec.batch_size:
        raise _bad(f"a loader cuts each batch into 1 to batch_size parts, got {spec.parts}")
    if not spec.mine or any(not 0 <= k < spec.parts for k in spec.mine):
        raise _bad(f"a loader's parts {list(spec.mine)} are not among 0..{spec.parts - 1}")
    if not 0 <= spec.num_workers <= 256 or not 0 <= spec.prefetch <= 1024:
        raise _bad("a loader's num_workers (0..256) or prefetch (0..1024) is out of range")
    if spec.axis and spec.axis not in axis_names:
        raise _bad(f"a loader's batch axis {spec.axis!r} is not an axis of this slice "
                   f"{tuple(axis_names)}")
    if any(k < 0 for k in spec.leaves):
        raise _bad("a loader's kept items must be non-negative positions")
    if spec.sub < 0 or spec.sub > 1 << 20 or any(not 0 <= k < max(spec.sub, 1)
                                                 for k in spec.sub_mine):
        raise _bad(f"a loader's sub-blocks {list(spec.sub_mine)} are not among "
                   f"0..{max(spec.sub, 1) - 1}")
