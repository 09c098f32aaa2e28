"""Real third-party models train through pw.Trainer with plain PyTorch's numbers.

Hugging Face GPT-2 (tied weights), Llama (GQA, RoPE buffers; also with Hugging Face's
activation checkpointing), BERT (masked LM, 2D
attention mask, keyword arguments), T5 (encoder-decoder, labels in the batch, .loss),
ViT, Mixtral (mixture of experts, default experts path) and torchvision ResNet
(BatchNorm) and ConvNeXt (stochastic depth), each from a tiny config with random
weights (tests/zoo.py). Each trains 3 steps under DataParallel and FullyShardedDataParallel
over 2 devices; losses are within 1e-4 of plain torch's (AdamW, same seed, same data),
and so are the parameters and buffers that ``sync_to`` copies back. The vision models
train with SGD: Adam divides by the root of tiny squared gradients, which turns float
rounding differences (~1e-7) in the BatchNorm layers of a 4-image batch into 1e-3 loss
differences within 3 steps (checked: the first step's gradients agree to 7e-5 relative).
LoRA fine-tuning with peft (a frozen Llama, adapters trained) is checked the same way,
and GPT-2's own blocks as a 2-stage pipeline whose stages share the tied embeddings.
"""

from __future__ import annotations

import copy

import pytest
import torch

import pathways_torch as pw
from zoo import (MODELS, V, TokenStream, _lm_batch, bert, bert_batch, convnext,
                 encoding_collate, gpt2, gpt2_sequential, image_batch, llama, torch_step)

TOL = 1e-4
STEPS = 3


def _optimizer(name):
    # AdamW turns float noise in a zero gradient (a bias before a batch norm) into a
    # full step of either sign: the models with batch norm train with SGD
    if name in ("resnet", "convnext", "segformer"):
        return lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)
    return lambda ps: torch.optim.AdamW(ps, lr=1e-3)


def _train_both(name, parallelism, s):
    build, make_batch, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    data = [make_batch(g) for _ in range(STEPS)]
    ref.train()
    make_opt = _optimizer(name)
    opt = make_opt(ref.parameters())
    expected = []
    for b in data:
        opt.zero_grad()
        loss = torch_step(ref, b, loss_fn)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    tr = pw.Trainer(model, make_opt(model.parameters()), loss_fn, slice=s,
                    parallelism=parallelism("data"))
    got = [tr.step(b) if isinstance(b, dict) else tr.step(*b) for b in data]
    got = [float(l) for l in got]
    out = copy.deepcopy(model)
    tr.sync_to(out)
    return expected, got, out, ref


#: models that test capture (ops, not sharding) train under DataParallel only
CAPTURE_ONLY = ("segformer", "deberta")


@pytest.mark.parametrize("name,parallelism", [
    pytest.param(n, p, id=f"{n}-{pid}") for n in MODELS
    for p, pid in ((pw.DataParallel, "dp"), (pw.FullyShardedDataParallel, "fsdp"))
    if pid == "dp" or n not in CAPTURE_ONLY])
def test_model_trains_like_plain_torch(name, parallelism, s2):
    expected, got, out, ref = _train_both(name, parallelism, s2)
    assert got == pytest.approx(expected, abs=TOL, rel=TOL), (name, got, expected)
    assert len(set(round(x, 6) for x in got)) > 1, "the loss never changed: no update?"
    for (n, a), (_, b) in zip(out.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL, msg=lambda m: f"{n}: {m}")
    for (n, a), (_, b) in zip(out.named_buffers(), ref.named_buffers()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, atol=TOL, rtol=TOL, msg=lambda m: f"{n}: {m}")
        else:
            assert torch.equal(a, b), n


