"""pw.Trainer's knobs against plain PyTorch on the CPU (same seed, same data).

Every optimizer torch.optim has that the Trainer runs (options included), a list of
optimizers (Muon and AdamW), schedulers (passed as ``scheduler=`` or stepped by the user), ``max_grad_norm`` (DataParallel, FSDP,
Pipeline), ``accumulate=k``, ``precision="bf16"`` and ``"fp16"`` (with loss scaling), ``evaluate``/``predict``, the ways a
model is called (tuple, dict, a model that returns its own loss), BatchNorm's buffers,
dropout's RNG (``seed=``, checkpoint resume) and activation checkpointing.

Tolerances: fp32 losses, parameters and buffers within 1e-5 (absolute and relative:
``assert_close(rtol=1e-5, atol=1e-5)``; losses ~1.4 agree to ~1e-7 in practice, XLA's
CPU kernels round a little differently); optimizer state too, or within 4x plain
torch's own float32 error where that is larger (centered RMSprop); bf16 losses within 2e-2
relative of torch's CPU autocast (they agree to ~3e-4), fp16 ones within 2e-3 (with
every loss scale equal). Runs on one module-scoped
cluster (``cluster8``): a 2-device "data" slice for the SPMD strategies, two 1-device
slices for the pipeline.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pathways_torch as pw
from pathways_torch import P
from trainer_helpers import (assert_losses, assert_same_model, batches, fp16_batches,
                             fp16_model, mlp, torch_fp16_train)

F = nn.functional
TOL = 1e-5
BF16_RTOL = 2e-2


# ---------------------------------------------------------------------- fixtures, helpers

def strategy(name):
    return {"dp": lambda: pw.DataParallel("data"),
            "fsdp": lambda: pw.FullyShardedDataParallel("data")}[name]()


def torch_train(model, opt, data, loss_fn=F.cross_entropy, clip=None, scheduler=None,
                bf16=False, call=None, each_step=None, clip_value=None):
    """Plain torch: the losses of one step per batch; the gradient norms before clipping.
    ``each_step(model, i)`` runs before step i (a layer frozen, a hook registered)."""
    call = call or (lambda m, x: m(x))
    losses, norms = [], []
    model.train()
    for i, (x, y) in enumerate(data):
        if each_step is not None:
            each_step(model, i)
        opt.zero_grad()
        if bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(call(model, x), y)
        else:
            loss = loss_fn(call(model, x), y)
        loss.float().backward()
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses, norms


def trainer_train(model, make_opt, data, each_step, **kw):
    """pw.Trainer's losses with ``each_step(model, i)`` before step i (step 0's before
    the Trainer is built, as a script does it), and the Trainer."""
    each_step(model, 0)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, **kw)
    got = []
    for i, (x, y) in enumerate(data):
        if i:
            each_step(model, i)
        got.append(float(tr.step(x, y)))
    return got, tr


def dp_or_pipeline(strat, s2, pipe_slices) -> dict:
    if strat == "dp":
        return dict(slice=s2)
    return dict(parallelism=pw.Pipeline(stages=2, microbatches=2, slices=pipe_slices))


def assert_differ(a, b, by=1e-3):
    """Guards against tests that cannot fail: the knob changes the numbers."""
    assert max(abs(x - y) for x, y in zip(a, b)) > by, (a, b)


def floats(losses):
    return [float(l) for l in losses]


# ---------------------------------------------------------------------- 1. optimizers

OPTIMIZERS = {
    "sgd_momentum_dampening_wd": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, dampening=0.2, weight_decay=1e-2),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd_maximize_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, maximize=True,
                                                  weight_decay=1e-2),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True,
                                                weight_decay=1e-2),
    "adam_maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, maximize=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True,
                                                  weight_decay=0.1),
    "adamw_maximize": lambda ps: torch.optim.AdamW(ps, lr=1e-2, maximize=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=2e-2, weight_decay=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=1e-2,
                                          decoupled_weight_decay=True),
    # 7 steps: RAdam's rectified branch starts at step 6 (rho_t > 5)
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=1e-2),
    "rmsprop_centered_momentum": lambda ps: torch.optim.RMSprop(
        ps, lr=1e-2, centered=True, momentum=0.9, weight_decay=1e-2),
    "adagrad_lr_decay": lambda ps: torch.optim.Adagrad(
        ps, lr=0.1, lr_decay=0.05, weight_decay=1e-2, initial_accumulator_value=0.1),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0, rho=0.9, weight_decay=1e-2),
    # eta and the step sizes start from the learning rate; etas=(0.4, ...) catches a
    # comparison with a float done in double (torch_xla) instead of in float32 (torch)
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.05, t0=2, lambd=1e-2, weight_decay=1e-2),
    "rprop_maximize": lambda ps: torch.optim.Rprop(ps, lr=1e-2, etas=(0.4, 1.3),
                                                   maximize=True),
    # Adafactor reads the step count and two norms with .item(); lr=0.8 takes
    # 1/sqrt(step) for rho after the first step, and the min with lr before
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=0.8, weight_decay=1e-2),
}
STEPS = {"radam": 7}

CASES = [("dp", o) for o in OPTIMIZERS] + [("fsdp", "adamw_amsgrad"),
                                           ("fsdp", "rmsprop_centered_momentum")]


@pytest.mark.parametrize("strat,opt_name", CASES, ids=[f"{s}-{o}" for s, o in CASES])
def test_optimizer_equals_torch_and_state_round_trips(s2, strat, opt_name):
    make_opt = OPTIMIZERS[opt_name]
    steps = STEPS.get(opt_name, 3)
    model, data = mlp(), batches(steps + 2)
    ref = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2, parallelism=strategy(strat))
    got = floats([tr.step(x, y) for x, y in data[:steps]])
    ref_opt = make_opt(ref.parameters())
    want, _ = torch_train(ref, ref_opt, data[:steps])
    assert_losses(got, want)

    # sync_to(tr.model): parameters and the optimizer state, as torch keeps them. State
    # within 1e-5, or 4x plain torch's own float32 error (against a float64 run), or
    # 1e-5 of the state's largest magnitude, where that is larger: centered RMSprop
    # divides by sqrt(v - avg^2), which cancels (its momentum buffer, up to 27: torch
    # fp32 2e-5 to 6e-5 off float64 depending on the CPU, pathways 1.5e-4; params 1e-6)
    assert tr.sync_to() is model
    assert_same_model(model, ref)
    r64 = copy.deepcopy(mlp()).double()
    opt64 = make_opt(r64.parameters())
    torch_train(r64, opt64, [(x.double(), y) for x, y in data[:steps]])
    for (n, p), p_ref, p64 in zip(model.named_parameters(), ref.parameters(),
                                  r64.parameters()):
        mine = {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
        theirs = {k: v for k, v in ref_opt.state[p_ref].items() if isinstance(v, torch.Tensor)}
        assert set(mine) == set(theirs), (n, set(mine), set(theirs))
        for k in theirs:
            own = float((theirs[k].double() - opt64.state[p64][k]).abs().max())
            scale = float(opt64.state[p64][k].abs().max())
            tol = max(TOL, 4 * own, TOL * scale)
            torch.testing.assert_close(mine[k].to(theirs[k].dtype), theirs[k], rtol=TOL,
                                       atol=tol, msg=lambda m, n=n, k=k: f"{n}.{k}: {m}")
    assert tr.steps == steps

    # the state round-trips: plain torch's next step on the CPU, from what sync_to wrote,
    # gives the same next loss as the Trainer's next step (on a copy: the Trainer's own
    # module and optimizer show the Trainer's next steps when read)
    cpu = copy.deepcopy(model)
    cpu_opt = make_opt(cpu.parameters())
    cpu_opt.load_state_dict(opt.state_dict())
    (x1, y1), (x2, y2) = data[steps:]
    tr.step(x1, y1)
    trainer_next = float(tr.step(x2, y2))
    cpu_opt.zero_grad()
    F.cross_entropy(cpu(x1), y1).backward()
    cpu_opt.step()
    with torch.no_grad():
        torch_next = F.cross_entropy(cpu(x2), y2).item()
    assert_losses([trainer_next], [torch_next])
    ref_next, _ = torch_train(ref, ref_opt, data[steps:])
    assert_losses([trainer_next], ref_next[1:])


# ---------------------------------------------------------------------- 2. schedulers

SCHEDULES = {
    "steplr_sgd": (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
                   lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)),
    "lambda_warmup_adamw": (lambda ps: torch.optim.AdamW(ps, lr=2e-2),
                            lambda o: torch.optim.lr_scheduler.LambdaLR(
                                o, lambda s: min(1.0, (s + 1) / 4))),
    # cycles Adam's betas[0] too (cycle_momentum): a static hyperparameter of the step
    "onecycle_adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2),
                      lambda o: torch.optim.lr_scheduler.OneCycleLR(
                          o, max_lr=5e-2, total_steps=5, cycle_momentum=True,
                          base_momentum=0.8, max_momentum=0.95)),
}


@pytest.mark.parametrize("who", ["trainer", "user"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_scheduler_equals_torch(s2, name, who):
    make_opt, make_sched = SCHEDULES[name]
    steps = 5
    model, data = mlp(), batches(steps)
    ref = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    sched = make_sched(opt)
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2,
                    scheduler=sched if who == "trainer" else None)
    got = []
    for x, y in data:
        got.append(tr.step(x, y))
        if who == "user":
            sched.step()             # writes param_groups[i]["lr"] (and betas) as in torch
    got = floats(got)
    ref_opt = make_opt(ref.parameters())
    ref_sched = make_sched(ref_opt)
    want, _ = torch_train(ref, ref_opt, data, scheduler=ref_sched)
    assert_losses(got, want)
    assert sched.last_epoch == ref_sched.last_epoch == steps
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)
    # the schedule matters: without it, plain torch's losses differ
    plain = copy.deepcopy(mlp())
    unscheduled, _ = torch_train(plain, make_opt(plain.parameters()), data)
    assert_differ(got, unscheduled, by=1e-4)
    # a momentum that changes every step (OneCycleLR) is an input once it has changed:
    # one more trace, not one a step (each of those was a compile)
    assert len(tr._programs["train_step"]._traces) <= 2


def test_schedulers_do_not_warn_that_the_optimizer_never_stepped(s2):
    """torch's schedulers warn when they step before optimizer.step() ("PyTorch will
    skip the first value of the schedule"): the Trainer's update is that step."""
    import warnings
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2, scheduler=sched)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(2):
            tr.step(x, y)
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], \
        [str(w.message) for w in caught]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


def muon_and_adamw(model):
    """Muon for the weight matrices, AdamW for the biases (Muon takes 2-d parameters
    only), each with its own schedule."""
    mats = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    opts = [torch.optim.Muon(mats, lr=2e-2, weight_decay=0.05),
            torch.optim.AdamW(rest, lr=1e-2)]
    return opts, [torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.5),
                  torch.optim.lr_scheduler.LinearLR(opts[1], 0.5, total_iters=3)]


