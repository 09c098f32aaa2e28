"""Slices that span hosts (issue 14) on a real cluster: a coordinator and four worker
agents (2 islands x 2 hosts x 2 CPU devices), each host's part of a slice a member
executor process on jaxlib with gloo collectives between hosts.

Numbers are checked against plain torch on the CPU: moves of bytes exactly, programs
within 1e-5, training losses within 1e-4 relative (as tests/test_trainer.py).
"""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch

import pathways_torch as pw
from pathways_torch import P
from pathways_torch.client import runtime

pytest.importorskip("jax")

TOL = 1e-5


@pytest.fixture(scope="module")
def cluster():
    pw.init(islands=2, hosts_per_island=2, devices_per_host=2, timeout=120)
    try:
        yield runtime.get_state().cluster
    finally:
        pw.shutdown()


@pytest.fixture(scope="module")
def wide(cluster):
    """A (2, 2) slice over both hosts of island 0: "data" crosses hosts."""
    s = pw.slice((2, 2), axis_names=("data", "model"), island=0)
    yield s
    s.release()


def test_a_slice_bigger_than_a_host_spans_hosts_host_major(wide):
    assert wide.spans_hosts and wide.hosts == (0, 1)
    assert [(d.host, d.index) for d in wide.devices] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    used = {(d.island, d.host) for d in pw.devices() if d.state == "in_use"}
    assert {(0, 0), (0, 1)} <= used
    assert "hosts 0, 1" in repr(wide)
    with pytest.raises(pw.ResourceExhaustedError, match="equal share"):
        pw.slice((3,), island=1)        # 2 + 1 devices: not the same on each host


@pytest.mark.parametrize("spec", [P("data"), P(None, "model"), P(("data", "model")), P(),
                                  P("model", "data")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
def test_each_host_gets_its_shards_and_a_fetch_assembles_them(wide, spec, dtype):
    x = (torch.arange(8 * 4) - 7).reshape(8, 4).to(dtype)
    a = pw.put(x, wide, spec)
    got = a.torch()
    assert got.dtype == dtype and torch.equal(got, x)


def _loss_and_grads(x, w1, w2):
    loss = torch.tanh(x @ w1).matmul(w2).pow(2).mean()
    g1, g2 = torch.autograd.grad(loss, (w1, w2))
    return loss, g1, g2


def test_one_program_over_both_hosts_matches_torch_and_keeps_the_gang_order(wide):
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 32) * 0.3, torch.randn(32, 4) * 0.3
    want = _loss_and_grads(x.clone(), w1.clone().requires_grad_(),
                           w2.clone().requires_grad_())

    @pw.program
    def step(x, w1, w2):
        w1, w2 = w1.requires_grad_(), w2.requires_grad_()
        return _loss_and_grads(x, w1, w2)

    args = (pw.put(x, wide, P("data")), pw.put(w1, wide, P(None, "model")),
            pw.put(w2, wide, P("model")))
    got = step(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.torch(), w.detach(), rtol=TOL, atol=TOL)
    for _ in range(3):
        with pw.graph():
            got = step(*args)
    pw.wait(list(got))
    orders = [m.stats().gang_positions for m in wide._conn.members]
    assert len(orders[0]) >= 3 and orders[0] == orders[1]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 4))


@pytest.mark.parametrize("strategy", [lambda: pw.DataParallel("data"),
                                      lambda: pw.FullyShardedDataParallel("data")],
                         ids=["data_parallel", "fsdp"])
def test_trainer_over_two_hosts_matches_plain_torch(wide, strategy):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(6)]
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    want = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    trainer = pw.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                         torch.nn.functional.cross_entropy, slice=wide,
                         parallelism=strategy())
    got = [float(trainer.step(x, y)) for x, y in data]
    for k, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {k}: pathways {a} torch {b}"


def test_multi_island_over_slices_that_span_hosts_matches_plain_torch(wide):
    other = pw.slice((2, 2), axis_names=("data", "model"), island=1)
    try:
        g = torch.Generator().manual_seed(5)
        data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
                for _ in range(5)]
        ref = _model()
        opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        want = []
        for x, y in data:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ref(x), y)
            loss.backward()
            opt.step()
            want.append(loss.item())
        model = _model()
        tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        torch.nn.functional.cross_entropy,
                        parallelism=pw.MultiIsland([wide, other], axis="data"))
        got = [float(tr.step(x, y)) for x, y in data]
        for k, (a, b) in enumerate(zip(got, want)):
            assert abs(a - b) <= 1e-4 * abs(b), f"step {k}: pathways {a} torch {b}"
    finally:
        other.release()


