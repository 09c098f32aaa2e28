"""Malformed and random messages against a live cluster (issue 6, part 5).

Hypothesis generates messages that are wrong in at least one way (a field out of range,
an unknown or foreign id, a byte count that does not match its shape and dtype, an HLO
module that is garbage or does not fit its parameters, bytes that do not decode, a
message over the size limit) and sends them to the coordinator, the worker agent and the
executors of one embedded cluster. Every message must get an error status (an op of the
Dispatch stream: an error on each of its output buffers, or be dropped when it names
none); no handler may fail with an unexpected exception (status UNKNOWN); no process may
die; the agent must fork nothing; and afterwards a program computes what torch computes
on the CPU. Generation is derandomized, so every run sends the same messages.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import re
import threading
import time

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from procs import alive, descendants

import pathways_torch as pw
from pathways_torch.client import capture
from pathways_torch.client.cluster import RESTART_ENV
from pathways_torch.client.runtime import Slice
from pathways_torch.rpc import codec, grpc_util, validate
from pathways_torch.rpc import pathways_pb2 as pb
from pathways_torch.rpc import pathways_pb2_grpc as pbg
from pathways_torch.rpc.ownership import SLICE_KEY, with_slice_key

SENT: collections.Counter = collections.Counter()   # messages sent, by target
OPS = "executor Dispatch ops"
C = grpc.StatusCode
REFUSED = {C.INVALID_ARGUMENT, C.NOT_FOUND, C.PERMISSION_DENIED, C.UNAUTHENTICATED,
           C.FAILED_PRECONDITION, C.RESOURCE_EXHAUSTED}
UNDECODABLE = {C.INTERNAL}          # grpc: "Exception deserializing request!"
BASE = 1 << 40                      # buffer ids of this test (the client counts from 1)
LIVE, SHORT, INTS = BASE + 1, BASE + 2, BASE + 3
_fresh = itertools.count(BASE + 1000)
N_DEVICES = 3                        # the host's devices: slice A has 2, slice B 1

FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                phases=(Phase.explicit, Phase.generate),     # no shrinking: it resends
                suppress_health_check=list(HealthCheck))


def fresh() -> int:
    return next(_fresh)


# ------------------------------------------------------------------ the cluster
class Env:
    pass


def _agent_address(pid: int, probe) -> str:
    """The worker agent's gRPC address: its process's listening TCP port (/proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                p = line.split()
                if p[3] == "0A" and p[9] in inodes:        # LISTEN, one of its sockets
                    address = f"127.0.0.1:{int(p[1].rsplit(':', 1)[1], 16)}"
                    if probe(address):
                        return address
    raise AssertionError(f"no worker agent listens in process {pid}")


def _is_agent(address: str) -> bool:
    ch = grpc_util.channel(address)
    try:
        pbg.WorkerStub(ch).Profile(pb.ProfileRequest(action=pb.ProfileRequest.CLOCK),
                                   timeout=5)
        return True
    except grpc.RpcError:
        return False
    finally:
        ch.close()


def _allocate(env, mesh, axes) -> pb.AllocateSliceReply:
    return env.coord.AllocateSlice(pb.AllocateSliceRequest(
        client_id=env.client_id, mesh_shape=list(mesh), axis_names=list(axes),
        any_island=True), timeout=180)


def _mm(x, w):
    return x @ w


def _compile_request(fn, avals, program_id: str) -> pb.CompileRequest:
    tr = capture.trace(fn, fn.__name__, avals, lambda ps: (ps, {}))
    req = pb.CompileRequest(program_id=program_id, name=fn.__name__, hlo=tr.hlo)
    for src, k in tr.params:
        req.params.add(**({"input": k} if src == "i" else {"constant": k}))
    for c in tr.constants:
        req.constants.add(meta=pb.TensorMeta(dtype=codec.dtype_name(c.dtype),
                                             shape=list(c.shape)), data=codec.to_bytes(c))
    for shape, dtype in avals:
        req.inputs.add(dtype=codec.dtype_name(dtype), shape=list(shape))
        req.input_specs.add()
    return req


def _put(env, bid: int, t: torch.Tensor) -> int:
    return env.a._conn.send(pb.Op(put=pb.PutOp(
        buffer_id=bid, meta=pb.TensorMeta(dtype=codec.dtype_name(t.dtype),
                                          shape=list(t.shape)),
        data=codec.to_bytes(t), last=True)))


@pytest.fixture(scope="module")
def env():
    old = os.environ.get(RESTART_ENV)
    os.environ[RESTART_ENV] = "0"       # a crashed worker must stay dead, and be seen
    try:
        pw.init(islands=1, hosts_per_island=1, devices_per_host=N_DEVICES, timeout=120)
    finally:
        if old is None:
            os.environ.pop(RESTART_ENV, None)
        else:
            os.environ[RESTART_ENV] = old
    e, other = Env(), None
    try:
        state = pw.client.runtime._state
        e.client_id = state.client_id
        e.coord_addr = state.address
        e.coord_ch = grpc_util.channel(e.coord_addr)
        e.coord = pbg.CoordinatorStub(e.coord_ch)
        procs = state.cluster.procs
        e.coord_pid, e.worker_pid = procs[0].pid, procs[1].pid
        e.worker_addr = _agent_address(e.worker_pid, _is_agent)
        e.worker_ch = grpc_util.channel(e.worker_addr)
        e.worker = pbg.WorkerStub(e.worker_ch)
        # Slice A (2 devices, SPMD): a pw Slice whose key the test holds too, fuzzed
        # through the client's own Dispatch stream and raw unary calls.
        rep = _allocate(e, (2,), ("data",))
        e.a = Slice(state, rep, (2,), ("data",))
        state.slices.append(e.a)
        e.a_id = rep.slice_id
        e.a_ch = with_slice_key(grpc_util.channel(rep.executor_address), rep.slice_key)
        e.a_stub = pbg.ExecutorStub(e.a_ch)
        e.a_addr = rep.executor_address
        # Slice B (1 device): raw Dispatch streams of undecodable bytes.
        rep = _allocate(e, (1,), ("data",))
        e.b_id = rep.slice_id
        e.b_ch = with_slice_key(grpc_util.channel(rep.executor_address), rep.slice_key)
        e.b_stub = pbg.ExecutorStub(e.b_ch)
        e.b_addr, e.b_key = rep.executor_address, rep.slice_key
        # Another client's session: its id is foreign to slices A and B.
        e.other_up = threading.Event()
        other = e.coord.OpenSession(_until(e.other_up, pb.SessionUp(
            open=pb.OpenSessionRequest(name="fuzz-other", pid=os.getpid(), share=1.0))))
        e.other_id = next(other).client_id
        e.a_pid = e.a_stub.Stats(pb.StatsRequest(), timeout=30).pid
        e.b_pid = e.b_stub.Stats(pb.StatsRequest(), timeout=30).pid
        e.pids = {"coordinator": e.coord_pid, "worker agent": e.worker_pid,
                  "executor A": e.a_pid, "executor B": e.b_pid}
        e.agent_children = set(descendants(e.worker_pid))
        # A compiled program (x @ w on f32[4, 4]) and live buffers of three avals.
        f32 = torch.float32
        e.compile = _compile_request(_mm, [((4, 4), f32), ((4, 4), f32)], "fuzz-mm")
        e.a_stub.Compile(e.compile, timeout=120)
        e.live = torch.arange(16, dtype=f32).reshape(4, 4)
        _put(e, LIVE, e.live)
        _put(e, SHORT, torch.ones(3))
        e.seq = _put(e, INTS, torch.ones(4, 4, dtype=torch.int32))
        e.t0 = time.monotonic()
        yield e
    finally:
        if other is not None:
            e.other_up.set()
            other.cancel()
        for name in ("coord_ch", "worker_ch", "a_ch", "b_ch"):
            if hasattr(e, name):
                getattr(e, name).close()
        pw.shutdown()


# ------------------------------------------------------------------ sending
def expect(target: str, call, codes) -> None:
    """``call()`` must fail with one of ``codes``."""
    SENT[target] += 1
    try:
        call()
    except grpc.RpcError as e:
        assert e.code() in codes, f"{target}: {e.code()} {e.details()}"
        return
    raise AssertionError(f"{target}: a malformed message was accepted")


def raw(channel, method: str, data: bytes, kind: str = "unary", timeout: float = 30,
        metadata=None):
    """Send ``data`` as the request of ``method`` without serializing anything."""
    if kind == "unary":
        return channel.unary_unary(method)(data, timeout=timeout, metadata=metadata)
    if kind == "stream":                      # unary request, streamed reply
        return list(channel.unary_stream(method)(data, timeout=timeout, metadata=metadata))
    return list(channel.stream_stream(method)(iter([data]), timeout=timeout,
                                              metadata=metadata))


def _until(event: threading.Event, first_message):
    """A request stream: ``first_message``, then open (beats) until ``event`` is set."""
    yield first_message
    beat = 0
    while not event.wait(1.0):
        beat += 1
        yield pb.SessionUp(beat=beat)


def first(it):
    """The first message of a server stream (registration, session)."""
    return lambda: next(iter(it()))


# ------------------------------------------------------------------ strategies
NAN, INF = float("nan"), float("inf")
i32 = st.integers(-2**31, 2**31 - 1)
u64 = st.integers(0, 2**64 - 1)
text = st.text(max_size=12)
unknown_fields = st.lists(st.one_of(
    st.integers(0, 2**63).map(lambda v: b"\xc0\x3e" + _varint(v)),            # 1000: varint
    st.binary(max_size=8).map(lambda b: b"\xca\x3e" + _varint(len(b)) + b)),   # 1001: bytes
    max_size=3).map(b"".join)
# After a field boundary these fail to decode whatever follows: wire types 6 and 7,
# field number 0, an end group without its start; and these at the very end: a start
# group without its end, truncated length-delimited, varint and fixed32 fields, a
# truncated tag.
HARD_TAILS = [b"\x0f", b"\x0e", b"\x00", b"\x0c"]
END_TAILS = [b"\x0b", b"\x0a\x05ab", b"\x08\x80", b"\x0d\x01\x02", b"\x80"]
garbage = st.one_of(
    st.builds(lambda head, tail, rest: head + tail + rest, unknown_fields,
              st.sampled_from(HARD_TAILS), st.binary(max_size=16)),
    st.builds(lambda head, tail: head + tail, unknown_fields, st.sampled_from(END_TAILS)))


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def parsed(cls, data: bytes):
    """Random bytes as a message of ``cls`` (empty when they do not decode)."""
    try:
        return cls.FromString(data)
    except DecodeError:
        return cls()


bad_island = st.one_of(st.integers(-2**31, -1),
                       st.integers(validate.MAX_ISLAND + 1, 2**31 - 1))
bad_count = st.one_of(st.integers(-2**31, 0),
                      st.integers(validate.MAX_DEVICES + 1, 2**31 - 1))
bad_kind = st.one_of(st.just(""), st.text(min_size=65, max_size=70),
                     st.text(alphabet=" /$%*\n\t", min_size=1, max_size=5))
good_address = st.integers(1, 65535).map(lambda p: f"127.0.0.1:{p}")
bad_address = st.one_of(
    st.just(""), st.text(alphabet="abc.-", max_size=10),
    st.builds("{}:{}".format, st.sampled_from(["127.0.0.1", "localhost", "h", "[::1]"]),
              st.one_of(st.integers(-9, 0), st.integers(65536, 10**7),
                        st.text(alphabet="xyz +", min_size=0, max_size=4),
                        st.text(alphabet="\u00b2\u0668\u0660", min_size=1, max_size=3))),
    st.builds("{}:{}".format, st.text(alphabet=" !@#*/", min_size=1, max_size=6),
              st.integers(1, 65535)))
bad_share = st.one_of(st.sampled_from([NAN, INF, -INF, 0.0, -0.0]),
                      st.floats(max_value=-1e-300),
                      st.floats(min_value=1e-300, max_value=validate.MIN_SHARE / 2),
                      st.floats(min_value=validate.MAX_SHARE * 2, allow_infinity=False))
long_name = st.text(min_size=validate.MAX_NAME + 1, max_size=validate.MAX_NAME + 8)
bad_timeout = st.one_of(st.sampled_from([NAN, INF, -INF]),
                        st.floats(max_value=-1e-9, allow_infinity=False),
                        st.floats(min_value=validate.MAX_TIMEOUT_S * 2,
                                  allow_infinity=False))
bad_action = st.one_of(st.integers(-2**31, -1), st.integers(3, 2**31 - 1))
real_slice_id = re.compile(r"s\d+")
slice_ids = st.text(max_size=10).filter(lambda s: not real_slice_id.fullmatch(s))


@st.composite
def bad_mesh(draw):
    """(mesh_shape, axis_names) wrong in at least one way."""
    n = draw(st.integers(1, 3))
    mesh = [1] * n
    axes = [f"a{i}" for i in range(n)]
    flaw = draw(st.sampled_from(["size", "rank", "names", "dup", "empty", "long", "count"]))
    if flaw == "size":
        mesh[draw(st.integers(0, n - 1))] = draw(st.one_of(
            st.integers(-2**40, 0), st.integers(validate.MAX_DEVICES + 1, 2**62)))
    elif flaw == "rank":
        mesh, axes = [], []
        if draw(st.booleans()):
            mesh = [1] * (validate.MAX_MESH_RANK + 1)
            axes = [f"a{i}" for i in range(len(mesh))]
    elif flaw == "names":
        axes = axes[:-1] if draw(st.booleans()) else axes + ["x"]
    elif flaw == "dup":
        axes = ["a"] * n if n > 1 else ["a", "a"]
        mesh = [1] * len(axes)
    elif flaw == "empty":
        axes[0] = ""
    elif flaw == "long":
        axes[0] = "x" * 65
    else:
        mesh = [64] * 3 if draw(st.booleans()) else [validate.MAX_DEVICES, 2]
        axes = [f"a{i}" for i in range(len(mesh))]
    return mesh, axes


# ------------------------------------------------------------------ coordinator
@st.composite
def coordinator_message(draw, env):
    """(target, call, codes): one malformed coordinator call."""
    c = env.coord
    which = draw(st.sampled_from(["register", "session", "allocate", "release",
                                  "schedule", "profile"]))
    base = draw(st.binary(max_size=24))
    if which == "register":
        f = dict(island=draw(st.integers(0, 3)), host=draw(st.integers(0, 3)),
                 num_devices=draw(st.integers(1, 8)), kind="CPU",
                 address=draw(good_address), pid=draw(st.integers(0, 10**6)))
        bad = {"island": bad_island, "host": bad_island, "num_devices": bad_count,
               "kind": bad_kind, "address": bad_address, "pid": st.integers(-2**31, -1)}
        for k in draw(st.sets(st.sampled_from(sorted(bad)), min_size=1)):
            f[k] = draw(bad[k])
        m = parsed(pb.RegisterWorkerRequest, base)
        for k, v in f.items():
            setattr(m, k, v)
        return which, first(lambda: c.RegisterWorker(iter([pb.WorkerUp(register=m)]),
                                                     timeout=10)), {C.INVALID_ARGUMENT}
    if which == "session":
        f = dict(name=draw(text), pid=draw(st.integers(0, 10**6)), share=1.0)
        flaw = draw(st.sampled_from(["share", "name", "pid"]))
        f[flaw] = draw({"share": bad_share, "name": long_name,
                        "pid": st.integers(-2**31, -1)}[flaw])
        m = parsed(pb.OpenSessionRequest, base)
        for k, v in f.items():
            setattr(m, k, v)
        return which, first(lambda: c.OpenSession(iter([pb.SessionUp(open=m)]),
                                                  timeout=10)), {C.INVALID_ARGUMENT}
    if which == "allocate":
        if draw(st.booleans()):         # an unknown client (valid request otherwise)
            m = pb.AllocateSliceRequest(client_id=draw(text), mesh_shape=[1],
                                        axis_names=["data"], any_island=True)
            return which, lambda: c.AllocateSlice(m, timeout=30), {C.UNAUTHENTICATED}
        mesh, axes = draw(bad_mesh())
        island, any_island = draw(st.integers(0, 3)), draw(st.booleans())
        if not any_island and draw(st.booleans()):
            island = draw(st.one_of(st.integers(-2**31, -1), st.integers(1, 2**31 - 1)))
            mesh, axes = ([1], ["data"]) if draw(st.booleans()) else (mesh, axes)
        m = pb.AllocateSliceRequest(client_id=env.client_id, mesh_shape=mesh,
                                    axis_names=axes, island=island, any_island=any_island)
        return which, lambda: c.AllocateSlice(m, timeout=30), {C.INVALID_ARGUMENT}
    if which == "release":
        client, sid, code = draw(st.sampled_from([
            ("random", "random", C.UNAUTHENTICATED), ("random", "A", C.UNAUTHENTICATED),
            ("mine", "random", C.NOT_FOUND), ("other", "A", C.PERMISSION_DENIED),
            ("other", "B", C.PERMISSION_DENIED), ("other", "random", C.NOT_FOUND)]))
        m = pb.ReleaseSliceRequest(
            client_id={"random": draw(text), "mine": env.client_id,
                       "other": env.other_id}[client],
            slice_id={"random": draw(slice_ids), "A": env.a_id, "B": env.b_id}[sid])
        return which, lambda: c.ReleaseSlice(m, timeout=30), {code}
    if which == "schedule":
        flaw = draw(st.sampled_from(["client", "empty", "dup", "unknown", "foreign"]))
        ids = [env.a_id, env.b_id]
        client = env.client_id
        if flaw == "client":
            client = draw(text)
        elif flaw == "empty":
            ids = []
        elif flaw == "dup":
            ids = [env.a_id, env.a_id]
        elif flaw == "unknown":
            ids.insert(draw(st.integers(0, 2)), draw(slice_ids.filter(bool)))
        else:
            client = env.other_id
        m = pb.ScheduleRequest(client_id=client, slice_ids=ids)
        return which, lambda: c.Schedule(m, timeout=30), REFUSED
    m = _bad_profile(draw)
    return which, lambda: c.Profile(m, timeout=30), {C.INVALID_ARGUMENT, C.NOT_FOUND}


def _bad_profile(draw) -> pb.ProfileRequest:
    m = parsed(pb.ProfileRequest, draw(st.binary(max_size=12)))
    if draw(st.booleans()):
        m.action = draw(bad_action)
    else:
        m.action, m.session = pb.ProfileRequest.STOP, draw(u64)   # no session is open
    return m


COORD_METHODS = [("RegisterWorker", "bidi"), ("OpenSession", "bidi"),
                 ("ListDevices", "unary"), ("AllocateSlice", "unary"),
                 ("ReleaseSlice", "unary"), ("Schedule", "unary"), ("Profile", "unary")]
WORKER_METHODS = ["StartExecutor", "StopExecutor", "ExecutorReady", "Profile"]
EXECUTOR_METHODS = [("Compile", "unary"), ("Fetch", "stream"), ("Wait", "unary"),
                    ("Stats", "unary"), ("Profile", "unary"),
                    ("OpenLoader", "unary", "LoaderSpec"), ("Colocated", "unary"),
                    ("PeekLoader", "unary", "LoaderPeek")]


def undecodable(draw, cls) -> bytes:
    data = draw(garbage)
    with pytest.raises(DecodeError):
        cls.FromString(data)
    return data


def test_coordinator_refuses_malformed_messages(env):
    @settings(FUZZ, max_examples=110)
    @given(st.data())
    def run(data):
        for _ in range(24):
            target, call, codes = data.draw(coordinator_message(env))
            expect(f"coordinator {target}", call, codes)
        for method, kind in COORD_METHODS:             # bytes that do not decode
            cls = {"RegisterWorker": pb.WorkerUp, "OpenSession": pb.SessionUp}.get(
                method) or getattr(pb, f"{method}Request", pb.ListDevicesRequest)
            blob = undecodable(data.draw, cls)
            # the coordinator (grpc.aio) decodes itself: it answers INVALID_ARGUMENT
            expect("coordinator (undecodable)",
                   lambda: raw(env.coord_ch, f"/pathways.Coordinator/{method}", blob, kind),
                   {C.INVALID_ARGUMENT})

    run()
    assert alive(env.coord_pid)
    devices = env.coord.ListDevices(pb.ListDevicesRequest(), timeout=30).devices
    assert len(devices) == N_DEVICES


# ------------------------------------------------------------------ worker agent
@st.composite
def start_executor(draw, env):
    """A StartExecutor that must not fork anything: wrong in at least one way."""
    n = draw(st.integers(1, 2))
    f = dict(slice_id=f"fuzz{draw(st.integers(0, 10**6))}", device_indices=list(range(n)),
             mesh_shape=[n], axis_names=["data"], client_id=env.client_id, share=0.0)
    flaw = draw(st.sampled_from(["slice_id", "devices", "dup", "range", "mesh", "axes",
                                 "share", "client"]))
    if flaw == "slice_id":
        f["slice_id"] = draw(st.one_of(st.just(""), long_name,
                                       st.text(alphabet=" /\n\t$", min_size=1, max_size=4)))
    elif flaw == "devices":
        f["device_indices"] = []
    elif flaw == "dup":
        f["device_indices"] = [0, 0]
        f["mesh_shape"] = [2]
    elif flaw == "range":
        f["device_indices"][-1] = draw(st.one_of(st.integers(-2**31, -1),
                                                 st.integers(N_DEVICES, 2**31 - 1)))
    elif flaw == "mesh":
        f["mesh_shape"], f["axis_names"] = draw(bad_mesh())
        if math.prod(f["mesh_shape"]) == n and len(f["mesh_shape"]) == 1 \
                and f["axis_names"] == ["data"]:
            f["mesh_shape"] = [n + 1]
    elif flaw == "axes":
        f["axis_names"] = draw(st.sampled_from([[], [""], ["data", "data"], ["a", "b"]]))
    elif flaw == "share":
        f["share"] = draw(bad_share.filter(lambda v: v != 0))
    else:
        f["client_id"] = draw(st.text(alphabet=" /\n$", min_size=1, max_size=4))
    m = parsed(pb.StartExecutorRequest, draw(st.binary(max_size=16)))
    for k, v in f.items():
        if isinstance(v, list):
            getattr(m, k)[:] = v
        else:
            setattr(m, k, v)
    return m


def test_worker_agent_refuses_malformed_messages(env):
    w = env.worker

    @settings(FUZZ, max_examples=95)
    @given(st.data())
    def run(data):
        for _ in range(8):
            m = data.draw(start_executor(env))
            expect("worker StartExecutor", lambda: w.StartExecutor(m, timeout=30),
                   {C.INVALID_ARGUMENT})
            m = pb.StopExecutorRequest(slice_id=data.draw(slice_ids))
            expect("worker StopExecutor", lambda: w.StopExecutor(m, timeout=30),
                   {C.NOT_FOUND})
            m = parsed(pb.ExecutorReadyRequest, data.draw(st.binary(max_size=24)))
            m.slice_id = data.draw(slice_ids)
            expect("worker ExecutorReady", lambda: w.ExecutorReady(m, timeout=30),
                   {C.NOT_FOUND})
            m = _bad_profile(data.draw)
            expect("worker Profile", lambda: w.Profile(m, timeout=30),
                   {C.INVALID_ARGUMENT, C.NOT_FOUND})
        for method in WORKER_METHODS:
            cls = getattr(pb, f"{method}Request", pb.ProfileRequest)
            blob = undecodable(data.draw, cls)
            expect("worker (undecodable)",
                   lambda: raw(env.worker_ch, f"/pathways.Worker/{method}", blob),
                   UNDECODABLE)

    run()
    assert alive(env.worker_pid)
    # It never forked an executor for garbage: the same processes live under it.
    assert set(descendants(env.worker_pid)) == env.agent_children


# ------------------------------------------------------------------ executor: Dispatch
bad_dtype = st.text(max_size=10).filter(lambda s: s not in validate.DTYPES)
bad_axes = st.one_of(st.text(max_size=6).filter(lambda s: s != "data"),
                     st.just("data").map(lambda a: [a, a]))


@st.composite
def bad_meta(draw, oom_ok: bool = True):
    """(TensorMeta, kind) that a receiver must refuse."""
    flaws = ["dtype", "neg", "rank", "dim"] + (["oom"] if oom_ok else [])
    flaw = draw(st.sampled_from(flaws))
    dtype, shape = "float32", [draw(st.integers(0, 4))]
    if flaw == "dtype":
        dtype = draw(bad_dtype)
    elif flaw == "neg":
        shape.append(draw(st.integers(-2**63, -1)))
    elif flaw == "rank":
        shape = [1] * draw(st.integers(validate.MAX_RANK + 1, validate.MAX_RANK + 4))
    elif flaw == "dim":
        shape.append(draw(st.integers(validate.MAX_DIM + 1, 2**63 - 1)))
    else:
        shape = [1 << 20, 1 << 20, draw(st.integers(1, 1 << 10))]
    return pb.TensorMeta(dtype=dtype, shape=shape), ("oom" if flaw == "oom" else "input")


def _spec(axes) -> pb.Spec:
    s = pb.Spec()
    for a in axes:
        s.dims.add().axes.extend([a] if isinstance(a, str) else a)
    return s


@st.composite
def bad_spec(draw, rank: int | None):
    """A spec naming an unknown axis, an axis twice, or more dimensions than ``rank``."""
    flaw = draw(st.sampled_from(["axis", "dup"] + (["rank"] if rank is not None else [])))
    if flaw == "axis":
        return _spec([draw(st.text(max_size=6).filter(lambda s: s != "data"))])
    if flaw == "dup":
        return _spec([["data", "data"]])
    return _spec([[]] * (rank + draw(st.integers(1, 3))))


UNITS = ["put", "chunks", "execute", "recv", "send", "save", "load", "gang", "empty",
         "random_put", "random_execute", "batch"]
SINGLE = ["put", "execute", "recv", "save", "load", "random_put", "batch"]  # with outputs


@st.composite
def dispatch_ops(draw, env, kinds=tuple(UNITS)):
    """([ops], {output id: the BufferError kinds it may get}): one malformed unit of the
    stream (a gang: its ops)."""
    kind = draw(st.sampled_from(kinds))
    out = fresh()
    if kind == "put":
        flaw = draw(st.sampled_from(["meta", "bytes", "spec", "live"]))
        meta, want = pb.TensorMeta(dtype="float32", shape=[4]), {"input"}
        data, spec, bid = b"\0" * 16, pb.Spec(), out
        if flaw == "meta":
            meta, k = draw(bad_meta())
            want = {k}
        elif flaw == "bytes":
            n = draw(st.integers(0, 40).filter(lambda n: n != 16))
            data = b"\1" * n
        elif flaw == "spec":
            spec = draw(bad_spec(1))
        else:
            bid = LIVE                         # must not overwrite a live buffer
        op = pb.Op(put=pb.PutOp(buffer_id=bid, meta=meta, spec=spec, data=data, last=True))
        return [op], ({} if bid == LIVE else {bid: want})
    if kind == "chunks":
        n = draw(st.integers(2, 4))
        meta = pb.TensorMeta(dtype="float32", shape=[8])            # 32 bytes
        flaw = draw(st.sampled_from(["over", "short", "meta", "first"]))
        sizes = [8] * (n - 1) + [32 - 8 * (n - 1)]
        first_meta, last_meta = meta, meta
        if flaw == "over":
            sizes[draw(st.integers(0, n - 1))] += draw(st.integers(1, 64))
        elif flaw == "short":
            sizes[-1] -= draw(st.integers(1, sizes[-1]))
        elif flaw == "meta":
            last_meta = pb.TensorMeta(dtype=draw(st.sampled_from(["int32", "float32"])),
                                      shape=[2, 4])
        else:
            first_meta, want = draw(bad_meta())
        ops = [pb.Op(put=pb.PutOp(buffer_id=out, meta=first_meta if i == 0 else
                                  (last_meta if i == n - 1 else None),
                                  data=b"\2" * sizes[i], last=i == n - 1))
               for i in range(n)]
        kinds = {want} if flaw == "first" else {"input"}
        return ops, {out: kinds}
    if kind == "execute":
        flaw = draw(st.sampled_from(["unknown", "inputs", "outputs", "dtype", "shape",
                                     "live", "self", "donate", "carry"]))
        x = pb.ExecuteOp(program_id="fuzz-mm", inputs=[LIVE, LIVE], outputs=[out])
        if flaw == "unknown":
            x.program_id = draw(st.text(max_size=12).filter(lambda s: s != "fuzz-mm"))
        elif flaw == "inputs":
            x.inputs[:] = [LIVE] * draw(st.sampled_from([0, 1, 3, 5]))
        elif flaw == "outputs":
            extra = draw(st.integers(1, 3))
            x.outputs.extend(fresh() for _ in range(extra))
        elif flaw == "dtype":
            x.inputs[draw(st.integers(0, 1))] = INTS
        elif flaw == "shape":
            x.inputs[draw(st.integers(0, 1))] = SHORT
        elif flaw == "live":
            x.outputs[:] = [LIVE]
        elif flaw == "self":
            x.inputs[1] = out
        elif flaw == "carry":
            x.carry[:] = draw(st.sampled_from([[3], [1, 0], [0, 0, 9]]))
        else:
            x.donate[:] = draw(st.sampled_from([[2], [0, 0], [1, 7]]))
        return [pb.Op(execute=x)], {b: {"input"} for b in x.outputs if b != LIVE}
    if kind == "recv":
        r = pb.RecvOp(buffer_id=out, meta=pb.TensorMeta(dtype="float32", shape=[2]),
                      transfer_id=draw(u64))
        flaw = draw(st.sampled_from(["meta", "spec", "live", "src"]))
        want = {"input"}
        if flaw == "meta":
            meta, k = draw(bad_meta())
            r.meta.CopyFrom(meta)
            want = {k}
        elif flaw == "spec":
            r.spec.CopyFrom(draw(bad_spec(1)))
        elif flaw == "live":
            r.buffer_id = LIVE
        else:
            r.src_data_address = draw(bad_address.filter(bool))
        return [pb.Op(recv=r)], ({} if r.buffer_id == LIVE else {out: want})
    if kind == "send":
        send = pb.SendOp(buffer_id=LIVE, transfer_id=draw(u64),
                         dst_data_address=draw(bad_address))
        return [pb.Op(send=send)], {}
    if kind == "save":
        s = pb.SaveOp(path="/nonexistent/fuzz", keys=["w"], buffer_ids=[LIVE],
                      status_id=out)
        flaw = draw(st.sampled_from(["lengths", "path", "dup", "key", "live"]))
        if flaw == "lengths" and draw(st.booleans()):
            s.buffer_ids.append(LIVE)
        elif flaw == "lengths":
            s.keys.append("v")
        elif flaw == "path":
            s.path = ""
        elif flaw == "dup":
            s.keys[:] = ["w", "w"]
            s.buffer_ids[:] = [LIVE, LIVE]
        elif flaw == "key":
            s.keys[:] = [""]
        else:
            s.status_id = LIVE
        return [pb.Op(save=s)], ({} if s.status_id == LIVE else {out: {"input"}})
    if kind == "load":
        ld = pb.LoadOp(path="/nonexistent/fuzz", keys=["w"], buffer_ids=[out],
                       metas=[pb.TensorMeta(dtype="float32", shape=[4])], specs=[pb.Spec()])
        flaw = draw(st.sampled_from(["lengths", "path", "meta", "spec", "dup", "live"]))
        want = {"input"}
        if flaw == "lengths":
            getattr(ld, draw(st.sampled_from(["keys", "metas", "specs"]))).pop()
        elif flaw == "path":
            ld.path = ""
        elif flaw == "meta":
            meta, k = draw(bad_meta())
            ld.metas[0].CopyFrom(meta)
            want = {k}
        elif flaw == "spec":
            ld.specs[0].CopyFrom(draw(bad_spec(1)))
        elif flaw == "dup":
            ld.keys.append("w")
            ld.buffer_ids.append(fresh())
            ld.metas.append(ld.metas[0])
            ld.specs.add()
        else:
            ld.buffer_ids.append(LIVE)
            ld.keys.append("v")
            ld.metas.append(ld.metas[0])
            ld.specs.add()
        return [pb.Op(load=ld)], {b: want for b in ld.buffer_ids if b != LIVE}
    if kind == "gang":
        inner, outs = [], {}
        for _ in range(draw(st.integers(1, 3))):
            ops, o = draw(dispatch_ops(env, SINGLE))
            inner += ops
            outs.update(o)
        if draw(st.booleans()):                 # nested: the inner gang is refused whole
            ok = pb.Op(put=pb.PutOp(buffer_id=out, meta=pb.TensorMeta(dtype="int8",
                                                                      shape=[1]),
                                    data=b"\1", last=True))
            nested = pb.Op(gang=pb.GangOp(ops=inner + [ok]))
            outs = {b: {"input"} for b in list(outs) + [out]}
            return [pb.Op(gang=pb.GangOp(ops=[nested]))], outs
        return [pb.Op(gang=pb.GangOp(ops=inner))], outs
    if kind == "empty":
        return [pb.Op()], {}
    if kind == "batch":                          # a pw.DataLoader batch, made wrong
        b = pb.BatchOp(loader_id=draw(u64), epoch=draw(st.integers(-5, 5)),
                       index=draw(st.integers(-5, 5)), outputs=[out])
        if draw(st.booleans()):                  # must not overwrite a live buffer
            b.outputs.append(LIVE)
            return [pb.Op(batch=b)], {out: {"input"}}
        return [pb.Op(batch=b)], {out: {"data"}}    # no such loader is open
    if kind == "random_put":                     # random bytes as a PutOp, made wrong
        p = parsed(pb.PutOp, draw(st.binary(max_size=48)))
        p.buffer_id, p.last = out, True
        p.meta.shape.append(-1)
        return [pb.Op(put=p)], {out: {"input"}}
    x = parsed(pb.ExecuteOp, draw(st.binary(max_size=48)))   # random bytes as an ExecuteOp
    x.program_id = "?" + x.program_id                        # no program has that id
    x.outputs[:] = [out] + [fresh() for _ in range(draw(st.integers(0, 2)))]
    return [pb.Op(execute=x)], {b: {"input"} for b in x.outputs}


def test_executor_refuses_malformed_ops(env):
    conn = env.a._conn

    @settings(FUZZ, max_examples=70)
    @given(st.data())
    def run(data):
        want, seq = {}, 0
        for _ in range(60):
            ops, outs = data.draw(dispatch_ops(env))
            for op in ops:
                seq = conn.send(op)
                SENT[OPS] += 1
            want.update(outs)
        ids = list(want)
        rep = env.a_stub.Wait(pb.WaitRequest(buffer_ids=ids, after_seq=seq, timeout_s=60),
                              timeout=90)
        # one verdict and one error per id asked: zip would hide a short reply
        assert len(rep.failed) == len(rep.errors) == len(ids), (
            len(ids), len(rep.failed), len(rep.errors))
        for b, failed, err in zip(ids, rep.failed, rep.errors):
            assert failed and err.kind in want[b] and err.message, (b, want[b], err)

    run()
    assert alive(env.a_pid)


# ------------------------------------------------------------------ executor: unary
@st.composite
def bad_compile(draw, env):
    """(CompileRequest, codes): a compile request wrong in at least one way, or (for
    "flip") the program's HLO with random bytes changed, which may even compile."""
    m = pb.CompileRequest()
    m.CopyFrom(env.compile)
    m.program_id = f"fuzz-{fresh()}"
    flaw = draw(st.sampled_from(["hlo", "trunc", "flip", "params", "n_params", "const",
                                 "specs", "meta", "shape", "spec", "out_spec", "donate",
                                 "id", "oom", "random"]))
    codes = {C.INVALID_ARGUMENT}
    if flaw == "hlo":
        m.hlo = draw(st.binary(max_size=64))
    elif flaw == "trunc":
        m.hlo = m.hlo[:draw(st.integers(0, len(m.hlo) // 2))]    # the computations cut
    elif flaw == "flip":
        hlo = bytearray(m.hlo)
        for _ in range(draw(st.integers(1, 4))):
            hlo[draw(st.integers(0, len(hlo) - 1))] = draw(st.integers(0, 255))
        m.hlo = bytes(hlo)
        codes = None                                   # refused, or it compiles
    elif flaw == "params":
        p = m.params[draw(st.integers(0, len(m.params) - 1))]
        which = draw(st.sampled_from(["input", "constant", "none"]))
        if which == "none":
            p.Clear()
        else:
            setattr(p, which, draw(st.one_of(st.integers(-2**31, -1),
                                              st.integers(len(m.inputs) + len(m.constants),
                                                          2**31 - 1))))
    elif flaw == "n_params":
        if draw(st.booleans()):
            m.params.pop()
        else:
            m.params.add(input=0)
    elif flaw == "const":
        c = m.constants.add(meta=pb.TensorMeta(dtype="float32", shape=[2]))
        c.data = b"\0" * draw(st.integers(0, 16).filter(lambda n: n != 8))
    elif flaw == "specs":
        m.input_specs.pop() if draw(st.booleans()) else m.input_specs.add()
    elif flaw == "meta":
        meta, _ = draw(bad_meta(oom_ok=False))
        m.inputs[draw(st.integers(0, 1))].CopyFrom(meta)
    elif flaw == "shape":
        m.inputs[draw(st.integers(0, 1))].shape[:] = draw(
            st.lists(st.integers(0, 6), max_size=3).filter(lambda s: s != [4, 4]))
    elif flaw == "spec":
        m.input_specs[draw(st.integers(0, 1))].CopyFrom(draw(bad_spec(2)))
    elif flaw == "out_spec":
        if draw(st.booleans()):
            m.has_out_specs = True
            m.out_specs.append(draw(bad_spec(None)))
        else:
            m.out_specs.add()                          # given, but has_out_specs is false
    elif flaw == "donate":
        m.donate[:] = draw(st.sampled_from([[2], [0, 0], [5]]))
    elif flaw == "id":
        n = validate.MAX_PROGRAM_NAME
        m.program_id = draw(st.one_of(st.just(""), st.text(min_size=n + 1, max_size=n + 4)))
    elif flaw == "oom":
        m.inputs[0].shape[:] = [1 << 20, 1 << 20, 1 << 8]
        codes = {C.RESOURCE_EXHAUSTED}
    else:                                              # random bytes as the request
        m = parsed(pb.CompileRequest, draw(st.binary(max_size=64)))
        if not m.program_id:
            m.program_id = "fuzz-random"
        codes = {C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED}
    return m, codes


def test_executor_refuses_malformed_calls(env):
    a = env.a_stub
    compiled = []

    @settings(FUZZ, max_examples=70)
    @given(st.data())
    def run(data):
        for _ in range(10):
            m, codes = data.draw(bad_compile(env))
            if codes is None:                          # a changed HLO: refused, or compiled
                SENT["executor Compile (changed HLO)"] += 1
                try:
                    a.Compile(m, timeout=120)
                    compiled.append(m.program_id)
                except grpc.RpcError as e:
                    assert e.code() == C.INVALID_ARGUMENT, e.details()
                continue
            expect("executor Compile", lambda: a.Compile(m, timeout=120), codes)
        for _ in range(10):
            t = data.draw(bad_timeout)
            m = pb.FetchRequest(buffer_id=data.draw(u64), timeout_s=t)
            expect("executor Fetch", lambda: list(a.Fetch(m, timeout=30)),
                   {C.INVALID_ARGUMENT})
            m = pb.WaitRequest(buffer_ids=[fresh()], timeout_s=data.draw(bad_timeout))
            expect("executor Wait", lambda: a.Wait(m, timeout=30), {C.INVALID_ARGUMENT})
            m = _bad_profile(data.draw)
            expect("executor Profile", lambda: a.Profile(m, timeout=30),
                   {C.INVALID_ARGUMENT, C.NOT_FOUND})
            # Unknown ids are error entries, not statuses (after_seq 0: never created).
            ids = [fresh() for _ in range(data.draw(st.integers(1, 4)))]
            SENT["executor Fetch/Wait (unknown ids)"] += 2
            chunk = next(iter(a.Fetch(pb.FetchRequest(buffer_id=ids[0], timeout_s=5),
                                      timeout=30)))
            assert chunk.has_error and chunk.error.kind == "unknown_buffer"
            rep = a.Wait(pb.WaitRequest(buffer_ids=ids, timeout_s=5), timeout=30)
            assert all(rep.failed) and {e.kind for e in rep.errors} == {"unknown_buffer"}
            # a loader whose numbers make no sense is refused before any import
            m = pb.LoaderSpec(loader_id=data.draw(u64), dataset="os:getcwd",
                              batch_size=data.draw(st.integers(-3, 0)), parts=1, mine=[0])
            if data.draw(st.booleans()):
                m.batch_size, m.mine[:] = 4, [data.draw(st.integers(1, 9))]
            expect("executor OpenLoader", lambda: a.OpenLoader(m, timeout=30),
                   {C.INVALID_ARGUMENT})
            # a colocated call on unknown buffers answers with their error, not a status
            SENT["executor Colocated (unknown ids)"] += 1
            rep = a.Colocated(pb.ColocatedRequest(fn="os:getcwd", inputs=[ids[0]],
                                                  timeout_s=5), timeout=30)
            assert rep.has_error and rep.error.kind == "unknown_buffer"
            # so does a peek at a loader that is not open
            SENT["executor PeekLoader (unknown loader)"] += 1
            rep = a.PeekLoader(pb.LoaderPeek(loader_id=data.draw(u64), timeout_s=5),
                               timeout=30)
            assert rep.has_error and rep.error.kind == "data" and not rep.exists
        for method, kind, *name in EXECUTOR_METHODS:
            cls = getattr(pb, name[0] if name else f"{method}Request")
            blob = undecodable(data.draw, cls)
            expect("executor (undecodable)",
                   lambda: raw(env.a_ch, f"/pathways.Executor/{method}", blob, kind),
                   UNDECODABLE)
        blob = undecodable(data.draw, pb.OpBatch)      # a stream of one undecodable batch
        expect("executor Dispatch (undecodable)",  # (or the last one is still closing)
               lambda: raw(env.b_ch, "/pathways.Executor/Dispatch", blob, "bidi"),
               UNDECODABLE | {C.FAILED_PRECONDITION})

    run()
    assert alive(env.a_pid) and alive(env.b_pid)
    SENT["executor (changed HLO compiled)"] = len(compiled)


# ------------------------------------------------------------------ size limit, streams
def test_oversize_messages_and_a_second_stream_are_refused(env):
    big = b"\0" * (grpc_util.MAX_MESSAGE_BYTES + 1)
    opts = [("grpc.max_send_message_length", -1)]
    md = [(grpc_util.TOKEN_KEY, grpc_util.token())] if grpc_util.token() else []
    for address, method, kind, key in [
            (env.coord_addr, "/pathways.Coordinator/ListDevices", "unary", ""),
            (env.worker_addr, "/pathways.Worker/StartExecutor", "unary", ""),
            (env.a_addr, "/pathways.Executor/Compile", "unary", ""),
            (env.b_addr, "/pathways.Executor/Dispatch", "bidi", env.b_key)]:
        ch = grpc.insecure_channel(address, options=opts)    # sends what it is given
        try:
            extra = md + ([(SLICE_KEY, key)] if key else [])
            expect("over the size limit",
                   lambda: raw(ch, method, big, kind, timeout=60, metadata=extra or None),
                   {C.RESOURCE_EXHAUSTED})
        finally:
            ch.close()
    # A client's own chunks stay far below the limit.
    assert codec.CHUNK_BYTES * 4 <= grpc_util.MAX_MESSAGE_BYTES
    # A second Dispatch stream while the client's is open.
    op = pb.OpBatch(ops=[pb.Op(barrier=pb.BarrierOp(token=1))])
    expect("executor Dispatch (second stream)",
           lambda: list(env.a_stub.Dispatch(iter([op]), timeout=30)),
           {C.FAILED_PRECONDITION})


# ------------------------------------------------------------------ afterwards
def _barrier_on_b(env, ops) -> int:
    """Send ``ops`` on a new stream to executor B; the first event's barrier token."""
    deadline = time.monotonic() + 30
    while True:
        done = threading.Event()

        def requests():
            yield pb.OpBatch(ops=ops)
            done.wait(60)                  # keep the stream open until the barrier is back

        try:
            return next(iter(env.b_stub.Dispatch(requests(), timeout=60))).barrier
        except grpc.RpcError as e:         # a refused stream may still be closing
            if e.code() != C.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
        finally:
            done.set()


def test_cluster_still_computes_correctly(env):
    for name, pid in env.pids.items():
        assert alive(pid), f"the {name} died"
    assert env.a_stub.Stats(pb.StatsRequest(), timeout=30).pid == env.a_pid
    assert set(descendants(env.worker_pid)) == env.agent_children
    # The live buffer that malformed ops named as their output kept its value.
    chunks = list(env.a_stub.Fetch(pb.FetchRequest(buffer_id=LIVE, after_seq=env.seq,
                                                   timeout_s=60), timeout=90))
    assert not chunks[0].has_error, chunks[0].error
    got = codec.from_bytes(b"".join(c.data for c in chunks), chunks[0].meta.dtype,
                           chunks[0].meta.shape)
    assert torch.equal(got, env.live)
    # A real program on the fuzzed executor: put, a @pw.program matmul, fetch.
    torch.manual_seed(0)
    x, w = torch.randn(16, 8), torch.randn(8, 4)

    @pw.program
    def matmul(a, b):
        return torch.relu(a @ b) * 0.5

    got = matmul(pw.put(x, env.a, pw.P("data")), pw.put(w, env.a)).torch()
    # XLA's CPU dot may sum in another order than torch's: float32 rounding only.
    torch.testing.assert_close(got, torch.relu(x @ w) * 0.5, rtol=1e-5, atol=1e-5)
    # Executor B (fed undecodable and over-size streams) still takes a stream.
    ops = [pb.Op(put=pb.PutOp(buffer_id=7, meta=pb.TensorMeta(dtype="float32", shape=[3]),
                              data=codec.to_bytes(torch.tensor([1.0, 2.0, 3.0])),
                              last=True)),
           pb.Op(barrier=pb.BarrierOp(token=5))]
    assert _barrier_on_b(env, ops) == 5
    chunk = next(iter(env.b_stub.Fetch(pb.FetchRequest(buffer_id=7, after_seq=1,
                                                       timeout_s=30), timeout=60)))
    assert codec.from_bytes(chunk.data, "float32", [3]).tolist() == [1.0, 2.0, 3.0]
    # The coordinator still takes back and hands out slices.
    env.coord.ReleaseSlice(pb.ReleaseSliceRequest(client_id=env.client_id,
                                                  slice_id=env.b_id), timeout=60)
    s = pw.slice((1,))
    assert pw.put(torch.ones(2), s).torch().tolist() == [1.0, 1.0]
    s.release()
    refused = sum(n for k, n in SENT.items() if "changed HLO" not in k)
    calls = refused - SENT[OPS]
    print(f"\nfuzz: {refused} malformed messages ({calls} calls, {SENT[OPS]} Dispatch ops) "
          f"in {time.monotonic() - env.t0:.1f} s: "
          + ", ".join(f"{k} {n}" for k, n in sorted(SENT.items())))
    assert calls >= 10_000 and SENT[OPS] >= 4_000, SENT
