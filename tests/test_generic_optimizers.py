"""Optimizers from outside torch.optim, traced with their Python numbers, against torch.

timm's and papers' optimizers (and the user's own) keep step counts as Python numbers,
compute bias corrections with ``math.sqrt``, branch on their numbers, keep a step count
as a 0-d tensor in a param group (timm's Lamb), or read a number as a plain value. Each
optimizer here is written the way those are, and trained by ``pw.Trainer`` and by plain
torch from the same seed and data: losses, parameters and the optimizer's state
(numbers included, as torch keeps them) within 1e-5; the number of traces stays
bounded, so a step count does not compile a program a step. (timm's own Lion, Lamb,
Adan, MADGRAD, AdaBelief, NAdamW, LaProp, Adopt, Lars, MARS, SGDW and RMSpropTF were
checked the same way by hand: docs/architecture.md, Decision 14.)
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import pathways_torch as pw
from trainer_helpers import TOL, assert_losses, assert_same_model, batches, mlp

F = nn.functional


class HandAdam(torch.optim.Optimizer):
    """Adam as a paper's repository writes it: a Python int step count in the state,
    bias corrections with ``math.sqrt``, a branch on weight decay."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps,
                                      weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                grad = p.grad
                if group["weight_decay"] != 0:
                    grad = grad.add(p, alpha=group["weight_decay"])
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = 1 - beta1 ** state["step"]
                bias2 = 1 - beta2 ** state["step"]
                step_size = group["lr"] * math.sqrt(bias2) / bias1
                denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-step_size)


class GroupStepLion(torch.optim.Optimizer):
    """Lion with a warm-up, its step count a 0-d tensor in the param group (timm's
    Lamb keeps it so), replaced rather than updated in place every other step."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, warmup=3):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay,
                                      warmup=warmup))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if "step" not in group:
                group["step"] = torch.tensor(0.0)
            group["step"].add_(1)
            scale = torch.clamp(group["step"] / group["warmup"], max=1.0)
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = state["exp_avg"].mul(beta1).add(p.grad, alpha=1 - beta1).sign_()
                p.add_(update * scale, alpha=-group["lr"])
                state["exp_avg"] = state["exp_avg"].mul(beta2) + p.grad * (1 - beta2)


class Branchy(torch.optim.Optimizer):
    """SGD whose Python branches read its numbers: a warm-up phase (``if step <=
    warmup``), ``min(lr, 1 / sqrt(step))`` and a rectification that turns on at a step
    count, as RAdam-style optimizers do. Each outcome is traced once."""

    def __init__(self, params, lr=0.5, warmup=2):
        super().__init__(params, dict(lr=lr, warmup=warmup))
        self.halve_from = 4                      # an attribute of the instance, not a group

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                step = state["step"]
                if step <= group["warmup"]:
                    lr = group["lr"] * step / group["warmup"]
                else:
                    lr = min(group["lr"], 1 / math.sqrt(step))
                if step >= self.halve_from:
                    lr = lr * 0.5
                p.add_(p.grad, alpha=-lr)


class FloatReader(torch.optim.Optimizer):
    """SGD that reads its step count as a plain float (``float(step)``, which a trace
    cannot follow): correct, but a program per step, which ``pw.RetraceWarning`` says."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                decay = torch.tensor(float(state["step"]))      # a value, not a number
                p.add_(p.grad / decay, alpha=-group["lr"])


