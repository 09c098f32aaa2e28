"""Bulk data and input pipelines on a real two-island cluster: puts, fetches and island
transfers on the data plane (through /dev/shm, the socket, and the control stream),
``pw.DataLoader`` batches built on the hosts (checked against torch's DataLoader and
against plain torch training), and ``pw.colocated`` functions.

The hosts import ``tests/loader_data.py`` by name: the embedded cluster gives its
workers the client's import path.
"""

import os
import time

import pytest
import torch

import pathways_torch as pw
from pathways_torch import P
from pathways_torch.client import connection

import loader_data

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]


@pytest.fixture(scope="module")
def islands():
    pw.init(islands=2, devices_per_host=4, timeout=120)
    try:
        yield [pw.slice((2, 2), axis_names=("data", "model"), island=i) for i in range(2)]
    finally:
        pw.shutdown()


@pytest.fixture(params=["shm", "socket", "stream"])
def path(request, monkeypatch):
    """Which way bulk bytes go: the data plane through /dev/shm or its socket, or the
    control stream (the data plane off)."""
    monkeypatch.setenv("PATHWAYS_SHM", "0" if request.param == "socket" else "1")
    least = 1 << 62 if request.param == "stream" else 1024
    monkeypatch.setattr(connection, "PUT_MIN_BYTES", least)
    monkeypatch.setattr(connection, "FETCH_MIN_BYTES", least)
    return request.param


def sample(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g,
                         dtype=torch.int64).to(dtype)


# ---------------------------------------------------------------- puts, fetches, moves
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_put_and_fetch_every_dtype_and_spec(islands, path, dtype):
    s = islands[0]
    x = sample(dtype, (32, 12, 5))
    for spec in (P(), P("data"), P(None, "model"), P("data", "model"), P(("data", "model"))):
        back = pw.put(x, s, spec).torch()
        assert back.dtype == dtype and back.shape == x.shape
        assert torch.equal(back, x), (path, spec)


def test_put_and_fetch_empty_non_contiguous_and_scalars(islands, path):
    s = islands[0]
    stats = s.stats()
    before, sent = stats.bytes_received, stats.bytes_sent
    base = torch.randn(64, 48)
    z = torch.randn(64, 48, dtype=torch.complex64)
    for x in (base.t(), base[::2, 1::3], base[:, :0], torch.zeros(0, 5),
              torch.tensor(3.5), base.expand(2, 64, 48), torch.randn(3, 4, requires_grad=True),
              z.conj(), z.conj().t(), torch._neg_view(base)):
        a = pw.put(x, s)        # lazy conjugate and negative views put their values
        back = a.torch()
        assert back.shape == x.shape and torch.equal(back, x.detach().resolve_conj()
                                                     .resolve_neg())
        assert back.is_contiguous()
    # the caller may change its tensor once put returns: the put took its bytes
    x = torch.randn(256, 256)
    keep = x.clone()
    a = pw.put(x, s, P("data"))
    x.fill_(0)
    assert torch.equal(a.torch(), keep)
    # the bytes went by the data plane, or (stream) not, both ways
    stats = s.stats()
    got, back = stats.bytes_received - before, stats.bytes_sent - sent
    if path == "stream":
        assert got == back == 0
    else:
        assert got >= keep.numel() * 4 and back >= keep.numel() * 4, (path, got, back)


def test_fetched_tensors_are_the_callers(islands, path):
    """A fetch gives a fresh tensor that owns its bytes: writing it changes nothing on
    the slice (the /dev/shm path maps the file copy-on-write)."""
    s = islands[0]
    x = torch.randn(300, 300)
    a = pw.put(x, s)
    b = a.torch()
    b.mul_(0)
    assert torch.equal(a.torch(), x)


