"""What a script does to a pw.Trainer's module and optimizer between steps, against
plain torch doing the same (same seed, same data).

Loading pretrained weights or a torch checkpoint after building the Trainer, nn.init,
rolling back to the best weights, clipping a critic's weights (``p.data.clamp_`` too),
adding a param group, swapping in a new head, a forward in train mode on the client
(BatchNorm's statistics), a Python attribute or a buffer changed between steps,
``model.double()``, ``torch.manual_seed`` after building: the next steps train on what
torch would. A change computed from a reference kept from before a step raises
``pw.StaleModuleError``. Reads: a second Trainer on the same model, ``copy.deepcopy``,
pickling, an EMA's ``update_parameters``, ``model.parameters()`` and ``model.fc.weight``
see the trained values; reads that need none do not fetch, and a read after every step
warns (``pw.SyncWarning``). Losses and parameters within 1e-5 (``trainer_helpers.TOL``);
one module-scoped cluster (``cluster8``).
"""

from __future__ import annotations

import copy
import io
import pickle
import types

import pytest
import torch
from torch import nn

import pathways_torch as pw
from trainer_helpers import TOL, assert_losses, assert_same_model, batches, mlp

F = nn.functional


def torch_run(model, opt, data, between=None):
    """Plain torch: one step per batch, ``between(i, model, opt)`` after step i."""
    losses = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if between is not None:
            between(i, model, opt)
    return losses


def pw_run(tr, data, between=None):
    losses = []
    for i, (x, y) in enumerate(data):
        losses.append(float(tr.step(x, y)))
        if between is not None:
            between(i, tr.model, tr.optimizer)
    return losses


def trainer(model, opt, s, **kw):
    return pw.Trainer(model, opt, F.cross_entropy, slice=s, **kw)


def both(make_opt, before=None, between=None, n=4, model=mlp, s=None, **kw):
    """The same model, optimizer and data trained by torch and by a Trainer built
    before ``before(model, opt)`` runs; returns (torch model, trained module, losses)."""
    data = batches(n)
    ref, got = model(), model()
    ref_opt, got_opt = make_opt(ref), make_opt(got)
    if before is not None:
        before(ref, ref_opt)
    want = torch_run(ref, ref_opt, data, between)
    tr = trainer(got, got_opt, s, **kw)
    if before is not None:
        before(got, got_opt)
    losses = pw_run(tr, data, between)
    assert_losses(losses, want)
    tr.sync_to()
    assert_same_model(got, ref)
    return ref, got, tr


def adam(m):
    return torch.optim.Adam(m.parameters(), lr=1e-2)


def test_weights_loaded_after_building_the_trainer_are_trained(s2):
    pretrained = mlp(seed=5).state_dict()
    _, _, tr = both(adam, lambda m, o: m.load_state_dict(pretrained), s=s2)
    assert len(tr._programs) == 1         # a value change puts tensors, no new trace


def test_nn_init_after_building_the_trainer(s2):
    def init(m, o):
        torch.manual_seed(7)
        for mod in m.modules():
            if isinstance(mod, nn.Linear):
                nn.init.zeros_(mod.bias)
                nn.init.orthogonal_(mod.weight)
    both(adam, init, s=s2, parallelism=pw.FullyShardedDataParallel("data"))


def test_a_torch_checkpoint_restored_into_model_and_optimizer_after_building(s2):
    """Resume: a run's model and optimizer state (Adam's moments and step) loaded
    after pw.Trainer is built continue exactly as torch does."""
    m0 = mlp()
    o0 = adam(m0)
    torch_run(m0, o0, batches(3, seed=9))
    msd, osd = m0.state_dict(), o0.state_dict()

    def resume(m, o):
        m.load_state_dict(msd)
        o.load_state_dict(copy.deepcopy(osd))    # torch's load aliases the tensors
    _, got, tr = both(adam, resume, s=s2)
    assert tr.steps == 3 + 4
    assert int(tr.optimizer.state_dict()["state"][0]["step"]) == 7


def test_rolling_back_to_the_best_weights_between_steps(s2):
    best = {}

    def between(i, m, o):
        if i == 0:
            best.update(copy.deepcopy(m.state_dict()))   # a read: the trained values
        if i == 2:
            m.load_state_dict(best)
    both(adam, between=between, n=5, s=s2)


@pytest.mark.parametrize("through_data", [False, True], ids=["no_grad", "p.data"])
def test_weight_clipping_between_steps_equals_torch(s2, through_data):
    """WGAN's critic clipping after each step, as its original code writes it
    (``p.data.clamp_``, which torch's version counter does not see) and as torch
    recommends (``torch.no_grad()``): ``model.parameters()`` hands out the trained
    values, and the next step takes the clipped ones."""
    def clip(i, m, o):
        for p in m.parameters():
            if through_data:
                p.data.clamp_(-0.05, 0.05)
            else:
                with torch.no_grad():
                    p.clamp_(-0.05, 0.05)

    data = batches(4)
    ref, got = mlp(), mlp()
    want = torch_run(ref, torch.optim.RMSprop(ref.parameters(), lr=5e-3), data, clip)
    tr = trainer(got, torch.optim.RMSprop(got.parameters(), lr=5e-3), s2)
    assert_losses(pw_run(tr, data, clip), want)
    tr.sync_to()
    assert_same_model(got, ref)


def test_a_change_of_the_stale_module_raises_and_loses_nothing(s2):
    """A write through a reference kept from before the step (not a read through the
    module, which would sync first) changes the values of before the step."""
    data = batches(3)
    model = mlp()
    tr = trainer(model, adam(model), s2)
    kept = model[0].weight
    tr.step(*data[0])
    trained = {n: a.torch() for n, a in tr.params.items()}
    with torch.no_grad():
        kept.mul_(0.5)                      # the values of before the step, halved
    with pytest.raises(pw.StaleModuleError, match=r"0\.weight.*trainer\.sync_to\(\)"):
        tr.step(*data[1])
    with pytest.raises(pw.StaleModuleError):
        model.state_dict()                  # a read would overwrite the change
    for n, a in tr.params.items():          # the workers kept the trained values
        torch.testing.assert_close(a.torch(), trained[n], rtol=0, atol=0)
    tr.sync_to()                            # explicit: the trained values win
    torch.testing.assert_close(model[0].weight.detach(), trained["0.weight"], rtol=0, atol=0)
    tr.step(*data[1])


def test_a_param_group_added_between_steps_is_trained_from_then_on(s2):
    """Progressive unfreezing: the head joins the optimizer after two steps."""
    def make_opt(m):
        return torch.optim.AdamW(m[0].parameters(), lr=1e-2)

    def between(i, m, o):
        if i == 1:
            o.add_param_group({"params": list(m[4].parameters()), "lr": 5e-3})
    both(make_opt, between=between, n=5, s=s2)