class Flagged(torch.optim.Optimizer):
    """Flags, names and None in its state and groups (constants of a trace, kept by
    the client), and a tensor of state that starts as None."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            first = not group.get("started", False)
            group["started"] = True
            for p in group["params"]:
                state = self.state[p]
                if "prev" not in state:
                    state["prev"], state["mode"] = None, "warm"
                lr = group["lr"] * (0.1 if first else 1.0) * (
                    0.5 if state["mode"] == "warm" else 1.0)
                if state["prev"] is not None:
                    p.add_(state["prev"], alpha=-0.1 * lr)
                p.add_(p.grad, alpha=-lr)
                state["prev"], state["mode"] = p.grad.clone(), "run"


class ForeachAdam(torch.optim.Optimizer):
    """Adam over whole lists with torch._foreach_* ops (timm's foreach=True paths):
    each takes a number of the step where its overloads would read a tensor's value."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in ps]
            states = [self.state[p] for p in ps]
            for st, p in zip(states, ps):
                if not st:
                    st.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["step"] += 1
            beta1, beta2 = group["betas"]
            step = states[0]["step"]
            ms, vs = [st["m"] for st in states], [st["v"] for st in states]
            torch._foreach_lerp_(ms, grads, 1 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, grads, grads, 1 - beta2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, math.sqrt(1 - beta2 ** step))
            torch._foreach_maximum_(denom, group["eps"])
            torch._foreach_addcdiv_(ps, ms, denom, -group["lr"] / (1 - beta1 ** step))


def torch_train(model, opt, data, sched=None):
    """Plain torch's losses; ``opt`` (and ``sched``) may be a list, stepped together."""
    opts = opt if isinstance(opt, list) else [opt]
    out = []
    for x, y in data:
        for o in opts:
            o.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for o in opts:
            o.step()
        if sched is not None:
            sched.step()
        out.append(loss.item())
    return out


def traces(tr) -> int:
    return len(tr._programs["train_step"]._traces)


def trained_like_torch(s2, opt_cls, steps: int = 4):
    """An MLP trained ``steps`` steps by pw.Trainer and by plain torch with ``opt_cls``
    from the same seed and data: losses and parameters asserted equal; the Trainer."""
    data = batches(steps)
    model = mlp()
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, opt_cls(model.parameters()), F.cross_entropy, slice=s2)
    got = [float(tr.step(x, y)) for x, y in data]
    assert_losses(got, torch_train(ref, opt_cls(ref.parameters()), data))
    tr.sync_to()
    assert_same_model(model, ref)
    return tr


def test_a_hand_written_adam_equals_torch_and_its_state_round_trips(s2):
    steps = 5
    data = batches(steps + 2)
    model = mlp()
    ref = copy.deepcopy(model)
    make = lambda ps: HandAdam(ps, lr=1e-2, weight_decay=1e-2)      # noqa: E731
    opt = make(model.parameters())
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2)
    got = [float(tr.step(x, y)) for x, y in data[:steps]]
    ref_opt = make(ref.parameters())
    assert_losses(got, torch_train(ref, ref_opt, data[:steps]))
    # the first step creates the state, the second traces with it; then none
    assert traces(tr) == 2
    tr.sync_to()
    assert_same_model(model, ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        st, want = opt.state[p], ref_opt.state[q]
        assert st["step"] == want["step"] == steps and isinstance(st["step"], int)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(st[k], want[k], rtol=TOL, atol=TOL)
    # plain torch goes on from what sync_to wrote as the Trainer does (a copy: the
    # Trainer's own module shows the Trainer's next steps when read)
    cpu = copy.deepcopy(model)
    cpu_opt = make(cpu.parameters())
    cpu_opt.load_state_dict(opt.state_dict())
    (x1, y1), (x2, y2) = data[steps:]
    tr.step(x1, y1)
    trainer_next = float(tr.step(x2, y2))
    torch_train(cpu, cpu_opt, [(x1, y1)])
    with torch.no_grad():
        assert_losses([trainer_next], [F.cross_entropy(cpu(x2), y2).item()])
    # the numbers matter: without the bias corrections the losses differ
    plain = copy.deepcopy(mlp())
    sgd = torch_train(plain, torch.optim.SGD(plain.parameters(), lr=1e-2), data[:steps])
    assert max(abs(a - b) for a, b in zip(got, sgd)) > 1e-3


def test_a_step_count_kept_as_a_group_tensor_and_a_checkpoint(s2, tmp_path):
    """GroupStepLion's count lives in the param group as a 0-d tensor on the workers;
    a checkpoint holds it and the state, and a fresh Trainer resumes from them (state
    a step creates included)."""
    steps = 4
    data = batches(steps + 1)
    model = mlp()
    ref = copy.deepcopy(model)
    make = lambda ps: GroupStepLion(ps, lr=1e-2, weight_decay=0.1)    # noqa: E731
    opt = make(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2, scheduler=sched)
    got = [float(tr.step(x, y)) for x, y in data[:steps]]
    ref_opt = make(ref.parameters())
    want = torch_train(ref, ref_opt,
                       data[:steps], torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.7))
    assert_losses(got, want)
    assert traces(tr) <= 2           # a learning rate per step is an input, not a key
    tr.save(str(tmp_path / "ck"))
    fresh = mlp(seed=5)
    opt2 = make(fresh.parameters())
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.7)
    tr2 = pw.Trainer(fresh, opt2, F.cross_entropy, slice=s2, scheduler=sched2)
    tr2.load(str(tmp_path / "ck"))
    x, y = data[steps]
    resumed = float(tr2.step(x, y))
    want_next = torch_train(ref, ref_opt, [(x, y)])
    assert_losses([resumed], want_next)
    tr2.sync_to()
    assert float(opt2.param_groups[0]["step"]) == steps + 1
    assert_same_model(fresh, ref)


