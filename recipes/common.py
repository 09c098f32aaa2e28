"""Pieces the recipes share: a tiny GPT, offline text data, a progress line, a summary.

Copy what you need; nothing here is part of the pathways_torch API.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import time
from typing import Iterator, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------- data

def stdlib_text(max_bytes: int = 2_000_000) -> torch.Tensor:
    """Bytes of the Python standard library's own source files: text that is always there."""
    root = os.path.dirname(os.__file__)
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


def text_batches(data: torch.Tensor, batch: int, seq: int, seed: int = 0
                 ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, next-byte targets) windows, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + seq] for s in starts])
        y = torch.stack([data[s + 1:s + seq + 1] for s in starts])
        yield x, y


# ---------------------------------------------------------------------- model

class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx):
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.out(self.ln(x))


def gpt(vocab: int = 256, dim: int = 128, heads: int = 4, layers: int = 4, seq: int = 64,
        seed: int = 0) -> nn.Sequential:
    """A small decoder-only transformer as an nn.Sequential (so pw.Pipeline can split it)."""
    torch.manual_seed(seed)
    return nn.Sequential(Embed(vocab, dim, seq), *[Block(dim, heads) for _ in range(layers)],
                         Head(dim, vocab))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------- reporting

class Progress:
    """A one-line progress bar with loss and steps per second (reads a loss every
    ``every`` steps only, so steps keep being dispatched ahead)."""

    def __init__(self, total: int, every: int = 10):
        self.total, self.every = total, every
        self.t0 = time.perf_counter()
        self.first_loss = None
        self.last_loss = None
        self.tty = sys.stdout.isatty()

    def update(self, step: int, loss) -> None:
        if step % self.every and step not in (1, self.total):
            return
        value = float(loss)                      # blocks on this step's loss only
        if self.first_loss is None:
            self.first_loss = value
        self.last_loss = value
        rate = step / (time.perf_counter() - self.t0)
        done = int(30 * step / self.total)
        line = (f"[{'#' * done}{'.' * (30 - done)}] step {step}/{self.total} "
                f"loss {value:.4f} {rate:.1f} steps/s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)

    def summary(self, **extra) -> dict:
        if self.tty:
            print()
        elapsed = time.perf_counter() - self.t0
        out = {"steps": self.total, "first_loss": self.first_loss,
               "final_loss": self.last_loss, "seconds": round(elapsed, 2),
               "steps_per_s": round(self.total / elapsed, 2), **extra}
        print(json.dumps(out), flush=True)
        return out
