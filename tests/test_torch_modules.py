"""torch's own modules that take CPU-only paths train and evaluate like plain torch.

On CPU tensors nn.LSTM and nn.GRU call oneDNN, nn.TransformerEncoder in eval mode
turns a padding mask into nested tensors, nn.Embedding(sparse=True) makes sparse
gradients and weight_norm has a fused backward: none lowers to XLA (the LSTM used to
fail its trace as "a bug in pathways_torch"). A torch.compile'd model used to fail
with dynamo's error, a bfloat16 model under AdamW failed its second step, and
importing torch_xla (the client's first trace) swapped torch.nn.GRU and
clip_grad_norm_ for torch_xla's in the user's own process. Each case is compared with
plain torch on the CPU, same seed and data: losses and parameters within 1e-5 (SGD,
which does not magnify float rounding as Adam does on near-zero gradients).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathways_torch as pw

TOL = 1e-5


class Recurrent(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.rnn = getattr(nn, kind)(16, 24, num_layers=2, batch_first=True,
                                     bidirectional=True)
        self.head = nn.Linear(48, 5)

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        return self.head(h.mean(1))


class Encoder(nn.Module):
    """A text classifier that pools every position, the padded ones too, so the
    encoder's outputs at padded positions count."""

    def __init__(self, batch_first: bool = True):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        e = self.emb(x) if self.batch_first else self.emb(x).transpose(0, 1)
        h = self.enc(e, src_key_padding_mask=(x == 0))
        return self.head(h.mean(1 if self.batch_first else 0))


