"""A small character-level GPT and real text that is on every machine: the Python standard library's sources.

Used by the language-model benchmark (bench/lm.py). The text is the concatenation of the standard library's
top-level ``.py`` files in sorted order, cut into contiguous train / validation / test parts (80 / 10 / 10),
so the three never share a file's middle.
"""
from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def stdlib_text(max_chars: int) -> str:
    """The first ``max_chars`` characters of the standard library's top-level sources, in sorted file order."""
    parts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


class CharData:
    """Characters as token ids (the vocabulary is the text's own characters), split into train / val / test."""

    def __init__(self, text: str, splits=(0.8, 0.1, 0.1)):
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        n_train, n_val = int(splits[0] * len(ids)), int(splits[1] * len(ids))
        self.parts = {"train": ids[:n_train], "val": ids[n_train:n_train + n_val], "test": ids[n_train + n_val:]}

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, split: str, batch_size: int, context: int, generator: torch.Generator):
        """``batch_size`` random windows of ``context`` tokens and their next tokens."""
        ids = self.parts[split]
        starts = torch.randint(0, len(ids) - context - 1, (batch_size,), generator=generator)
        x = torch.stack([ids[s:s + context] for s in starts.tolist()])
        y = torch.stack([ids[s + 1:s + context + 1] for s in starts.tolist()])
        return x, y

    def windows(self, split: str, context: int, limit: int):
        """Up to ``limit`` consecutive non-overlapping windows of the split (an evaluation that is the same every
        time): (x, y) of shape (windows, context)."""
        ids = self.parts[split]
        n = min(limit, (len(ids) - 1) // context)
        x = ids[:n * context].view(n, context)
        y = ids[1:n * context + 1].view(n, context)
        return x, y


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        n, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(n, t, w))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class CharGPT(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks without biases, a final norm and an output
    layer of its own (not tied)."""

    def __init__(self, vocab: int, width: int = 128, layers: int = 2, heads: int = 4, context: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        for block in self.blocks:
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * layers))
            nn.init.normal_(block.down.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.norm(self.blocks(self.embed(tokens) + self.position(positions))))


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy (nats)."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 64) -> float:
    """Mean loss over fixed windows, in batches."""
    total = 0.0
    for i in range(0, len(x), batch_size):
        total += float(loss(model, x[i:i + batch_size], y[i:i + batch_size])) * len(x[i:i + batch_size])
    return total / len(x)
