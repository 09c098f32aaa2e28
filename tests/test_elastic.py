"""Elastic training with real processes and real signals: a worker is SIGKILLed in the
middle of ``Trainer.fit``, the embedded cluster restarts it, the Trainer rebuilds its
slice on the replacement, reloads the last checkpoint and goes on with the same numbers.
"""

import glob
import os
import signal

import pytest
import torch

import pathways_torch as pw
from pathways_torch.client import runtime
from pathways_torch.client.cluster import LocalCluster

from procs import descendants, wait_gone

STEPS = 10


@pytest.fixture(scope="module")
def cluster():
    """Two islands of one host with 2 devices each; every process it ever started (the
    restarted workers too) is gone after the shutdown."""
    pw.init(islands=2, devices_per_host=2, timeout=120)
    c = runtime._state.cluster
    # The tests kill island 0's worker 4 times within a minute or so; the default of 3
    # restarts in a row would leave it dead for the last (the bound is tested below).
    c.max_restarts = 8
    try:
        yield c
    finally:
        pids = set(c.pids()) | {r.new_pid for r in c.restarts}
        pids |= {d for p in list(pids) for d in descendants(p)}
        pw.shutdown()
        assert wait_gone(pids) == []


def make_trainer(slice_, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return pw.Trainer(model, opt, torch.nn.functional.mse_loss, slice=slice_,
                      parallelism=pw.DataParallel("data"))


def batches(n=STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(n)]


def worker_of(pid, cluster):
    """The worker agent above process ``pid`` (an executor, forked below the agent)."""
    workers = set(cluster.pids())
    while pid not in workers:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        assert pid > 1, "the executor is not below a worker of the cluster"
    return pid


def test_fit_resumes_on_the_restarted_worker_with_the_same_losses(cluster, tmp_path):
    data = batches()
    trainer = make_trainer(pw.slice((2,), island=0))
    killed = []

    def on_step(i, loss):
        if i == 5 and not killed:
            executor = trainer.slices[0].stats(sync=False).pid
            worker = worker_of(executor, cluster)
            assert worker == cluster.worker_pid(0)
            os.kill(worker, signal.SIGKILL)
            killed.append(worker)
            # its executor dies with it (parent-death signal): then no later step can
            # finish, and which step fails first does not depend on timing
            assert wait_gone([worker, executor]) == []

    ckpt = tmp_path / "ckpt"
    losses = trainer.fit(data, checkpoint_dir=str(ckpt), checkpoint_every=3,
                         max_restarts=1, on_step=on_step, keep_checkpoints=None)

    assert len(losses) == STEPS and all(isinstance(x, float) for x in losses)
    assert len(trainer.restarts) == 1
    r = trainer.restarts[0]
    # Steps 6 and 7 were in flight when step 5's loss came back: 6 is the first that
    # fails, and the last complete checkpoint is step 3's.
    assert (r.failed_at, r.resumed_from) == (6, 3)
    assert [(w.island, w.old_pid) for w in cluster.restarts] == [(0, killed[0])]
    assert trainer.slices[0].island == 0
    assert "lost" not in {d.state for d in pw.devices()}
    assert trainer.steps == STEPS
    assert sorted(os.listdir(ckpt)) == ["latest.json", "step-000000", "step-000003",
                                        "step-000006", "step-000009"]

    # An uninterrupted run from the checkpoint it resumed from: the same numbers, bit
    # for bit (same programs, same device count, the optimizer's state and step count
    # restored from the checkpoint).
    other = pw.slice((2,), island=1)
    again = make_trainer(other, seed=123)           # other weights: load replaces them
    again.load(str(ckpt / "step-000003"))
    assert again.steps == 3
    assert [float(again.step(x, y)) for x, y in data[3:]] == losses[3:]

    # And the whole curve equals a run that no worker interrupted.
    again.load(str(ckpt / "step-000000"))
    assert again.fit(data) == losses
    other.release()
    trainer.slices[0].release()


def test_without_restarts_a_lost_worker_is_raised(cluster, tmp_path):
    data = batches()
    trainer = make_trainer(pw.slice((2,), island=1))

    def on_step(i, loss):
        if i == 2:
            executor = trainer.slices[0].stats(sync=False).pid
            worker = cluster.worker_pid(1)
            os.kill(worker, signal.SIGKILL)
            # and its executor with it: until it is gone it may still finish every
            # step (it did once the steps got faster), and nothing would be lost
            assert wait_gone([worker, executor]) == []

    with pytest.raises(pw.WorkerLostError, match="island 1 host 0"):
        trainer.fit(data, checkpoint_dir=str(tmp_path), checkpoint_every=3,
                    max_restarts=0, on_step=on_step)
    assert trainer.restarts == []


def test_fit_takes_callables_and_iterables_and_checks_its_arguments(cluster, tmp_path):
    data = batches(4)
    a = make_trainer(pw.slice((2,), island=0))
    with pytest.raises(pw.PathwaysError, match="checkpoint_dir"):
        a.fit(data, max_restarts=1)
    from_list = a.fit(data, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=2)
    a.slices[0].release()
    b = make_trainer(pw.slice((2,), island=0))
    assert b.fit(lambda i: data[i], steps=4) == from_list
    with pytest.raises(pw.PathwaysError, match="steps="):
        b.fit(lambda i: data[i])
    b.slices[0].release()
    c = make_trainer(pw.slice((2,), island=0))
    assert c.fit(iter(data), checkpoint_dir=str(tmp_path / "c"), checkpoint_every=2,
                 keep_checkpoints=1) == from_list
    assert sorted(os.listdir(tmp_path / "c")) == ["latest.json", "step-000004"]
    c.slices[0].release()


def test_multi_island_replicas_are_rebuilt_on_both_islands(cluster, tmp_path):
    """Killing island 0's worker: the replica on island 1 is released too (it may wait
    for a gradient transfer from the dead one) and both come back."""
    _until(lambda: "lost" not in {d.state for d in pw.devices()}, 120)
    data = batches(6)

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        par = pw.MultiIsland([pw.slice((2,), island=0), pw.slice((2,), island=1)], "data")
        return pw.Trainer(model, opt, torch.nn.functional.mse_loss, parallelism=par)

    trainer = make()
    first = trainer.slices

    def on_step(i, loss):
        if i == 3 and not trainer.restarts:
            os.kill(cluster.worker_pid(0), signal.SIGKILL)

    losses = trainer.fit(data, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                         max_restarts=1, on_step=on_step)
    assert len(trainer.restarts) == 1 and trainer.restarts[0].resumed_from in (2, 4)
    assert [s.island for s in trainer.slices] == [0, 1]
    assert all(s.released for s in first)
    assert trainer.parallelism.slices == tuple(trainer.slices)
    for s in trainer.slices:
        s.release()
    again = make()
    assert again.fit(data) == losses
    for s in again.slices:
        s.release()


@pytest.mark.parametrize("dataset", ["rows", "stream"])
def test_fit_on_a_host_loader_replays_the_same_batches(cluster, tmp_path, dataset):
    """pw.DataLoader batches are built on the hosts: after the worker is lost, the
    replayed steps load the same batches again on the replacement's new slice (a
    shuffled map-style dataset, and a stream, whose epochs end where it ends)."""
    _until(lambda: "lost" not in {d.state for d in pw.devices()}, 120)

    def loader_for(trainer):
        if dataset == "stream":
            return pw.DataLoader("loader_data:stream", dataset_kwargs={"n": 48},
                                 batch_size=8, slice=trainer, num_workers=1)
        return pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 48}, batch_size=8,
                             slice=trainer, shuffle=True, seed=3, num_workers=1)

    trainers = [make_trainer(pw.slice((2,), island=0))]
    try:
        trainer = trainers[0]
        loader = loader_for(trainer)
        killed = []

        def on_step(i, loss):
            if i == 5 and not killed:
                killed.append(cluster.worker_pid(0))
                os.kill(killed[0], signal.SIGKILL)

        losses = trainer.fit(loader, steps=STEPS, checkpoint_dir=str(tmp_path),
                             checkpoint_every=3, max_restarts=1, on_step=on_step)
        assert len(trainer.restarts) == 1 and len(losses) == STEPS
        state = loader.state_dict()                  # 6 batches an epoch: into epoch 1
        assert (state["epoch"], state["index"]) == (1, STEPS - 6)
        trainer.slices[0].release()
        # an uninterrupted run on the other island, with a fresh loader: the same numbers
        trainers.append(make_trainer(pw.slice((2,), island=1)))
        assert trainers[1].fit(loader_for(trainers[1]), steps=STEPS) == losses
    finally:                    # a failure here must not hold the next case's devices
        for t in trainers:
            for s in t.slices:
                s.release()


