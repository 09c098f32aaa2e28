"""``Trainer.fit`` as users of Hugging Face Trainer / Lightning expect it: a progress bar,
its metrics returned (a ``FitResult``, still the list of losses), ``resume=True`` after a
restarted script, and dict batches. Losses are checked against plain torch on the CPU
(same seed, same data) within TOL, relative and absolute (they agree to ~1e-7).
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import pathways_torch as pw
from pathways_torch.training import FitResult

TOL = 1e-5
BATCH = 8


@pytest.fixture(autouse=True)
def _progress_env(monkeypatch):
    monkeypatch.delenv("PATHWAYS_PROGRESS", raising=False)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def make_opt(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def make_trainer(s2, seed=0):
    """As a (restarted) script builds it: the same model and optimizer every time."""
    model = make_model(seed)
    return pw.Trainer(model, make_opt(model), F.mse_loss, slice=s2)


def batches(n=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g))
            for _ in range(n)]


def torch_losses(data, seed=0):
    """Plain torch, one process, the CPU: the reference losses."""
    model = make_model(seed)
    opt = make_opt(model)
    out = []
    for x, y in data:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def assert_losses(got, want):
    assert len(got) == len(want)
    assert list(got) == pytest.approx(want, rel=TOL, abs=TOL)


def test_fit_returns_the_losses_and_its_metrics(s2, capsys):
    data = batches(6)
    result = make_trainer(s2).fit(data, progress=False)
    assert isinstance(result, FitResult) and isinstance(result, list)
    assert all(isinstance(x, float) for x in result)
    assert_losses(result, torch_losses(data))
    assert result == list(result)                 # still compares as the list of losses
    assert result.steps == 6 and result.restarts == 0 and result.resumed_from is None
    assert result.time_s > 0
    assert result.steps_per_s == pytest.approx(6 / result.time_s)
    # samples: dimension 0 of the inputs (8 per step)
    assert result.samples_per_s == pytest.approx(6 * BATCH / result.time_s)
    assert result.tokens_per_s is None            # float inputs: no token ids
    assert capsys.readouterr().err == ""          # progress=False: no bar


def test_progress_bar_on_stderr(s2, capsys, monkeypatch):
    data = batches(4)
    trainer = make_trainer(s2)
    result = trainer.fit(data, progress=True)
    err = capsys.readouterr().err
    assert "loss=" in err and "4/4" in err and "step" in err
    assert "samples/s=" in err
    assert f"loss={result[-1]:.4g}" in err        # the last loss, 4 significant digits

    trainer.fit(data, progress=False)
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("PATHWAYS_PROGRESS", "0")  # off for every fit of the process
    trainer.fit(data)
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("kind", ["sequence", "callable", "iterable"])
def test_resume_continues_a_restarted_script(s2, tmp_path, kind):
    data = batches(10)
    want = torch_losses(data)
    ckpt = str(tmp_path / "ckpt")
    first = make_trainer(s2).fit(data, steps=6, checkpoint_dir=ckpt, checkpoint_every=3,
                                 progress=False)
    assert_losses(first, want[:6])
    with open(os.path.join(ckpt, "latest.json")) as f:
        assert json.load(f)["step"] == 6

    if kind == "sequence":                        # a checkpoint at the last step: no step
        done = make_trainer(s2).fit(data, steps=6, checkpoint_dir=ckpt, resume=True,
                                    progress=False)
        assert done == [] and done.steps == 0 and done.resumed_from == 6

    # The script again, from the start: a new Trainer, built the same way.
    called, seen = [], []

    def data_at(i):
        called.append(i)
        return data[i]
    source = {"sequence": data, "callable": data_at, "iterable": iter(data)}[kind]
    again = make_trainer(s2)
    result = again.fit(source, steps=10, checkpoint_dir=ckpt, checkpoint_every=3,
                       resume=True, on_step=lambda i, loss: seen.append(i), progress=False)
    assert result.resumed_from == 6 and result.steps == 4
    assert_losses(result, want[6:])               # steps 7..10 of an uninterrupted run
    assert seen == [7, 8, 9, 10]
    if kind == "callable":
        assert called == [6, 7, 8, 9]             # data(i) goes on at the checkpoint's step
    assert again.steps == 10
    # keep_checkpoints=2 counts the earlier run's checkpoints too
    assert sorted(os.listdir(ckpt)) == ["latest.json", "step-000006", "step-000009"]


def test_resume_from_an_empty_directory_starts_afresh(s2, tmp_path):
    data = batches(4)
    trainer = make_trainer(s2)
    with pytest.raises(pw.PathwaysError, match="checkpoint_dir"):
        trainer.fit(data, resume=True)
    with pytest.raises(pw.PathwaysError, match=r"pair \(inputs, targets\)"):
        trainer.fit([(data[0][0], data[0][1], None)], progress=False)
    result = trainer.fit(data, checkpoint_dir=str(tmp_path), checkpoint_every=2,
                         resume=True, progress=False)
    assert result.resumed_from is None and result.steps == 4
    assert_losses(result, torch_losses(data))
    assert os.path.exists(tmp_path / "latest.json")


class KeywordModel(torch.nn.Module):
    """Hugging Face style: keyword inputs, labels among them, the loss in the output."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.emb(input_ids).mean(1)))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def dict_batches(n=4, seq=6, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 32, (BATCH, seq), generator=g),
             "labels": torch.randint(0, 4, (BATCH,), generator=g)} for _ in range(n)]


def torch_dict_losses(data):
    torch.manual_seed(0)
    model = KeywordModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    out = []
    for b in data:
        opt.zero_grad()
        loss = model(**b)["loss"]
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("loss_fn", [lambda out, targets: out["loss"], None],
                         ids=["loss_fn_ignoring_targets", "loss_fn_none"])
def test_dict_batches(s2, loss_fn):
    """A Mapping batch is the inputs (labels included), with targets=None."""
    data = dict_batches()
    torch.manual_seed(0)
    model = KeywordModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    trainer = pw.Trainer(model, opt, loss_fn, slice=s2)
    result = trainer.fit(data, progress=False)
    assert_losses(result, torch_dict_losses(data))
    assert result.samples_per_s == pytest.approx(4 * BATCH / result.time_s)
    # input_ids: batch * sequence tokens per step
    assert result.tokens_per_s == pytest.approx(4 * BATCH * 6 / result.time_s)
