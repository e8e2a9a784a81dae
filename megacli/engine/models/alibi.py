"""ALiBi (Press et al., 2022): a per-head linear position bias on the attention scores, used by
the local attention kernel and by ring attention alike."""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi head slopes (Press et al., 2022; as in BLOOM): 2^(-8i/n), i = 1..n, for n a power of
    two; otherwise those of the largest power of two below n, then every other slope of twice it."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    return geometric(closest) + geometric(2 * closest)[0::2][: num_heads - closest]


def alibi_bias(slopes: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """Additive ALiBi bias -slope * |i - j| for query positions ``qpos`` and key positions ``kpos``;
    ``slopes`` is shaped to broadcast against [..., sq, sk]. On the causal region (j <= i) this is
    the paper's slope * (j - i); the symmetric form keeps bidirectional attention sensible."""
    return -slopes * (qpos[:, None] - kpos[None, :]).abs()