class _FloatInput(nn.Module):
    """Feeds the token batches of these tests to an MLP."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x.float() / 50.0)


def _batches(n=3, left_aligned=True, seq=12):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(1, 50, (8, seq), generator=g)
        x[:, -3:] = 0
        if not left_aligned:
            x[2, 0] = 0                   # a row padded at its start too
        out.append((x, torch.randint(0, 5, (8,), generator=g)))
    return out


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def _train_both(build, s, compile_=None, make_opt=_sgd, data=None, approx=None):
    """Plain torch and pw.Trainer from one init on the same batches; the losses must
    agree (``approx``: pytest.approx's tolerances, 1e-5 by default) and change."""
    torch.manual_seed(0)
    ref = build()
    model = copy.deepcopy(ref)
    data = data if data is not None else _batches()
    opt = make_opt(ref.parameters())
    expected = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    given = compile_(model) if compile_ else model
    tr = pw.Trainer(given, make_opt(given.parameters()), F.cross_entropy, slice=s)
    got = [float(tr.step(x, y)) for x, y in data]
    assert got == pytest.approx(expected, **(approx or dict(abs=TOL, rel=TOL)))
    assert len({round(v, 6) for v in got}) > 1, "the loss never changed: no update?"
    return tr, model, ref


def _assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for n in pa:
        torch.testing.assert_close(pa[n], pb[n], atol=TOL, rtol=TOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_recurrent_layers_train_like_torch(s2, kind):
    # 5 positions: the unrolled layers compile in a third of the time 12 take
    data = _batches(seq=5)
    tr, model, ref = _train_both(lambda: Recurrent(kind), s2, data=data)
    out = copy.deepcopy(model)
    tr.sync_to(out)
    _assert_same_parameters(out, ref)
    ref.eval()
    x, y = _batches(1, seq=5)[0]
    with torch.no_grad():
        want = F.cross_entropy(ref(x), y).item()
    assert float(tr.evaluate(x, y)) == pytest.approx(want, abs=TOL)


class Bag(nn.Module):
    """An embedding with sparse gradients and a weight-normed layer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0, sparse=True)
        self.fc = nn.utils.parametrizations.weight_norm(nn.Linear(16, 24))
        self.head = nn.Linear(24, 5)

    def forward(self, x):
        return self.head(torch.relu(self.fc(self.emb(x).mean(1))))


def test_sparse_embedding_and_weight_norm_train_like_torch(s2):
    """nn.Embedding(sparse=True) is traced with dense gradients (XLA has no sparse
    tensors; SGD's numbers are the same), and weight_norm's backward, which XLA does
    not lower, is computed by its formula (lowerings.py)."""
    tr, model, ref = _train_both(Bag, s2)
    out = copy.deepcopy(model)
    tr.sync_to(out)
    _assert_same_parameters(out, ref)


@pytest.mark.parametrize("left_aligned", [True, False], ids=["padded_at_end", "padded_inside"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_transformer_encoder_evaluates_like_torch_fast_path(s2, batch_first, left_aligned):
    """In eval mode without gradients torch's encoder runs on nested tensors and leaves
    zeros at padded positions when its layers are batch_first and every row's padding
    is at its end (otherwise it computes them): evaluate and predict give torch's
    numbers in every case."""
    tr, _, ref = _train_both(lambda: Encoder(batch_first), s2)
    ref.eval()
    x, y = _batches(1, left_aligned)[0]
    with torch.no_grad():
        want_logits = ref(x)
        want = F.cross_entropy(want_logits, y).item()
    with torch.enable_grad():
        slow = ref(x)                  # torch's other path: what the layers compute
    differs = (slow - want_logits).abs().max().item()
    assert (differs > 1e-3) == (left_aligned and batch_first), "not the case it says"
    assert float(tr.evaluate(x, y)) == pytest.approx(want, abs=TOL)
    torch.testing.assert_close(tr.predict(x).torch(), want_logits, atol=TOL, rtol=TOL)


def test_a_compiled_model_trains_like_torch_and_syncs_both_ways(s2):
    """torch.compile on the whole model and on one block (names gain "_orig_mod."):
    the Trainer trains what they wrap, and sync_to fills a compiled or a plain copy."""
    def build():
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))

    def compile_(m):
        m.body[0] = torch.compile(m.body[0])
        return torch.compile(m)

    tr, model, ref = _train_both(lambda: _FloatInput(build()), s2, compile_)
    for target in (copy.deepcopy(model), _FloatInput(build())):
        tr.sync_to(target)
        got = {n.replace("_orig_mod.", ""): p for n, p in target.named_parameters()}
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p, atol=TOL, rtol=TOL)
    with pytest.raises(pw.PathwaysError, match="not the one this Trainer trains"):
        tr.sync_to(nn.Linear(12, 5))
    f = torch.compile(lambda t: torch.relu(t) * 2)
    x = torch.tensor([-1.0, 2.0, -3.0, 4.0])
    assert torch.equal(pw.program(f)(pw.put(x, s2)).torch(), torch.relu(x) * 2)


def test_importing_torch_xla_leaves_torch_nn_as_it_was(s2):
    """The client's first trace imports torch_xla, which replaces torch.nn.GRU and
    torch.nn.utils.clip_grad_norm_ process-wide; pathways_torch puts torch's back, so
    a module built after a program is the same as one built before."""
    import torch.nn.modules.rnn as rnn
    import torch.nn.utils.clip_grad as clip
    pw.program(lambda t: t + 1)(pw.put(torch.zeros(2), s2)).torch()
    assert nn.GRU is rnn.GRU
    assert nn.utils.clip_grad_norm_ is clip.clip_grad_norm_
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    nn.utils.clip_grad_norm_([p], 1.0, foreach=True)     # torch_xla's refuses foreach
    assert p.grad.norm().item() == pytest.approx(1.0, abs=1e-5)


def test_adaptive_pooling_to_sizes_that_do_not_divide_trains_like_torch(s2):
    """VGG's AdaptiveAvgPool2d((7, 7)) on small images, and an adaptive max pooling
    from 12x12 to 5x7: torch_xla runs those on the CPU, which aborted the client; they
    are computed from torch's windows (torch_paths.py)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.pool = nn.Sequential(nn.AdaptiveMaxPool2d((5, 7)), nn.AdaptiveAvgPool2d(3),
                                      nn.AdaptiveAvgPool2d((7, 7)))
            self.head = nn.Linear(4 * 49, 5)

        def forward(self, x):
            x = x.float().reshape(-1, 1, 12, 1).expand(-1, 3, 12, 12) / 50.0
            return self.head(self.pool(torch.tanh(self.conv(x))).flatten(1))

    tr, model, ref = _train_both(Net, s2)
    out = copy.deepcopy(model)
    tr.sync_to(out)
    _assert_same_parameters(out, ref)


def test_a_bfloat16_model_trains_like_torch(s2):
    """``model.bfloat16()`` under AdamW. torch_xla's addcdiv of bfloat16 values gave a
    float32 parameter, which the next step refused as the wrong input; values now keep
    torch's dtypes. Losses and parameters agree within bfloat16's rounding: 2 units in
    the last place at 1 (2 ** -6), not the float32 tolerance of the other tests."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g).bfloat16(), torch.randint(0, 4, (8,), generator=g))
            for _ in range(4)]
    def build():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).bfloat16()
    tr, model, ref = _train_both(build, s2, make_opt=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                 data=data, approx=dict(rel=2 ** -6))
    torch.manual_seed(0)
    initial = dict(build().named_parameters())       # _train_both's init
    out = copy.deepcopy(model)
    tr.sync_to(out)
    for (n, a), b in zip(out.named_parameters(), ref.parameters()):
        assert a.dtype == torch.bfloat16, n
        torch.testing.assert_close(a, b, atol=2 ** -6, rtol=2 ** -6, msg=lambda m: f"{n}: {m}")
        assert not torch.equal(a, initial[n]), f"{n} never moved"


class Reentrant(nn.Module):
    """torch.utils.checkpoint's reentrant form (torch's default when use_reentrant is
    left out): once after a layer, once on the raw input (where torch gives the block's
    parameters no gradient: no input requires grad), and checkpoint_sequential."""

    def __init__(self):
        super().__init__()
        self.raw = nn.Linear(12, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh())
        self.out = nn.Linear(16, 5)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint, checkpoint_sequential
        h = checkpoint(lambda t: F.relu(self.raw(t)), x, use_reentrant=True)
        h = h + checkpoint(lambda t: self.mid[0](t).tanh(), h.detach().requires_grad_(),
                           use_reentrant=True)
        return self.out(checkpoint_sequential(self.mid, 2, h, use_reentrant=True))


def test_reentrant_activation_checkpointing_trains_like_torch(s2):
    """It used to fail the trace: the reentrant backward refuses torch.autograd.grad."""
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(6, 12, generator=g), torch.randint(0, 5, (6,), generator=g))
            for _ in range(3)]
    tr, model, ref = _train_both(Reentrant, s2, data=data)
    out = copy.deepcopy(model)
    tr.sync_to(out)
    _assert_same_parameters(out, ref)
    torch.manual_seed(0)
    untouched = Reentrant()
    torch.testing.assert_close(out.raw.weight, untouched.raw.weight)   # as torch: no grad


class CausalLM(nn.Module):
    """PyTorch's word_language_model TransformerModel, shrunk: a causal mask from
    ``generate_square_subsequent_mask`` and no ``is_causal=`` hint, sequence first."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        dec = nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0)
        self.dec = nn.TransformerDecoder(dec, 1)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = self.emb(x).transpose(0, 1)
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[0])
        h = self.dec(h, self.enc(h, mask), tgt_mask=mask)
        return self.head(h[-1])