@pytest.mark.parametrize("spec", [P(), P("data"), P("data", "model"), P("model")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_bulk_puts_and_fetches_go_host_by_host_on_the_data_plane(wide, spec, dtype):
    """A put of 300 KiB or more sends each host its own blocks on its data plane, and a fetch
    pulls each host's shards: equal to the source, and no byte on the control stream."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(512, 600, generator=g) * 50).to(dtype)      # 300 KiB+ even as bool
    members = wide._conn.parts()
    before = [(m.stats().bytes_received, m.stats().bytes_sent) for m in members]
    back = pw.put(x, wide, spec).torch()
    assert back.dtype == dtype and torch.equal(back, x)
    after = [(m.stats().bytes_received, m.stats().bytes_sent) for m in members]
    for (r0, s0), (r1, s1) in zip(before, after):
        assert r1 > r0 and s1 > s0, (spec, before, after)


def _reference_batches(n, batch_size, seed, epoch=0):
    import loader_data
    order = torch.randperm(n, generator=torch.Generator().manual_seed(
        seed * 1_000_003 + epoch)).tolist()
    return list(torch.utils.data.DataLoader(loader_data.Rows(n=n), batch_size=batch_size,
                                            sampler=order))


@pytest.mark.parametrize("axis", ["data", "model", None])
def test_each_host_loads_its_own_rows_of_host_batches(wide, axis):
    """pw.DataLoader over a slice that spans hosts: each host loads the rows its own
    devices hold ("data" crosses hosts: half each; "model" and replicated: all), and
    the Arrays are torch's batches."""
    loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 32}, batch_size=8,
                           slice=wide, spec=P(axis) if axis else None, shuffle=True,
                           seed=6)
    for (x, y), (rx, ry) in zip(loader, _reference_batches(32, 8, 6), strict=True):
        assert x.slice is wide and torch.equal(x.torch(), rx) and torch.equal(y.torch(), ry)


@pytest.mark.parametrize("axis", ["data", None])
def test_a_stream_over_two_hosts_gives_torchs_batches(wide, axis):
    """An IterableDataset over a slice that spans hosts: each host reads the stream and
    keeps its own devices' rows; the Arrays are torch's batches, the short last one
    included."""
    import loader_data
    loader = pw.DataLoader("loader_data:stream", dataset_kwargs={"n": 20}, batch_size=8,
                           slice=wide, spec=P(axis) if axis else None)
    ref = list(torch.utils.data.DataLoader(loader_data.Stream(n=20), batch_size=8))
    for (x, y), (rx, ry) in zip(loader, ref, strict=True):
        assert torch.equal(x.torch(), rx) and torch.equal(y.torch(), ry)


def test_training_on_host_batches_over_two_hosts_matches_torch(cluster, wide):
    other = pw.slice((2, 2), axis_names=("data", "model"), island=1)
    try:
        model, ref = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        ref.load_state_dict(model.state_dict())
        want = []
        opt = torch.optim.SGD(ref.parameters(), lr=1e-3, momentum=0.9)
        for x, y in _reference_batches(32, 8, 2):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ref(x), y)
            loss.backward()
            opt.step()
            want.append(loss.item())
        tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
                        torch.nn.functional.mse_loss,
                        parallelism=pw.MultiIsland([wide, other], axis="data"))
        loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 32}, batch_size=8,
                               slice=tr, shuffle=True, seed=2)
        got = [float(tr.step(x, y)) for x, y in loader]
        assert len(got) == 4
        for k, (a, b) in enumerate(zip(got, want)):
            assert abs(a - b) <= 1e-5 * abs(b), f"step {k}: pathways {a} torch {b}"
    finally:
        other.release()


def test_colocated_runs_on_each_host_with_its_own_rows(wide):
    x = torch.arange(48.0).reshape(8, 6)
    a, b = pw.put(x, wide, P("data")), pw.put(torch.ones(3, 2), wide)
    per_host = pw.colocated("loader_data:row_stats")(a, b)
    assert [h["rows"] for h in per_host] == [4, 4]          # "data" crosses the hosts
    assert [h["first"] for h in per_host] == [0.0, 24.0]
    assert sum(h["sum"] for h in per_host) == float(x.sum())
    assert per_host[0]["y_shape"] == [3, 2]                  # replicated: all of it