def test_a_new_head_swapped_in_after_building(s2):
    def new_head(m, o):
        torch.manual_seed(3)
        m[4] = nn.Linear(16, 4)
        o.add_param_group({"params": m[4].parameters()})
    both(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), new_head, s=s2)


def test_a_list_of_optimizers_with_a_group_added_to_one(s2):
    def make_opts(m):
        return [torch.optim.SGD(m[0].parameters(), lr=0.1),
                torch.optim.Adam(m[2].parameters(), lr=1e-2)]

    def between(i, m, o):
        if i == 1:
            o.optimizers[1].add_param_group({"params": list(m[4].parameters())})

    data = batches(4)
    ref, got = mlp(), mlp()
    ref_opts, got_opts = make_opts(ref), make_opts(got)
    want = []
    for i, (x, y) in enumerate(data):
        for o in ref_opts:
            o.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        for o in ref_opts:
            o.step()
        want.append(loss.item())
        if i == 1:
            ref_opts[1].add_param_group({"params": list(ref[4].parameters())})
    tr = trainer(got, got_opts, s2)
    assert_losses(pw_run(tr, data, between), want)
    tr.sync_to()
    assert_same_model(got, ref)


def bn_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def test_a_forward_in_train_mode_on_the_client_updates_batchnorm_as_in_torch(s2):
    probe = torch.randn(16, 8, generator=torch.Generator().manual_seed(4)) * 3

    def sanity_forward(m, o):
        m(probe)                             # train mode: running statistics move
    both(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), sanity_forward, model=bn_model,
         s=s2)


def test_evaluate_after_loading_weights_uses_them(s2):
    x, y = batches(1)[0]
    model, pretrained = mlp(), mlp(seed=5)
    tr = trainer(model, adam(model), s2)
    model.load_state_dict(pretrained.state_dict())
    pretrained.eval()
    torch.testing.assert_close(float(tr.evaluate(x, y)),
                               F.cross_entropy(pretrained(x), y).item(), rtol=1e-5, atol=1e-5)


def test_a_trainer_checkpoint_loaded_after_a_module_change_wins(s2, tmp_path):
    data = batches(3)
    model = mlp()
    tr = trainer(model, adam(model), s2)
    tr.step(*data[0])
    tr.save(str(tmp_path / "ckpt"))
    saved = {n: a.torch() for n, a in tr.params.items()}
    tr.sync_to()
    with torch.no_grad():
        model[0].weight.zero_()              # then the checkpoint is restored
    tr.load(str(tmp_path / "ckpt"))
    for n, a in tr.params.items():
        torch.testing.assert_close(a.torch(), saved[n], rtol=0, atol=0)
    tr.step(*data[1])                        # no StaleModuleError: the checkpoint won
    tr.sync_to()
    assert model[0].weight.abs().sum() > 0


def test_pipeline_follows_values_and_refuses_a_new_layer(pipe_slices):
    pretrained = mlp(seed=5).state_dict()
    both(lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
         lambda m, o: m.load_state_dict(pretrained), s=None,
         parallelism=pw.Pipeline(2, 2, pipe_slices))
    model = mlp()
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                    parallelism=pw.Pipeline(2, 2, pipe_slices))
    model[4] = nn.Linear(16, 4)
    with pytest.raises(pw.PathwaysError, match="Pipeline.*build the Trainer after"):
        tr.step(*batches(1)[0])


def test_torch_manual_seed_after_building_the_trainer_sets_its_dropout(s2):
    """The same torch.manual_seed after pw.Trainer(...) (no seed=) gives the same
    masks whatever the seed was when the Trainer was built, as in a torch loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))
    x, y = batches(1)[0]

    def run(seed, seeded_before):
        torch.manual_seed(seeded_before)
        m = copy.deepcopy(model)
        tr = trainer(m, torch.optim.SGD(m.parameters(), lr=0.0), s2)
        torch.manual_seed(seed)
        return [float(tr.step(x, y)) for _ in range(3)]

    a, b, c = run(1, seeded_before=10), run(1, seeded_before=20), run(2, seeded_before=10)
    assert a == b                                    # bit-identical
    assert a != c and len(set(a)) == 3               # another seed; a mask per step


class Fade(nn.Module):
    """ProGAN's fade-in: a Python float attribute mixes two paths, set between steps;
    ``cfg.scale`` is a number on a plain object the module holds (a config)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.old, self.new = nn.Linear(8, 4), nn.Linear(8, 4)
        self.alpha = 0.0
        self.cfg = types.SimpleNamespace(scale=1.0)

    def forward(self, x):
        return self.cfg.scale * (self.alpha * self.new(x) + (1 - self.alpha) * self.old(x))


def test_a_python_attribute_changed_between_steps_is_traced_again(s2):
    def between(i, m, o):
        m.alpha = min(1.0, (i + 1) / 4)
        if i == 2:
            m.cfg.scale = 0.5
    with pytest.warns(pw.RetraceWarning, match=r"model\.alpha changed.*register_buffer"):
        both(lambda m: torch.optim.SGD(m.parameters(), lr=0.1), between=between, n=5,
             model=Fade, s=s2)