def _train_two(model, opts, scheds, data):
    out = []
    for x, y in data:
        for o in opts:
            o.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for o in opts:
            o.step()
        for sch in scheds:
            sch.step()
        out.append(loss.item())
    return out


def test_a_list_of_optimizers_muon_and_adamw_equals_torch(s2, tmp_path):
    """``pw.Trainer(model, [muon, adamw], scheduler=[...])`` is the torch loop that
    steps both. Muon orthogonalizes its update in bfloat16 (torch's Newton-Schulz
    iteration), where XLA's fused elementwise ops round less often than torch's: the
    parameters agree within 2x the distance between torch's own bfloat16 iteration and
    the same iteration in float32, and the losses to 1e-3. AdamW's biases are fp32."""
    import torch.optim._muon as muon_mod
    steps = 4
    data = batches(steps + 1)
    model = mlp()
    ref, ref32 = copy.deepcopy(model), copy.deepcopy(model)
    opts, scheds = muon_and_adamw(model)
    tr = pw.Trainer(model, opts, F.cross_entropy, slice=s2, scheduler=scheds)
    got = floats([tr.step(x, y) for x, y in data[:steps]])
    want = _train_two(ref, *muon_and_adamw(ref), data[:steps])

    def newton_schulz_fp32(grad, coefficients, ns_steps, eps):
        a, b, c = coefficients
        g = grad.float().T if grad.size(0) > grad.size(1) else grad.float()
        g = g / g.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = g @ g.T
            g = a * g + (b * gram + c * gram @ gram) @ g
        return (g.T if grad.size(0) > grad.size(1) else g).bfloat16()

    bf16_iteration = muon_mod._zeropower_via_newtonschulz
    muon_mod._zeropower_via_newtonschulz = newton_schulz_fp32
    try:
        _train_two(ref32, *muon_and_adamw(ref32), data[:steps])
    finally:
        muon_mod._zeropower_via_newtonschulz = bf16_iteration
    assert_losses(got, want, rtol=1e-3, atol=1e-3)
    tr.sync_to()
    torch_own = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(),
                                                                   ref32.parameters()))
    ours = max(float((a - b).abs().max()) for a, b in zip(model.parameters(),
                                                             ref.parameters()))
    assert 0 < torch_own and ours <= 2 * torch_own, (ours, torch_own)
    # each optimizer holds its own parameters' state
    assert all("momentum_buffer" in st for st in opts[0].state.values())
    assert all("exp_avg" in st for st in opts[1].state.values())
    assert len(opts[0].state) == 3 and len(opts[1].state) == 3
    assert [o.param_groups[0]["lr"] for o in opts] == pytest.approx(
        [2e-2 * 0.25, 1e-2])
    # a checkpoint resumes both optimizers and both schedules
    tr.save(str(tmp_path / "ck"))
    fresh = mlp(seed=3)
    opts2, scheds2 = muon_and_adamw(fresh)
    tr2 = pw.Trainer(fresh, opts2, F.cross_entropy, slice=s2, scheduler=scheds2)
    tr2.load(str(tmp_path / "ck"))
    assert [s.last_epoch for s in scheds2] == [steps, steps]
    x, y = data[steps]
    assert_losses([float(tr2.step(x, y))], [float(tr.step(x, y))])


def test_a_list_of_optimizers_equals_torch_to_float_precision(s2):
    """Two float32 optimizers (SGD with momentum on the matrices, AdamW on the biases,
    one scheduled): losses, parameters and both optimizers' state within 1e-5."""
    def make(model):
        mats = [p for p in model.parameters() if p.ndim == 2]
        opts = [torch.optim.SGD(mats, lr=0.1, momentum=0.9),
                torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=1e-2)]
        return opts, [torch.optim.lr_scheduler.StepLR(opts[1], step_size=1, gamma=0.5)]
    data = batches(3)
    model = mlp()
    ref = copy.deepcopy(model)
    opts, scheds = make(model)
    tr = pw.Trainer(model, opts, F.cross_entropy, slice=s2, scheduler=scheds)
    got = floats([tr.step(x, y) for x, y in data])
    ref_opts, ref_scheds = make(ref)
    assert_losses(got, _train_two(ref, ref_opts, ref_scheds, data))
    assert_same_model(tr.sync_to(), ref)
    for o, ro in zip(opts, ref_opts):
        for st, rst in zip(o.state.values(), ro.state.values()):
            for k in rst:
                torch.testing.assert_close(st[k], rst[k], rtol=TOL, atol=TOL)


def test_reading_the_module_or_the_optimizer_after_steps_gives_the_trained_values(s2):
    """A torch loop's model holds the trained weights when the script reads it; here
    they live on the workers. ``model.state_dict()`` (torch.save at the end of a run),
    a CPU forward and ``optimizer.state_dict()`` sync first, without sync_to."""
    data = batches(4)
    model = mlp()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2)
    for x, y in data[:3]:
        tr.step(x, y)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    torch_train(ref, ref_opt, data[:3])
    saved = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(saved[k], v, rtol=TOL, atol=TOL)
    x, y = data[3]
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=TOL, atol=TOL)
    # a step later, the optimizer's state_dict is read first: it syncs again
    tr.step(x, y)
    torch_train(ref, ref_opt, [(x, y)])
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    for i in want:
        for k in want[i]:
            torch.testing.assert_close(got[i][k], want[i][k], rtol=TOL, atol=TOL)
    assert_same_model(model, ref)
    # the Trainer's own traces do not sync (a program is traced with fake tensors)
    assert tr._synced == tr._version == 4


def test_reduce_lr_on_plateau_stepped_by_the_user_equals_torch(s2):
    """ReduceLROnPlateau needs a metric: as scheduler= it is refused with what to do,
    and stepped by the user on the evaluate loss it gives torch's numbers."""
    model, data = mlp(), batches(6)
    val = batches(1, seed=7)[0]
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    with pytest.raises(pw.PathwaysError, match="sched.step"):
        pw.Trainer(model, opt, F.cross_entropy, slice=s2, scheduler=plateau(opt))
    sched = plateau(opt, factor=0.5, patience=0)
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2)
    got = []
    for x, y in data:
        got.append(float(tr.step(x, y)))
        sched.step(float(tr.evaluate(*val)))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    ref_sched = plateau(ref_opt, factor=0.5, patience=0)

    def evaluate_and_step(m, i):
        if i:
            m.eval()
            with torch.no_grad():
                ref_sched.step(F.cross_entropy(m(val[0]), val[1]).item())
            m.train()
    want, _ = torch_train(ref, ref_opt, data, each_step=evaluate_and_step)
    assert_losses(got, want)
    assert ref_opt.param_groups[0]["lr"] < 0.5          # the plateau did cut it


def _vary(opt, i):
    """Step i's hyperparameters, as a schedule would write them: every float one the
    optimizer's step reads changes (betas, rho, alpha, momentum, dampening shrink;
    weight decay, eps, lr_decay, momentum_decay grow)."""
    shrink = {"betas", "rho", "alpha", "momentum", "dampening"}
    for g in opt.param_groups:
        for k in ("momentum", "dampening", "weight_decay", "betas", "eps", "alpha", "rho",
                  "lr_decay", "momentum_decay"):
            if k in g:
                f = 1 - 0.05 * i if k in shrink else 1 + 0.5 * i
                g[k] = (tuple(b * f for b in g[k]) if isinstance(g[k], tuple)
                        else g[k] * f)


@pytest.mark.parametrize("opt_name", ["sgd_momentum_dampening_wd", "sgd_nesterov",
                                      "adamw_amsgrad", "adamax", "nadam", "radam",
                                      "rmsprop_centered_momentum", "adagrad_lr_decay",
                                      "adadelta"])
def test_hyperparameters_changed_every_step_equal_torch_without_retracing(s2, opt_name):
    """Every float hyperparameter changes before every step: the Trainer follows them
    as torch does, with at most two traces (the first step's constants, then inputs)."""
    make_opt = OPTIMIZERS[opt_name]
    steps = STEPS.get(opt_name, 4)
    model, data = mlp(), batches(steps)
    ref = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2)
    got = []
    for i, (x, y) in enumerate(data):
        _vary(opt, i)
        got.append(tr.step(x, y))
    ref_opt = make_opt(ref.parameters())
    want, _ = torch_train(ref, ref_opt, data, each_step=lambda m, i: _vary(ref_opt, i))
    assert_losses(floats(got), want)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)
    assert len(tr._programs["train_step"]._traces) <= 2


# ---------------------------------------------------------------------- 3. max_grad_norm

MAX_NORM = 0.05


def clip_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def clip_kw(strat, s2, pipe_slices) -> dict:
    """The clipping tests' layout. Under a pipeline, GPipe's two microbatches'
    gradients (each loss / 2) sum to the whole batch's: the reference is plain torch's
    whole-batch step."""
    if strat == "pipeline":
        return dict(parallelism=pw.Pipeline(stages=2, microbatches=2, slices=pipe_slices))
    return dict(slice=s2, parallelism=strategy(strat))


@pytest.mark.parametrize("strat", ["dp", "fsdp", "pipeline"])
def test_max_grad_norm_equals_clip_grad_norm(s2, pipe_slices, strat):
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)
    model, data = clip_model(), batches(4, batch=8, seed=3)
    ref, unclipped = copy.deepcopy(model), copy.deepcopy(model)
    kw = clip_kw(strat, s2, pipe_slices)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy,
                    max_grad_norm=MAX_NORM, **kw)
    assert tr.grad_norm is None                         # no update yet
    got, got_norms = [], []
    for x, y in data:
        got.append(float(tr.step(x, y)))
        got_norms.append(float(tr.grad_norm))
    want, norms = torch_train(ref, make_opt(ref.parameters()), data, clip=MAX_NORM)
    assert min(norms) > 2 * MAX_NORM, norms            # clipping happens at every step
    assert_losses(got, want)
    # trainer.grad_norm: what clip_grad_norm_ returned, before clipping (stop 39)
    assert_losses(got_norms, norms)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)
    free, _ = torch_train(unclipped, make_opt(unclipped.parameters()), data)
    assert_differ(got, free)


def _critic_loss_with_penalty_backward(out, y):
    """A WGAN-GP critic loss ported from a torch loop: the penalty's gradient goes in by
    its own ``backward`` before the loss is returned."""
    penalty = 0.5 * out.pow(2).mean()
    penalty.backward(retain_graph=True)
    return F.cross_entropy(out, y)


@pytest.mark.parametrize("strat", ["dp", "pipeline"])
def test_a_backward_inside_the_loss_fn_adds_its_gradient_as_torch_does(s2, pipe_slices,
                                                                      strat):
    """torch's optimizer steps on the sum of what every ``backward`` put in ``.grad``;
    the Trainer took the loss's gradient alone, silently: the parameters equalled a
    run without the penalty (89% off after 3 steps of WGAN-GP)."""
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)
    model, data = clip_model(), batches(3, batch=8, seed=3)
    ref, free = copy.deepcopy(model), copy.deepcopy(model)
    tr = pw.Trainer(model, make_opt(model.parameters()), _critic_loss_with_penalty_backward,
                    **clip_kw(strat, s2, pipe_slices))
    got = [float(tr.step(x, y)) for x, y in data]
    want, _ = torch_train(ref, make_opt(ref.parameters()), data,
                          loss_fn=_critic_loss_with_penalty_backward)
    assert_losses(got, want)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)
    without, _ = torch_train(free, make_opt(free.parameters()), data)
    assert_differ(got, without)


