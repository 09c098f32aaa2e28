"""Third-party models from tiny configs with random weights (nothing is downloaded).

Each entry builds a model with its library's default settings (attention
implementation, experts path, ...) except dropout, which is off so that losses can be
compared with plain torch (dropout has its own tests), and gives batches the way its
users feed it: Hugging Face models take a dict with the labels inside (``model(**b)``,
the model returns ``.loss``), torchvision models take ``(images, classes)``.
"""

from __future__ import annotations

import torch

V = 64          # vocabulary of the language models


def _lm_batch(g, batch=4, seq=16):
    ids = torch.randint(0, V, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 4:] = 0                        # a padded row: a real 2D attention mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def gpt2():
    import transformers
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=V, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def gpt2_sequential(layers=4):
    """Hugging Face GPT-2's own modules as an nn.Sequential, for pw.Pipeline: the token
    embedding and the LM head stay one tensor (tied), so two stages share it."""
    import transformers
    from torch import nn

    class Embed(nn.Module):
        def __init__(self, wte, wpe):
            super().__init__()
            self.wte, self.wpe = wte, wpe

        def forward(self, ids):
            return self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))[None]

    class Block(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, h):
            out = self.block(h)
            return out[0] if isinstance(out, tuple) else out

    class Head(nn.Module):
        def __init__(self, ln, lm):
            super().__init__()
            self.ln, self.lm = ln, lm

        def forward(self, h):
            return self.lm(self.ln(h))

    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_head=2, n_embd=32, vocab_size=V, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    t = m.transformer
    return nn.Sequential(Embed(t.wte, t.wpe), *[Block(b) for b in t.h],
                         Head(t.ln_f, m.lm_head))


def llama():
    import transformers
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0))


def llama_checkpointed():
    """Llama with Hugging Face's activation checkpointing (torch.utils.checkpoint per layer,
    non-reentrant, the transformers v5 default)."""
    model = llama()
    model.activation_checkpointing_enable()
    return model


def bert():
    import transformers
    return transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=V, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def bert_batch(g):
    b = _lm_batch(g)
    labels = torch.full_like(b["labels"], -100)      # masked LM: predict 3 positions
    labels[:, [2, 5, 9]] = b["labels"][:, [2, 5, 9]]
    b["labels"] = labels
    return b


def t5():
    import transformers
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16,
        vocab_size=V, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1))


def t5_batch(g):
    b = _lm_batch(g)
    b["labels"] = torch.randint(2, V, (4, 8), generator=g)      # decoder targets
    return b


def vit():
    import transformers
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=16, patch_size=8, num_labels=4, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def vit_batch(g):
    return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 4, (4,), generator=g)}


def mixtral():
    import transformers
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=0))


def segformer():
    """Semantic segmentation: bilinear upsampling in the decode head and of the logits
    to the labels' size, whose backward torch_xla lowers only on a TPU."""
    import transformers
    return transformers.SegformerForSemanticSegmentation(transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        decoder_hidden_size=32, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, drop_path_rate=0.0))


def segformer_batch(g):
    return {"pixel_values": torch.randn(4, 3, 32, 32, generator=g),
            "labels": torch.randint(0, 3, (4, 32, 32), generator=g)}


def deberta():
    """Relative-position attention with log buckets. Its default classification loss
    filters labels with ``nonzero`` (a shape that depends on data): the problem type
    says which loss, as a user of pathways_torch must."""
    import transformers
    return transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=V, num_labels=3, problem_type="single_label_classification",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, relative_attention=True,
        pos_att_type=["p2c", "c2p"], max_relative_positions=16, position_buckets=8))


def classify_batch(g):
    b = _lm_batch(g)
    b["labels"] = torch.randint(0, 3, (4,), generator=g)
    return b


def resnet():
    from torchvision.models.resnet import BasicBlock, ResNet
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=4)


def convnext(stochastic_depth_prob: float = 0.0):
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)],
                    stochastic_depth_prob=stochastic_depth_prob, num_classes=4)


def image_batch(g, size=64):
    return (torch.randn(4, 3, size, size, generator=g), torch.randint(0, 4, (4,), generator=g))


#: name -> (build, batch(generator), loss_fn or None when the model returns its loss)
MODELS = {
    "gpt2": (gpt2, _lm_batch, None),
    "llama": (llama, _lm_batch, None),
    "llama_checkpointed": (llama_checkpointed, _lm_batch, None),
    "bert": (bert, bert_batch, None),
    "t5": (t5, t5_batch, None),
    "vit": (vit, vit_batch, None),
    "mixtral": (mixtral, _lm_batch, None),
    "resnet": (resnet, image_batch, torch.nn.functional.cross_entropy),
    "convnext": (convnext, image_batch, torch.nn.functional.cross_entropy),
    "segformer": (segformer, segformer_batch, None),
    "deberta": (deberta, classify_batch, None),
}


def torch_step(model, batch, loss_fn):
    """The loss of one batch as plain torch computes it."""
    if isinstance(batch, dict):
        return model(**batch).loss
    x, y = batch
    return loss_fn(model(x), y)


class TokenStream(torch.utils.data.IterableDataset):
    """A stream of language-model samples (dicts, as a tokenized Hugging Face dataset
    streams them): seeded token ids, their attention mask and labels."""

    def __init__(self, n=24, seq=16, seed=0):
        self.n, self.seq, self.seed = n, seq, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        for i in range(self.n):
            ids = torch.randint(0, V, (self.seq,), generator=g)
            mask = torch.ones(self.seq, dtype=torch.long)
            if i % 3 == 1:
                mask[self.seq - 4:] = 0              # a padded sample
            yield {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def token_stream(**kw):
    return TokenStream(**kw)


def encoding_collate(samples):
    """torch's default collate, returned as a Hugging Face ``BatchEncoding`` (what its
    data collators return: a UserDict, not a dict)."""
    from transformers import BatchEncoding
    return BatchEncoding(torch.utils.data.default_collate(samples))