class Tempered(nn.Module):
    """The same kind of value kept in a buffer, updated in place: an input of the step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)
        self.register_buffer("tau", torch.tensor(1.0))

    def forward(self, x):
        return self.lin(x) / self.tau


def test_a_buffer_updated_in_place_between_steps_needs_no_trace(s2):
    def between(i, m, o):
        m.tau.fill_(1.0 + 0.5 * (i + 1))     # no sync needed: no step writes tau
    _, _, tr = both(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), between=between,
                    n=5, model=Tempered, s=s2)
    assert sum(len(p._traces) for p in tr._programs.values()) == 1


def test_a_dropout_rate_set_to_zero_between_steps(s2):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))
    x, y = batches(1)[0]
    tr = trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), s2)
    first = float(tr.step(x, y))
    model[2].p = 0.0
    with torch.no_grad():
        want = F.cross_entropy(model.eval()(x), y).item()
    model.train()
    assert first != pytest.approx(want, abs=1e-6)     # the mask was on
    assert float(tr.step(x, y)) == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_a_second_trainer_on_the_same_model_starts_from_the_trained_weights(s2):
    """A linear probe, then a fine-tune with a new optimizer and a new Trainer."""
    data = batches(6)
    ref, got = mlp(), mlp()
    want = torch_run(ref, torch.optim.SGD(ref[4].parameters(), lr=0.1), data[:3])
    want += torch_run(ref, adam(ref), data[3:])
    probe = trainer(got, torch.optim.SGD(got[4].parameters(), lr=0.1), s2)
    losses = pw_run(probe, data[:3])
    tune = trainer(got, adam(got), s2)
    losses += pw_run(tune, data[3:])
    assert_losses(losses, want)


def test_deepcopy_and_pickling_the_module_after_steps_hold_the_trained_values(s2):
    data = batches(3)
    model = mlp()
    tr = trainer(model, adam(model), s2)
    pw_run(tr, data)
    best = copy.deepcopy(model)                  # a best-model snapshot
    trained = {n: a.torch() for n, a in tr.params.items()}
    for n, p in best.named_parameters():
        torch.testing.assert_close(p.detach(), trained[n], rtol=0, atol=0)
    assert not best._forward_pre_hooks and not best._state_dict_pre_hooks
    pw_run(tr, data)                             # stale again
    buf = io.BytesIO()
    torch.save(model, buf)                       # the whole module, pickled
    assert b"pathways_torch" not in buf.getvalue()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    trained = {n: a.torch() for n, a in tr.params.items()}
    for n, p in loaded.named_parameters():
        torch.testing.assert_close(p.detach(), trained[n], rtol=0, atol=0)
    x, _ = data[0]
    torch.testing.assert_close(loaded(x), model(x))   # the copy runs without the hooks


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compiled_forward_on_the_client_after_steps_uses_the_trained_weights(s2, backend):
    """Also with inductor, whose recompile after the steps traces the module's tensor
    dicts (dynamo cannot guard a dict subclass by id: their reads skip under dynamo,
    and the forward pre-hook syncs outside the graph)."""
    data = batches(3)
    model = mlp()
    tr = trainer(model, adam(model), s2)
    compiled = torch.compile(model, backend=backend)
    x, _ = data[0]
    before = compiled(x).detach()
    pw_run(tr, data)
    trained = mlp()
    trained.load_state_dict({n: a.torch() for n, a in tr.params.items()})
    torch.testing.assert_close(compiled(x), trained(x))   # not the graph's old weights
    assert not torch.allclose(before, trained(x))


def test_model_bfloat16_after_building_the_trainer(s2):
    """``model.bfloat16()`` swaps every parameter's ``.data``: the Trainer lays out
    bfloat16 parameters and state (AdamW creates it at the first step, in the
    parameters' dtype). Losses within bfloat16's rounding: 2 units in the last place
    at 1 (2 ** -6), as for a model built in bfloat16."""
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(8, 8, generator=g).bfloat16(), torch.randint(0, 4, (8,), generator=g))
            for _ in range(3)]
    ref, got = mlp(), mlp()
    ref.bfloat16()
    want = torch_run(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), data)
    tr = trainer(got, torch.optim.AdamW(got.parameters(), lr=1e-2), s2)
    got.bfloat16()
    losses = pw_run(tr, data)
    assert losses == pytest.approx(want, rel=2 ** -6)
    assert all(a.dtype == torch.bfloat16 for a in tr.params.values())
    assert all(a.dtype == torch.bfloat16 for st in tr.states[0].values()
               for k, a in st.items() if k != "step")


# ---------------------------------------------------------------- reads through the module
def test_reads_through_the_module_after_steps_see_the_trained_values(s2):
    """An EMA of the weights (``AveragedModel.update_parameters(model)``), a logged
    weight norm and ``parameters_to_vector`` after every step, as in a torch loop."""
    swa = torch.optim.swa_utils

    def track(log):
        def between(i, m, o):
            if "ema" not in log:
                log["ema"] = swa.AveragedModel(
                    m, multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))
            log["ema"].update_parameters(m)
            log.setdefault("norms", []).append(m[2].weight.norm().item())
            log.setdefault("flat", []).append(
                torch.nn.utils.parameters_to_vector(m.parameters()).clone())
        return between

    data = batches(4)
    ref, got = mlp(), mlp()
    want_log, got_log = {}, {}
    want = torch_run(ref, adam(ref), data, track(want_log))
    assert_losses(pw_run(trainer(got, adam(got), s2), data, track(got_log)), want)
    torch.testing.assert_close(got_log["norms"], want_log["norms"], rtol=TOL, atol=TOL)
    for a, b in zip(got_log["flat"], want_log["flat"]):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)
    assert_same_model(got_log["ema"].module, want_log["ema"].module)
    assert not torch.allclose(got_log["flat"][0], got_log["flat"][-1])   # it trained


def test_model_double_then_float_after_steps_equals_torch(s2):
    """``model.to(dtype)`` (``_apply``) converts the trained values, not those the
    module held before the step."""
    def between(i, m, o):
        if i == 1:
            m.double()
            m.float()
    both(adam, between=between, n=4, s=s2)


def test_reads_that_need_no_fetch_do_not_sync(s2):
    """``model.zero_grad()`` reads gradients only, and a buffer no step writes (a
    temperature) is current in the module: neither copies the trained values back."""
    model = Tempered()
    tr = trainer(model, adam(model), s2)
    x, y = batches(1)[0]
    tr.step(x, y)
    model.zero_grad()
    model.tau.fill_(2.0)
    assert tr._synced != tr._version            # still not fetched
    model.lin.weight.norm()                     # a trained one: fetched
    assert tr._synced == tr._version


def test_a_module_read_after_every_step_warns_once_with_the_line(s2):
    model = mlp()
    tr = trainer(model, adam(model), s2)
    x, y = batches(1)[0]
    with pytest.warns(pw.SyncWarning, match=r"each of the last 5 steps") as got:
        for _ in range(8):
            tr.step(x, y)
            model[0].weight.sum()
    ours = [w for w in got if w.category is pw.SyncWarning]
    assert len(ours) == 1 and ours[0].filename == __file__      # the reading line


def test_reads_after_evaluate_and_after_loading_a_checkpoint_fetch(s2, tmp_path):
    """A buffer pushed by ``evaluate`` leaves the trained parameters stale in the
    module; ``trainer.load`` makes every tensor stale: reads fetch in both cases."""
    model = Tempered()
    tr = trainer(model, adam(model), s2)
    data = batches(3)
    tr.step(*data[0])
    tr.save(str(tmp_path / "ckpt"))
    saved = {n: a.torch() for n, a in tr.params.items()}
    tr.step(*data[1])
    model.tau.fill_(2.0)
    tr.evaluate(*data[2])                       # pushes tau, not the weights
    torch.testing.assert_close(model.lin.weight.detach(), tr.params["lin.weight"].torch(),
                               rtol=0, atol=0)
    tr.load(str(tmp_path / "ckpt"))
    torch.testing.assert_close(model.lin.weight.detach(), saved["lin.weight"], rtol=0, atol=0)


def test_a_head_swapped_in_after_building_syncs_on_read(s2):
    model = mlp()
    tr = trainer(model, adam(model), s2)
    x, y = batches(1)[0]
    model[4] = nn.Linear(16, 4)
    tr.optimizer.add_param_group({"params": model[4].parameters()})
    tr.step(x, y)
    torch.testing.assert_close(model[4].weight.detach(), tr.params["4.weight"].torch(),
                               rtol=0, atol=0)


def test_the_module_pickles_with_plain_tensor_dicts(s2):
    model = mlp()
    tr = trainer(model, adam(model), s2)
    tr.step(*batches(1)[0])
    for m in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(m[0]._parameters) is dict and type(m[0]._buffers) is dict
    del tr
    import gc
    gc.collect()                                # the Trainer gone: plain dicts again
    assert type(model[0]._parameters) is dict


# ---------------------------------------------------------------- Trainers sharing tensors
class Stacked(nn.Module):
    """``second(first(x))``: a GAN's generator followed by its discriminator, or a
    shared encoder followed by one task's head."""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return self.second(self.first(x))


def _gan(seed=0):
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return gen, disc


def test_a_gan_with_a_trainer_for_each_network_equals_torch(s2):
    """The discriminator's Trainer trains ``disc``; the generator's trains ``gen``
    through ``Stacked(gen, disc)``, where ``disc`` is fixed: each step sees the other
    Trainer's last update, and the fakes come from a client forward of ``gen``."""
    bce = F.binary_cross_entropy_with_logits
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g) + 2, torch.randn(8, 4, generator=g))
            for _ in range(4)]
    labels = torch.cat([torch.ones(8, 1), torch.zeros(8, 1)])

    def run(gen, disc, step_d, step_g):
        out = []
        for real, z in data:
            with torch.no_grad():
                fake = gen(z)
            out += [step_d(torch.cat([real, fake]), labels), step_g(z, torch.ones(8, 1))]
        return out

    gen, disc = _gan()
    both_nets = Stacked(gen, disc)
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (gen, disc))

    def torch_step(model, opt):
        def step(x, y):
            opt.zero_grad()
            loss = bce(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()
        return step

    want = run(gen, disc, torch_step(disc, opt_d), torch_step(both_nets, opt_g))
    gen2, disc2 = _gan()
    d_tr = pw.Trainer(disc2, torch.optim.Adam(disc2.parameters(), lr=1e-2), bce, slice=s2)
    g_tr = pw.Trainer(Stacked(gen2, disc2), torch.optim.Adam(gen2.parameters(), lr=1e-2),
                      bce, slice=s2)
    got = run(gen2, disc2, lambda x, y: float(d_tr.step(x, y)),
              lambda x, y: float(g_tr.step(x, y)))
    assert_losses(got, want)
    assert_same_model(Stacked(gen2, disc2), both_nets)


def test_two_trainers_training_a_shared_encoder_in_turns_equal_torch(s2):
    """Two tasks, each with its own Trainer and optimizer over the shared encoder and
    its head, stepped in turns: each step starts from the other's update."""
    def make():
        torch.manual_seed(3)
        enc = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        return enc, nn.Linear(16, 4), nn.Linear(16, 4)

    data = batches(6)

    def run(step_a, step_b):
        return [(step_a if i % 2 == 0 else step_b)(x, y) for i, (x, y) in enumerate(data)]

    enc, ha, hb = make()
    ma, mb = Stacked(enc, ha), Stacked(enc, hb)
    oa, ob = adam(ma), adam(mb)

    def torch_step(model, opt):
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.item()
        return step

    want = run(torch_step(ma, oa), torch_step(mb, ob))
    enc2, ha2, hb2 = make()
    ma2, mb2 = Stacked(enc2, ha2), Stacked(enc2, hb2)
    ta, tb = trainer(ma2, adam(ma2), s2), trainer(mb2, adam(mb2), s2)
    got = run(lambda x, y: float(ta.step(x, y)), lambda x, y: float(tb.step(x, y)))
    assert_losses(got, want)
    assert_same_model(nn.ModuleList([enc2, ha2, hb2]), nn.ModuleList([enc, ha, hb]))


@pytest.mark.parametrize("reads", [False, True], ids=["unread", "state_read_each_step"])
@pytest.mark.parametrize("second", ["built_at_once", "built_later"])
def test_two_trainers_sharing_a_model_and_its_optimizer_carry_its_state(s2, reads, second):
    """Two Trainers on one model and one optimizer, stepped in turns (A, A, B, B, A, A,
    B, A): each step starts from the last update's weights *and* optimizer state
    (momentum), as one torch loop would. The momentum used to stay the stepping
    Trainer's own: its step after the other's was off by 3e-2. Read through
    ``optimizer.state``, the momentum is that of the Trainer that stepped last."""
    data = batches(8)
    order = "AABBAABA"
    model = mlp()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = torch_run(ref, ref_opt, data)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tr = {"A": trainer(model, opt, s2)}
    if second == "built_at_once":
        tr["B"] = trainer(model, opt, s2)
    got = []
    for who, (x, y) in zip(order, data):
        if who not in tr:
            tr[who] = trainer(model, opt, s2)
        got.append(float(tr[who].step(x, y)))
        if reads:
            torch.testing.assert_close(opt.state[model[0].weight]["momentum_buffer"],
                                       _momentum_after(data[:len(got)]), rtol=TOL, atol=TOL)
    assert_losses(got, want)
    assert_same_model(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   ref_opt.state[q]["momentum_buffer"], rtol=TOL, atol=TOL)


def _momentum_after(data):
    """The first layer's momentum after plain torch's steps on ``data``."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch_run(model, opt, data)
    return opt.state[model[0].weight]["momentum_buffer"]


class _Counting(nn.Module):
    """A forward that updates a buffer in any mode (a call counter)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.a(x) * self.calls


def test_a_buffer_that_evaluate_or_predict_updates_reads_as_in_torch(s2):
    """A buffer a forward updates in eval mode: after ``predict`` or ``evaluate``, a
    read of the module gives the updated value, as after torch's forward. The read used
    to give the value of before them (only a step marked the module stale), and so did
    ``model.state_dict()`` and ``torch.save(model)``."""
    x, y = batches(1)[0]
    model, ref = _Counting(), _Counting()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch_run(ref, ref_opt, [(x, y)])
    tr = trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), s2)
    tr.step(x, y)
    assert float(model.calls) == 1.0
    ref.eval()
    with torch.no_grad():
        want = ref(x)
    torch.testing.assert_close(tr.predict(x).torch(), want, rtol=TOL, atol=TOL)
    assert float(model.calls) == float(ref.calls) == 2.0
    with torch.no_grad():
        want_loss = F.cross_entropy(ref(x), y)
    torch.testing.assert_close(float(tr.evaluate(x, y)), float(want_loss), rtol=TOL, atol=TOL)
    assert float(model.state_dict()["calls"]) == float(ref.calls) == 3.0