def test_python_branches_on_the_numbers_are_followed(s2):
    tr = trained_like_torch(s2, Branchy, steps=6)
    # steps 1-2 warm up, 3 takes min(lr, 1/sqrt(3)) = lr, 4 halves 1/sqrt(4), then
    # the same branches: one trace per outcome, not one per step
    assert traces(tr) <= 5


def test_flags_and_none_in_state_and_groups_and_sync_to(s2):
    data = batches(4)
    model = mlp()
    ref = copy.deepcopy(model)
    opt = Flagged(model.parameters())
    tr = pw.Trainer(model, opt, F.cross_entropy, slice=s2)
    got = [float(tr.step(x, y)) for x, y in data]
    ref_opt = Flagged(ref.parameters())
    assert_losses(got, torch_train(ref, ref_opt, data))
    assert traces(tr) == 2
    tr.sync_to()
    assert opt.param_groups[0]["started"] is True
    for p, q in zip(model.parameters(), ref.parameters()):
        assert opt.state[p]["mode"] == "run"
        torch.testing.assert_close(opt.state[p]["prev"], ref_opt.state[q]["prev"])


def test_under_fsdp_with_accumulation_and_clipping(s2):
    """The generic update is the same update of the same step: sharded state (FSDP),
    accumulate=2 (one update per two calls), max_grad_norm."""
    data = batches(6)
    model = mlp()
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, HandAdam(model.parameters(), lr=1e-2), F.cross_entropy,
                    slice=s2, parallelism=pw.FullyShardedDataParallel("data"),
                    accumulate=2, max_grad_norm=0.05)
    for x, y in data:
        tr.step(x, y)
    ref_opt = HandAdam(ref.parameters(), lr=1e-2)
    for i in range(0, len(data), 2):
        x = torch.cat([data[i][0], data[i + 1][0]])
        y = torch.cat([data[i][1], data[i + 1][1]])
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    tr.sync_to()
    assert_same_model(model, ref)


def test_foreach_ops_given_numbers_equal_torch(s2):
    tr = trained_like_torch(s2, ForeachAdam)
    assert traces(tr) == 2


def test_step_hooks_are_refused(s2):
    model = mlp()
    opt = HandAdam(model.parameters())
    opt.register_step_post_hook(lambda *a: None)
    with pytest.raises(pw.PathwaysError, match="HandAdam has step hooks"):
        pw.Trainer(model, opt, F.cross_entropy, slice=s2)


def test_a_number_read_as_a_value_warns_that_each_step_compiles(s2):
    data = batches(4)
    model = mlp()
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, FloatReader(model.parameters()), F.cross_entropy, slice=s2)
    with pytest.warns(pw.RetraceWarning, match=r"FloatReader|float\(\) at"):
        got = [float(tr.step(x, y)) for x, y in data]
    assert_losses(got, torch_train(ref, FloatReader(ref.parameters()), data))


def test_an_optimizer_that_reads_tensor_values_is_refused_and_the_session_goes_on(s2):
    class Projected(torch.optim.Optimizer):              # AdamP's projection test
        def __init__(self, params, lr=0.1):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad.norm() > 1.0:
                        p.add_(p.grad, alpha=-group["lr"])

    model = mlp()
    tr = pw.Trainer(model, Projected(model.parameters()), F.cross_entropy, slice=s2)
    x, y = batches(1)[0]
    with pytest.raises(pw.DataDependentError, match="if p.grad.norm"):
        tr.step(x, y)
    other = mlp()
    ok = pw.Trainer(other, HandAdam(other.parameters()), F.cross_entropy, slice=s2)
    assert math.isfinite(float(ok.step(x, y)))


