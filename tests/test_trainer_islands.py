"""Multi-island data parallelism and a pipeline across islands (two islands, real DCN)."""

import copy

import pytest
import torch

import pathways_torch as pw

from test_trainer import OPTIMIZERS, assert_losses_match, check_grouped_pipeline, \
    deep_model, loss_fn, make_data, torch_losses
from trainer_helpers import fp16_batches, fp16_model, torch_fp16_train


@pytest.fixture(scope="module")
def islands():
    pw.init(islands=2, hosts_per_island=1, devices_per_host=2, timeout=120)
    try:
        yield [pw.slice((2,), axis_names=("data",), island=i) for i in range(2)]
    finally:
        pw.shutdown()


@pytest.mark.parametrize("opt", ["adamw", "sgd_momentum"])
def test_multi_island_losses_equal_plain_torch(islands, opt):
    model, data = deep_model(), make_data(10, batch=8, seed=7)
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, OPTIMIZERS[opt](model.parameters()), loss_fn,
                    parallelism=pw.MultiIsland(islands, axis="data"))
    losses = [tr.step(x, y) for x, y in data]
    assert_losses_match([float(l) for l in losses], torch_losses(ref, OPTIMIZERS[opt], data))
    # both replicas hold identical parameters after the exchanged updates
    for n in tr.replicas[0]:
        assert torch.equal(tr.replicas[0][n].torch(), tr.replicas[1][n].torch()), n
    assert islands[1].stats().bytes_received > 0        # gradients crossed the DCN


def test_pipeline_across_islands(islands):
    model, data = deep_model(1), make_data(5, batch=8, seed=8)
    ref = copy.deepcopy(model)
    make_opt = OPTIMIZERS["sgd_momentum"]
    tr = pw.Trainer(model, make_opt(model.parameters()), loss_fn,
                    parallelism=pw.Pipeline(2, 4, islands))
    assert_losses_match([float(tr.step(x, y)) for x, y in data],
                        torch_losses(ref, make_opt, data))


def test_a_data_parallel_pipeline_in_groups_of_micro_batches_across_islands(islands):
    """``per_program=2`` with stages split over "data": a group's activations move
    stacked, split along their batch dimension (1), island to island."""
    check_grouped_pipeline(islands, 2, axis="data")


def test_multi_island_follows_requires_grad_between_steps(islands):
    """Layers frozen and unfrozen between steps (AdamW keeps a frozen parameter's
    state): both replicas train what torch trains, and stay identical."""
    model, data = deep_model(2), make_data(5, batch=8, seed=9)
    ref = copy.deepcopy(model)
    first = next(iter(dict(model.named_parameters())))
    plan = {0: False, 2: True, 3: False}

    def apply(m, i):
        if i in plan:
            dict(m.named_parameters())[first].requires_grad_(plan[i])

    make_opt = OPTIMIZERS["adamw"]
    opt, want = make_opt(ref.parameters()), []
    for i, (x, y) in enumerate(data):
        apply(ref, i)
        opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    apply(model, 0)
    tr = pw.Trainer(model, make_opt(model.parameters()), loss_fn,
                    parallelism=pw.MultiIsland(islands, axis="data"))
    got = []
    for i, (x, y) in enumerate(data):
        apply(model, i)
        got.append(float(tr.step(x, y)))
    assert_losses_match(got, want)
    for r0, r1 in ((tr.replicas[0], tr.replicas[1]), (tr.fixed[0], tr.fixed[1])):
        assert r0.keys() == r1.keys()
        for n in r0:
            assert torch.equal(r0[n].torch(), r1[n].torch()), n


def test_multi_island_takes_weights_loaded_and_a_group_added_after_building(islands):
    """Pretrained weights loaded after the Trainer is built, and the last layer joining
    the optimizer after two steps, reach both replicas (pathways' follow.py)."""
    model, data = deep_model(3), make_data(5, batch=8, seed=10)
    pretrained = deep_model(4).state_dict()
    ref = copy.deepcopy(model)
    ref.load_state_dict(pretrained)

    def opt_of(m):
        return torch.optim.Adam([p for n, p in m.named_parameters()
                                 if not n.startswith("6.")], lr=3e-3)

    def add_head(m, o, i):
        if i == 2:
            o.add_param_group({"params": list(m[6].parameters())})

    opt, want = opt_of(ref), []
    for i, (x, y) in enumerate(data):
        add_head(ref, opt, i)
        opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    tr = pw.Trainer(model, opt_of(model), loss_fn,
                    parallelism=pw.MultiIsland(islands, axis="data"))
    model.load_state_dict(pretrained)
    got = []
    for i, (x, y) in enumerate(data):
        add_head(model, tr.optimizer, i)
        got.append(float(tr.step(x, y)))
    assert_losses_match(got, want)
    for n in tr.replicas[0]:
        assert torch.equal(tr.replicas[0][n].torch(), tr.replicas[1][n].torch()), n