class _KeepsItsParameters(nn.Module):
    """SAM or a regulariser written over a list of the parameters kept in __init__."""

    def __init__(self):
        super().__init__()
        self.net = clip_model()
        self.plist = list(self.net.parameters())

    def forward(self, x):
        return self.net(x) * (1 + 0.05 * sum(p.pow(2).sum() for p in self.plist))


@pytest.mark.parametrize("where", ["module_list", "loss_closure"])
def test_parameters_reached_through_a_reference_kept_by_the_script_train(s2, where):
    """A list of the parameters kept in ``__init__``, or closed over by the loss_fn,
    held the real tensors, which a trace takes as constants: no gradient went through
    them (2e-3 off after 3 steps), and SAM's autograd.grad over them gave None."""
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.5)
    data = batches(3, batch=8, seed=3)

    def loss_for(model):
        if where == "module_list":
            return F.cross_entropy
        params = list(model.parameters())
        return lambda out, y: F.cross_entropy(out, y) + 0.05 * sum(
            p.pow(2).sum() for p in params)

    model = _KeepsItsParameters() if where == "module_list" else clip_model()
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, make_opt(model.parameters()), loss_for(model), slice=s2,
                    parallelism=pw.DataParallel("data"))
    got = [float(tr.step(x, y)) for x, y in data]
    want, _ = torch_train(ref, make_opt(ref.parameters()), data, loss_fn=loss_for(ref))
    assert_losses(got, want)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)


class _Poisson(nn.Module):
    """A physics-informed residual: the forward differentiates u w.r.t. its input."""

    def __init__(self, enable_grad: bool):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
        self.enable_grad = enable_grad

    def forward(self, x):
        with torch.enable_grad() if self.enable_grad else contextlib.nullcontext():
            x = x.clone().requires_grad_(True)
            u = self.net(x)
            du, = torch.autograd.grad(u.sum(), x, create_graph=True)
            d2u, = torch.autograd.grad(du.sum(), x, create_graph=True)
            return (d2u + math.pi ** 2 * torch.sin(math.pi * x)).pow(2).mean()


def test_evaluate_of_a_forward_that_differentiates_says_to_enable_grad(s2):
    """``evaluate`` runs under no_grad, as an evaluation loop does: a PINN's forward
    failed with torch's "does not require grad" and no word of why."""
    x = torch.rand(16, 1)
    torch.manual_seed(0)
    model = _Poisson(enable_grad=False)
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3), None, slice=s2)
    with pytest.raises(pw.TraceError, match=r"under torch.no_grad.*enable_grad"):
        tr.evaluate(x)
    model.enable_grad = True
    ref = copy.deepcopy(model).eval()
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=1e-3), None, slice=s2)
    torch.testing.assert_close(float(tr.evaluate(x)), ref(x).item(), rtol=TOL, atol=TOL)


def test_grad_norm_logged_without_clipping(s2):
    """``max_grad_norm=float("inf")`` measures the norm and scales nothing, as
    ``clip_grad_norm_(params, float("inf"))`` does: the losses are those of no
    clipping, bit for bit; without max_grad_norm there is no norm."""
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)
    model, data = clip_model(), batches(3, batch=8, seed=3)
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2,
                    max_grad_norm=float("inf"))
    other = pw.Trainer(plain, make_opt(plain.parameters()), F.cross_entropy, slice=s2)
    got, got_norms, free = [], [], []
    for x, y in data:
        got.append(float(tr.step(x, y)))
        got_norms.append(float(tr.grad_norm))
        free.append(float(other.step(x, y)))
    assert got == free and other.grad_norm is None
    want, norms = torch_train(ref, make_opt(ref.parameters()), data, clip=float("inf"))
    assert_losses(got, want)
    assert_losses(got_norms, norms)


@pytest.mark.parametrize("strat,norm", [("dp", None), ("fsdp", MAX_NORM), ("pipeline", None),
                                        ("pipeline", MAX_NORM)])
def test_max_grad_value_equals_clip_grad_value(s2, pipe_slices, strat, norm):
    """``clip_grad_value_`` (Lightning's gradient_clip_algorithm="value"), alone or
    before ``clip_grad_norm_`` (the norm then of the clamped gradients)."""
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)
    model, data = clip_model(), batches(4, batch=8, seed=3)
    ref, unclipped = copy.deepcopy(model), copy.deepcopy(model)
    kw = clip_kw(strat, s2, pipe_slices)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy,
                    max_grad_value=0.05, max_grad_norm=norm, **kw)
    got, got_norms = [], []
    for x, y in data:
        got.append(float(tr.step(x, y)))
        got_norms.append(None if norm is None else float(tr.grad_norm))
    want, norms = torch_train(ref, make_opt(ref.parameters()), data, clip=norm,
                              clip_value=0.05)
    assert_losses(got, want)
    if norm is not None:                # the norm of the clamped gradients, as torch's
        assert_losses(got_norms, norms)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)
    free, _ = torch_train(unclipped, make_opt(unclipped.parameters()), data, clip=norm)
    assert_differ(got, free)


# ---------------------------------------------------------------------- 4. accumulate


@pytest.mark.parametrize("strat", ["dp", "fsdp"])
def test_accumulate_equals_one_step_on_the_concatenated_batch(s2, strat):
    k, updates = 3, 2
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=2e-2, weight_decay=0.05)
    make_sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    model, micro = mlp(), batches(k * updates, batch=4, seed=4)
    ref = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2, parallelism=strategy(strat),
                    accumulate=k, scheduler=make_sched(opt))
    ref_opt = make_opt(ref.parameters())
    ref_sched = make_sched(ref_opt)
    held = copy.deepcopy(model)                     # the Trainer's parameters so far
    for u in range(updates):
        group = micro[u * k:(u + 1) * k]
        before = copy.deepcopy(ref)
        with torch.no_grad():
            micro_want = [F.cross_entropy(before(x), y).item() for x, y in group]
        got = [tr.step(x, y) for x, y in group[:-1]]
        # no update before the k-th call: the parameters are exactly those before
        now = tr.sync_to(copy.deepcopy(model))
        for (n, a), b in zip(now.named_parameters(), held.parameters()):
            assert torch.equal(a, b), n
        assert tr.steps == u and tr.micro == k - 1
        got.append(tr.step(*group[-1]))
        assert tr.steps == u + 1 and tr.micro == 0
        assert_losses(floats(got), micro_want)          # each micro-batch's own loss
        # the update: one plain torch step on the k micro-batches concatenated (mean loss)
        x = torch.cat([x for x, _ in group])
        y = torch.cat([y for _, y in group])
        torch_train(ref, ref_opt, [(x, y)], scheduler=ref_sched)
        held = tr.sync_to(copy.deepcopy(model))
        assert_same_model(held, ref)
        assert_differ([p.sum().item() for p in ref.parameters()],
                      [p.sum().item() for p in before.parameters()], by=1e-4)
    # the scheduler steps once per update, not per micro-step
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-2 * 0.5 ** updates)


@pytest.mark.parametrize("k", [1, 2])
def test_a_step_that_fails_before_it_runs_leaves_the_count_as_it_was(s2, k):
    """A loop that catches a bad batch's error and goes on (stop 43): the failed call
    had counted a micro-step, so with k=1 no later step was an update to the client
    (the scheduler froze, module reads stopped syncing) and with k=2 the updates were
    cut at other micro-batches. torch's loop never saw that batch."""
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    make_sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    model, data = mlp(), batches(4 * k, batch=4, seed=6)
    ref = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2, accumulate=k,
                    scheduler=make_sched(opt))
    for i, (x, y) in enumerate(data):
        if i == 1:
            with pytest.raises(pw.ShapeError):
                tr.step(x, y[:3])                   # one label short
        tr.step(x, y)
    assert tr.steps == 4 and tr.micro == 0
    ref_opt = make_opt(ref.parameters())
    big = [(torch.cat([x for x, _ in data[u * k:(u + 1) * k]]),
            torch.cat([y for _, y in data[u * k:(u + 1) * k]])) for u in range(4)]
    torch_train(ref, ref_opt, big, scheduler=make_sched(ref_opt))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)
    assert_same_model(model, ref)                   # a read of the module syncs it


@pytest.mark.parametrize("how", ["save", "state_dict"])
def test_a_resume_mid_accumulation_keeps_the_schedule_and_the_summed_gradients(
        s2, tmp_path, how):
    """A checkpoint taken between the micro-batches of an update, under a scheduler,
    restored into a new Trainer over a freshly built model: the learning rates, the
    scheduler's state, the gradients summed so far and the position in the
    accumulation come back, so the run equals plain torch's uninterrupted one.
    ``state_dict()`` used to hold none of them (a resume trained at the initial lr)."""
    import io
    k, updates, cut = 2, 3, 3                       # cut after 3 micro-batches: mid-update
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9)
    make_sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.1)
    model, micro = mlp(), batches(k * updates, batch=4, seed=12)
    ref, fresh = copy.deepcopy(model), copy.deepcopy(model)
    ref_opt = make_opt(ref.parameters())
    ref_sched = make_sched(ref_opt)
    for u in range(updates):
        group = micro[u * k:(u + 1) * k]
        torch_train(ref, ref_opt, [(torch.cat([x for x, _ in group]),
                                    torch.cat([y for _, y in group]))], scheduler=ref_sched)
    opt = make_opt(model.parameters())
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2, accumulate=k,
                    scheduler=make_sched(opt))
    for x, y in micro[:cut]:
        tr.step(x, y)
    if how == "save":
        tr.save(str(tmp_path / "ckpt"))
    else:
        buf = io.BytesIO()
        torch.save(tr.state_dict(), buf)
        buf.seek(0)
    opt2 = make_opt(fresh.parameters())
    sched2 = make_sched(opt2)
    tr2 = pw.Trainer(fresh, opt2, F.cross_entropy, slice=s2, accumulate=k, scheduler=sched2)
    if how == "save":
        tr2.load(str(tmp_path / "ckpt"))
    else:
        tr2.load_state_dict(torch.load(buf, weights_only=False))
    assert (tr2.steps, tr2.micro) == (tr.steps, tr.micro) == (1, 1)
    assert sched2.last_epoch == 1 and opt2.param_groups[0]["lr"] == pytest.approx(0.05)
    for x, y in micro[cut:]:
        tr2.step(x, y)
    assert opt2.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    assert_same_model(tr2.sync_to(copy.deepcopy(fresh)), ref)