class Cosine(torch.optim.Optimizer):
    """SGD scaled by the gradient's cosine with its parameter, its group's ``eps``
    handed to ``F.cosine_similarity`` and ``torch.full_like``, which take Python numbers
    only there (AdamP's and SGDP's projection passes ``eps`` so)."""

    def __init__(self, params, lr=0.1, eps=1e-8):
        super().__init__(params, dict(lr=lr, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                cos = F.cosine_similarity(p.grad.reshape(1, -1), p.reshape(1, -1), dim=1,
                                          eps=group["eps"]).abs()
                floor = torch.full_like(p, group["eps"])
                p.add_(p.grad * (1 + cos) + floor, alpha=-group["lr"])


def test_an_optimizer_that_needs_a_closure_says_how_to_write_the_step(s2):
    """The common SAM wrapper asserts a closure (it evaluates the loss again at the
    perturbed weights); the Trainer calls none. It raised the optimizer's own
    AssertionError inside a TraceError; now a PathwaysError says what to do."""
    class SAM(torch.optim.Optimizer):
        def __init__(self, params, rho=0.05):
            super().__init__(params, dict(rho=rho))
            self.base = torch.optim.SGD(self.param_groups, lr=0.1)

        @torch.no_grad()
        def step(self, closure=None):
            assert closure is not None, "Sharpness Aware Minimization requires closure"
            closure()
            self.base.step()

    model = mlp()
    tr = pw.Trainer(model, SAM(model.parameters()), F.cross_entropy, slice=s2)
    x, y = batches(1)[0]
    with pytest.raises(pw.PathwaysError, match=r"SAM.step needs a closure.*"
                                                      r"functional_call"):
        tr.step(x, y)


def test_a_number_where_torch_takes_only_a_python_number_is_its_value(s2):
    """Before stop 37 the number became a 0-d tensor there, which torch's argument
    parser read: a DataDependentError that named the cosine's line for a read the
    optimizer did not make (timm's AdamP failed so, at a line before its real value
    read). Now the op gets the number's value, guarded like a ``float()``."""
    tr = trained_like_torch(s2, Cosine)
    assert traces(tr) == 1


class HalfMomentum(torch.optim.Optimizer):
    """Momentum kept in bfloat16 and updated with a Python-number weight, as timm's
    AdafactorBigVision keeps its (``momentum_dtype=torch.bfloat16``, its default)."""

    def __init__(self, params, lr=0.5, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                m = state["exp_avg"]
                m.lerp_(p.grad.to(torch.bfloat16), 1 - group["momentum"])
                m.mul_(1 + group["momentum"] / 7)
                p.add_(m.to(p.dtype), alpha=-group["lr"])


def test_a_number_with_half_precision_tensors_stays_a_float32_scalar(s2):
    """torch keeps a Python number in float32 inside a bfloat16 kernel; before stop 37
    it became a bfloat16 0-d tensor, rounded first (1 - 0.9 is 0.10009765625 in
    bfloat16), and the momentum drifted from torch's."""
    trained_like_torch(s2, HalfMomentum, steps=5)


def test_pipeline_asks_for_a_torch_optimizer(cluster8):
    slices = [pw.slice((1,)) for _ in range(2)]
    try:
        model = mlp()
        with pytest.raises(pw.PathwaysError, match="HandAdam is traced with its Python "
                           "numbers, which DataParallel"):
            pw.Trainer(model, HandAdam(model.parameters()), F.cross_entropy,
                       parallelism=pw.Pipeline(stages=2, microbatches=2, slices=slices))
    finally:
        for s in slices:
            s.release()


def test_a_generic_optimizer_beside_a_torch_one(s2):
    """A list mixing both kinds: AdamW (torch.optim) on the biases, HandAdam on the
    matrices."""
    data = batches(3)

    def make(m):
        return [HandAdam([p for p in m.parameters() if p.ndim == 2], lr=1e-2),
                torch.optim.AdamW([p for p in m.parameters() if p.ndim != 2], lr=1e-2)]
    model = mlp()
    ref = copy.deepcopy(model)
    tr = pw.Trainer(model, make(model), F.cross_entropy, slice=s2)
    got = [float(tr.step(x, y)) for x, y in data]
    assert_losses(got, torch_train(ref, make(ref), data))
    tr.sync_to()
    assert_same_model(model, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr.step(*data[0])
