"""Silent failures (issue 12, part 3): heartbeats both ways with read deadlines.

A host, a client or a coordinator that stops answering while its connection stays open
(SIGSTOP: a hung machine, a dead switch) is noticed within the read deadline: a silent
host is lost within 5 s and the client's Arrays on it fail with WorkerLostError; a
frozen client's slices are reclaimed after the grace period; a worker whose coordinator
goes silent registers with the next address it was given. Real processes throughout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import torch
from procs import descendants

import pathways_torch as pw
from pathways_torch.client.cluster import LocalCluster
from pathways_torch.rpc import grpc_util
from pathways_torch.rpc import pathways_pb2 as pb
from pathways_torch.rpc import pathways_pb2_grpc as pbg

LOST_WITHIN_S = 5.0          # the bar; the coordinator's default read deadline is 4 s


def _signal_all(pids, sig) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def _until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def _states(address: str) -> dict:
    stub = pbg.CoordinatorStub(grpc_util.channel(address))
    rep = stub.ListDevices(pb.ListDevicesRequest(), timeout=10)
    return {(d.island, d.host, d.index): d.state for d in rep.devices}


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(islands=1, hosts_per_island=2, devices_per_host=1,
                     coordinator_args=["--session-grace-s", "1"])
    try:
        pw.init(address=c.address)
        yield c
    finally:
        pw.shutdown()
        c.stop()


@pw.program
def twice(x):
    return x * 2


def test_a_frozen_client_loses_its_slices_after_the_grace_period(cluster, tmp_path):
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent("""
        import sys
        import pathways_torch as pw
        pw.init(address=sys.argv[1])
        s = pw.slice(1)
        print(s.host, flush=True)
        sys.stdin.read()
    """))
    p = subprocess.Popen([sys.executable, str(script), cluster.address],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        host = int(p.stdout.readline())
        assert _states(cluster.address)[(0, host, 0)] == "in_use"
        os.kill(p.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _until(lambda: _states(cluster.address)[(0, host, 0)] == "free", 30,
               "the frozen client's device is free again")
        # the read deadline (4 s) plus the grace period (1 s), and a sweep
        assert time.monotonic() - t0 < 4 + 1 + 3
    finally:
        p.kill()
        p.wait()


def test_a_silent_host_is_lost_in_seconds_and_registers_again_when_it_wakes(cluster):
    s0, s1 = pw.slice(1), pw.slice(1)
    assert {s0.host, s1.host} == {0, 1}            # least loaded: one slice per host
    assert [(d.host, d.state) for d in pw.devices(island=0)] == [(0, "in_use"),
                                                                 (1, "in_use")]
    assert pw.devices(island=5) == []
    x = pw.put(torch.arange(4.0), s1)
    assert twice(x).torch().tolist() == [0, 2, 4, 6]     # compiled while it answers
    agent = cluster.worker_pid(0, s1.host)
    pids = [agent] + descendants(agent)
    _signal_all(pids, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        y = twice(x)                                 # dispatched to a stopped executor
        good = twice(pw.put(torch.ones(2), s0))
        with pytest.raises(pw.WorkerLostError, match="silent"):
            pw.wait([good, y], timeout=60)           # both slices' waits at once
        with pytest.raises(pw.WorkerLostError, match="silent"):
            pw.wait([y], timeout=60)
        took = time.monotonic() - t0
        assert took < LOST_WITHIN_S + 1.5, took
        assert _states(cluster.address)[(0, s1.host, 0)] == "lost"
        with pytest.raises(pw.WorkerLostError):
            x.torch()
        # the other host is not disturbed
        assert twice(pw.put(torch.ones(2), s0)).torch().tolist() == [2, 2]
    finally:
        _signal_all(pids, signal.SIGCONT)
    # Awake again, the agent finds its stream ended and registers anew (fresh devices).
    _until(lambda: _states(cluster.address)[(0, s1.host, 0)] == "free", 60,
           "the woken host registered again")
    s1.release()
    s2 = pw.slice(1)
    assert s2.host == s1.host
    assert twice(pw.put(torch.ones(3), s2)).torch().tolist() == [2, 2, 2]
    s0.release()
    s2.release()


# ------------------------------------------------------------------ bare coordinators
def _coordinator(*flags) -> tuple:
    p = subprocess.Popen([sys.executable, "-m", "pathways_torch.coordinator", "--port", "0",
                          "--parent-pid", str(os.getpid()), *flags],
                         stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    line = p.stdout.readline().decode()
    assert line.startswith("PATHWAYS_COORDINATOR_PORT="), line
    return p, f"127.0.0.1:{int(line.split('=')[1])}"


def _registered(address: str) -> int:
    stub = pbg.CoordinatorStub(grpc_util.channel(address))
    return stub.ListDevices(pb.ListDevicesRequest(), timeout=10).registered_workers


def test_a_worker_leaves_a_silent_coordinator_for_the_next_and_clients_get_a_deadline(
        tmp_path):
    (a, addr_a), (b, addr_b) = (_coordinator("--heartbeat-s", "0.5", "--lost-after-s", "2"),
                                _coordinator("--max-sessions", "1"))
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    w = subprocess.Popen([sys.executable, "-m", "pathways_torch.worker", "--coordinator",
                          f"{addr_a},{addr_b}", "--devices", "1", "--parent-pid",
                          str(os.getpid())], env=env, stdin=subprocess.DEVNULL,
                         stderr=open(tmp_path / "worker.log", "wb"), start_new_session=True)
    try:
        _until(lambda: _registered(addr_a) == 1, 120, "the worker registered with A")
        os.kill(a.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _until(lambda: _registered(addr_b) == 1, 30, "the worker moved to B")
        assert time.monotonic() - t0 < 2 + 10          # A's read deadline, then B

        # A client of the silent coordinator gets an error, not a hang.
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import pathways_torch as pw
            from pathways_torch.client import runtime
            runtime.OPEN_TIMEOUT_S = 2
            try:
                pw.init(address="{addr_a}")
            except pw.PathwaysError as e:
                print("REFUSED", e)
        """)], capture_output=True, text=True, timeout=120)
        assert "REFUSED" in r.stdout and "no answer within 2 s" in r.stdout, r

        # Past --max-sessions: RESOURCE_EXHAUSTED that names the flag, at once.
        stub = pbg.CoordinatorStub(grpc_util.channel(addr_b))

        def up():
            yield pb.SessionUp(open=pb.OpenSessionRequest(name="t", share=1.0))
            time.sleep(30)

        first = stub.OpenSession(up())
        assert next(first).client_id
        with pytest.raises(grpc.RpcError) as err:
            next(stub.OpenSession(up(), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-sessions" in err.value.details()
        first.cancel()
    finally:
        for p in (w, a, b):
            try:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


# ------------------------------------------------------------------ datagram beats
def _register_by_hand(stub, done):
    """A RegisterWorker stream that sends its registration and then nothing."""
    def up():
        yield pb.WorkerUp(register=pb.RegisterWorkerRequest(
            island=0, host=0, num_devices=1, kind="CPU", address="127.0.0.1:1",
            pid=os.getpid()))
        done.wait(60)
    call = stub.RegisterWorker(up())
    return call, next(call)


def test_datagram_beats_alone_keep_a_host_and_replays_or_forgeries_do_not():
    import socket
    import threading

    from pathways_torch.rpc import beats
    coord, address = _coordinator("--heartbeat-s", "0.5", "--lost-after-s", "2")
    done, call = threading.Event(), None
    try:
        call, first = _register_by_hand(pbg.CoordinatorStub(grpc_util.channel(address)),
                                        done)
        assert first.beat_port and first.beat_id and len(first.beat_key) == 16
        assert 0 <= first.beat_phase_s < 0.5
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.connect(("127.0.0.1", first.beat_port))
        sock.settimeout(2)
        key, bid = first.beat_key, first.beat_id
        sock.send(beats.pack(beats.BEAT, bid, 1, key))
        answer = beats.unpack(sock.recv(64), {bid: key}.get)
        assert answer == (beats.ANSWER, bid, 1)     # answered under the same key
        # The stream says nothing after its registration: datagrams alone keep the host
        # past the 2 s read deadline.
        seq, t0 = 1, time.monotonic()
        while time.monotonic() - t0 < 3.5:
            seq += 1
            sock.send(beats.pack(beats.BEAT, bid, seq, key))
            time.sleep(0.2)
        assert _registered(address) == 1
        # A replay of the last good datagram, forgeries (another key, a damaged MAC, a
        # wrong size) and beats for another id do not: the host is lost on time.
        last = beats.pack(beats.BEAT, bid, seq, key)
        forged = [beats.pack(beats.BEAT, bid, seq + 100, beats.new_key()),
                  last[:-1] + bytes([last[-1] ^ 1]), last + b"x",
                  beats.pack(beats.BEAT, bid + 1, seq + 1, key)]
        t0 = time.monotonic()
        while _registered(address) == 1:
            assert time.monotonic() - t0 < LOST_WITHIN_S, "replays kept the host alive"
            for data in [last] + forged:
                sock.send(data)
            time.sleep(0.1)
        assert time.monotonic() - t0 > 1.0      # the last good beat still counted
    finally:
        done.set()
        if call is not None:
            call.cancel()
        coord.kill()
        coord.wait()


def test_beats_unpack_refuses_what_it_cannot_check():
    from pathways_torch.rpc import beats
    key = beats.new_key()
    good = beats.pack(beats.BEAT, 7, 9, key)
    assert len(good) == beats.SIZE == 32
    assert beats.unpack(good, {7: key}.get) == (beats.BEAT, 7, 9)
    assert beats.unpack(good, {8: key}.get) is None                 # unknown id
    assert beats.unpack(good, {7: beats.new_key()}.get) is None     # another key
    assert beats.unpack(good[:-1], {7: key}.get) is None            # short
    assert beats.unpack(good[:8] + b"\0" + good[9:], {7: key}.get) is None  # damaged
    assert beats.host_of("[::1]:7000") == "::1" and beats.host_of("a.b:1") == "a.b"
    spread = sorted(beats.phase(i, 1.0) for i in range(1, 65))
    assert max(b - a for a, b in zip(spread, spread[1:])) < 3 / 64   # no two bunch up


def test_a_worker_beats_on_its_stream_when_the_coordinator_takes_no_datagrams(tmp_path):
    coord, address = _coordinator("--heartbeat-s", "0.5", "--lost-after-s", "2",
                                  "--no-udp-beats")
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    w = subprocess.Popen([sys.executable, "-m", "pathways_torch.worker", "--coordinator",
                          address, "--devices", "1", "--parent-pid", str(os.getpid())],
                         env=env, stdin=subprocess.DEVNULL,
                         stderr=open(tmp_path / "worker.log", "wb"), start_new_session=True)
    try:
        _until(lambda: _registered(address) == 1, 120, "the worker registered")
        time.sleep(4)                   # twice the read deadline
        assert _registered(address) == 1
    finally:
        for p in (w, coord):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