def test_a_trainers_state_dict_leaves_out_non_persistent_buffers_as_torch_does(s2):
    """``state_dict()["model"]`` loads into the module with load_state_dict's strict
    check: like ``model.state_dict()``, it leaves out buffers registered
    ``persistent=False`` (a rotary table, a counter), which it used to hold ("Unexpected
    key(s)"); loading it back into a Trainer keeps their values."""
    class WithTables(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Linear(8, 4)
            self.register_buffer("rope", torch.arange(8.0), persistent=False)

        def forward(self, x):
            return self.a(x + self.rope)

    model = WithTables()
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                    slice=s2)
    x, y = batches(1)[0]
    tr.step(x, y)
    sd = tr.state_dict()
    assert set(sd["model"]) == set(model.state_dict()) == {"a.weight", "a.bias"}
    fresh = WithTables()
    fresh.load_state_dict(sd["model"])               # strict
    tr2 = pw.Trainer(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), F.cross_entropy,
                     slice=s2)
    tr2.load_state_dict(sd)
    assert_losses([float(tr2.step(x, y))], [float(tr.step(x, y))])


def test_accumulate_with_clipping(s2):
    k = 2
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)
    model, micro = mlp(), batches(2 * k, batch=4, seed=5)
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2,
                    accumulate=k, max_grad_norm=MAX_NORM)
    got_norms = []
    for i, (x, y) in enumerate(micro):
        tr.step(x, y)
        if i % k == k - 1:
            got_norms.append(float(tr.grad_norm))    # the norm at each update
        elif i == 0:
            assert tr.grad_norm is None             # a micro-step updates nothing
    whole = [(torch.cat([micro[i][0], micro[i + 1][0]]),
              torch.cat([micro[i][1], micro[i + 1][1]])) for i in range(0, len(micro), k)]
    _, norms = torch_train(ref, make_opt(ref.parameters()), whole, clip=MAX_NORM)
    assert min(norms) > 2 * MAX_NORM
    assert_losses(got_norms, norms)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)


# ---------------------------------------------------------------------- float64

@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    lambda ps: torch.optim.Adam(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    lambda ps: torch.optim.RAdam(ps, lr=1e-2)], ids=["sgd", "adam", "adamw", "radam"])
def test_float64_training_equals_torch_in_float64(s2, make_opt):
    """A model in float64 (scientific ML, a gradient check) trains as torch trains it,
    to float64's precision, and its loss is float64. Before, the learning rate went
    in as a float32 input and Adam's step count as a float32 tensor, so each update was
    rounded to float32's precision (losses 1e-7 off after 4 steps, a BatchNorm network
    1e-5), and the loss came back rounded to float32."""
    def net():          # no GELU: XLA's float64 erf is not torch's to the last bits
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()

    data = [(x.double(), y) for x, y in batches(4, seed=3)]
    ref, model = net(), net()
    want, _ = torch_train(ref, make_opt(ref.parameters()), data)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2)
    losses = [tr.step(x, y) for x, y in data]
    assert all(a.dtype == torch.float64 for a in losses)
    assert_losses(floats(losses), want, rtol=1e-12, atol=1e-12)
    tr.sync_to()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12,
                                   msg=lambda m, n=n: f"{n}: {m}")


# ---------------------------------------------------------------------- 5. bf16

@pytest.mark.parametrize("strat", ["dp", "pipeline"])
def test_bf16_equals_torch_autocast(s2, pipe_slices, strat):
    """``precision="bf16"``: forward and loss under bfloat16 autocast. The first loss
    (no update yet) is torch's autocast loss to 1e-6, which the float32 one is not:
    before stop 39 a Pipeline's stages ran in float32 whatever the precision."""
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    model, data = mlp(), batches(3, seed=6)
    ref, ref32 = copy.deepcopy(model), copy.deepcopy(model)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy,
                    precision="bf16", **dp_or_pipeline(strat, s2, pipe_slices))
    got = floats([tr.step(x, y) for x, y in data])
    want, _ = torch_train(ref, make_opt(ref.parameters()), data, bf16=True)
    fp32, _ = torch_train(ref32, make_opt(ref32.parameters()), data)
    print(f"bf16 losses: pathways {got}  torch autocast {want}  torch fp32 {fp32}")
    assert_losses(got, want, rtol=BF16_RTOL, atol=0)
    assert got[0] == pytest.approx(want[0], rel=1e-6, abs=0)
    assert abs(fp32[0] - want[0]) > 1e-5        # what the 1e-6 tells apart
    # parameters and optimizer state stay float32, and close to torch's
    assert all(a.dtype == torch.float32 for a in tr.params.values())
    assert all(a.dtype == torch.float32 for st in tr.states[0].values() for a in st.values())
    # evaluation runs under the same autocast
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref_eval = F.cross_entropy(copy.deepcopy(ref).eval()(data[0][0]), data[0][1])
    assert float(tr.evaluate(*data[0])) == pytest.approx(float(ref_eval), rel=BF16_RTOL)
    trained = tr.sync_to(copy.deepcopy(model))
    for (n, a), b in zip(trained.named_parameters(), ref.parameters()):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b.detach(), rtol=BF16_RTOL, atol=BF16_RTOL,
                                   msg=lambda m, n=n: f"{n}: {m}")
    # the forward does run in bf16 (as torch's autocast: Linear outputs bfloat16)
    out = tr.predict(data[0][0])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref_out = trained.eval()(data[0][0])
    assert out.dtype == ref_out.dtype == torch.bfloat16
    torch.testing.assert_close(out.torch().float(), ref_out.float(), rtol=BF16_RTOL,
                               atol=BF16_RTOL)


def test_bf16_batch_norm_after_a_convolution_equals_torch_autocast(s2):
    """Under autocast a convolution outputs bfloat16 into a float32 batch norm: torch's
    CPU kernel takes the mix and computes in float32. XLA's BatchNormGrad refuses mixed
    precision, so before stop 36 every ResNet-like model failed to compile with
    ``precision="bf16"`` ("Seen floating point types of different precisions in
    batch-norm-grad"); its backward is now torch's decomposition."""
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(3)]
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    model, ref = net(), net()
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2,
                    parallelism=pw.DataParallel("data"), precision="bf16")
    got = floats([tr.step(x, y) for x, y in data])
    want, _ = torch_train(ref, make_opt(ref.parameters()), data, bf16=True)
    assert_losses(got, want, rtol=BF16_RTOL, atol=0)
    tr.sync_to()
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert a.dtype == b.dtype, n
        torch.testing.assert_close(a, b, rtol=BF16_RTOL, atol=BF16_RTOL,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_steps_inside_the_users_own_autocast_equal_torch(s2):
    """``with torch.autocast(...): trainer.step(x, y)``, on every other step, as a user
    of plain torch writes it around the forward: those steps run in bfloat16 as torch's
    do and the others in float32 (the autocast state is part of a program's key; before,
    the first program traced was reused whatever the context)."""
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    model, data = mlp(), batches(4, seed=7)
    ref = copy.deepcopy(model)
    opt, want = make_opt(ref.parameters()), []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i % 2 == 1):
            loss = F.cross_entropy(ref(x), y)
        loss.float().backward()
        opt.step()
        want.append(loss.item())
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2)
    got = []
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i % 2 == 1):
            got.append(float(tr.step(x, y)))
    assert_losses(got, want, rtol=BF16_RTOL, atol=0)
    assert got[0] == pytest.approx(want[0], rel=1e-6)       # the float32 step is exact
    # the bfloat16 steps are not float32 ones: torch's fp32 loss differs from both
    ref32 = copy.deepcopy(model)
    fp32, _ = torch_train(ref32, make_opt(ref32.parameters()), data)
    assert abs(got[1] - fp32[1]) > 1e-4 and abs(want[1] - fp32[1]) > 1e-4


# ---------------------------------------------------------------------- 5b. fp16

FP16_RTOL = 2e-3


@pytest.mark.parametrize("case", ["adam", "adam_fsdp", "sgd_dampened_clipped",
                                  "adamw_accumulate"])
def test_fp16_with_loss_scaling_equals_torch_gradscaler(s2, case, tmp_path):
    """``precision="fp16"``: float16 autocast with torch.amp.GradScaler's dynamic loss
    scaling, against torch's own recipe. Every update's scale equals torch's exactly
    (overflowing steps skipped and the scale halved, growth after ``growth_interval``
    clean steps), a skipped update leaves parameters and state bit for bit as they
    were, state a skipped first update would have made is not made (SGD with
    dampening), and the user's GradScaler is brought up to date by ``sync_to``. Losses
    and parameters within 2e-3 relative: the float16 forward rounds as torch's does
    op by op, not in the same order inside every kernel. Before, "fp16" was refused."""
    make_opt, kw, k = {
        "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2), {}, 1),
        "adam_fsdp": (lambda ps: torch.optim.Adam(ps, lr=1e-2),
                      {"parallelism": pw.FullyShardedDataParallel("data")}, 1),
        "sgd_dampened_clipped": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                            dampening=0.1),
                                 {"max_grad_norm": 0.5}, 1),
        "adamw_accumulate": (lambda ps: torch.optim.AdamW(ps, lr=1e-2), {"accumulate": 2},
                             2),
    }[case]
    model, data = fp16_model(), fp16_batches()
    if k > 1:       # the overflowing batches end an accumulation: both updates skip
        data = [data[i] for i in (1, 0, 2, 4, 5, 6, 3, 1)]
    ref = copy.deepcopy(model)
    ref_opt = make_opt(ref.parameters())
    want, want_scales = torch_fp16_train(
        ref, ref_opt, data,
        torch.amp.GradScaler("cpu", growth_interval=2), clip=kw.get("max_grad_norm"),
        accumulate=k)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2,
                    precision="fp16", scaler=scaler, **kw)
    got, scales, before_skip = [], [], None
    for i, (x, y) in enumerate(data):
        if i == 3 * k:                   # the second skipped update: nothing changes
            before_skip = tr.state_dict()
        got.append(float(tr.step(x, y)))
        if (i + 1) % k == 0:
            scales.append(tr.loss_scale)
        if i == 3 * k + k - 1:
            after = tr.state_dict()
            for part in ("model", "optim"):
                for n, t in before_skip[part].items():
                    same = (torch.equal(t, after[part][n]) if part == "model" else
                            all(torch.equal(v, after[part][n][kk]) for kk, v in t.items()))
                    assert same, f"{part} {n} changed in a skipped update"
    print(f"fp16 {case}: losses {got} torch {want}; scales {scales} torch {want_scales}")
    assert scales == want_scales
    seq = [65536.0] + scales                    # updates were skipped, and it grew again
    assert any(b < a for a, b in zip(seq, seq[1:])) and any(b > a for a, b in zip(seq, seq[1:]))
    assert_losses(got, want, rtol=FP16_RTOL, atol=1e-4)
    tr.sync_to()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=FP16_RTOL, atol=FP16_RTOL,
                                   msg=lambda m, n=n: f"{n}: {m}")
    # the optimizer's state as torch's: Adam's step counts the updates not skipped, and
    # SGD's momentum buffer is the gradient of its first update not skipped
    for p, q in zip(model.parameters(), ref.parameters()):
        mine, theirs = tr.optimizer.state[p], ref_opt.state[q]
        assert set(mine) == set(theirs)
        for key, v in theirs.items():
            torch.testing.assert_close(mine[key], v, rtol=FP16_RTOL, atol=FP16_RTOL)
    assert scaler.get_scale() == want_scales[-1]
    # a checkpoint holds the scale: a new Trainer goes on from it as torch's would
    tr.save(str(tmp_path / "ckpt"))
    copied = copy.deepcopy(model)
    again = pw.Trainer(copied, make_opt(copied.parameters()),
                       F.cross_entropy, slice=s2, precision="16-mixed",
                       scaler=torch.amp.GradScaler("cpu", growth_interval=2), **kw)
    assert again.loss_scale == 65536.0
    again.load(str(tmp_path / "ckpt"))
    assert again.loss_scale == tr.loss_scale == want_scales[-1]


