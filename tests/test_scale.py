"""The control plane at scale, fast form (issue 12, part 5): the real coordinator process
and 256 fake hosts that speak the real protocol from one asyncio process
(bench/fakehosts.py; bench/scale.py measures the same at up to 2,048 hosts).

No speed is asserted here; the deadlines of failure detection are correctness and are
asserted with slack (a closed host within 2 s, a silent one within 6 s against the
coordinator's default read deadline of 4 s).
"""

from __future__ import annotations

import pathlib
import sys
import time

import grpc
import pytest

from procs import alive, wait_gone

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import fakehosts as fh  # noqa: E402
from fakehosts import pb, pbg  # noqa: E402

N = 256
DEVICES = 4


def place(i: int):
    return i // fh.ISLAND_SIZE, i % fh.ISLAND_SIZE


@pytest.fixture(scope="module")
def scale():
    """The coordinator (default flags) and N registered fake hosts, for the module."""
    coord = fh.Coordinator()
    fleet = None
    pids = [coord.pid]
    try:
        fleet = fh.FleetProcess(coord.address)
        pids.append(fleet.pid)
        reg = fleet.register(N, DEVICES, timeout=60)
        channel = fh.grpc_util.channel(coord.address)
        try:
            yield coord, fleet, reg, pbg.CoordinatorStub(channel)
        finally:
            channel.close()
    finally:
        if fleet is not None:
            fleet.stop()
        coord.stop()
    assert wait_gone(pids, 10) == [], "the coordinator or the fake hosts outlived the test"


def host_states(stub, i: int):
    island, host = place(i)
    rep = stub.ListDevices(pb.ListDevicesRequest(island=island, has_island=True), timeout=30)
    return [d.state for d in rep.devices if (d.island, d.host) == (island, host)]


def test_all_hosts_register_and_are_listed(scale):
    coord, fleet, reg, stub = scale
    assert reg["registered"] == N, reg["errors"]
    assert reg["errors"] == {}
    assert reg["heartbeat_s"] > 0 and reg["lost_after_s"] > 0
    rep = stub.ListDevices(pb.ListDevicesRequest(), timeout=30)
    assert rep.registered_workers == N
    assert len(rep.devices) == N * DEVICES
    got = {(d.island, d.host, d.index) for d in rep.devices}
    assert got == {(*place(i), d) for i in range(N) for d in range(DEVICES)}
    assert {d.kind for d in rep.devices} == {"CPU"}
    assert {d.state for d in rep.devices} == {"free"}
    # one island only, with the island filter
    rep = stub.ListDevices(pb.ListDevicesRequest(island=3, has_island=True), timeout=30)
    assert {(d.island, d.host) for d in rep.devices} == {(3, h) for h in range(64)}
    assert fleet.stats()["hosts"] == {"up": N}
    assert coord.alive()


def test_closed_host_is_lost_at_once(scale):
    coord, fleet, reg, stub = scale
    i = N - 1
    r = fleet.notice([i], "close", timeout=10)
    assert r["not_noticed"] == [], f"host {i} closed its stream and is not lost after 10 s"
    assert r["seconds"][0] < 2.0, r
    assert host_states(stub, i) == ["lost"] * DEVICES


def test_silent_host_is_lost_then_registers_again(scale):
    coord, fleet, reg, stub = scale
    i = N - 2
    r = fleet.notice([i], "silent", timeout=15)
    assert r["not_noticed"] == [], (f"host {i} went silent with its connection open and "
                                    "is not lost after 15 s")
    assert r["seconds"][0] < 6.0, r
    assert host_states(stub, i) == ["lost"] * DEVICES
    # it comes back on a fresh stream: registered again, its devices free
    back = fleet.resume(i, timeout=30)
    assert back["state"] == "up", back
    assert host_states(stub, i) == ["free"] * DEVICES
    rep = stub.ListDevices(pb.ListDevicesRequest(), timeout=30)
    assert rep.registered_workers == fleet.stats()["hosts"]["up"]
    assert coord.alive()


def test_allocation_spreads_and_release_frees(scale):
    coord, fleet, reg, stub = scale
    before = fleet.stats()["counts"]
    with fh.Session(coord.address, name="test_scale") as s:
        req = pb.AllocateSliceRequest(client_id=s.client_id, mesh_shape=[1],
                                      axis_names=["data"], any_island=True)
        reps = [s.stub.AllocateSlice(req, timeout=30) for _ in range(16)]
        places = {(r.island, r.host) for r in reps}
        assert len(places) == 16, f"1-device slices were not spread: {sorted(places)}"
        assert (place(N - 1)) not in places        # the closed host is not used
        for r in reps:
            assert r.executor_address == fleet.info["executor_address"]
            assert r.slice_key and len(r.devices) == 1
        first = reps[0]
        d = first.devices[0]
        rows = stub.ListDevices(pb.ListDevicesRequest(island=d.island, has_island=True),
                                timeout=30).devices
        row = [x for x in rows if (x.host, x.index) == (d.host, d.index)][0]
        assert (row.state, row.slice_id) == ("in_use", first.slice_id)
        # a gang submission over all of them
        sched = s.stub.Schedule(pb.ScheduleRequest(
            client_id=s.client_id, slice_ids=[r.slice_id for r in reps]), timeout=30)
        assert list(sched.slice_seqs) == [1] * 16
        s.stub.ReleaseSlice(pb.ReleaseSliceRequest(client_id=s.client_id,
                                                   slice_id=first.slice_id), timeout=30)
        rows = stub.ListDevices(pb.ListDevicesRequest(island=d.island, has_island=True),
                                timeout=30).devices
        row = [x for x in rows if (x.host, x.index) == (d.host, d.index)][0]
        assert (row.state, row.slice_id) == ("free", "")
        with pytest.raises(grpc.RpcError) as e:         # released: unknown to Schedule
            s.stub.Schedule(pb.ScheduleRequest(client_id=s.client_id,
                                               slice_ids=[first.slice_id]), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # the next allocation takes a free host again, not a used one
        again = s.stub.AllocateSlice(req, timeout=30)
        assert (again.island, again.host) not in places - {(first.island, first.host)}
    after = fleet.stats()["counts"]
    assert after.get("start_executor", 0) - before.get("start_executor", 0) == 17
    # closing the session frees every slice (and stops their executors)
    deadline = time.monotonic() + 10
    while True:
        rep = stub.ListDevices(pb.ListDevicesRequest(), timeout=30)
        states = {d.state for d in rep.devices}
        if states <= {"free", "lost"} or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert states <= {"free", "lost"}, "a closed session's slices were not freed in 10 s"


def test_past_max_hosts_is_refused_by_name():
    """A coordinator started with --max-hosts 8 refuses the 9th host at once with
    RESOURCE_EXHAUSTED naming the limit; the 8 others stay registered."""
    pids = []
    with fh.Coordinator({"max_hosts": 8}) as coord:
        pids.append(coord.pid)
        with fh.FleetProcess(coord.address) as fleet:
            pids.append(fleet.pid)
            reg = fleet.register(9, DEVICES, timeout=20)
            assert reg["registered"] == 8, reg
            assert list(reg["errors"]) == ["RESOURCE_EXHAUSTED"], reg["errors"]
            details = reg["errors"]["RESOURCE_EXHAUSTED"]["example"]["details"]
            assert "--max-hosts" in details and "8" in details, details
            assert reg["listed_workers"] == 8
            assert coord.alive()
    assert not any(alive(p) for p in wait_gone(pids, 10))