def test_a_lost_worker_fails_a_loader_loop_with_worker_lost(cluster):
    _until(lambda: "lost" not in {d.state for d in pw.devices()}, 120)
    s = pw.slice((2,), island=1)
    loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 64}, batch_size=8,
                           slice=s, spec=pw.P("data"))
    it = iter(loader)
    x, _ = next(it)
    x.torch()
    executor, worker = s.stats(sync=False).pid, cluster.worker_pid(1)
    os.kill(worker, signal.SIGKILL)
    assert wait_gone([worker, executor]) == []      # mid-epoch: 7 batches to go
    with pytest.raises(pw.WorkerLostError, match="island 1 host 0"):
        for x, _ in it:
            x.torch()



def test_host_loader_workers_die_with_their_executor(cluster):
    """A DataLoader worker blocked in the dataset's __getitem__ (where torch's check of
    its parent never runs) is gone within seconds of its executor's SIGKILL."""
    import time
    from procs import parent
    _until(lambda: "lost" not in {d.state for d in pw.devices()}, 120)
    s = pw.slice((2,), island=1)
    try:
        executor = s.stats().pid
        loader = pw.DataLoader("loader_data:slow_rows", dataset_kwargs={"n": 16},
                               batch_size=8, slice=s, spec=pw.P("data"), num_workers=1)
        next(iter(loader))                  # names batch 0: a worker starts reading it
        _until(lambda: any(parent(p) not in (executor, 0) for p in descendants(executor)))
        workers = [p for p in descendants(executor) if parent(p) != executor]
        time.sleep(1.0)                     # inside time.sleep(120) by now
        os.kill(executor, signal.SIGKILL)
        assert wait_gone([executor] + workers, timeout=10) == []
    finally:
        s.release()