def test_program_outputs_fetch_on_every_path(islands, path):
    s = islands[0]
    f = pw.program(lambda t: (t * 2 + 1).sum(-1))
    x = torch.randn(64, 128, dtype=torch.float64)
    for spec in (P(), P("data")):
        out = f(pw.put(x, s, spec))
        assert torch.allclose(out.torch(), (x * 2 + 1).sum(-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_island_transfers_with_resharding(islands, dtype):
    a, b = islands
    x = sample(dtype, (32, 20))
    for src, dst in ((P(), P("data")), (P("data"), P(None, "model")),
                     (P("data", "model"), P())):
        moved = pw.put(x, a, src).to(b, dst)
        assert moved.slice is b and moved.sharding == dst.normalized(2)
        assert torch.equal(moved.torch(), x)
    assert torch.equal(pw.put(x[:, :0], a).to(b).torch(), x[:, :0])


# ---------------------------------------------------------------- pw.DataLoader
def reference(n, batch_size, seed, epoch, shuffle=True, drop_last=False, **kw):
    """torch's own DataLoader over the same dataset in the documented order: a
    randperm seeded with seed * 1_000_003 + epoch."""
    ds = loader_data.Rows(n=n, **kw)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(
        seed * 1_000_003 + epoch)).tolist() if shuffle else list(range(n))
    return list(torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=order,
                                            drop_last=drop_last))


def test_batches_equal_torch_dataloader_and_cover_each_epoch(islands):
    s = islands[0]
    loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 36}, batch_size=8,
                           slice=s, spec=P("data"), shuffle=True, seed=4)
    assert len(loader) == 5 and loader.dataset_length == 36   # the last batch has 4
    epochs = []
    for epoch in range(2):
        ref = reference(36, 8, seed=4, epoch=epoch)
        seen = []
        for (x, y), (rx, ry) in zip(loader, ref, strict=True):
            assert isinstance(x, pw.Array) and x.slice is s and x.sharding == P("data")
            assert torch.equal(x.torch(), rx) and torch.equal(y.torch(), ry)
            seen += x.torch()[:, 0].long().tolist()
        assert sorted(seen) == list(range(36))      # every index once
        epochs.append(seen)
    assert epochs[0] != epochs[1]                   # each epoch has its own order
    assert loader.state_dict()["epoch"] == 2


def test_islands_load_their_halves(islands):
    """A MultiIsland trainer's loader: each island's host loads half of each batch,
    and together they are torch's batch; over an epoch every index comes once."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    trainer = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         torch.nn.functional.mse_loss, slice=islands,
                         parallelism=pw.MultiIsland(islands, "data"))
    loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 32}, batch_size=8,
                           slice=trainer, shuffle=True, seed=1)
    seen = []
    for (x, y), (rx, ry) in zip(loader, reference(32, 8, seed=1, epoch=0), strict=True):
        assert [p.slice for p in x.parts] == islands and len(y.parts) == 2
        assert torch.equal(torch.cat([p.torch() for p in x.parts]), rx)
        assert torch.equal(torch.cat([p.torch() for p in y.parts]), ry)
        seen += [int(v) for p in x.parts for v in p.torch()[:, 0]]
    assert sorted(seen) == list(range(32))


def torch_losses(model, opt, batches, loss_fn=torch.nn.functional.mse_loss):
    out = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        out.append(float(loss))
    return out


def make(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


@pytest.mark.parametrize("dataset", ["rows", "stream"])
@pytest.mark.parametrize("strategy", ["dp", "fsdp", "islands", "pipeline"])
def test_training_on_host_batches_matches_torch(islands, strategy, dataset):
    """Trainers fed by pw.DataLoader give plain torch's losses on the same batches
    (tolerance 1e-5: the same float32 math, reduced in another order), from a shuffled
    map-style dataset and from a stream (read whole by every loading host: both
    islands, or a pipeline's first and last stages)."""
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if strategy == "dp":
        kw = dict(slice=islands[0], parallelism=pw.DataParallel("data"))
    elif strategy == "fsdp":
        kw = dict(slice=islands[0], parallelism=pw.FullyShardedDataParallel("data"))
    elif strategy == "islands":
        kw = dict(parallelism=pw.MultiIsland(islands, "data"))
    else:
        kw = dict(parallelism=pw.Pipeline(2, 2, islands, axis="data"))
    trainer = pw.Trainer(model, opt, torch.nn.functional.mse_loss, **kw)
    if dataset == "stream":
        loader = pw.DataLoader("loader_data:stream", dataset_kwargs={"n": 48},
                               batch_size=16, slice=trainer)
        batches = list(torch.utils.data.DataLoader(loader_data.Stream(n=48),
                                                   batch_size=16))
    else:
        loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 48},
                               batch_size=16, slice=trainer, shuffle=True, seed=2)
        batches = reference(48, 16, seed=2, epoch=0)
    got = []
    for x, y in loader:
        if strategy == "pipeline":          # each stage's micro-batches split over "data"
            assert {p.sharding for p in x.parts + y.parts} == {P("data")}
        got.append(float(trainer.step(x, y)))
    want = torch_losses(ref, torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9),
                        batches)
    assert len(got) == 3
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)


