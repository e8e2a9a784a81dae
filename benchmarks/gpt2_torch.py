"""A plain PyTorch GPT-2 (learned positions, pre-LayerNorm blocks, tanh GELU MLP, tied output
embedding, biases everywhere, SDPA causal attention): the baseline of benchmarks/gpu_bench.py.
Same parameters as megacli builds for a gpt2_*.yaml recipe."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden, eps=eps)
        self.fc = nn.Linear(hidden, ffn)
        self.fc_proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, s, h))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, *, vocab: int, positions: int, layers: int, hidden: int, heads: int, ffn: int, eps: float, std: float):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(positions, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn, eps) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        with torch.no_grad():  # GPT-2's init: N(0, std), output projections std / sqrt(2 * layers), biases 0
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() > 1:
                    p.normal_(0.0, std / (2 * layers) ** 0.5 if name.endswith(("proj.weight", "fc_proj.weight")) else std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of predicting `labels` from `tokens` (both [batch, sequence])."""
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