def test_precision_names_and_what_they_refuse(s2, pipe_slices):
    """Lightning's names for the same modes are taken; what cannot work says why."""
    model = mlp()
    make = lambda **kw: pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   F.cross_entropy, **kw)
    assert make(slice=s2, precision="bf16-mixed").options.precision == "bf16"
    assert make(slice=s2, precision="16-mixed").loss_scale == 65536.0
    assert make(slice=s2, precision="fp32").loss_scale is None
    off = make(slice=s2, precision="fp16",
               scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert off.options.precision == "fp16" and off.loss_scale is None
    with pytest.raises(pw.PathwaysError, match="model.bfloat16"):
        make(slice=s2, precision="bf16-true")
    # a GPU habit: float16 autocast around the step, where no GradScaler can reach
    plain, (x, y) = make(slice=s2), batches(1)[0]
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.warns(UserWarning, match="precision='fp16' instead"):
            plain.step(x, y)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            plain.step(x, y)                        # said once
    with pytest.raises(pw.PathwaysError, match="takes a torch.amp.GradScaler"):
        make(slice=s2, precision="fp16", scaler={"init_scale": 1024})
    with pytest.raises(pw.PathwaysError, match="goes with precision='fp16'"):
        make(slice=s2, precision="bf16", scaler=torch.amp.GradScaler("cpu"))


class _TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.a(x[:, :4]), self.b(x[:, 4:])


def test_fp16_with_two_optimizers_skips_only_the_one_that_overflowed(s2):
    """GradScaler checks each optimizer's gradients on their own: a step where only
    ``b``'s overflow skips ``b``'s update and makes ``a``'s, and the scale backs off.
    The Trainer used to skip both."""
    loss_fn = lambda o, y: F.mse_loss(o[0], y) + o[1].mean()
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g))
            for _ in range(4)]
    data[1][0][:, 4:] *= 3e4            # only b's (scaled) gradients overflow in fp16
    opts = lambda m: [torch.optim.SGD(m.a.parameters(), lr=0.1),
                      torch.optim.SGD(m.b.parameters(), lr=0.1, momentum=0.9)]
    ref = _TwoBranches()
    ref_opts, ref_scaler = opts(ref), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    want = []
    for x, y in data:
        with torch.autocast("cpu", torch.float16):
            loss = loss_fn(ref(x), y)
        for o in ref_opts:
            o.zero_grad()
        ref_scaler.scale(loss).backward()
        for o in ref_opts:
            ref_scaler.step(o)
        ref_scaler.update()
        want.append(loss.item())
    model = _TwoBranches()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    tr = pw.Trainer(model, opts(model), loss_fn, slice=s2, precision="fp16", scaler=scaler)
    got = [float(tr.step(x, y)) for x, y in data]
    assert_losses(got, want)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)
    assert tr.loss_scale == ref_scaler.get_scale() == 128.0


@pytest.mark.parametrize("case", ["adam_clipped", "sgd_dampened"])
def test_pipeline_fp16_with_loss_scaling_equals_torch_gradscaler(pipe_slices, case,
                                                                 tmp_path):
    """``precision="fp16"`` under a 2-stage Pipeline, against torch's recipe over the
    same micro-batches (``scaler.scale(loss / m).backward()`` each, then one
    ``unscale_``, clip, ``step``, ``update``). A stage's gradients overflow where the
    other's may not: every stage must skip together and keep the same scale, so the
    stages' found_inf meet on the first stage's slice beside the clipping norm's parts.
    Every scale equals torch's; losses, parameters and state within 2e-3 relative.
    Before stop 39, refused."""
    make_opt, clip = {
        "adam_clipped": (lambda ps: torch.optim.Adam(ps, lr=1e-2), 0.5),
        "sgd_dampened": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                    dampening=0.1), None),
    }[case]
    model, data = fp16_model(), fp16_batches()
    ref = copy.deepcopy(model)
    ref_opt = make_opt(ref.parameters())
    micro = [(x[a:a + 4], y[a:a + 4]) for x, y in data for a in (0, 4)]
    losses, want_scales = torch_fp16_train(
        ref, ref_opt, micro, torch.amp.GradScaler("cpu", growth_interval=2), clip=clip,
        accumulate=2)
    want = [(a + b) / 2 for a, b in zip(losses[::2], losses[1::2])]

    def pipeline_trainer(m):
        return pw.Trainer(m, make_opt(m.parameters()), F.cross_entropy,
                          parallelism=pw.Pipeline(stages=2, microbatches=2,
                                                  slices=pipe_slices),
                          precision="fp16", max_grad_norm=clip,
                          scaler=torch.amp.GradScaler("cpu", growth_interval=2))
    tr = pipeline_trainer(model)
    got, scales, norms = [], [], []
    for x, y in data:
        got.append(float(tr.step(x, y)))
        scales.append(tr.loss_scale)
        norms.append(None if clip is None else float(tr.grad_norm))
    print(f"pipeline fp16 {case}: losses {got} torch {want}; scales {scales} "
          f"torch {want_scales}")
    assert scales == want_scales
    seq = [65536.0] + scales
    assert any(b < a for a, b in zip(seq, seq[1:])) and any(b > a for a, b in zip(seq, seq[1:]))
    if clip is not None:    # the norm of the unscaled gradients: not finite on overflow
        skipped = [b < a for a, b in zip(seq, seq[1:])]
        assert [not math.isfinite(n) for n in norms] == skipped, norms
    # both stages' copies of the scale stay equal
    assert [float(sc["scale"].torch()) for sc in tr._scalers] == [scales[-1]] * 2
    assert_losses(got, want, rtol=FP16_RTOL, atol=1e-4)
    tr.sync_to()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=FP16_RTOL, atol=FP16_RTOL,
                                   msg=lambda m, n=n: f"{n}: {m}")
    for p, q in zip(model.parameters(), ref_opt.param_groups[0]["params"]):
        mine, theirs = tr.optimizer.state[p], ref_opt.state[q]
        assert set(mine) == set(theirs)
        for key, v in theirs.items():
            torch.testing.assert_close(mine[key], v, rtol=FP16_RTOL, atol=FP16_RTOL)
    # a checkpoint restores the scale on every stage
    tr.save(str(tmp_path / "ckpt"))
    again = pipeline_trainer(copy.deepcopy(model))
    again.load(str(tmp_path / "ckpt"))
    assert [float(sc["scale"].torch()) for sc in again._scalers] == [scales[-1]] * 2