def test_state_dict_resumes_with_the_same_batches(islands):
    s = islands[1]

    def make_loader(seed=7):
        return pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 40}, batch_size=8,
                             slice=s, spec=P("data"), shuffle=True, seed=seed,
                             num_workers=1)
    loader = make_loader()
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    after = [x.torch() for x, _ in it]             # batches 2, 3, 4
    again = make_loader()
    again.load_state_dict(state)
    resumed = [x.torch() for x, _ in again]
    assert len(resumed) == 3 and all(torch.equal(a, b) for a, b in zip(after, resumed))
    with pytest.raises(ValueError, match="seed"):
        make_loader(seed=8).load_state_dict(state)


def test_dict_batches_and_drop_last(islands):
    s = islands[0]
    loader = pw.DataLoader("loader_data:dict_rows", dataset_kwargs={"n": 21},
                           batch_size=4, slice=s, spec=P("data"), drop_last=True)
    batches = list(loader)
    assert len(batches) == 5 and set(batches[0]) == {"x", "y"}
    assert torch.equal(batches[-1]["x"].torch(), loader_data.Rows(n=21).x[16:20])
    # the batch size divides: the dataset's length is what leaves a bad last batch
    with pytest.raises(pw.ShardingError, match=r"21 samples leave 1 after the full "
                                               r"batches of 4; pass drop_last=True"):
        pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 21}, batch_size=4,
                      slice=s, spec=P("data"))
    with pytest.raises(pw.ShardingError, match="use a batch_size divisible by 2"):
        pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 21}, batch_size=3,
                      slice=s, spec=P("data"))


def test_dataset_errors_are_typed_and_the_cluster_stays_usable(islands):
    s = islands[0]
    loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 16, "bad": 5},
                           batch_size=8, slice=s, spec=P("data"))
    first, second = list(loader)
    with pytest.raises(pw.DataLoaderError, match=r"index 5 .*batch 0 of epoch 0.*corrupt") \
            as e:
        first[0].torch()
    assert e.value.host == "island 0 host 0" and isinstance(e.value, pw.ProgramError)
    assert torch.equal(second[0].torch(), loader_data.Rows(n=16).x[8:])   # goes on
    with pytest.raises(pw.DataLoaderError, match="no such split: dev"):
        pw.DataLoader("loader_data:broken_factory", dataset_kwargs={"split": "dev"},
                      batch_size=8, slice=s)
    with pytest.raises(pw.DataLoaderError, match="cannot be imported"):
        pw.DataLoader("loader_data_nope:rows", batch_size=8, slice=s)
    with pytest.raises(pw.DataLoaderError, match="must be a tensor"):
        pw.DataLoader("loader_data:with_strings", batch_size=8, slice=s)
    with pytest.raises(TypeError, match="pickled"):
        pw.DataLoader(loader_data.rows, batch_size=8, slice=s)
    assert torch.equal(pw.put(torch.ones(3), s).torch(), torch.ones(3))


def test_a_bad_first_sample_fails_its_batch_not_the_loader(islands):
    """torch's DataLoader reads nothing until it is iterated, so a corrupt sample 0
    fails batch 0 and the next batches load. The loader learns its batches' shapes
    from the first samples, and a bad sample 0 used to refuse the whole loader; it now
    describes the batches from the first two samples that load."""
    s = islands[0]
    loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 16, "bad": 0},
                           batch_size=8, slice=s, spec=P("data"))
    first, second = list(loader)
    with pytest.raises(pw.DataLoaderError, match=r"index 0 .*batch 0 of epoch 0.*corrupt"):
        first[0].torch()
    assert torch.equal(second[0].torch(), loader_data.Rows(n=16).x[8:])
    with pytest.raises(pw.DataLoaderError, match=r"index 0 .*corrupt"):   # nothing loads
        pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 1, "bad": 0},
                      batch_size=1, slice=s)