def test_the_local_cluster_restarts_a_dead_worker_a_bounded_number_of_times():
    with LocalCluster(devices_per_host=1, max_restarts=1, restart_backoff=0.1) as c:
        first = c.worker_pid(0)
        first_tmp = c._workers[(0, 0)].proc._pw_tmp
        # the agent's arbiter socket is in its own TMPDIR, which a SIGKILL cannot remove
        assert glob.glob(os.path.join(first_tmp, "pathways-arb-*", "arbiter.sock"))
        os.kill(first, signal.SIGKILL)
        _until(lambda: len(c.restarts) == 1)
        assert not os.path.exists(first_tmp)        # the cluster removed it
        second = c.worker_pid(0)
        assert second != first and c.restarts[0].exit_code == -signal.SIGKILL
        os.kill(second, signal.SIGKILL)             # while it is still starting up
        _until(lambda: c._workers[(0, 0)].gave_up)  # restarted once already: not again
        assert len(c.restarts) == 1 and c.worker_pid(0) == second
        pids = set(c.pids()) | {first, second}
    assert wait_gone(pids) == []
    assert not os.path.exists(c.rundir)


def _until(cond, timeout=30.0):
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("owner", ["cluster", "arbiter"])
def test_a_dead_processes_tmp_folder_is_removed_by_the_next_one(owner):
    """A killed client leaves its cluster's TMPDIR, a killed worker started by hand (or
    by a batch system) its arbiter's socket folder; the next one removes them."""
    import subprocess
    import tempfile
    from pathways_torch.client import cluster
    from pathways_torch.worker import arbiter
    dead = subprocess.Popen(["true"])
    dead.wait()                                    # a pid no process has now
    prefix = cluster._RUNDIR_PREFIX if owner == "cluster" else arbiter._FOLDER_PREFIX
    orphan = tempfile.mkdtemp(prefix=f"{prefix}{dead.pid}-")
    open(os.path.join(orphan, "arbiter.sock"), "w").close()
    alive = tempfile.mkdtemp(prefix=f"{prefix}{os.getppid()}-")
    try:
        if owner == "cluster":
            cluster.remove_orphan_folders(tempfile.gettempdir(), prefix)
        else:
            arbiter.ShareArbiter().close()
        assert not os.path.exists(orphan)
        assert os.path.isdir(alive)                # its process still runs
    finally:
        os.rmdir(alive)