def tied_lm():
    """A language model's shape: input and output embeddings are one tensor."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Tanh(),
                      nn.Linear(8, 16, bias=False))
    m[3].weight = m[0].weight
    return m


@pytest.mark.parametrize("precision", [None, "fp16"])
def test_pipeline_with_tied_embeddings_equals_torch(pipe_slices, precision):
    """Tied input and output embeddings in two stages (GPT-2's): the first stage holds
    the tensor and lends the last a copy each step; the copy's gradient comes back and
    is added to the first stage's before clipping (the norm counts it once) and the
    update, as torch's one ``.grad``. The last stage then has no parameter of its own
    (and, under fp16, only its copy of the loss scale to update). The tie survives
    ``sync_to``. Before stop 39, a PlacementError ("got no pw.Array input")."""
    g = torch.Generator().manual_seed(2)
    data = [(torch.randint(0, 16, (8,), generator=g), torch.randint(0, 16, (8,), generator=g))
            for _ in range(4)]
    model, ref = tied_lm(), tied_lm()
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy,
                    parallelism=pw.Pipeline(stages=2, microbatches=2, slices=pipe_slices),
                    max_grad_norm=0.5, precision=precision)
    got, got_norms = [], []
    for x, y in data:
        got.append(float(tr.step(x, y)))
        got_norms.append(float(tr.grad_norm))
    ref_opt, want, norms = make_opt(ref.parameters()), [], []
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    for x, y in data:
        ref_opt.zero_grad()
        losses = []
        for part in (slice(0, 4), slice(4, 8)):       # the pipeline's micro-batches
            with torch.autocast("cpu", dtype=torch.float16, enabled=precision == "fp16"):
                loss = F.cross_entropy(ref(x[part]), y[part])
            scaler.scale(loss / 2).backward()
            losses.append(loss.item())
        scaler.unscale_(ref_opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        scaler.step(ref_opt)
        scaler.update()
        want.append(sum(losses) / 2)
    finite = [n for n in norms if math.isfinite(n)]
    assert min(finite) > 0.5, norms
    tol = TOL if precision is None else FP16_RTOL
    assert_losses(got, want, rtol=tol, atol=tol)
    assert [math.isfinite(n) for n in got_norms] == [math.isfinite(n) for n in norms]
    assert_losses([n for n in got_norms if math.isfinite(n)], finite, rtol=tol, atol=tol)
    if precision == "fp16":     # the last stage (no parameters) kept its copy up to date
        assert len(finite) < len(norms)             # an update was skipped
        assert [float(sc["scale"].torch()) for sc in tr._scalers] == [scaler.get_scale()] * 2
    tr.sync_to()
    assert model[3].weight is model[0].weight
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=tol, atol=tol,
                                   msg=lambda m, n=n: f"{n}: {m}")
    x = data[0][0]
    ref.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16,
                                         enabled=precision == "fp16"):
        ref_out = ref(x)
    torch.testing.assert_close(tr.predict(x).torch().float(), ref_out.float(), rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("strat", ["dp", "pipeline"])
def test_freezing_and_unfreezing_between_steps_equals_torch(s2, pipe_slices, strat):
    """Gradual unfreezing, as fine-tuning scripts do it: requires_grad changed between
    steps. torch's AdamW skips a frozen parameter (no gradient) and keeps its state;
    unfrozen for the first time, it starts from fresh state. The Trainer used to keep
    the set it was built with, silently."""
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    model, data = mlp(), batches(6, seed=8)
    ref = copy.deepcopy(model)
    # step 0-1: first layer frozen; 2-3: all trained; 4: last layer frozen; 5: all again
    plan = {0: ("0", False), 2: ("0", True), 4: ("4", False), 5: ("4", True)}

    def apply(m, i):
        if i in plan:
            layer, flag = plan[i]
            m.get_submodule(layer).weight.requires_grad_(flag)

    want, _ = torch_train(ref, make_opt(ref.parameters()), data, each_step=apply)
    got, tr = trainer_train(model, make_opt, data, apply,
                            **dp_or_pipeline(strat, s2, pipe_slices))
    assert_losses(got, want, rtol=1e-5, atol=1e-6)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref, atol=1e-6)


@pytest.mark.parametrize("strat", ["dp", "pipeline"])
def test_gradient_hooks_on_parameters_run_as_in_torch(s2, pipe_slices, strat):
    """``p.register_hook`` (a gradient scaled or clamped) changes the update as in
    torch; one registered after a step applies from the next step. They used to be
    dropped: the step traces other tensors than the module's parameters. A pipeline
    runs a hook on each micro-batch's gradient, as torch's gradient accumulation does,
    so it gets a linear one here (a clamp of the parts is not a clamp of the sum)."""
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)
    model, data = mlp(), batches(4, seed=9)
    ref = copy.deepcopy(model)

    def hook(m, i):
        if i == 0:
            m[0].weight.register_hook(lambda g: g * 0.25)
        if i == 2:
            m[4].bias.register_hook((lambda g: g.clamp(-0.01, 0.01)) if strat == "dp"
                                    else (lambda g: g * 3.0))

    want, _ = torch_train(ref, make_opt(ref.parameters()), data, each_step=hook)
    kw = dp_or_pipeline(strat, s2, pipe_slices)
    got, tr = trainer_train(model, make_opt, data, hook, **kw)
    assert_losses(got, want, rtol=1e-5, atol=1e-6)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref, atol=1e-6)
    plain = mlp()
    plain[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(pw.TraceError, match="register_post_accumulate_grad_hook"):
        pw.Trainer(plain, make_opt(plain.parameters()), F.cross_entropy, **kw).step(*data[0])


def test_requires_grad_changed_inside_an_accumulation_is_refused(s2):
    model = mlp()
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                    slice=s2, accumulate=2)
    (x, y), = batches(1)
    tr.step(x, y)
    model[0].weight.requires_grad_(False)
    with pytest.raises(pw.PathwaysError, match="after the update"):
        tr.step(x, y)
    model[0].weight.requires_grad_(True)
    float(tr.step(x, y))          # the accumulation goes on as before


# ---------------------------------------------------------------------- 6. evaluate, predict

def bn_dropout_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(16, 4))


def test_evaluate_and_predict_equal_torch_eval(s2):
    model, data = bn_dropout_model(), batches(4, seed=7)
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                    F.cross_entropy, slice=s2, seed=0)
    for x, y in data[:3]:
        tr.step(x, y)
    x, y = data[3]
    before = tr.state_dict()
    ev = tr.evaluate(x, y)
    out = tr.predict(x)
    after = tr.state_dict()
    # neither changes parameters, BatchNorm buffers or optimizer state
    for n in before["model"]:
        assert torch.equal(before["model"][n], after["model"][n]), n
    for n in before["optim"]:
        for key in before["optim"][n]:
            assert torch.equal(before["optim"][n][key], after["optim"][n][key]), (n, key)
    assert int(after["model"]["1.num_batches_tracked"]) == 3
    trained = tr.sync_to(copy.deepcopy(model)).eval()
    with torch.no_grad():
        want_out = trained(x)
        want = F.cross_entropy(want_out, y).item()
        train_mode = F.cross_entropy(copy.deepcopy(trained).train()(x), y).item()
    assert_losses([float(ev)], [want])
    assert abs(train_mode - want) > 1e-3                # eval mode is what makes it equal
    assert float(tr.evaluate(x, y)) == float(ev)        # no dropout: deterministic
    assert isinstance(out, pw.Array) and out.shape == (8, 4)
    torch.testing.assert_close(out.torch(), want_out, rtol=TOL, atol=TOL)
    assert model.training and all(m.training for m in model.modules())


class MultiOut(nn.Module):
    """A model whose output is a dict holding a tuple."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.cls = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 2)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return {"logits": self.cls(h), "pair": (self.aux(h), h.sum(-1))}


def multi_loss(out, y):
    return F.cross_entropy(out["logits"], y) + out["pair"][0].pow(2).mean()


def test_predict_keeps_the_output_structure(s2):
    torch.manual_seed(0)
    model, data = MultiOut(), batches(3, seed=8)
    ref = copy.deepcopy(model)
    make_opt = lambda ps: torch.optim.Adam(ps, lr=1e-2)
    tr = pw.Trainer(model, make_opt(model.parameters()), multi_loss, slice=s2)
    got = floats([tr.step(x, y) for x, y in data[:2]])
    want, _ = torch_train(ref, make_opt(ref.parameters()), data[:2], loss_fn=multi_loss)
    assert_losses(got, want)
    x = data[2][0]
    out = tr.predict(x)
    with torch.no_grad():
        ref_out = ref.eval()(x)
    assert isinstance(out, dict) and set(out) == {"logits", "pair"}
    assert isinstance(out["pair"], tuple) and len(out["pair"]) == 2
    flat = [out["logits"], *out["pair"]]
    ref_flat = [ref_out["logits"], *ref_out["pair"]]
    for a, b in zip(flat, ref_flat):
        assert isinstance(a, pw.Array)
        torch.testing.assert_close(a.torch(), b, rtol=TOL, atol=TOL)
    assert_losses([float(tr.evaluate(x, data[2][1]))],
                  [multi_loss(ref_out, data[2][1]).item()])


# ---------------------------------------------------------------------- 7. calling conventions

class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(6, 4)

    def forward(self, x, z):
        return self.a(x) + torch.tanh(self.b(z))


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, features, mask=None, scale=1.0):
        h = torch.tanh(self.a(features)) * scale
        if mask is not None:
            h = h * mask[:, None]
        return self.b(h)


class ScalarLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


class DictLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def _conventions(g):
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    z = torch.randn(8, 6, generator=g)
    mask = (torch.rand(8, generator=g) > 0.3).float()
    return {
        # name: (model class, loss_fn, trainer inputs, targets, plain torch's loss)
        "tuple": (TwoInputs, F.cross_entropy, (x, z), y,
                  lambda m: F.cross_entropy(m(x, z), y)),
        "dict": (Keywords, F.cross_entropy, {"features": x, "mask": mask, "scale": 0.5}, y,
                 lambda m: F.cross_entropy(m(features=x, mask=mask, scale=0.5), y)),
        "scalar_loss": (ScalarLoss, None, (x, y), None, lambda m: m(x, y)),
        "dict_loss": (DictLoss, None, {"x": x, "labels": y}, None,
                      lambda m: m(x=x, labels=y)["loss"]),
    }


@pytest.mark.parametrize("convention", ["tuple", "dict", "scalar_loss", "dict_loss"])
def test_calling_conventions(s2, convention):
    g = torch.Generator().manual_seed(9)
    steps = [_conventions(g)[convention] for _ in range(3)]
    cls, loss_fn = steps[0][0], steps[0][1]
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)
    tr = pw.Trainer(model, make_opt(model.parameters()), loss_fn, slice=s2)
    got = floats([tr.step(inputs, targets) for _, _, inputs, targets, _ in steps])
    ref_opt = make_opt(ref.parameters())
    want = []
    for *_, torch_loss in steps:
        ref_opt.zero_grad()
        loss = torch_loss(ref)
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    assert_losses(got, want)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)


def _loss_and_accuracy(form):
    def loss_fn(out, y):
        loss, acc = F.cross_entropy(out, y), (out.argmax(1) == y).float().mean()
        return (loss, acc) if form == "tuple" else {"loss": loss, "accuracy": acc}
    return loss_fn


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_a_loss_fn_that_returns_metrics_beside_the_loss(s2, pipe_slices, form):
    """(loss, metric) or {"loss": ..., ...}: the step trains on the loss and returns
    the whole result (Arrays), as torch code unpacks it; fit reads the loss; each
    accumulate micro-step returns its own. Where a step combines several programs'
    losses (Pipeline, MultiIsland) it is refused with what to do."""
    loss_fn = _loss_and_accuracy(form)
    model, data = mlp(), batches(3)
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.2), loss_fn, slice=s2)
    got = [tr.step(x, y) for x, y in data]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    for (x, y), result in zip(data, got):
        ref_opt.zero_grad()
        loss, acc = F.cross_entropy(ref(x), y), (ref(x).argmax(1) == y).float().mean()
        loss.backward()
        ref_opt.step()
        mine = result if form == "tuple" else (result["loss"], result["accuracy"])
        assert isinstance(mine[0], pw.Array)
        assert_losses([float(mine[0])], [loss.item()])
        assert float(mine[1]) == acc.item()
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)
    x, y = data[0]
    ev = tr.evaluate(x, y)
    assert float(ev[0] if form == "tuple" else ev["loss"]) == pytest.approx(
        F.cross_entropy(ref.eval()(x), y).item(), abs=TOL)
    assert len(tr.fit(data, steps=2)) == 2
    # with accumulate, each micro-step returns its own micro-batch's result
    other = mlp()
    acc_tr = pw.Trainer(other, torch.optim.SGD(other.parameters(), lr=0.2), loss_fn,
                        slice=s2, accumulate=2)
    fresh = mlp()
    for half in (slice(0, 4), slice(4, 8)):
        r = acc_tr.step(x[half], y[half])
        want = (fresh(x[half]).argmax(1) == y[half]).float().mean().item()
        assert float(r[1] if form == "tuple" else r["accuracy"]) == want
    other = mlp()
    t = pw.Trainer(other, torch.optim.SGD(other.parameters(), lr=0.2), loss_fn,
                   parallelism=pw.Pipeline(stages=2, microbatches=2, slices=pipe_slices))
    with pytest.raises(pw.TraceError, match="loss alone"):
        t.step(x, y)


@pytest.mark.parametrize("strat", ["dp", "fsdp"])
def test_a_last_batch_the_devices_do_not_divide_trains_as_in_torch(s2, strat):
    """A DataLoader without drop_last ends an epoch with a partial batch (21 samples in
    batches of 8: the last has 5, which 2 devices cannot split): fit trains on it as a
    torch loop does, where it used to stop there with a ShardingError."""
    torch.manual_seed(3)
    ds = torch.utils.data.TensorDataset(torch.randn(21, 8), torch.randint(0, 4, (21,)))
    loader = torch.utils.data.DataLoader(ds, batch_size=8)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2,
                    parallelism=strategy(strat))
    got = list(tr.fit(loader, steps=3))
    want, _ = torch_train(ref, make_opt(ref.parameters()), list(loader))
    assert [len(y) for _, y in loader] == [8, 8, 5]
    assert_losses(got, want)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_a_step_inside_no_grad_still_trains(s2, context):
    """A step computes its own gradients: called (and traced) inside an evaluation
    loop's no_grad or inference_mode it trains as outside, where its trace failed
    with "element 0 of tensors does not require grad"."""
    model, data = mlp(), batches(2)
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.2), F.cross_entropy,
                    slice=s2)
    with context():
        got = floats([tr.step(x, y) for x, y in data])
    want, _ = torch_train(ref, torch.optim.SGD(ref.parameters(), lr=0.2), data)
    assert_losses(got, want)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref)