@pytest.mark.parametrize("strategy", ["dp", "pipeline"])
def test_a_step_on_a_batch_that_failed_to_load_leaves_the_trainer_as_it_was(islands,
                                                                            strategy):
    """A loop that catches the DataLoaderError of a batch whose sample raised and goes
    on trains as torch's loop that skips that batch: the step that took it leaves the
    weights and the optimizer's state as they were, and its loss says why. The failed
    batch used to fail every buffer the step updated, so every later step and every
    read of the module raised it again, and the training was lost."""
    import copy
    s = islands[0]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    make_opt = lambda m: torch.optim.Adam(m.parameters(), lr=0.05)
    if strategy == "pipeline":          # a stage on each island
        tr = pw.Trainer(model, make_opt(model), torch.nn.functional.mse_loss,
                        parallelism=pw.Pipeline(2, 2, islands))
    else:
        tr = pw.Trainer(model, make_opt(model), torch.nn.functional.mse_loss, slice=s,
                        parallelism=pw.DataParallel("data"))
    try:
        loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 32, "bad": 13},
                               batch_size=4, slice=tr)
        data, ref_opt = loader_data.Rows(n=32), make_opt(ref)
        got, want, failed = [], [], []
        for i, (x, y) in enumerate(loader):
            try:
                got.append(float(tr.step(x, y)))
            except pw.DataLoaderError as e:
                failed.append((i, str(e)))
                continue
            ref_opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ref(data.x[4 * i:4 * i + 4]),
                                                data.y[4 * i:4 * i + 4])
            loss.backward()
            ref_opt.step()
            want.append(loss.item())
        assert [i for i, _ in failed] == [3] and "index 13" in failed[0][1]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=n: f"{n}: {m}")
    finally:
        del tr


def test_a_failed_batch_is_said_by_a_later_step_when_its_loss_is_never_read(islands):
    """A loop that never reads its losses (it logs every hundred steps) skipped a batch
    whose sample raised without a word; torch's loop would have stopped there. A later
    ``trainer.step`` raises the loader's error once (after dispatching its own step, so
    a loop that catches it loses no other batch), and the training equals torch's
    skipping that batch."""
    import copy
    s = islands[0]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                    torch.nn.functional.mse_loss, slice=s,
                    parallelism=pw.DataParallel("data"))
    try:
        loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 32, "bad": 13},
                               batch_size=4, slice=tr)
        raised = []
        for i, (x, y) in enumerate(loader):
            try:
                tr.step(x, y)
            except pw.DataLoaderError as e:
                raised.append((i, str(e)))
            time.sleep(0.05)               # (the failure is known a moment later)
        try:
            tr.step(*next(iter(loader)))   # one more: the last batches are known now
        except pw.DataLoaderError as e:
            raised.append((8, str(e)))
        assert len(raised) == 1 and raised[0][0] > 3, raised
        assert "index 13" in raised[0][1] and "call 4, skipped" in raised[0][1]
        data, ref_opt = loader_data.Rows(n=32), torch.optim.SGD(ref.parameters(), lr=0.05)
        for i in [0, 1, 2, 4, 5, 6, 7, 0]:
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref(data.x[4 * i:4 * i + 4]),
                                         data.y[4 * i:4 * i + 4]).backward()
            ref_opt.step()
        tr.sync_to()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=n: f"{n}: {m}")
    finally:
        del tr


def test_a_program_that_cannot_run_leaves_the_inputs_it_updates_in_place(islands):
    """An in-place update whose program did not run (an input failed) leaves its
    tensor as it was, as in torch, where the exception comes before the update; the
    program's outputs carry the failure."""
    s = islands[0]

    @pw.program
    def accumulate(total, x):
        total.add_(x.sum(0))
        return x.mean()

    total = pw.put(torch.ones(8), s)
    loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 8, "bad": 5},
                           batch_size=4, slice=s)
    good, bad = [x for x, _ in loader]
    mean = accumulate(total, bad)
    with pytest.raises(pw.DataLoaderError, match="index 5"):
        mean.torch()
    assert torch.equal(total.torch(), torch.ones(8))
    accumulate(total, good)
    assert torch.equal(total.torch(), 1 + loader_data.Rows(n=8).x[:4].sum(0))


