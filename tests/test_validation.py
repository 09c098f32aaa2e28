"""The pure checks behind every RPC handler (rpc/validate.py), without a cluster."""

import math

import pytest
import torch

from pathways_torch.rpc import codec, grpc_util
from pathways_torch.rpc import pathways_pb2 as pb
from pathways_torch.rpc import validate as V
from pathways_torch.worker.store import Entry


def refused(fn, *args, match=None, code="INVALID_ARGUMENT", kind="input"):
    with pytest.raises(V.InvalidMessage, match=match) as e:
        fn(*args)
    assert (e.value.code, e.value.kind) == (code, kind)
    assert isinstance(e.value, ValueError)
    return e.value


def test_addresses():
    for ok in ["127.0.0.1:1", "localhost:65535", "[::1]:80", "::1:80",
               "node-3.cluster:7000", "worker_1:7000"]:
        V.check_address(ok)
    for bad in ["", "127.0.0.1", "127.0.0.1:0", "h:65536", "h:x", ":80", "a b:80", "h/1:80",
                "h:\u00b2", "h:\u0668\u0660", "h:" + "9" * 250,
                "-h:80", "h:-1", "x" * 300 + ":1"]:
        refused(V.check_address, bad)


def test_coordinator_requests():
    good = dict(island=0, host=1, num_devices=8, kind="CPU", address="127.0.0.1:5", pid=3)
    V.check_register_worker(pb.RegisterWorkerRequest(**good))
    for field, value in [("island", -1), ("host", V.MAX_ISLAND + 1), ("num_devices", 0),
                         ("num_devices", V.MAX_DEVICES + 1), ("kind", ""),
                         ("kind", "a b"), ("address", "nowhere"), ("pid", -1)]:
        refused(V.check_register_worker, pb.RegisterWorkerRequest(**{**good, field: value}),
                match=field.split("_")[0])
    V.check_open_session(pb.OpenSessionRequest(name="me", share=2.5))
    for share in [0.0, -1.0, math.nan, math.inf, 1e-9, 1e9]:
        refused(V.check_open_session, pb.OpenSessionRequest(share=share), match="share")
    refused(V.check_open_session, pb.OpenSessionRequest(name="x" * 300, share=1),
            match="characters")


def test_meshes():
    assert V.check_mesh([4, 2], ["data", "model"]) == 8
    for mesh, axes, what in [([], [], "1 to 8 axes"), ([1] * 9, list("abcdefghi"), "axes"),
                             ([0], ["a"], "axis size"), ([-3], ["a"], "axis size"),
                             ([2, 2], ["a"], "axis names"),
                             ([2, 2], ["a", "a"], "distinct"),
                             ([2], [""], "empty"), ([4096, 2], ["a", "b"], "devices"),
                             ([2**62], ["a"], "axis size")]:
        refused(V.check_mesh, mesh, axes, match=what)
    V.check_allocate(pb.AllocateSliceRequest(mesh_shape=[2], axis_names=["d"], island=3))
    refused(V.check_allocate, pb.AllocateSliceRequest(mesh_shape=[2], axis_names=["d"],
                                                      island=-1), match="island")


def test_start_executor_requests_that_must_not_fork():
    good = dict(slice_id="s4", device_indices=[0, 1], mesh_shape=[2], axis_names=["data"],
                client_id="c0123", share=0.0)
    V.check_start_executor(pb.StartExecutorRequest(**good), 4)
    for field, value, what in [("slice_id", "", "empty"), ("slice_id", "a/b", "letters"),
                               ("device_indices", [], "no device"),
                               ("device_indices", [0, 4], r"\[0, 3\]"),
                               ("device_indices", [1, 1], "repeat"),
                               ("mesh_shape", [3], "3 devices but 2"),
                               ("axis_names", ["a", "b"], "axis names"),
                               ("share", math.nan, "share"),
                               ("client_id", "c d", "letters")]:
        req = pb.StartExecutorRequest(**{**good, field: value})
        refused(V.check_start_executor, req, 4, match=what)
    refused(V.check_executor_ready, pb.ExecutorReadyRequest(slice_id="s", pid=7,
                                                            address="x"), match="address")
    V.check_executor_ready(pb.ExecutorReadyRequest(slice_id="s", pid=7, error="boom"))