def test_no_loss_fn_and_no_loss_in_the_output(s2):
    model = mlp()
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None, slice=s2)
    x, y = batches(1)[0]
    with pytest.raises(pw.PathwaysError, match="loss_fn") as e:
        float(tr.step(x, y))
    print(f"{type(e.value).__name__}: {e.value}")


# ---------------------------------------------------------------------- 8. BatchNorm

def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


@pytest.mark.parametrize("strat", ["dp", "fsdp"])
def test_batchnorm_buffers_equal_torch_on_the_global_batch(s2, strat):
    g = torch.Generator().manual_seed(10)
    data = [(torch.randn(8, 3, 8, 8, generator=g) * 2 + 0.5,
             torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)
    model = cnn()
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2,
                    parallelism=strategy(strat))
    if strat == "fsdp":
        assert tr.param_specs["1.running_mean"] != P()   # FSDP shards the statistics too
    got = floats([tr.step(x, y) for x, y in data])
    # plain torch on the whole (global) batch: statistics over all 8 examples
    want, _ = torch_train(ref, make_opt(ref.parameters()), data)
    assert_losses(got, want)
    trained = tr.sync_to(copy.deepcopy(model))
    assert_same_model(trained, ref)
    for bn in ("1", "4"):
        assert int(dict(trained.named_buffers())[f"{bn}.num_batches_tracked"]) == 3
    # the statistics moved (per-device statistics over 4 examples would differ)
    per_device = copy.deepcopy(cnn())
    torch_train(per_device, make_opt(per_device.parameters()),
                [(x[:4], y[:4]) for x, y in data])
    assert_differ(trained[1].running_var.tolist(), per_device[1].running_var.tolist(),
                  by=1e-4)


# ---------------------------------------------------------------------- 9. dropout, RNG

def dropout_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))


def test_dropout_seed_reproducible_and_fresh_masks(s2):
    model = dropout_model()
    x, y = batches(1, d_in=16, seed=11)[0]

    def run(seed):
        m = copy.deepcopy(model)
        tr = pw.Trainer(m, torch.optim.SGD(m.parameters(), lr=0.0), F.cross_entropy,
                        slice=s2, seed=seed)
        return floats([tr.step(x, y) for _ in range(3)])

    a, b, c = run(1234), run(1234), run(4321)
    assert a == b                                   # bit-identical
    assert len(set(a)) == 3, a                      # a fresh mask every step (lr=0)
    assert a != c
    with torch.no_grad():
        no_dropout = F.cross_entropy(copy.deepcopy(model).eval()(x), y).item()
    assert all(abs(v - no_dropout) > 1e-6 for v in a)


class DropMean(nn.Module):
    """loss = mean(dropout(w * ones)): 1 on average, as in torch (masks scaled by 2)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return F.dropout(x * self.w, 0.5, training=self.training).mean()


def test_dropout_rate_and_scale_as_torch(s2):
    x = torch.ones(64, 64)                          # 4096 draws: std of the mean 0.0156
    model = DropMean()
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), None, slice=s2,
                    seed=5)
    got = floats([tr.step(x) for _ in range(3)])
    torch.manual_seed(5)
    want = [DropMean()(x).item() for _ in range(3)]
    for v in got + want:
        assert abs(v - 1.0) < 0.08, (got, want)      # 5 standard deviations
        assert v != 1.0


def test_checkpoint_resume_with_dropout_is_bit_identical(s2, tmp_path):
    data = batches(4, d_in=16, seed=12)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    model = dropout_model()
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2, seed=7)
    first = floats([tr.step(x, y) for x, y in data[:2]])
    tr.save(str(tmp_path / "ckpt"))
    rest = floats([tr.step(x, y) for x, y in data[2:]])

    other = dropout_model(seed=3)                   # other weights and another seed:
    tr2 = pw.Trainer(other, make_opt(other.parameters()), F.cross_entropy, slice=s2,
                     seed=99)                       # load replaces both
    tr2.load(str(tmp_path / "ckpt"))
    assert tr2.steps == 2
    assert floats([tr2.step(x, y) for x, y in data[2:]]) == rest
    assert len(set(first + rest)) == 4


def test_checkpoint_resume_with_a_scheduler(s2, tmp_path):
    data = batches(4, seed=13)
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)
    make_sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    model = mlp()
    opt = make_opt(model.parameters())
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2, scheduler=make_sched(opt))
    for x, y in data[:2]:
        tr.step(x, y)
    tr.save(str(tmp_path / "ckpt"))
    rest = floats([tr.step(x, y) for x, y in data[2:]])

    other = mlp(seed=3)
    opt2 = make_opt(other.parameters())
    tr2 = pw.Trainer(other, opt2, F.cross_entropy, slice=s2, scheduler=make_sched(opt2))
    tr2.load(str(tmp_path / "ckpt"))
    assert tr2.scheduler.last_epoch == 2
    assert floats([tr2.step(x, y) for x, y in data[2:]]) == rest
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])


def test_checkpoint_in_the_middle_of_an_accumulation(s2, tmp_path):
    micro = batches(4, batch=4, seed=14)
    make_opt = lambda ps: torch.optim.Adam(ps, lr=1e-2)
    model = mlp()
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2,
                    accumulate=2)
    tr.step(*micro[0])
    tr.save(str(tmp_path / "ckpt"))                 # one micro-step's gradients held
    rest = floats([tr.step(x, y) for x, y in micro[1:]])
    after = tr.state_dict()["model"]

    other = mlp(seed=3)
    tr2 = pw.Trainer(other, make_opt(other.parameters()), F.cross_entropy, slice=s2,
                     accumulate=2)
    tr2.load(str(tmp_path / "ckpt"))
    assert tr2.micro == 1
    assert floats([tr2.step(x, y) for x, y in micro[1:]]) == rest
    for n, t in tr2.state_dict()["model"].items():
        assert torch.equal(t, after[n]), n


# ---------------------------------------------------------------- 10. activation checkpointing

class Checkpointed(nn.Module):
    def __init__(self, width=16, layers=2, ckpt=True, d_in=8, d_out=4):
        super().__init__()
        self.ckpt = ckpt
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width),
                          nn.Tanh()) for _ in range(layers))
        self.head = nn.Linear(width, d_out)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(x)


def test_activation_checkpointing_equals_torch(s2):
    torch.manual_seed(0)
    model, data = Checkpointed(), batches(4, seed=15)
    ref = copy.deepcopy(model)
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.5)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2)
    got = floats([tr.step(x, y) for x, y in data])
    want, _ = torch_train(ref, make_opt(ref.parameters()), data)
    assert_losses(got, want)


@pytest.mark.parametrize("how", ["save", "state_dict"])
def test_a_frozen_parameters_optimizer_state_survives_a_checkpoint(s2, tmp_path, how):
    """AdamW state of a parameter frozen when the checkpoint is taken is part of it:
    resumed in a new Trainer and unfrozen, it goes on from that state as torch does
    (it used to be dropped by save(), and the parameter restarted from fresh state)."""
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    model, data = mlp(), batches(5, seed=11)
    ref = copy.deepcopy(model)
    plan = {2: False, 4: True}                     # trained, frozen at 2-3, trained again

    def apply(m, i):
        if i in plan:
            m.get_submodule("0").weight.requires_grad_(plan[i])

    want, _ = torch_train(ref, make_opt(ref.parameters()), data, each_step=apply)
    tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s2)
    got = []
    for i, (x, y) in enumerate(data[:3]):
        apply(model, i)
        got.append(float(tr.step(x, y)))
    if how == "save":
        tr.save(str(tmp_path / "ckpt"))
    else:
        sd = tr.state_dict()
    # a new process would build the model again, frozen as it was when saved
    model2 = copy.deepcopy(model)
    tr2 = pw.Trainer(model2, make_opt(model2.parameters()), F.cross_entropy, slice=s2)
    if how == "save":
        tr2.load(str(tmp_path / "ckpt"))
    else:
        tr2.load_state_dict(sd)
    for i, (x, y) in enumerate(data[3:], start=3):
        apply(model2, i)
        got.append(float(tr2.step(x, y)))
    assert_losses(got, want, rtol=1e-5, atol=1e-6)
    assert_same_model(tr2.sync_to(copy.deepcopy(model2)), ref, atol=1e-6)


@pytest.mark.parametrize("strat", ["dp", "pipeline"])
def test_modules_put_in_eval_mode_stay_so_in_training_steps(s2, pipe_slices, strat):
    """Fine-tuning with frozen batch norms: the model in train mode, its BatchNorm
    layers set to .eval() (running statistics used, not updated; no dropout where a
    Dropout is in eval), changed between steps. The step used to trace everything in
    train mode, and torch_xla's batch norm backward failed in eval mode. A pipeline
    normalizes each micro-batch by itself (GPipe's semantics), so there both stay
    frozen: the running statistics are then the same for every micro-batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
                          nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(),
                          nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    data = batches(4, seed=12)
    plan = {1: (True, False), 2: (False, True), 3: (True, True)}   # which BN frozen
    if strat == "pipeline":
        plan = {i: (True, True) for i in range(4)}

    def apply(m, i):
        m.train()
        for frozen, layer in zip(plan.get(i, (False, False)), (m[1], m[4])):
            layer.train(not frozen)

    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    want, _ = torch_train(ref, make_opt(ref.parameters()), data, each_step=apply)
    got, tr = trainer_train(model, make_opt, data, apply,
                            **dp_or_pipeline(strat, s2, pipe_slices))
    assert_losses(got, want, rtol=1e-5, atol=1e-6)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref, atol=1e-6)


def test_a_model_left_in_eval_mode_trains_in_train_mode(s2):
    """from_pretrained returns a model in eval mode, and a torch loop that validated
    last leaves it so; trainer.step trains it in train mode (batch statistics, running
    statistics updated), as Hugging Face's Trainer does, and leaves it in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    data = batches(2, seed=13)
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1)
    want, _ = torch_train(ref, make_opt(ref.parameters()), data)       # in train mode
    model.eval()
    got, tr = trainer_train(model, make_opt, data, lambda m, i: None, slice=s2)
    assert_losses(got, want, rtol=1e-5, atol=1e-6)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref, atol=1e-6)
    assert not model.training and not model[1].training


def test_a_model_left_in_eval_mode_trains_in_train_mode_under_pipeline(pipe_slices):
    """The same under Pipeline, whose stages are new containers cut from the model
    (always in train mode themselves): before stop 39 they kept the layers' eval mode,
    so a model left in eval mode trained without dropout and with frozen batch norms
    there, and in train mode under DataParallel. Against torch's GPipe semantics: each
    micro-batch normalised by itself, its running statistics updated in turn."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    data = batches(2, seed=13)
    make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1)
    opt, want = make_opt(ref.parameters()), []
    for x, y in data:
        opt.zero_grad()
        losses = []
        for part in (slice(0, 4), slice(4, 8)):
            loss = F.cross_entropy(ref(x[part]), y[part])
            (loss / 2).backward()
            losses.append(loss.item())
        opt.step()
        want.append(sum(losses) / 2)
    model.eval()
    got, tr = trainer_train(model, make_opt, data, lambda m, i: None,
                            **dp_or_pipeline("pipeline", None, pipe_slices))
    assert_losses(got, want, rtol=1e-5, atol=1e-6)
    assert_same_model(tr.sync_to(copy.deepcopy(model)), ref, atol=1e-6)
    assert not model.training and not model[1].training