# ---------------------------------------------------------------- streams
def stream_reference(n, batch_size, num_workers=0, drop_last=False):
    """torch's own DataLoader over the same IterableDataset."""
    return list(torch.utils.data.DataLoader(loader_data.Stream(n=n), batch_size=batch_size,
                                            num_workers=num_workers, drop_last=drop_last))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stream_gives_torchs_batches_and_ends_each_epoch_where_it_ends(islands,
                                                                         num_workers):
    """An IterableDataset: exactly torch's DataLoader batches (with 2 workers, torch
    interleaves the workers' batches), an epoch that ends with the stream, no len()."""
    s = islands[0]
    loader = pw.DataLoader("loader_data:stream", dataset_kwargs={"n": 20}, batch_size=8,
                           slice=s, spec=P("data"), num_workers=num_workers)
    assert loader.is_stream and loader.dataset_length is None
    assert "a stream, at epoch 0 batch 0" in repr(loader)
    with pytest.raises(TypeError, match="no length"):
        len(loader)
    ref = stream_reference(20, 8, num_workers)
    assert [len(x) for x, _ in ref] == ([8, 8, 4] if num_workers == 0 else [8, 8, 2, 2])
    for epoch in range(2):
        got = list(loader)
        assert len(got) == len(ref) and loader.epoch == epoch + 1
        for (x, y), (rx, ry) in zip(got, ref):
            assert x.sharding == P("data") and x.shape == rx.shape
            assert torch.equal(x.torch(), rx) and torch.equal(y.torch(), ry)


def test_a_streams_host_pushes_what_it_made_so_the_client_rarely_asks(islands,
                                                                     monkeypatch):
    """The asked host pushes each batch its loader made on the slice's stream; the
    client asks (a PeekLoader RPC) only where it has nothing to wait for: the first
    batch, and after a jump (load_state_dict). Over 2 epochs of 12 batches and their
    ends (26 positions) it asks at most a few times, not once a batch."""
    from pathways_torch.client import loader as client_loader
    asked = []
    peek = client_loader.DataLoader._peek
    monkeypatch.setattr(client_loader.DataLoader, "_peek",
                        lambda self, e, i, jump: asked.append((e, i)) or peek(self, e, i,
                                                                               jump))
    loader = pw.DataLoader("loader_data:stream", dataset_kwargs={"n": 96}, batch_size=8,
                           slice=islands[0], spec=P("data"))
    ref = stream_reference(96, 8)
    for epoch in range(2):
        got = [x.torch() for x, _ in loader]
        assert len(got) == 12 and all(torch.equal(a, r) for a, (r, _) in zip(got, ref))
    assert asked[0] == (0, 0) and len(asked) <= 4, asked
    state = loader.state_dict()
    state["index"] = 5                              # a jump: asked again, then pushed
    loader.load_state_dict(state)
    asked.clear()
    rest = [x.torch() for x, _ in loader]
    assert len(rest) == 7 and torch.equal(rest[0], ref[5][0])
    assert asked[0] == (2, 5) and len(asked) <= 3, asked