def test_tensor_metas_and_budgets():
    assert V.tensor_meta(pb.TensorMeta(dtype="bfloat16", shape=[3, 4])) == \
        ("bfloat16", (3, 4), 24)
    assert all(V.DTYPES[n][0] == codec.nbytes(codec.dtype_from_name(n), [1])
               for n in V.DTYPES)
    for meta, what in [(pb.TensorMeta(dtype="float8", shape=[1]), "unknown dtype"),
                       (pb.TensorMeta(dtype="int8", shape=[2, -1]), "dimension"),
                       (pb.TensorMeta(dtype="int8", shape=[V.MAX_DIM + 1]), "dimension"),
                       (pb.TensorMeta(dtype="int8", shape=[1] * 17), "rank")]:
        refused(V.tensor_meta, meta, match=what)
    refused(V.tensor_meta, pb.TensorMeta(dtype="float32", shape=[1 << 20]), "x", 1 << 20,
            code="RESOURCE_EXHAUSTED", kind="oom",
            match=r"needs 4\.0 MiB, more than the 1\.0 MiB")


def spec(*dims):
    s = pb.Spec()
    for d in dims:
        s.dims.add().axes.extend(d)
    return s


def test_specs():
    assert tuple(V.check_spec(spec(["data"], []), 2, ["data", "model"])) == ("data", None)
    refused(V.check_spec, spec(["x"]), 1, ["data"], match="unknown mesh axis")
    refused(V.check_spec, spec(["data"], ["data"]), 2, ["data"], match="twice")
    refused(V.check_spec, spec([], [], []), 2, ["data"], match="3 spec entries for rank 2")


def put(bid=1, dtype="float32", shape=(2,), data=b"\0" * 8, last=True, meta=True):
    op = pb.PutOp(buffer_id=bid, data=data, last=last)
    if meta:
        op.meta.CopyFrom(pb.TensorMeta(dtype=dtype, shape=list(shape)))
    return op


def test_puts_chunk_by_chunk():
    live = {5}.__contains__
    V.check_put(put(), None, 0, ["data"], 1 << 20, live)
    refused(V.check_put, put(data=b"\0" * 7), None, 0, ["data"], 1 << 20, live,
            match="payload has 7 bytes")
    refused(V.check_put, put(bid=5), None, 0, ["data"], 1 << 20, live, match="exists")
    refused(V.check_put, put(shape=(1 << 20,), data=b""), None, 0, ["data"], 1 << 20, live,
            code="RESOURCE_EXHAUSTED", kind="oom")
    # Unfinished chunked puts count against the budget too.
    refused(V.check_put, put(shape=(1 << 10,), data=b"", last=False), None,
            (1 << 20) - 100, ["data"], 1 << 20, live, kind="oom", code="RESOURCE_EXHAUSTED")
    first = put(shape=(4,), data=b"\0" * 8, last=False)
    state = (first.meta, first.spec, [first.data])
    V.check_put(put(data=b"\0" * 8, last=True, meta=False, shape=(4,)), state, 0, ["data"],
                1 << 20, live)
    refused(V.check_put, put(data=b"\0" * 9, last=False, meta=False), state, 0, ["data"],
            1 << 20, live, match="chunks bring 17 bytes")
    refused(V.check_put, put(data=b"\0" * 4, meta=False), state, 0, ["data"], 1 << 20, live,
            match="needs 16")
    refused(V.check_put, put(data=b"\0" * 8, shape=(2, 2)), state, 0, ["data"], 1 << 20,
            live, match="differs")


class Prog:
    name = "f"
    in_avals = [(torch.float32, (4, 4)), (torch.int32, (2,))]
    out_nbytes = [64]


def test_executions_against_the_compiled_program():
    entries = {1: Entry(torch.ones(4, 4)), 2: Entry(torch.ones(2, dtype=torch.int32)),
               3: Entry(torch.ones(3)), 4: Entry(error=pb.BufferError(kind="program"))}
    ok = pb.ExecuteOp(program_id="f", inputs=[1, 2], outputs=[9])
    V.check_execute(ok, Prog, entries)
    # a failed or unknown input is reported by the execution itself
    V.check_execute(pb.ExecuteOp(inputs=[4, 77], outputs=[9]), Prog, entries)
    refused(V.check_execute, ok, None, entries, match="unknown program id 'f'")
    for inputs, outputs, donate, what in [
            ([1], [9], [], "takes 2 inputs"), ([1, 2], [9, 10], [], "returns 1 outputs"),
            ([1, 2], [3], [], "already exists"), ([1, 2], [2], [], "is an input"),
            ([3, 2], [9], [], r"input 0 \(buffer 3\) is float32\[3\].*float32\[4, 4\]"),
            ([1, 1], [9], [], "input 1 .* is float32"), ([1, 2], [9], [2], "donated"),
            ([1, 2], [9], [0, 0], "donated")]:
        refused(V.check_execute, pb.ExecuteOp(inputs=inputs, outputs=outputs,
                                              donate=donate), Prog, entries, match=what)
    # carry: one entry per output, each 0 or 1 + an input's position
    V.check_execute(pb.ExecuteOp(inputs=[1, 2], outputs=[9], carry=[2]), Prog, entries)
    for carry in ([3], [1, 0]):
        refused(V.check_execute, pb.ExecuteOp(inputs=[1, 2], outputs=[9], carry=carry),
                Prog, entries, match="carry")