def test_a_parameter_resized_in_place_after_steps_fails_as_torch_does(s2):
    """``p.data = bigger`` (Hugging Face's ``resize_token_embeddings``) after the
    optimizer made state for ``p``: torch's next step fails on the state's shape, and
    so does the Trainer's, naming the parameter and what to do."""
    def grow(m):
        m[4].weight.data = torch.randn(6, 16)
        m[4].bias.data = torch.randn(6)

    x, y = batches(1)[0]
    ref = mlp()
    opt = adam(ref)
    torch_run(ref, opt, [(x, y)])
    grow(ref)
    with pytest.raises(RuntimeError, match="size"):
        torch_run(ref, opt, [(x, y)])
    model = mlp()
    tr = trainer(model, adam(model), s2)
    tr.step(x, y)
    grow(model)
    with pytest.raises(pw.PathwaysError, match=r"4\.weight is \[6, 16\].*exp_avg \[4, 16\]"
                                               r".*Build a new optimizer"):
        tr.step(x, y)


def test_a_tensor_kept_by_a_hook_or_a_forward_while_traced_warns(s2):
    """A forward hook appending activations, one keeping a statistic, and a forward
    storing its last output on the module run once, while the step is traced: what
    they keep holds no numbers, and the Trainer says where, and what to do instead
    (the statistic returned by loss_fn beside the loss equals torch's)."""
    class Keeps(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            self.last = self.net(x)
            return self.last

    acts, stats = [], {}
    model = Keeps()
    model.net[1].register_forward_hook(lambda m, i, o: acts.append(o.detach()))
    model.net[3].register_forward_hook(lambda m, i, o: stats.__setitem__("mean", o.mean()))
    tr = pw.Trainer(model, adam(model), lambda out, y: (F.cross_entropy(out, y),
                                                       {"mean": stats["mean"]}), slice=s2)
    x, y = batches(1)[0]
    with pytest.warns(UserWarning) as got:
        loss, metrics = tr.step(x, y)
    messages = [str(w.message) for w in got if "stored while the step" in str(w.message)]
    assert any(m.startswith("pw.Trainer: acts[0] holds") and "forward hook" in m and
               "model.net.1" in m and "return it from loss_fn" in m for m in messages)
    assert any(m.startswith("pw.Trainer: model.last holds") for m in messages)
    assert any(m.startswith("pw.Trainer: stats['mean'] holds") for m in messages)
    assert all(w.filename == __file__ for w in got if "stored while" in str(w.message))
    ref = mlp()
    with torch.no_grad():
        h = ref[3](ref[2](ref[1](ref[0](x))))
    torch.testing.assert_close(float(metrics["mean"]), h.mean().item(), rtol=TOL, atol=TOL)


_GRIDS = {}


class _CachesAGrid(nn.Module):
    """PWC-Net's habit: a base grid made once per shape, in a global dict."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.shape not in _GRIDS:
            _GRIDS[x.shape] = torch.linspace(-1, 1, x.shape[-1]).expand(x.shape)
        return self.lin(x) + _GRIDS[x.shape]


def test_a_cache_the_forward_fills_while_traced_warns_and_a_later_read_says_why(s2):
    """The cache kept the trace's FakeTensor: nothing warned, and the next program
    (evaluate) failed with ".numpy() is not supported for tensor subclasses"."""
    import warnings

    _GRIDS.clear()
    model = _CachesAGrid()
    tr = pw.Trainer(model, adam(model), lambda out, y: F.mse_loss(out, y), slice=s2)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        tr.step(x, y)
    assert [w for w in got if "_GRIDS[torch.Size([4, 8])]" in str(w.message)
            and "cache filled in the forward" in str(w.message)], \
        [str(w.message) for w in got]
    with pytest.raises(pw.TraceError, match="an earlier trace made.*register_buffer"):
        tr.evaluate(x, y)
    _GRIDS.clear()                                 # as the error says: then it works
    want = F.mse_loss(tr.sync_to(copy.deepcopy(model))(x), y)
    assert abs(float(tr.evaluate(x, y)) - want.item()) < TOL


@pytest.mark.parametrize("reparam", ["prune", "weight_norm", "spectral_norm"])
def test_weights_that_torch_recomputes_before_each_forward_stay_real(s2, reparam):
    """``nn.utils.prune`` (pruning tutorials), the older ``weight_norm`` and
    ``spectral_norm`` (GAN code) keep the weight a forward pre-hook computes as a plain
    attribute, so the trace left a FakeTensor there and warned as if the script had
    stored it. Now the attribute holds real numbers, nothing warns, and training,
    the spectral norm's power iteration (buffers written in the forward) and a CPU
    forward afterwards equal torch's."""
    import warnings

    from torch.nn.utils import prune

    def build(m):
        if reparam == "prune":
            prune.l1_unstructured(m[2], "weight", amount=0.5)
        elif reparam == "weight_norm":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)     # deprecated, still used
                nn.utils.weight_norm(m[2])
        else:
            nn.utils.spectral_norm(m[2])
        return m

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ref, model, _ = both(adam, n=3, s=s2, model=lambda: build(mlp()))
    assert not [w for w in got if "stored while the step" in str(w.message)], \
        [str(w.message) for w in got]
    assert type(model[2].weight) is torch.Tensor
    x = batches(1, seed=7)[0][0]
    torch.testing.assert_close(model(x), ref(x), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("parallelism", [None, pw.FullyShardedDataParallel("data")],
                         ids=["dp", "fsdp"])
def test_pruning_between_steps_keeps_the_optimizer_state_of_the_renamed_weight(
        s2, parallelism):
    """``prune.l1_unstructured`` moves the Parameter ``weight`` to ``weight_orig`` and
    ``prune.remove`` moves it back: the same object under a new name. torch's optimizer
    state belongs to the object, so Adam goes on; the Trainer took the name for a new
    parameter and restarted its state from the client's copy (empty, or as old as the
    last read: Adam's step 2 instead of 4, losses 2e-2 off)."""
    from torch.nn.utils import prune

    def between(i, m, o):
        if i == 1:
            prune.l1_unstructured(m[2], "weight", amount=0.5)
        elif i == 3:
            prune.remove(m[2], "weight")

    kw = {"parallelism": parallelism} if parallelism is not None else {}
    _, model, tr = both(adam, between=between, n=6, s=s2, **kw)
    assert "2.weight" in dict(model.named_parameters())
    assert int(tr.optimizer.state[model[2].weight]["step"]) == 6


def test_a_parameter_the_module_dropped_keeps_its_state_in_the_optimizer(s2):
    """weight_norm applied mid-training replaces ``2.weight``; torch's optimizer still
    holds it with the state of its steps. The Trainer's copy had lost that state (the
    weight had been read, its state not)."""
    from torch.nn.utils import parametrizations

    def between(i, m, o):
        if i == 1:
            parametrizations.weight_norm(m[2])
            w = m[2].parametrizations.weight
            o.add_param_group({"params": [w.original0, w.original1]})

    data = batches(4)
    ref, model = mlp(), mlp()
    ref_opt, opt = adam(ref), adam(model)
    want = torch_run(ref, ref_opt, data, between)
    tr = trainer(model, opt, s2)
    assert_losses(pw_run(tr, data, between), want)
    got, ref_sd = tr.optimizer.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sorted(got) == sorted(ref_sd)
    for k in ref_sd:
        for key, v in ref_sd[k].items():
            torch.testing.assert_close(got[k][key], v, rtol=TOL, atol=1e-7)


def test_sgd_without_momentum_has_no_state_entries_as_in_torch(s2):
    """A sync wrote an empty entry per parameter ({0: {}, 1: {}, ...}); torch's SGD
    without momentum keeps none."""
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    _, _, tr = both(sgd, n=2, s=s2)
    assert tr.optimizer.state_dict()["state"] == {}


def test_a_read_of_the_module_fetches_no_optimizer_state_and_one_of_the_state_does(s2):
    """A module read (an EMA, a client forward) needs the parameters only, a third of
    the bytes under Adam; ``optimizer.state[p]`` read directly (a logger of Adam's
    moments) gets the trained state, equal to torch's."""
    data = batches(3)
    ref, model = mlp(), mlp()
    ref_opt = adam(ref)
    torch_run(ref, ref_opt, data)
    tr = trainer(model, adam(model), s2)
    pw_run(tr, data)
    model[0].weight.sum()
    assert tr._synced == tr._version and tr._opt_synced != tr._version
    got = tr.optimizer.state[model[0].weight]["exp_avg_sq"]
    want = ref_opt.state[ref[0].weight]["exp_avg_sq"]
    torch.testing.assert_close(got, want, rtol=TOL, atol=1e-8)
    assert tr._opt_synced == tr._version
    assert int(tr.optimizer.state[model[4].bias]["step"]) == 3
    assert type(pickle.loads(pickle.dumps(tr.optimizer.state_dict()))["state"]) is dict


def test_a_torch_loops_leftovers_after_trainer_step(s2):
    """What a loop ported from torch keeps: clip_grad_norm_ after the step (warns that
    it clips nothing, fetches nothing), model.zero_grad(), loss.detach().cpu().item()
    (the loss), and loss.backward() (a TypeError saying what to remove)."""
    model = mlp()
    tr = trainer(model, adam(model), s2)
    ref = mlp()
    data = batches(3)
    want = torch_run(ref, adam(ref), data)
    got = []
    with pytest.warns(UserWarning, match=r"clip_grad_norm_ on the module after "
                                         r"trainer\.step clips nothing.*max_grad_norm=") as w:
        for x, y in data:
            loss = tr.step(x, y)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            model.zero_grad()
            got.append(loss.detach().cpu().item())
    assert len([x for x in w if "clips nothing" in str(x.message)]) == 1
    assert tr._synced != tr._version           # neither read fetched the weights
    assert_losses(got, want)
    with pytest.raises(TypeError, match=r"remove loss\.backward\(\) and optimizer\.step\(\)"):
        loss.backward()


def test_a_python_counter_the_forward_bumps_warns_and_a_buffer_counts(s2):
    """``self.calls += 1`` in a forward runs only while the step is traced; the
    Trainer says so, and the buffer it suggests counts every step, as in torch."""
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.calls = 0
            self.register_buffer("seen", torch.tensor(0))

        def forward(self, x):
            self.calls += 1
            self.seen += 1
            return self.net(x)

    model = Counts()
    tr = trainer(model, adam(model), s2)
    x, y = batches(1)[0]
    with pytest.warns(UserWarning, match=r"model\.calls went from 0 to 1 while the step "
                                         r"was traced.*register_buffer\('calls'") as got:
        for _ in range(3):
            tr.step(x, y)
    assert [w.filename for w in got if "went from" in str(w.message)] == [__file__]
    assert int(model.seen) == 3 and model.calls == 1


def test_a_queue_position_kept_in_python_warns(s2):
    """A ring buffer's position in a Python attribute, set in the forward (``self.ptr
    = (self.ptr + B) % K``, first made there with ``hasattr``): only the trace moved
    it, so every step wrote the same slot of the queue, silently; the warning was for
    counts that went up by exactly one."""
    class Queue(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.register_buffer("queue", torch.zeros(4, 32))

        def forward(self, x):
            out = self.net(x)
            if not hasattr(self, "ptr"):
                self.ptr = 0
            self.queue[:, self.ptr:self.ptr + 8] = out.detach().T
            self.ptr = (self.ptr + 8) % 32
            return out

    model = Queue()
    tr = trainer(model, adam(model), s2)
    with pytest.warns(UserWarning, match=r"model\.ptr was set to 8 while the step was "
                                         r"traced.*register_buffer\('ptr'"):
        for x, y in batches(2):
            tr.step(x, y)


@pytest.mark.parametrize("how", ["clear", "assign_empty", "zero_moments"])
def test_the_optimizers_state_reset_or_changed_between_steps_equals_torch(s2, how):
    """Resetting Adam after a change of phase (pruning, a new task): ``opt.state.clear()``,
    ``opt.state[p] = {}`` for the head, or the moments zeroed in place after reading
    them; torch's next step starts that state again, and so does the Trainer's."""
    def between(i, m, o):
        if i != 1:
            return
        if how == "clear":
            o.state.clear()
        elif how == "assign_empty":
            for p in m[4].parameters():
                o.state[p] = {}
        else:
            for p in m.parameters():
                o.state[p]["exp_avg"].zero_()
                o.state[p]["exp_avg_sq"].zero_()
    both(adam, between=between, n=4, s=s2)


# ------------------------------------------- what the loss_fn and forwards read (stop 41)
ALPHA = 1.0            # a global the loss_fn reads, rebound between steps


class _Masked(nn.Module):
    """A plain tensor attribute (not a buffer) assigned anew, and a global read."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.mask = torch.ones(4)

    def forward(self, x):
        return self.fc(x) * self.mask * SCALE


SCALE = 1.0


def test_values_rebound_between_steps_are_read_again(s2):
    """A trace keeps what the model and loss_fn read from Python as constants; a
    value assigned anew between steps (a global float or tensor, a loss module's
    ``weight`` or ``label_smoothing``, a module's plain tensor attribute, a global read
    in a forward) was kept at its first value, silently: step 3's loss 1.26 for 3.38."""
    global ALPHA, SCALE
    data = batches(4)
    criterion = nn.CrossEntropyLoss(weight=torch.ones(4))

    def lf(out, y):
        return criterion(out, y) * ALPHA

    def change(i, model):
        global ALPHA, SCALE
        ALPHA, SCALE = 1.0 + 0.5 * i, 1.0 + 0.25 * i
        criterion.weight = torch.linspace(0.5, 2.0, 4) * (i + 1)
        criterion.label_smoothing = 0.05 * i
        model.mask = torch.tensor([1.0, 0.5, 2.0, 1.5]) * (i + 1)

    try:
        torch.manual_seed(0)
        ref = _Masked()
        got = copy.deepcopy(ref)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        want = []
        for i, (x, y) in enumerate(data):
            change(i, ref)
            opt.zero_grad()
            loss = lf(ref(x), y)
            loss.backward()
            opt.step()
            want.append(loss.item())
        ALPHA, SCALE = 1.0, 1.0
        criterion.weight, criterion.label_smoothing = torch.ones(4), 0.0
        tr = pw.Trainer(got, torch.optim.SGD(got.parameters(), lr=0.1), lf, slice=s2)
        losses = []
        for i, (x, y) in enumerate(data):
            change(i, got)
            losses.append(float(tr.step(x, y)))
        assert_losses(losses, want)
    finally:
        ALPHA, SCALE = 1.0, 1.0


def test_parameters_the_model_does_not_hold_are_refused_with_what_to_do(s2):
    """A loss module's learnable temperature, or a free parameter in a param group of
    its own, stayed as it was while torch trained it (losses 2% off at step 4)."""
    class TempCE(nn.Module):
        def __init__(self):
            super().__init__()
            self.logt = nn.Parameter(torch.tensor(0.3))

        def forward(self, out, y):
            return F.cross_entropy(out / self.logt.exp(), y)
    torch.manual_seed(0)
    model, lf = nn.Linear(8, 4), TempCE()
    ref, rlf = copy.deepcopy(model), copy.deepcopy(lf)
    opt = torch.optim.SGD(list(model.parameters()) + list(lf.parameters()), lr=0.1)
    with pytest.raises(pw.PathwaysError, match="holds 1 parameter\\(s\\) that are not the "
                       "model's \\(loss_fn's 'logt'\\).*model.criterion = criterion"):
        pw.Trainer(model, opt, lf, slice=s2)
    # as the message says: the loss module as a submodule of the model
    model.criterion = lf
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), model.criterion,
                    slice=s2)
    ropt = torch.optim.SGD(list(ref.parameters()) + list(rlf.parameters()), lr=0.1)
    want = []
    for x, y in batches(3):
        ropt.zero_grad()
        loss = rlf(ref(x), y)
        loss.backward()
        ropt.step()
        want.append(loss.item())
    assert_losses([float(tr.step(x, y)) for x, y in batches(3)], want)
    tr.sync_to()
    assert abs(model.criterion.logt.item() - rlf.logt.item()) < TOL


