"""Several clients on one cluster: a client killed with SIGKILL loses its slices and
buffers, the others notice nothing, and no client can touch another's slices or buffers,
even by guessing ids. Every client is its own process."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest
import torch

import pathways_torch as pw
from pathways_torch.client.cluster import LocalCluster
from pathways_torch.rpc import grpc_util
from pathways_torch.rpc import pathways_pb2 as pb
from pathways_torch.rpc import pathways_pb2_grpc as pbg
from pathways_torch.rpc.ownership import with_slice_key

from procs import wait_gone

# Another client: holds a slice with an Array, says where they are, and answers
# "check" (read the Array back) on stdin.
OTHER = textwrap.dedent("""
    import json, sys, torch
    import pathways_torch as pw
    pw.init(address=sys.argv[1], name="other")
    s = pw.slice((2,))
    x = pw.put(torch.arange(8.), s)
    print(json.dumps({"slice": s.id, "executor": s._conn.address, "buffer": x._id,
                      "pid": s.stats().pid,
                      "devices": [[d.island, d.host, d.index] for d in s.devices]}),
          flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            print("VALUE", x.torch().tolist(), flush=True)
""")


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(devices_per_host=4) as c:
        pw.init(address=c.address, name="test")
        try:
            yield c
        finally:
            pw.shutdown()


class Other:
    def __init__(self, address):
        env = dict(os.environ, PJRT_DEVICE="CPU")
        env.pop("PATHWAYS_ADDRESS", None)
        self.p = subprocess.Popen([sys.executable, "-c", OTHER, address], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        assert line.startswith("{"), f"the other client did not start: {line!r}"
        self.info = json.loads(line)

    def check(self):
        self.p.stdin.write("check\n")
        self.p.stdin.flush()
        return self.p.stdout.readline()

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


@pytest.fixture()
def other(cluster):
    o = Other(cluster.address)
    try:
        yield o
    finally:
        o.stop()


@pw.program
def affine(x):
    return x * 3 + 1


def test_no_client_can_touch_another_clients_buffers_or_slices(cluster, other):
    info = other.info
    ch = grpc_util.channel(info["executor"])
    denied = 0
    for stub in (pbg.ExecutorStub(ch),                                    # no key
                 pbg.ExecutorStub(with_slice_key(ch, "0" * 32))):         # a guessed key
        for bid in range(1, 33):                                          # guessed ids
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Fetch(pb.FetchRequest(buffer_id=bid, timeout_s=1), timeout=10))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "belongs to another client" in e.value.details()
            denied += 1
        calls = [
            lambda: stub.Wait(pb.WaitRequest(buffer_ids=[info["buffer"]], timeout_s=1),
                              timeout=10),
            lambda: stub.Stats(pb.StatsRequest(), timeout=10),
            lambda: stub.Compile(pb.CompileRequest(program_id="p"), timeout=10),
            # a release of every guessable id, on the ordered stream
            lambda: list(stub.Dispatch(iter([pb.OpBatch(ops=[pb.Op(release=pb.ReleaseOp(
                buffer_ids=list(range(1, 1000))))])]), timeout=10)),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            denied += 1
    ch.close()
    coord = pbg.CoordinatorStub(grpc_util.channel(cluster.address))
    me = pw.client.runtime._state.client_id
    for call in (lambda: coord.ReleaseSlice(pb.ReleaseSliceRequest(
                     client_id=me, slice_id=info["slice"]), timeout=10),
                 lambda: coord.Schedule(pb.ScheduleRequest(
                     client_id=me, slice_ids=[info["slice"]]), timeout=10)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as e:              # a guessed client id
        coord.AllocateSlice(pb.AllocateSliceRequest(client_id="c0123456789ab",
                                                    mesh_shape=[1], any_island=True),
                            timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert denied == 72
    # Nothing was read, freed or taken: the owner still has its slice and its Array.
    assert other.check().strip() == "VALUE " + str([float(i) for i in range(8)])
    in_use = {(d.island, d.host, d.index) for d in pw.devices() if d.state == "in_use"}
    assert {tuple(d) for d in info["devices"]} <= in_use


def test_a_killed_client_loses_its_slices_and_the_others_notice_nothing(cluster, other):
    mine = pw.slice((2,))
    x = pw.put(torch.arange(16.), mine)
    errors, results = [], []
    stop = threading.Event()

    def keep_working():                 # this client computes throughout the other's death
        try:
            while not stop.is_set():
                results.append(affine(x).torch())
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append(e)

    worker = threading.Thread(target=keep_working)
    worker.start()
    theirs = {tuple(d) for d in other.info["devices"]}
    os.kill(other.p.pid, signal.SIGKILL)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        free = {(d.island, d.host, d.index) for d in pw.devices() if d.state == "free"}
        if theirs <= free:
            break
        time.sleep(0.1)
    lost_after = time.monotonic() - t0
    assert theirs <= free, "the killed client's devices were not freed within 10 s"
    assert wait_gone([other.info["pid"]], 10) == [], "its executor (and buffers) live on"
    time.sleep(0.5)
    stop.set()
    worker.join(60)
    assert not errors
    assert len(results) > 0
    want = torch.arange(16.) * 3 + 1
    assert all(torch.equal(r, want) for r in results)
    assert affine(x).torch().tolist() == want.tolist()
    assert lost_after < 10
    mine.release()