def test_a_stream_over_islands_drop_last_and_sizes(islands):
    """Each island's host reads the stream and keeps its half of each batch; a sized
    stream has a len(); drop_last drops the short batch; a short batch that does not
    cut over the devices is refused when it comes, with what to do."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    trainer = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         torch.nn.functional.mse_loss,
                         parallelism=pw.MultiIsland(islands, "data"))
    loader = pw.DataLoader("loader_data:sized_stream", dataset_kwargs={"n": 36},
                           batch_size=8, slice=trainer, drop_last=True)
    assert len(loader) == 4 and loader.dataset_length == 36
    got = list(loader)
    ref = stream_reference(36, 8, drop_last=True)
    assert len(got) == 4
    for (x, y), (rx, ry) in zip(got, ref):
        assert torch.equal(torch.cat([p.torch() for p in x.parts]), rx)
        assert torch.equal(torch.cat([p.torch() for p in y.parts]), ry)
    short = pw.DataLoader("loader_data:stream", dataset_kwargs={"n": 17}, batch_size=8,
                          slice=islands[0], spec=P("data"))
    it = iter(short)
    next(it), next(it)
    with pytest.raises(pw.ShardingError, match="last batch of 1 .*drop_last=True"):
        next(it)                                    # 1 row over 2 "data" devices


def test_a_stream_refuses_shuffle_and_its_errors_are_typed(islands):
    s = islands[0]
    with pytest.raises(pw.DataLoaderError, match="IterableDataset.*shuffle"):
        pw.DataLoader("loader_data:stream", batch_size=4, slice=s, shuffle=True)
    loader = pw.DataLoader("loader_data:stream", dataset_kwargs={"n": 16, "bad": 9},
                           batch_size=4, slice=s, spec=P("data"))
    batches = list(loader)      # 0-3, 4-7, then the batch where the stream raised
    assert len(batches) == 3
    assert torch.equal(batches[1][0].torch(), loader_data.Rows(n=16).x[4:8])
    with pytest.raises(pw.DataLoaderError, match="record 9 of the stream is unreadable"):
        batches[2][0].torch()
    assert len(list(loader)) == 3                   # the next epoch reads it again


def test_fit_over_a_stream_matches_torch_and_resumes_with_the_same_batches(islands,
                                                                         tmp_path):
    """fit(loader) over a stream gives plain torch's losses: to the stream's end, or on
    into the next epochs with steps=; resume=True in a fresh process (a new trainer
    and loader) goes on from the checkpoint with the same batches (tolerance 1e-5)."""
    def trainer_and_loader(model):
        tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                        torch.nn.functional.mse_loss, slice=islands[0],
                        parallelism=pw.DataParallel("data"))
        return tr, pw.DataLoader("loader_data:stream", dataset_kwargs={"n": 48},
                                 batch_size=8, slice=tr)

    def close(got, want):
        assert len(got) == len(want) and max(
            abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)

    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    want = torch_losses(ref, ref_opt, stream_reference(48, 8))          # 6 steps
    trainer, loader = trainer_and_loader(model)
    close(trainer.fit(loader, steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                      progress=False), want[:4])
    again, again_loader = trainer_and_loader(make(seed=3))
    resumed = again.fit(again_loader, checkpoint_dir=str(tmp_path), resume=True,
                        progress=False)
    assert resumed.resumed_from == 4
    close(resumed, want[4:])                        # the rest of the epoch: 2 steps
    close(trainer.fit(loader, progress=False), want[4:])
    # steps= goes on into the next epochs: epoch 1's 6 batches, then 2 of epoch 2
    more = torch_losses(ref, ref_opt, stream_reference(48, 8) + stream_reference(48, 8)[:2])
    close(trainer.fit(loader, steps=8, progress=False), more)


# ---------------------------------------------------------------- pw.colocated
def test_colocated_runs_on_the_host_and_returns_arrays_and_values(islands):
    s = islands[1]
    x, y = torch.randn(8, 6), torch.arange(4.0)
    out = pw.colocated("loader_data:summarize")(pw.put(x, s, P("data")), pw.put(y, s),
                                                scale=2.0)
    assert out["sum"] == pytest.approx(float(x.double().sum()) * 2, rel=1e-12)
    assert isinstance(out["doubled"], pw.Array) and out["doubled"].slice is s
    assert torch.equal(out["doubled"].torch(), x * 2)
    assert torch.equal(out["pair"][0].torch(), y + 1) and out["pair"][1] == "label"
    with pytest.raises(pw.ColocatedError, match="bad value") as e:
        pw.colocated("loader_data:boom")(pw.put(x, s))
    assert e.value.host == "island 1 host 0"
    with pytest.raises(TypeError, match="pickled"):
        pw.colocated(loader_data.boom)
    assert torch.equal(pw.put(y, s).torch(), y)


def test_a_colocated_timeout_raises_at_its_time_and_leaves_no_buffers(islands):
    """``timeout=1`` on a function that takes 4 s: a TimeoutError that says the function
    goes on, after about 1 s (before: 6 s, the RPC's deadline was timeout + 5), and the
    outputs the function makes after the client gave up are not kept on the host."""
    s = islands[1]
    x = pw.put(torch.ones(4), s)
    before = s.stats().num_buffers
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 1 s .* outputs are "
                       "dropped. Pass a larger timeout="):
        pw.colocated("loader_data:slow_double", timeout=1)(x, secs=4.0)
    assert time.monotonic() - t0 < 3.5          # (generous: the function takes 4 s)
    time.sleep(4.0)                              # until the function has returned
    assert s.stats().num_buffers == before
    assert torch.equal(pw.colocated("loader_data:slow_double")(x, secs=0.0).torch(),
                       torch.full((4,), 2.0))


def test_host_workers_come_from_a_fork_server_and_outlive_epochs(islands):
    """A host's DataLoader workers are not forks of the executor (its gRPC threads make
    such a fork hang or garble descriptors): a fork server, started by the executor,
    makes them. Each builds the dataset from its factory, so a dataset class made
    inside the factory and a lambda collate work, and they persist between epochs.
    The batches are torch's, epoch after epoch."""
    from procs import parent
    s = islands[0]
    executor = s.stats().pid
    loader = pw.DataLoader("loader_data:pid_rows", dataset_kwargs={"n": 32}, batch_size=8,
                           slice=s, spec=P("data"), shuffle=True, seed=4, num_workers=2,
                           collate_fn="loader_data:lambda_collate")
    pids = []
    for epoch in range(2):
        got = [(x.torch(), y.torch(), pid.torch()) for x, y, pid in loader]
        want = reference(32, 8, seed=4, epoch=epoch)
        assert len(got) == len(want) == 4
        for (x, y, _), (wx, wy) in zip(got, want):
            assert torch.equal(x, wx) and torch.equal(y, wy)
        pids.append({int(p) for _, _, pid in got for p in pid})
    assert pids[0] == pids[1] and len(pids[0]) == 2, pids     # the same two workers
    assert executor not in pids[0]
    servers = {parent(p) for p in pids[0]}
    assert len(servers) == 1 and executor not in servers
    server = servers.pop()
    assert parent(server) == executor
    with open(f"/proc/{server}/cmdline", "rb") as f:
        assert b"multiprocessing.forkserver" in f.read()
    with open(f"/proc/{executor}/environ", "rb") as f:       # gRPC's at-fork hooks off
        assert b"GRPC_ENABLE_FORK_SUPPORT=false" in f.read().split(b"\0")
    loader.close()