def test_a_teacher_trained_by_its_own_trainer_inside_the_students_loss(s2):
    """Distillation with the teacher called in the student's loss_fn, while another
    Trainer trains it: the student read the teacher's weights of its first trace, every
    step (0.82 for torch's 0.49 at step 0). Its module is now brought up to its
    Trainer's steps first; and a Trainer call inside a traced step says where to make
    it (it failed on ``.numpy()`` of a tensor subclass)."""
    torch.manual_seed(0)
    teacher, student = nn.Linear(8, 4), nn.Linear(8, 4)
    r_teacher, r_student = copy.deepcopy(teacher), copy.deepcopy(student)

    def distill(t):
        def lf(out, x):
            with torch.no_grad():
                soft = t(x)
            return F.mse_loss(out, soft)
        return lf
    tt = trainer(teacher, torch.optim.SGD(teacher.parameters(), lr=0.5), s2)
    st = pw.Trainer(student, torch.optim.SGD(student.parameters(), lr=0.5),
                    distill(teacher), slice=s2)
    rto = torch.optim.SGD(r_teacher.parameters(), lr=0.5)
    rso = torch.optim.SGD(r_student.parameters(), lr=0.5)
    got, want = [], []
    for x, y in batches(3):
        tt.step(x, y)
        rto.zero_grad()
        F.cross_entropy(r_teacher(x), y).backward()
        rto.step()
        got.append(float(st.step(x, x)))
        rso.zero_grad()
        loss = distill(r_teacher)(r_student(x), x)
        loss.backward()
        rso.step()
        want.append(loss.item())
    assert_losses(got, want)
    other = copy.deepcopy(student)
    inside = pw.Trainer(other, torch.optim.SGD(other.parameters(), lr=0.1),
                        lambda out, x: F.mse_loss(out, tt.predict(x).torch()), slice=s2)
    x = batches(1)[0][0]
    with pytest.raises(pw.TraceError, match="trainer.predict was called while a step was "
                       "being traced .* teacher_trainer.predict\\(x\\)"):
        inside.step(x, x)