def test_gpt2_blocks_in_a_data_parallel_pipeline_with_tied_embeddings(cluster8):
    """Hugging Face GPT-2's own modules in 2 pipeline stages on two 2-device slices
    (``axis="data"``), clipped: its tied token embedding and LM head, one tensor used
    by both stages, train as torch trains them (the tie intact after ``sync_to``)."""
    slices = [pw.slice((2,), axis_names=("data",)) for _ in range(2)]
    try:
        torch.manual_seed(0)
        model = gpt2_sequential()
        ref = copy.deepcopy(model)
        assert model[-1].lm.weight is model[0].wte.weight
        g = torch.Generator().manual_seed(1)
        data = []
        for _ in range(STEPS):
            ids = torch.randint(0, V, (8, 16), generator=g)
            data.append((ids, torch.roll(ids, -1, 1)))

        def loss_fn(logits, y):
            return torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        opt, want = torch.optim.AdamW(ref.parameters(), lr=1e-3), []
        for x, y in data:
            opt.zero_grad()
            loss = loss_fn(ref(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            want.append(loss.item())
        tr = pw.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn,
                        parallelism=pw.Pipeline(2, 2, slices, axis="data"),
                        max_grad_norm=1.0)
        assert tr._ties[1] == {f"{len(model) - 1}.lm.weight": "0.wte.weight"}
        got = [float(tr.step(x, y)) for x, y in data]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=TOL, atol=TOL)
        tr.sync_to()
        assert model[-1].lm.weight is model[0].wte.weight
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=TOL, atol=TOL,
                                       msg=lambda m, n=n: f"{n}: {m}")
    finally:
        for s in slices:
            s.release()


def test_stochastic_depth_trains_and_evaluates_like_torch(s2):
    """ConvNeXt with stochastic depth on: training draws (so losses are not torch's),
    evaluation is deterministic and equals plain torch's eval with the trained weights."""
    torch.manual_seed(0)
    model = convnext(stochastic_depth_prob=0.5)
    with torch.no_grad():           # layer scale starts at 1e-6: a dropped block would not show
        for m in model.modules():
            if hasattr(m, "layer_scale"):
                m.layer_scale.fill_(1.0)
    g = torch.Generator().manual_seed(1)
    x, y = image_batch(g)
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0),
                    torch.nn.functional.cross_entropy, slice=s2, seed=3)
    losses = [float(tr.step(x, y)) for _ in range(4)]
    assert len(set(losses)) > 1, f"lr=0 and stochastic depth: losses must vary, {losses}"
    model.eval()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(x), y).item()
    assert float(tr.evaluate(x, y)) == pytest.approx(want, abs=1e-5)
    assert float(tr.evaluate(x, y)) == pytest.approx(want, abs=1e-5)


def test_a_hugging_face_model_fits_on_a_stream_of_dict_samples_loaded_on_the_host(s2):
    """GPT-2 fed by pw.DataLoader over a stream of dict samples (what a tokenized
    streaming dataset gives): fit's losses equal plain torch's over torch's DataLoader
    on the same stream, to its end (tolerance 1e-4, as above)."""
    torch.manual_seed(0)
    model = gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    expected = []
    for b in torch.utils.data.DataLoader(TokenStream(n=24), batch_size=4):
        opt.zero_grad()
        loss = torch_step(ref, b, None)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    tr = pw.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), None, slice=s2,
                    parallelism=pw.DataParallel("data"))
    loader = pw.DataLoader("zoo:token_stream", dataset_kwargs={"n": 24}, batch_size=4,
                           slice=tr)
    got = tr.fit(loader, progress=False)
    assert len(got) == 6
    assert list(got) == pytest.approx(expected, abs=TOL, rel=TOL), (got, expected)


def test_batches_as_hugging_face_batch_encodings(s2):
    """Tokenizers and data collators return a BatchEncoding (a UserDict, which torch's
    pytree takes for one opaque leaf): step, evaluate and predict take it as
    ``model(**batch)`` does (it was refused as "neither a tensor nor a static value"),
    and so does a pw.DataLoader whose collate_fn returns one."""
    from transformers import BatchEncoding
    torch.manual_seed(0)
    model = bert()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batch = bert_batch(g)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    loss = ref(**batch).loss
    loss.backward()
    opt.step()
    tr = pw.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), None, slice=s2)
    assert float(tr.step(BatchEncoding(batch))) == pytest.approx(loss.item(), abs=TOL)
    ref.eval()
    with torch.no_grad():
        want = ref(**batch)
    assert float(tr.evaluate(BatchEncoding(batch))) == pytest.approx(want.loss.item(),
                                                                     abs=TOL)
    torch.testing.assert_close(tr.predict(BatchEncoding(batch)).logits.torch(),
                               want.logits, atol=TOL, rtol=TOL)
    loader = pw.DataLoader("zoo:token_stream", dataset_kwargs={"n": 8}, batch_size=4,
                           slice=s2, collate_fn="zoo:encoding_collate")
    expected = torch.utils.data.DataLoader(TokenStream(n=8), batch_size=4,
                                           collate_fn=encoding_collate)
    n = 0
    for got, want_b in zip(loader, expected):
        assert set(got) == set(want_b)
        for k in want_b:
            assert torch.equal(got[k].torch(), want_b[k]), k
        n += 1
    assert n == 2