def test_a_stream_over_host_workers_gives_torchs_batches_each_epoch(islands):
    """An IterableDataset split over 2 host workers (as torch's docs show) gives the
    batches torch's DataLoader with 2 workers gives, in its order, in each epoch."""
    loader = pw.DataLoader("loader_data:stream", dataset_kwargs={"n": 40}, batch_size=8,
                           slice=islands[0], spec=P("data"), num_workers=2)
    want = [x for x, _ in torch.utils.data.DataLoader(
        loader_data.Stream(n=40), batch_size=8, num_workers=2)]
    for _ in range(2):
        got = [x.torch() for x, _ in loader]
        # each worker yields 20 samples: batches of 8, 8 and 4 from each, interleaved
        assert [len(b) for b in want] == [8, 8, 8, 8, 4, 4] and len(got) == 6
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    loader.close()


def test_a_client_dataloader_with_workers_feeds_a_trainer_as_in_torch(islands):
    """The habit of a torch script: the client's own DataLoader, with worker processes,
    feeding trainer.step after pw.init. Its workers are forks of a process whose gRPC
    threads are busy, so gRPC's at-fork handlers are off (importing pathways_torch sets
    GRPC_ENABLE_FORK_SUPPORT=false); two epochs' losses equal torch's to 1e-5."""
    assert os.environ.get("GRPC_ENABLE_FORK_SUPPORT") == "false"

    def make():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4))

    def epochs(workers):
        dl = torch.utils.data.DataLoader(loader_data.Rows(n=32), batch_size=8,
                                         shuffle=True, num_workers=workers,
                                         generator=torch.Generator().manual_seed(1))
        return [b for _ in range(2) for b in dl]

    torch.manual_seed(0)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    trainer = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05),
                         torch.nn.functional.mse_loss, slice=islands[0],
                         parallelism=pw.DataParallel("data"))
    got = [float(trainer.step(x, y)) for x, y in epochs(2)]
    want = torch_losses(ref, torch.optim.SGD(ref.parameters(), lr=0.05), epochs(0))
    assert len(got) == 8
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)