def test_stale_gradients_are_cleared_and_retraces_are_said(s2):
    """A CPU backward before the Trainer left ``p.grad`` that every later read took
    for the step's (the same norm at every step); and a loss_fn's tensor changed in
    place every step traced the step every step, silently."""
    model = mlp()
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()            # a sanity check on the CPU
    assert model[0].weight.grad is not None
    weights = torch.ones(4)
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    lambda out, t: F.cross_entropy(out, t, weight=weights), slice=s2)
    assert all(p.grad is None for p in model.parameters())
    with pytest.warns(pw.RetraceWarning, match="each time a CPU tensor it reads from "
                      "outside its arguments .* changes in place \\(3 times"):
        for i, (x, y) in enumerate(batches(5)):
            weights[i % 4] += 1.0
            tr.step(x, y)


def test_a_module_registered_under_two_names_keeps_its_parameters(s2):
    """ALBERT's one block in every layer (``nn.ModuleList([blk, blk])``): the first step
    left the block holding the trace's fake tensors, so every later read of the module
    (a CPU forward, state_dict, named_parameters) raised. It trains as torch's does
    and stays a module."""
    def shared(seed=0):
        torch.manual_seed(seed)
        blk = nn.Linear(8, 8)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), blk, nn.Tanh(), blk,
                             nn.Linear(8, 4))
    ref, got, tr = both(adam, model=shared, s=s2)
    assert got[2] is got[4] and type(got[2]._parameters["weight"]) is nn.Parameter
    x = batches(1)[0][0]
    torch.testing.assert_close(got(x), ref(x))
    assert list(got.state_dict()) == list(ref.state_dict())
    tr.step(*batches(1)[0])               # and it goes on training