def test_predict_returns_a_hugging_face_cache_of_arrays(s2):
    """GPT-2 in eval mode returns its key/value cache (``use_cache`` is on by default), a
    ``DynamicCache`` of layer objects, no pytree node: ``predict`` returns one whose
    keys and values are Arrays with torch's values (it used to hold the trace's fake
    tensors, and reading them failed)."""
    from transformers import DynamicCache
    torch.manual_seed(0)
    model = gpt2()
    ref = copy.deepcopy(model).eval()
    ids = torch.randint(0, V, (4, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(input_ids=ids)
    tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), None, slice=s2)
    got = tr.predict({"input_ids": ids})
    assert list(got.keys()) == list(want.keys())
    torch.testing.assert_close(got.logits.torch(), want.logits, atol=TOL, rtol=TOL)
    cache, ref_cache = got[1], want[1]
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 8
    assert len(cache.layers) == len(ref_cache.layers)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(layer.keys.torch(), ref_layer.keys, atol=TOL, rtol=TOL)
        torch.testing.assert_close(layer.values.torch(), ref_layer.values, atol=TOL,
                                   rtol=TOL)


def test_hugging_face_dropout_with_gradient_checkpointing(s2):
    """GPT-2 with its default dropout (0.1) and ``gradient_checkpointing_enable()``, the
    usual fine-tuning setup (it used to be refused): the recomputation reuses the
    forward's masks, so with one seed it trains bit for bit as without checkpointing."""
    import transformers
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": (ids := torch.randint(0, 64, (4, 16), generator=g)),
                "labels": ids} for _ in range(3)]
    runs = []
    for ckpt in (False, True):
        model = copy.deepcopy(base)
        if ckpt:
            model.gradient_checkpointing_enable()
        tr = pw.Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), None,
                        slice=s2, seed=11)
        runs.append([float(tr.step(b)) for b in batches])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 3


@pytest.mark.parametrize("parallelism", [pw.DataParallel, pw.FullyShardedDataParallel],
                         ids=["dp", "fsdp"])
def test_lora_fine_tuning_with_peft_trains_like_plain_torch(parallelism, s2):
    """peft's LoRA on Llama (frozen base, adapters on q and v, AdamW over the trainable
    parameters only): losses within 1e-4 of torch's, the adapters peft saves (a read of
    the module's state_dict after the steps) equal torch's, the frozen base is
    unchanged, and the merged model equals torch's merged model."""
    import peft

    def build():
        torch.manual_seed(0)
        return peft.get_peft_model(llama(), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))

    def make_opt(m):
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)

    ref, model = build(), build()
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    g = torch.Generator().manual_seed(1)
    data = [_lm_batch(g) for _ in range(STEPS)]
    opt = make_opt(ref)
    expected = []
    for b in data:
        opt.zero_grad()
        loss = ref(**b).loss
        loss.backward()
        opt.step()
        expected.append(loss.item())
    tr = pw.Trainer(model, make_opt(model), slice=s2, parallelism=parallelism("data"))
    got = [float(tr.step(b)) for b in data]
    assert got == pytest.approx(expected, abs=TOL, rel=TOL)
    saved, want = (peft.get_peft_model_state_dict(m) for m in (model, ref))
    assert saved.keys() == want.keys() and len(saved) == 8
    for k in want:
        torch.testing.assert_close(saved[k], want[k], atol=TOL, rtol=TOL, msg=k)
    assert all(saved[k].abs().max() > 1e-3 for k in saved if "lora_B" in k), \
        "the adapters did not train (LoRA's B starts at zero)"
    for k, v in model.state_dict().items():
        if "lora_" not in k:
            assert torch.equal(v, base[k]), f"frozen {k} changed"
    merged, merged_ref = model.merge_and_unload(), ref.merge_and_unload()
    for (n, a), (_, b) in zip(merged.named_parameters(), merged_ref.named_parameters()):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL, msg=n)