def test_a_causal_mask_without_the_is_causal_hint_trains_like_torch(s2):
    """torch compares such a mask with a causal one to choose a kernel
    (``bool((mask == causal).all())``), a value read that failed the trace with a
    DataDependentError pointing at the model's call. The mask is applied either way."""
    _train_both(CausalLM, s2, data=_batches(seq=6))


def test_torch_nn_is_put_back_when_a_library_imported_torch_xla_first(tmp_path):
    """peft and transformers import torch_xla when it is installed, before any trace:
    torch_xla then swapped nn.GRU and clip_grad_norm_ for its own, and pathways_torch
    put back what it found (torch_xla's). Run as a fresh process, as a script would."""
    import subprocess
    import sys
    import textwrap
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        import torch_xla                      # what such a library does on import
        import torch.nn.modules.rnn as rnn, torch.nn.utils.clip_grad as clip
        assert nn.GRU is not rnn.GRU          # torch_xla's, as the library left it
        import pathways_torch as pw
        pw.init(devices_per_host=1)
        pw.program(lambda t: t + 1)(pw.put(torch.zeros(2), pw.slice((1,)))).torch()
        assert nn.GRU is rnn.GRU and nn.utils.clip_grad_norm_ is clip.clip_grad_norm_
        pw.shutdown()
        print("OK")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_torch_xla_is_imported_without_what_only_its_reexports_need(tmp_path):
    """torch_xla 2.9's import pulled torch._inductor in (through ``torch_xla.stablehlo``)
    and functorch's AOT compiler (through its scan GRU): 2.5 s of every first trace and
    every worker start. pathways_torch's import leaves them to first use; the modules
    and the names torch_xla re-exports still work, and torch.nn's GRU is torch's."""
    import subprocess
    import sys
    import textwrap
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.nn as nn, torch.nn.modules.rnn as rnn
        from pathways_torch._xla import import_torch_xla
        torch_xla = import_torch_xla()
        assert "torch._inductor.lowering" not in sys.modules
        assert nn.GRU is rnn.GRU
        import torch_xla.stablehlo as shlo
        assert hasattr(shlo, "StableHLOExportOptions")       # the real module
        from torch_xla.experimental.gru import GRU
        assert GRU.__module__ == "torch_xla.experimental.gru"
        import torch_xla._patched_functions as patched
        gru = patched.ScanGRU(4, 8)                           # its stand-in makes the real one
        assert type(gru) is GRU, type(gru)
        assert callable(torch_xla.save_as_stablehlo)
        print("OK")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