def test_colocated_tensors_from_each_host_make_one_array(wide):
    """Each host returns its region of each output; the regions are one Array, which
    programs and moves take like any other, and equal what torch gives on the whole."""
    x = torch.arange(48.0).reshape(8, 6)
    a = pw.put(x, wide, P("data", "model"))
    fn = pw.colocated("loader_data:scaled_rows", out_specs=[P("data"), P("data")])
    per_host = fn(a, by=3.0)
    assert [h["rows"] for h in per_host] == [4, 4]
    scaled, first = per_host[0]["scaled"], per_host[0]["first"]
    assert per_host[1]["scaled"] is scaled and scaled.slice is wide
    assert scaled.shape == (8, 6) and scaled.sharding == P("data")
    assert torch.equal(scaled.torch(), x * 3.0)
    assert torch.equal(first.torch(), x[[0, 4]])           # each host's first row

    @pw.program
    def total(t):
        return (t * 2).sum(0)

    assert torch.allclose(total(scaled).torch(), (x * 6.0).sum(0), rtol=TOL)
    small = pw.slice((2,), axis_names=("d",), island=1)
    try:
        assert torch.equal(scaled.to(small, P("d")).torch(), x * 3.0)
    finally:
        small.release()
    # Replicated (the default): every host returns all of it, the same.
    y = torch.randn(3, 2)
    rep = pw.colocated("loader_data:scaled_rows")(pw.put(y, wide))
    assert rep[0]["scaled"].sharding == P() and torch.equal(rep[0]["scaled"].torch(), y * 2)
    assert torch.equal(rep[1]["first"].torch(), y[:1])


def test_colocated_tensors_that_cannot_be_one_array_raise_and_leak_nothing(wide):
    x = torch.arange(48.0).reshape(8, 6)
    a = pw.put(x, wide, P("data"))
    holes = pw.put(x, wide, P(("model", "data")))

    def buffers():
        wide._conn.barrier()                             # releases processed
        return [m.stats().num_buffers for m in wide._conn.members]

    before = buffers()
    # Replicated (the default) but each host's rows differ: the copies would disagree.
    with pytest.raises(pw.ColocatedError, match="same region of tensor 0.*different"):
        pw.colocated("loader_data:scaled_rows")(a)
    with pytest.raises(pw.ColocatedError, match="different numbers of tensors"):
        pw.colocated("loader_data:tensors_on_host_0")(a)
    # 4 rows per host cannot be split 4 ways within the host and 8 across: not a box.
    with pytest.raises(pw.ColocatedError, match="not one box"):
        pw.colocated("loader_data:scaled_rows", out_specs=[P(("model", "data"))])(a)
    # The same for an input: a host would see its rows with holes between them.
    with pytest.raises(pw.ColocatedError, match="input buffer .* not one box"):
        pw.colocated("loader_data:row_stats")(holes)
    assert buffers() == before                          # no host kept its region
    assert torch.equal(a.torch(), x)                    # the slice stays usable


@pytest.mark.parametrize("there,back", [(P("d"), P(None, "model")), (P(), P("data")),
                                        (P(None, "d"), P(("data", "model")))])
def test_moves_to_and_from_a_one_host_slice_reshard_host_to_host(wide, there, back):
    small = pw.slice((2,), axis_names=("d",), island=1)
    try:
        x = torch.randn(8, 4)
        a = pw.put(x, wide, P("data", "model"))
        b = a.to(small, there)
        assert not b.slice.spans_hosts and torch.equal(b.torch(), x)
        c = b.to(wide, back)
        assert torch.equal(c.torch(), x)
        with pw.graph():                 # recorded like any move
            d = c.to(small, there)
        assert torch.equal(d.torch(), x)
    finally:
        small.release()
    # its pooled pull connections went with it (a later executor may take its port)
    from pathways_torch.client.connection import _ClientPlane
    assert small.data_address and not _ClientPlane.get()._idle_pulls.get(small.data_address)