def test_multi_island_clipping_and_its_grad_norm_equal_torch(islands):
    """``max_grad_norm`` and ``max_grad_value`` under MultiIsland clip the mean of the
    islands' gradients, as torch clips the whole batch's; ``trainer.grad_norm`` is the
    norm ``clip_grad_norm_`` returns."""
    model, data = deep_model(), make_data(4, batch=8, seed=9)
    ref = copy.deepcopy(model)
    # SGD: Adam turns the rounding of a near-zero mean gradient into a whole step
    ref_opt, want, norms = OPTIMIZERS["sgd_momentum"](ref.parameters()), [], []
    for x, y in data:
        ref_opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_value_(ref.parameters(), 0.02)
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)))
        ref_opt.step()
        want.append(loss.item())
    assert min(norms) > 0.05, norms                     # the clipping is not idle
    tr = pw.Trainer(model, OPTIMIZERS["sgd_momentum"](model.parameters()), loss_fn,
                    parallelism=pw.MultiIsland(islands, axis="data"), max_grad_norm=0.05,
                    max_grad_value=0.02)
    got, got_norms = [], []
    for x, y in data:
        got.append(float(tr.step(x, y)))
        got_norms.append(float(tr.grad_norm))
    assert_losses_match(got, want)
    torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(norms), rtol=1e-5,
                               atol=1e-6)
    tr.sync_to()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_multi_island_ema_equals_update_parameters(islands):
    """``ema=`` under MultiIsland: the first island's replica (every island's is equal)
    is averaged on its island after every update, as ``update_parameters`` does on the
    whole batch's model (before stop 39, refused)."""
    from torch.optim import swa_utils as swa
    model, data = deep_model(), make_data(4, batch=8, seed=5)
    ref = copy.deepcopy(model)
    kw = dict(multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))
    ref_opt, want = OPTIMIZERS["adamw"](ref.parameters()), swa.AveragedModel(ref, **kw)
    for x, y in data:
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_opt.step()
        want.update_parameters(ref)
    ema = swa.AveragedModel(model, **kw)
    tr = pw.Trainer(model, OPTIMIZERS["adamw"](model.parameters()), loss_fn,
                    parallelism=pw.MultiIsland(islands, axis="data"), ema=ema)
    for x, y in data:
        tr.step(x, y)
    assert tr._synced != tr._version            # the weights never came back
    got = ema.state_dict()
    for k, v in want.state_dict().items():
        # AdamW divides a near-zero gradient by its own size: the islands' halves,
        # averaged in another order than the whole batch's sum, moved one element of
        # 1,024 by 3.8e-5 on an AMD machine (also at the commit before this test's
        # tolerance); the averaging itself is exact
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-4,
                                   msg=lambda m, k=k: f"{k}: {m}")
    assert int(ema.n_averaged) == 4


@pytest.mark.parametrize("opt", ["adam", "sgd_dampened"])
def test_multi_island_fp16_loss_scaling_equals_torch_gradscaler(islands, tmp_path, opt):
    """``precision="fp16"`` over two islands: each island scales its loss with its own
    copy of the scale; the update unscales the mean gradient, so both islands skip the
    same overflowing updates and keep equal scales, equal to torch's GradScaler on the
    whole batch (stop 38). SGD with dampening makes its state at its first update,
    which overflows here: whether to keep it is read after the step's graph is sent
    (before stop 39, read inside it: an error)."""
    model, data = fp16_model(), fp16_batches()
    ref = copy.deepcopy(model)
    make_opt = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
                "sgd_dampened": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                           dampening=0.1)}[opt]
    ref_opt = make_opt(ref.parameters())
    want, want_scales = torch_fp16_train(ref, ref_opt, data,
                                         torch.amp.GradScaler("cpu", growth_interval=2))
    tr = pw.Trainer(model, make_opt(model.parameters()), torch.nn.functional.cross_entropy,
                    parallelism=pw.MultiIsland(islands, axis="data"), precision="fp16",
                    scaler=torch.amp.GradScaler("cpu", growth_interval=2))
    got, scales = [], []
    for x, y in data:
        got.append(float(tr.step(x, y)))
        scales.append(tr.loss_scale)
        assert float(tr._scalers[1]["scale"].torch()) == scales[-1]
    assert scales == want_scales and len(set(scales)) > 1
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-3, atol=1e-4)
    for n in tr.replicas[0]:
        assert torch.equal(tr.replicas[0][n].torch(), tr.replicas[1][n].torch()), n
    tr.sync_to()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=2e-3, atol=2e-3,
                                   msg=lambda m, n=n: f"{n}: {m}")
    for p, q in zip(model.parameters(), ref.parameters()):
        mine, theirs = tr.optimizer.state[p], ref_opt.state[q]
        assert set(mine) == set(theirs)
        for key, v in theirs.items():
            torch.testing.assert_close(mine[key], v, rtol=2e-3, atol=2e-3)
    tr.save(str(tmp_path / "ckpt"))
    copied = copy.deepcopy(model)
    again = pw.Trainer(copied, make_opt(copied.parameters()),
                       torch.nn.functional.cross_entropy,
                       parallelism=pw.MultiIsland(islands, axis="data"), precision="fp16")
    again.load(str(tmp_path / "ckpt"))
    assert [float(s_["scale"].torch()) for s_ in again._scalers] == [want_scales[-1]] * 2