def test_ops_of_the_stream():
    assert V.op_outputs(pb.Op(execute=pb.ExecuteOp(outputs=[3, 4]))) == [3, 4]
    assert V.op_outputs(pb.Op(put=put(last=False))) == []
    gang = pb.Op(gang=pb.GangOp(ops=[pb.Op(put=put(bid=7)),
                                     pb.Op(load=pb.LoadOp(buffer_ids=[8, 9]))]))
    assert V.op_outputs(gang) == [7, 8, 9]
    assert V.op_outputs(pb.Op(send=pb.SendOp(buffer_id=1))) == []
    live = {5}.__contains__
    recv = pb.RecvOp(buffer_id=6, meta=pb.TensorMeta(dtype="int8", shape=[3]),
                     src_data_address="127.0.0.1:9")
    V.check_recv(recv, ["data"], 100, live)
    recv.src_data_address = "nowhere"
    refused(V.check_recv, recv, ["data"], 100, live, match="sender")
    refused(V.check_send, pb.SendOp(dst_data_address="h:0"), match="destination")
    refused(V.check_save, pb.SaveOp(path="/p", keys=["a"], buffer_ids=[1, 2], status_id=3),
            live, match="1 keys for 2 buffers")
    refused(V.check_save, pb.SaveOp(path="", keys=[], status_id=3), live, match="path")
    refused(V.check_save, pb.SaveOp(path="/p", status_id=5), live, match="exists")
    load = pb.LoadOp(path="/p", keys=["a", "b"], buffer_ids=[1, 2],
                     metas=[pb.TensorMeta(dtype="int8", shape=[2])] * 2, specs=[pb.Spec()])
    refused(V.check_load, load, ["data"], 100, live,
            match="2 keys, 2 buffers, 2 metas and 1")
    load.specs.add()
    V.check_load(load, ["data"], 100, live)
    refused(V.check_load, load, ["data"], 3, live, kind="oom", code="RESOURCE_EXHAUSTED")


def test_timeouts_profiles_and_ids():
    assert V.check_timeout(0) == 600.0 and V.check_timeout(2.5) == 2.5
    for t in [-1.0, math.nan, math.inf, 1e9]:
        refused(V.check_timeout, t, match="timeout_s")
    refused(V.check_wait, pb.WaitRequest(buffer_ids=[1], timeout_s=-1), match="timeout")
    V.check_profile(pb.ProfileRequest(action=pb.ProfileRequest.START), lambda s: False)
    refused(V.check_profile, pb.ProfileRequest(action=7), lambda s: True, match="action")
    refused(V.check_profile, pb.ProfileRequest(action=pb.ProfileRequest.STOP, session=4),
            lambda s: False, code="NOT_FOUND", match="session 4")
    for ids, what in [([], "no slice id"), (["s1", "s1"], "repeat"), (["s 1"], "letters")]:
        refused(V.check_ids, ids, "slice id", match=what)


def test_messages_stay_below_the_size_limit():
    # Puts and fetches travel in chunks; a batch of the client's queue holds a few.
    assert codec.CHUNK_BYTES * 4 <= grpc_util.MAX_MESSAGE_BYTES
    for opts in (grpc_util.OPTIONS, grpc_util.SERVER_OPTIONS):
        assert ("grpc.max_receive_message_length", grpc_util.MAX_MESSAGE_BYTES) in opts


# ------------------------------------------------------------------ HLO modules
def module(params=(("float32", (2,)), ("float32", (2,)))):
    """A module of the shape torch_xla emits: add(p0, p1), entry computation id 4."""
    M = V._hlo_classes()
    m = M(name="m.4", entry_computation_name="main.4", entry_computation_id=4)
    c = m.computations.add(name="main.4", id=4, root_id=3)
    xla = {n: t for n, (_, t) in V.DTYPES.items()}
    for k, (dtype, shape) in enumerate(params):
        ins = c.instructions.add(name=f"p{k}.{k + 1}", opcode="parameter", id=k + 1,
                                 parameter_number=k)
        ins.shape.element_type = xla[dtype]
        ins.shape.dimensions.extend(shape)
        for ps in (c.program_shape, m.host_program_shape):
            s = ps.parameters.add(element_type=xla[dtype])
            s.dimensions.extend(shape)
    add = c.instructions.add(name="add.3", opcode="add", id=3, operand_ids=[1, 2])
    add.shape.element_type = xla[params[0][0]]
    for ps in (c.program_shape, m.host_program_shape):
        ps.result.element_type = 13
        r = ps.result.tuple_shapes.add(element_type=xla[params[0][0]])
        r.dimensions.extend(params[0][1])
    return m