def test_programs_mix_slices_and_reshard_in_place(wide):
    """A program on the spanning slice takes an Array of a one-host slice (moved there
    first), and a spanning Array reshards on its own slice (a resharding program)."""
    small = pw.slice((2,), axis_names=("d",), island=1)
    try:
        x, y = torch.randn(8, 4), torch.randn(8, 4)

        @pw.program
        def add(a, b):
            return a + b

        a = pw.put(x, wide, P("data"))
        b = pw.put(y, small, P("d"))
        c = add(a, b)
        assert c.slice is wide and torch.equal(c.torch(), x + y)
        d = c.to(wide, P(None, "model"))
        assert d.sharding == P(None, "model") and torch.equal(d.torch(), x + y)
        torch.testing.assert_close(add(b, d.to(small)).torch(), y + (x + y), rtol=0,
                                   atol=0)
    finally:
        small.release()


def test_moves_between_two_slices_that_span_hosts(wide):
    other = pw.slice((2, 2), axis_names=("data", "model"), island=1)
    try:
        x = torch.arange(32.).reshape(8, 4)
        a = pw.put(x, wide, P("data", "model"))

        @pw.program
        def double(v):
            return v * 2

        b = double(a.to(other, P("model", "data")))
        assert torch.equal(b.torch(), x * 2)
        assert torch.equal(b.to(wide, P()).torch(), x * 2)
    finally:
        other.release()


@pytest.mark.parametrize("spec", [P("data", "model"), P(), P(None, ("data", "model"))])
def test_checkpoint_of_a_slice_that_spans_hosts_is_plain_dcp(wide, tmp_path, spec):
    import torch.distributed.checkpoint as dcp
    from pathways_torch.client.checkpoint import load_arrays, save_arrays
    x = torch.randn(8, 4)
    y = torch.arange(6, dtype=torch.int64)
    arrays = {"x": pw.put(x, wide, spec), "y": pw.put(y, wide)}
    written = save_arrays(str(tmp_path), arrays)
    assert written == x.numel() * 4 + y.numel() * 8      # each block once
    plain = {"x": torch.zeros(8, 4), "y": torch.zeros(6, dtype=torch.int64)}
    dcp.load(plain, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(plain["x"], x) and torch.equal(plain["y"], y)
    back = load_arrays(str(tmp_path), {"x": (wide, x.shape, x.dtype, P("model")),
                                       "y": (wide, y.shape, y.dtype, P())})
    assert torch.equal(back["x"].torch(), x) and torch.equal(back["y"].torch(), y)


def test_fit_resumes_on_a_replacement_host_with_plain_torch_losses(cluster, tmp_path):
    """A host of a 2-host slice dies mid-fit; the cluster restarts it, the Trainer
    rebuilds the slice over both hosts again, reloads the last checkpoint (written by
    both hosts) and ends with plain torch's losses."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(8)]
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    model = _model()
    s = pw.slice((2, 2), axis_names=("data", "model"), island=1)
    trainer = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         torch.nn.functional.cross_entropy, slice=s,
                         parallelism=pw.DataParallel("data"))
    killed = []

    def on_step(i, loss):
        if i == 4 and not killed:
            killed.append(cluster.worker_pid(1, 1))
            os.kill(killed[0], signal.SIGKILL)

    got = trainer.fit(data, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2,
                      max_restarts=1, on_step=on_step)
    assert len(trainer.restarts) == 1 and trainer.slices[0].spans_hosts
    for k, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {k}: pathways {a} torch {b}"
    trainer.slices[0].release()


def test_a_dead_host_fails_the_slice_on_every_member_and_others_go_on(cluster, wide):
    """Last in the module: it kills island 1's host 1 (the cluster restarts it)."""
    lost = pw.slice((2, 2), axis_names=("data", "model"), island=1)
    x = pw.put(torch.ones(4, 4), lost, P("data"))

    @pw.program
    def total(x):
        return x.sum() * 1.0

    assert float(total(x)) == 16.0
    os.kill(cluster.worker_pid(1, 1), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(pw.WorkerLostError):
        for _ in range(200):            # until the loss is known
            total(x).wait()
            time.sleep(0.05)
    assert time.monotonic() - t0 < 5.0
    for m in lost._conn.members:        # every member's stream says so
        with pytest.raises(pw.WorkerLostError):
            m._check()
    with pytest.raises(pw.WorkerLostError):
        total(x).torch()
    y = pw.put(torch.ones(4, 4), wide, P("data"))
    assert float(total(y)) == 16.0      # the other slice that spans hosts goes on