def test_a_dropped_loader_stops_on_the_host(islands):
    """Dropping a loader (or close()) stops its prefetcher and DataLoader workers."""
    import gc
    from procs import descendants, parent, wait_gone
    s = islands[1]
    executor = s.stats().pid
    before = set(descendants(executor))
    loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 64}, batch_size=8,
                           slice=s, spec=P("data"), num_workers=1)
    next(iter(loader))[0].torch()
    # the fork server (and its resource tracker) serve the executor's later loaders
    workers = {p for p in set(descendants(executor)) - before if parent(p) != executor}
    assert workers, "the host's DataLoader has a worker process"
    del loader
    gc.collect()
    s.stats()                       # the close is in the stream before this barrier
    assert wait_gone(list(workers)) == []


def test_workers_can_narrow_what_may_be_imported(monkeypatch):
    """PATHWAYS_IMPORT_ALLOW on a worker: its loaders and colocated calls import only
    from those packages (the cluster token is what guards the rest)."""
    from pathways_torch.worker.loader import LoaderError, import_named
    monkeypatch.setenv("PATHWAYS_IMPORT_ALLOW", "loader_data, pathways_torch.datasets")
    assert import_named("loader_data:rows", "f") is loader_data.rows
    assert import_named("pathways_torch.datasets:synthetic_images", "f")
    for name in ("subprocess:run", "os:system", "loader_data_x:rows", "pathways_torch:init"):
        with pytest.raises(LoaderError, match="not allowed on this host"):
            import_named(name, "the colocated function")
    monkeypatch.delenv("PATHWAYS_IMPORT_ALLOW")
    assert import_named("os:getcwd", "f")


def test_a_pull_without_the_slice_key_is_refused(islands):
    """The data plane checks a pull's slice key as gRPC checks a call's: another
    client holding the cluster token still cannot read this slice's buffers."""
    from pathways_torch.client.connection import _ClientPlane
    from pathways_torch.rpc import pathways_pb2 as pb
    s = islands[0]
    a = pw.put(torch.randn(8), s)
    a.wait()
    for key in ("", "not-the-key"):
        req = pb.FetchRequest(buffer_id=a._id, timeout_s=5, slice_key=key)
        reply, payload = _ClientPlane.get().pull(s.data_address, req.SerializeToString(), 10)
        assert reply.has_error and reply.error.kind == "permission" and payload is None
    assert torch.equal(a.torch(), a.torch())


def test_pulls_outlive_connections_their_peer_closed(islands):
    """A pooled connection that its peer closed while idle (a new executor may take a
    released one's port) is replaced, not reported as a lost worker: CI once failed
    that way. (test_spanning checks that a released slice's connections close.)"""
    import socket
    from pathways_torch.client.connection import _ClientPlane
    plane, s, x = _ClientPlane.get(), islands[0], torch.randn(8)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        dead = socket.create_connection(srv.getsockname())
        srv.accept()[0].close()
    plane._idle_pulls.setdefault(s.data_address, []).append(dead)   # taken first
    a = pw.put(x, s)
    assert torch.equal(a.torch(), x)
    assert dead.fileno() == -1


def test_a_failing_pull_handler_answers_with_an_error():
    """A bug in serving a pull reaches the client as a typed answer, and the
    connection stays usable."""
    from pathways_torch.rpc import pathways_pb2 as pb
    from pathways_torch.worker.dataplane import DataPlane
    server, client = DataPlane("127.0.0.1", token=""), DataPlane("", token="", listen=False)
    try:
        server.on_pull = lambda raw: 1 / 0
        req = pb.FetchRequest(buffer_id=1).SerializeToString()
        for _ in range(2):
            reply, payload = client.pull(server.address, req, 10)
            assert reply.has_error and "ZeroDivisionError" in reply.error.message
            assert payload is None
    finally:
        server.close()
        client.close()