def test_hlo_modules_are_checked_before_xla_sees_them():
    params = [("float32", (2,)), ("float32", (2,))]
    V.check_hlo(module().SerializeToString(), params)
    refused(V.check_hlo, b"", params, match="empty")
    refused(V.check_hlo, b"\x0f\x01", params, match="does not parse")
    refused(V.check_hlo, module().SerializeToString()[:30], params)
    refused(V.check_hlo, module().SerializeToString(), params[:1],
            match="takes 2 parameters, the request gives 1")
    refused(V.check_hlo, module().SerializeToString(), [("float32", (3,))] * 2,
            match=r"parameter 0 is float32\[2\], its source is float32\[3\]")
    refused(V.check_hlo, module().SerializeToString(), [("int32", (2,))] * 2,
            match="parameter 0 is float32")

    def broken(change, what):
        m = module()
        change(m, m.computations[0])
        refused(V.check_hlo, m.SerializeToString(), params, match=what)

    broken(lambda m, c: setattr(c.instructions[2], "name", "add3"), "base.number")
    broken(lambda m, c: setattr(c.instructions[1], "name", "p0.1"), "repeats")
    broken(lambda m, c: c.instructions[2].operand_ids.append(9), "uses 9")
    broken(lambda m, c: c.instructions[2].called_computation_ids.append(4), "calls")
    broken(lambda m, c: setattr(c, "root_id", 8), "root")
    broken(lambda m, c: setattr(c.instructions[1], "parameter_number", 0),
           "parameter number")
    broken(lambda m, c: setattr(c.instructions[2], "sharding", b"\x08\x01"), "sharding")
    broken(lambda m, c: setattr(m, "entry_computation_id", 5), "entry computation")
    broken(lambda m, c: c.program_shape.parameters[0].dimensions.append(1), "program shape")
    broken(lambda m, c: [s.is_dynamic_dimension.append(True)
                         for s in (m.host_program_shape.parameters[0],
                                   c.program_shape.parameters[0])], "dynamic")
    broken(lambda m, c: [setattr(ps.result.tuple_shapes[0], "element_type", 13)
                         for ps in (m.host_program_shape, c.program_shape)], "result 0")


def compile_request():
    req = pb.CompileRequest(program_id="p1", name="add", hlo=module().SerializeToString())
    req.params.add(input=1)
    req.params.add(constant=0)
    req.constants.add(meta=pb.TensorMeta(dtype="float32", shape=[2]), data=b"\0" * 8)
    req.inputs.add(dtype="int8", shape=[5])
    req.inputs.add(dtype="float32", shape=[2])
    req.input_specs.add()
    req.input_specs.add()
    return req


def test_compile_requests():
    assert V.check_compile(compile_request(), ["data"], 1 << 20) == \
        [("int8", (5,)), ("float32", (2,))]

    def broken(change, what, **kw):
        req = compile_request()
        change(req)
        refused(V.check_compile, req, ["data"], 1 << 20, match=what, **kw)

    broken(lambda r: setattr(r, "program_id", ""), "program id is empty")
    broken(lambda r: r.input_specs.pop(), "2 inputs but 1 input specs")
    broken(lambda r: setattr(r.constants[0], "data", b"\0"), "constant 0: 1 bytes")
    broken(lambda r: setattr(r.params[0], "input", 2), "comes from input 2")
    broken(lambda r: setattr(r.params[1], "constant", -1), "comes from constant")
    broken(lambda r: r.params[0].Clear(), "comes from nowhere")
    broken(lambda r: r.donate.append(2), "donated")
    broken(lambda r: r.input_specs[0].dims.add().axes.append("model"), "unknown mesh axis")
    broken(lambda r: r.out_specs.add(), "has_out_specs is false")
    broken(lambda r: r.inputs[1].shape.append(1),
           r"parameter 0 is float32\[2\], its source is float32\[2, 1\]")
    broken(lambda r: r.inputs[0].shape.__setitem__(0, 1 << 30), "can still hold",
           code="RESOURCE_EXHAUSTED", kind="oom")
    broken(lambda r: setattr(r, "hlo", b"garbage"), "HLO")