# ---------------------------------------------------------------------- ema=
swa = torch.optim.swa_utils


def bn_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


AVERAGES = {
    "ema": (mlp, lambda: dict(multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))),
    "swa": (mlp, dict),
    "avg_fn": (mlp, lambda: dict(avg_fn=swa.get_ema_avg_fn(0.8))),
    "bn_buffers_averaged": (bn_mlp, lambda: dict(
        multi_avg_fn=swa.get_ema_multi_avg_fn(0.9), use_buffers=True)),
    "bn_buffers_copied": (bn_mlp, lambda: dict(multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))),
}


def sgd(m):
    # SGD: Adam amplifies the float noise of BatchNorm's layers (test_models.py says how)
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("norm", ["bn1d", "bn2d", "sync"])
@pytest.mark.parametrize("strat", ["dp", "fsdp"])
def test_batch_norms_cumulative_average_trains_as_in_torch(s2, norm, strat):
    """``momentum=None`` (the running statistics as a cumulative average: torch divides
    by ``float(num_batches_tracked)``, a read of a value) used to refuse every step
    with a DataDependentError; now it trains, and the statistics equal torch's."""
    torch.manual_seed(0)
    if norm == "bn2d":
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None),
                              nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 4))
        g = torch.Generator().manual_seed(3)
        data = [(torch.randn(8, 3, 4, 4, generator=g), torch.randint(0, 4, (8,), generator=g))
                for _ in range(4)]
    else:
        bn = nn.SyncBatchNorm if norm == "sync" else nn.BatchNorm1d
        model = nn.Sequential(nn.Linear(8, 16), bn(16, momentum=None), nn.ReLU(),
                              nn.Linear(16, 4))
        data = batches(4, seed=3)
    ref = copy.deepcopy(model)
    want, _ = torch_train(ref, sgd(ref), data)
    tr = pw.Trainer(model, sgd(model), F.cross_entropy, slice=s2, parallelism=strategy(strat))
    got = [float(tr.step(x, y)) for x, y in data]
    assert_losses(got, want)
    trained = tr.sync_to(copy.deepcopy(model))
    assert_same_model(trained, ref)             # running mean and var, the count
    assert int(trained[1].num_batches_tracked) == 4
    model.eval(), ref.eval()
    torch.testing.assert_close(model(data[0][0]), ref(data[0][0]), rtol=TOL, atol=TOL)


def test_anomaly_detection_traces_without_its_nan_check_and_says_so(s2):
    """Under ``torch.autograd.set_detect_anomaly(True)`` torch checks each gradient for
    NaN, reading its values: every step used to fail with a DataDependentError naming
    no line. Steps now trace without that check and train as torch does; one warning,
    at the script's line, says the check is off inside programs."""
    from pathways_torch.client import torch_paths
    model, data = mlp(seed=4), batches(3, seed=4)
    ref = copy.deepcopy(model)
    torch_paths._ANOMALY_WARNED = False
    with torch.autograd.set_detect_anomaly(True):
        want, _ = torch_train(ref, sgd(ref), data)
        tr = pw.Trainer(model, sgd(model), F.cross_entropy, slice=s2)
        with pytest.warns(UserWarning, match=r"check_nan=False.*nan instead") as caught:
            got = [float(tr.step(x, y)) for x, y in data]
        assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
    assert_losses(got, want)
    ours = [w for w in caught if "check_nan" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__


def torch_averaged(make, kw, data):
    ref = make()
    opt, avg = sgd(ref), swa.AveragedModel(ref, **kw)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        avg.update_parameters(ref)
    return avg


@pytest.mark.parametrize("kind,strat", [
    (kind, strat) for strat in ("dp", "fsdp", "pipeline") for kind in AVERAGES
    # a pipeline's batch norms normalise micro-batches, not torch's whole batch
    if not (strat == "pipeline" and AVERAGES[kind][0] is bn_mlp)])
def test_ema_is_updated_on_the_workers_as_update_parameters_does(s2, pipe_slices, kind,
                                                                 strat):
    """``ema=`` updates the AveragedModel after every step without fetching the weights
    (the module is still stale after the steps); reading it gives torch's average, its
    count, and its buffers averaged or copied as ``use_buffers`` says. Under a Pipeline
    each stage averages its own weights (before stop 39, refused)."""
    make, kw = AVERAGES[kind]
    data = batches(4)
    want = torch_averaged(make, kw(), data)
    model = make()
    ema = swa.AveragedModel(model, **kw())
    where = (dict(slice=s2, parallelism=strategy(strat)) if strat != "pipeline" else
             dp_or_pipeline(strat, s2, pipe_slices))
    tr = pw.Trainer(model, sgd(model), F.cross_entropy, ema=ema, **where)
    for x, y in data:
        tr.step(x, y)
    assert tr._synced != tr._version            # the weights never came back
    got = ema.state_dict()
    for k, v in want.state_dict().items():
        torch.testing.assert_close(got[k].float(), v.float(), rtol=TOL, atol=TOL,
                                   msg=lambda m, k=k: f"{k}: {m}")
    assert int(ema.n_averaged) == 4
    ema.eval(), want.eval()
    torch.testing.assert_close(ema(data[0][0]), want(data[0][0]), rtol=TOL, atol=TOL)


def test_ema_survives_a_checkpoint_and_refuses_a_second_update(s2, tmp_path):
    data = batches(4)
    kw = dict(multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))
    at_two = torch_averaged(mlp, kw, data[:2])
    model = mlp()
    ema = swa.AveragedModel(model, **kw)
    tr = pw.Trainer(model, sgd(model), F.cross_entropy, slice=s2, ema=ema)
    for x, y in data[:2]:
        tr.step(x, y)
    tr.save(str(tmp_path / "ckpt"))
    sd = tr.state_dict()
    for x, y in data[2:]:
        tr.step(x, y)
    for restore in (lambda: tr.load(str(tmp_path / "ckpt")), lambda: tr.load_state_dict(sd)):
        restore()
        for (k, a), b in zip(ema.module.state_dict().items(), at_two.module.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m, k=k: f"{k}: {m}")
        assert int(ema.n_averaged) == 2
        tr.step(*data[2])                       # and it goes on from there
        assert int(ema.n_averaged) == 3
    with pytest.raises(pw.PathwaysError, match=r"already updates the AveragedModel.*Remove"):
        ema.update_parameters(model)


def test_ema_of_something_else_is_refused(s2):
    model = mlp()
    with pytest.raises(pw.PathwaysError, match="AveragedModel"):
        pw.Trainer(model, sgd(model), F.cross_entropy, slice=s2, ema=copy.deepcopy(model))
    with pytest.raises(pw.PathwaysError, match="another model"):
        pw.Trainer(model, sgd(model), F.cross_entropy, slice=s2,
                   ema=swa.AveragedModel(mlp(d_out=5)))


def test_an_ema_updated_by_the_script_equals_torch_and_says_where_it_would_be_cheaper(s2):
    """Without ``ema=``, ``ema.update_parameters(model)`` after each step reads the
    trained weights (a fetch a step): torch's numbers, and a SyncWarning naming
    ``ema=``."""
    data = batches(6)
    kw = dict(multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))
    want = torch_averaged(mlp, kw, data)
    model = mlp()
    ema = swa.AveragedModel(model, **kw)
    tr = pw.Trainer(model, sgd(model), F.cross_entropy, slice=s2)
    with pytest.warns(pw.SyncWarning, match=r"pw\.Trainer\(\.\.\., ema=ema\)"):
        for x, y in data:
            tr.step(x, y)
            ema.update_parameters(model)
    for k, v in want.state_dict().items():
        torch.testing.assert_close(ema.state_dict()[k].float(), v.float(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01),
    lambda p: torch.optim.AdamW(p, lr=1e-2),
    lambda p: torch.optim.NAdam(p, lr=1e-2),
    lambda p: torch.optim.Adagrad(p, lr=1e-2),
    lambda p: torch.optim.Adamax(p, lr=1e-2),
], ids=["Adam", "AdamW", "NAdam", "Adagrad", "Adamax"])
def test_a_bfloat16_model_steps_as_torch_bit_for_bit(cluster8, make_opt):
    """``model.bfloat16()`` with torch's optimizers: every parameter equal to torch's
    after 4 steps. torch's eager step keeps its bias corrections, step sizes and
    learning rate as Python numbers, in float32 inside each bfloat16 kernel; before
    stop 37 the traced step rounded them to bfloat16 first (a quarter of the
    parameters one ulp off after 4 Adam steps). One device: a gradient summed over
    shards rounds each shard's part. The model has no layer norm, whose bfloat16
    backward torch computes in its own blocked order."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 8)).bfloat16()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 16, generator=g).bfloat16(), torch.randint(0, 8, (32,), generator=g))
            for _ in range(4)]
    want = torch_train(ref, make_opt(ref.parameters()), data)[0]
    s1 = pw.slice((1,))
    try:
        tr = pw.Trainer(model, make_opt(model.parameters()), F.cross_entropy, slice=s1)
        got = [float(tr.step(x, y)) for x, y in data]
        trained = model.state_dict()
    finally:
        s1.release()
    for (name, a), b in zip(trained.items(), ref.state_dict().values()):
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"
    # the reported mean loss is within one bfloat16 ulp: torch sums a bfloat16 nll_loss
    # in bfloat16 blocks of 16 rows, pathways in float32 (docs/architecture.md, stop 37)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2 ** -7, atol=0)


class _PairOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h, h.pow(2).mean(-1)             # activations and an auxiliary loss


class _PairIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, inp):
        h, aux = inp
        return self.lin(h) + 0.01 * aux.unsqueeze(-1)


def test_a_pipeline_stage_that_returns_a_tuple_is_refused_saying_what_to_do(pipe_slices):
    """A middle stage carrying (hidden, aux_loss) failed with "'tuple' object has no
    attribute 'detach'" (stop 43)."""
    model = nn.Sequential(_PairOut(), _PairIn())
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                    parallelism=pw.Pipeline(stages=2, microbatches=2, slices=pipe_slices))
    x, y = batches(1, batch=4, seed=1)[0]
    with pytest.raises(pw.TraceError, match="returned tuple, not one tensor.*torch.cat"):
        tr.step(x, y)