def test_a_program_that_calls_the_trained_module_sees_the_trained_values(s2):
    """``@pw.program def infer(x): return model(x)`` between steps computed with the
    module's values from before the Trainer (its CPU tensors, behind the workers until
    synced), silently; torch's loop would use the trained ones. The program now syncs
    the module when it is traced and before each call (traced again when the values
    changed, with the warning that points to predict())."""
    ref, got = mlp(), mlp()
    ref_opt, got_opt = adam(ref), adam(got)
    tr = trainer(got, got_opt, s2)

    @pw.program
    def infer(x):
        return got(x).softmax(-1)

    data, x_val = batches(4), batches(1, seed=9)[0][0]
    with pytest.warns(pw.RetraceWarning, match="that Trainer's predict"):
        for i, (x, y) in enumerate(data):
            tr.step(x, y)
            torch_run(ref, ref_opt, [(x, y)])
            got_val = infer(pw.put(x_val, s2)).torch()
            torch.testing.assert_close(got_val, ref(x_val).softmax(-1), rtol=1e-5,
                                       atol=1e-6, msg=lambda m, i=i: f"after step {i}: {m}")
    x, y = batches(1, seed=3)[0]
    assert_losses([float(tr.step(x, y))], torch_run(ref, ref_opt, [(x, y)]))


def test_a_model_converted_between_steps_keeps_its_optimizer_state(s2):
    """``model.double()`` after two steps, with no sync_to before it: the conversion
    reassigns each parameter's ``.data``, and the relayout that follows rebuilt the
    optimizer's state from the client's copy (as of the last sync: none here), so the
    momentum restarted from zero; torch keeps the state as it was, in float32."""
    ref, got = mlp(), mlp()
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ref_opt, got_opt = make(ref), make(got)
    tr = trainer(got, got_opt, s2)
    want, losses = [], []
    for i, (x, y) in enumerate(batches(4)):
        if i == 2:
            ref.double(), got.double()
            x = x.double()
        elif i > 2:
            x = x.double()
        want += torch_run(ref, ref_opt, [(x, y)])
        losses.append(float(tr.step(x, y)))
    assert_losses(losses, want)
    tr.sync_to()
    assert_same_model(got, ref)
    for p, q in zip(got.parameters(), ref.parameters()):
        a, b = got_opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"]
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_replaced_layer_keeps_what_it_learned_and_trains_on_when_put_back(s2):
    """``old = m[4]; m[4] = nn.Linear(...)`` between steps dropped the old layer's
    Arrays without copying them into it: the old layer held its values from before
    the Trainer, and putting it back (``m[4] = old``) trained on from those, with a
    fresh momentum. In torch the old layer keeps what it learned, and its state."""
    data = batches(6)
    runs = {}
    for who in ("torch", "pw"):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        tr = trainer(model, opt, s2) if who == "pw" else None
        old, losses = model[4], []
        for i, (x, y) in enumerate(data):
            if i == 2:
                torch.manual_seed(5)
                model[4] = nn.Linear(16, 4)
                opt.add_param_group({"params": list(model[4].parameters())})
            if i == 4:
                model[4] = old
            losses += pw_run(tr, [(x, y)]) if tr else torch_run(model, opt, [(x, y)])
            if i == 3:
                runs.setdefault(who, {})["old"] = old.weight.detach().clone()
        runs[who]["losses"] = losses
        runs[who]["model"] = model
    assert_losses(runs["pw"]["losses"], runs["torch"]["losses"])
    torch.testing.assert_close(runs["pw"]["old"], runs["torch"]["old"], rtol=TOL, atol=TOL)
    assert_same_model(runs["pw"]["model"], runs["torch"]["model"])


def test_a_forward_that_assigns_data_is_refused_with_the_in_place_form(s2):
    """MoCo's momentum encoder, ``pk.data = pk.data * m + pq.data * (1 - m)`` in the
    forward: the trace recorded no update, so the key encoder never moved (losses 4x
    torch's by step 3, silently). Refused, naming the tensors and the in-place form."""
    class Momentum(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(8, 4), nn.Linear(8, 4)
            self.k.requires_grad_(False)

        def forward(self, x):
            with torch.no_grad():
                for pq, pk in zip(self.q.parameters(), self.k.parameters()):
                    pk.data = pk.data * 0.9 + pq.data * 0.1
            return self.q(x) + self.k(x)

    model = Momentum()
    tr = trainer(model, torch.optim.SGD(model.q.parameters(), lr=0.1), s2)
    with pytest.raises(pw.TraceError, match=r"assigns \.data of k\.weight, k\.bias.*"
                                            r"pk\.mul_\(m\)\.add_"):
        tr.step(*batches(1)[0])


def test_two_parameters_over_one_storage_are_refused_with_how_to_tie_them(s2):
    """``head.weight = nn.Parameter(emb.weight)``: torch updates the one storage through
    both parameters, the workers held two Arrays and trained them apart (losses 1% off
    by step 3, silently). Refused; parameters over disjoint parts of one storage (views
    of one flat tensor) train as torch trains them."""
    def tied(how):
        model = mlp()
        if how == "parameter":
            model[4].weight = nn.Parameter(model[2].weight[:4])
        else:
            model[4].weight.data = model[2].weight.data[4:8]
        return model
    for how in ("parameter", "data"):
        model = tied(how)
        with pytest.raises(pw.PathwaysError, match=r"'2\.weight' and '4\.weight' are two "
                                                   r"Parameters over one storage.*model\.4\.weight = model\.2\.weight"):
            trainer(model, adam(model), s2)

    def views(seed=0):
        model = mlp(seed)
        with torch.no_grad():
            flat = torch.cat([model[0].weight.reshape(-1), model[0].bias])
        model[0].weight = nn.Parameter(flat[:128].view(16, 8))
        model[0].bias = nn.Parameter(flat[128:])
        return model
    ref, got, _ = both(adam, model=views, s=s2)


def test_evaluate_and_predict_see_the_parameters_flags(s2):
    """A forward that reads ``p.requires_grad`` (a frozen-backbone switch) saw False
    for every parameter in evaluate and predict, whose programs run under no_grad, and
    took the other branch; torch's eval under no_grad keeps the flags."""
    class Switch(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            out = self.net(x)
            return out * 2 if self.net[0].weight.requires_grad else out

    model = Switch()
    tr = trainer(model, adam(model), s2)
    x, y = batches(1)[0]
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(tr.predict(x).torch(), want)
    torch.testing.assert_close(float(tr.evaluate(x, y)), float(F.cross_entropy(want, y)))


def test_a_parameter_predict_changes_in_place_is_read_back(s2):
    """``nn.Embedding(max_norm=1)`` renorms the rows it looks up, in place, in eval
    and under no_grad too: predict did so on the workers, but the module kept its rows
    as before (it was not marked stale), so reading it after predict gave other
    numbers than torch's module."""
    def emb(seed=0):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Embedding(10, 6, max_norm=1.0), nn.Flatten(),
                             nn.Linear(18, 4))
    ref, got = emb(), emb()
    with torch.no_grad():
        ref[0].weight.mul_(5)
        got[0].weight.mul_(5)
    tr = trainer(got, adam(got), s2)
    ids = torch.tensor([[1, 2, 3], [3, 4, 5]])
    ref.eval()
    with torch.no_grad():
        want = ref(ids)
    torch.testing.assert_close(tr.predict(ids).torch(), want)
    torch.testing.assert_close(got[0].weight.detach(), ref[0].weight.detach())
