"""How Megatron-Core splits a weight over tensor-parallel ranks, by the weight's (canonical) name.

Column-parallel weights (and biases) are split along dim 0, row-parallel weights along dim 1, the
rest are replicated. A gated MLP's input projection (SwiGLU's linear_fc1) holds [gate; up]: each
rank keeps its slice of the gate half and of the up half. The vocabulary-sized tensors are
column-parallel with their rows padded to a multiple of the tensor-parallel size.
"""

from __future__ import annotations

import torch

from megacli.errors import UserError

COLUMN = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias", "linear_qkv.weight",
          "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
          # multi-latent attention (its down-projections are column-parallel too, gathered after)
          "linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight", "linear_kv_down_proj.weight",
          "linear_kv_up_proj.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")
GATED = ("linear_fc1.weight", "linear_fc1.bias")
# Matched as suffixes: BERT's and T5's heads (``lm_head.output_layer.*``) are vocabulary-sized too.
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")

GATED_SPLIT = "gated"


def is_vocab_key(name: str) -> bool:
    """A tensor whose first dimension is the (padded) vocabulary."""
    return name.endswith(VOCAB_KEYS)


def split_of(name: str, *, gated: bool) -> int | str | None:
    """The dimension ``name`` is split along (0 or 1), GATED_SPLIT for [gate; up] halves split
    along dim 0, None when every rank holds all of it."""
    if gated and name.endswith(GATED):
        return GATED_SPLIT
    if name.endswith(COLUMN):
        return 0
    if name.endswith(ROW):
        return 1
    return None


def merge(name: str, parts: list[torch.Tensor], *, gated: bool) -> torch.Tensor:
    """The global tensor from the tensor-parallel ranks' ``parts`` (rank order)."""
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) > 1:
        raise UserError(f"{name}: tensor-parallel shards have different shapes {sorted(shapes)}")
    if len(parts) == 1:
        return parts[0]
    split = split_of(name, gated=gated)
    if split == GATED_SPLIT:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if split is None:
        return parts[0]
    return torch.cat(parts, dim=split)


def shard(name: str, tensor: torch.Tensor, *, tp: int, rank: int, gated: bool) -> torch.Tensor:
    """Rank ``rank``'s part of the global ``tensor`` (a copy)."""
    return part_of(tensor, split_of(name, gated=gated), tp=tp, rank=rank).clone()


def part_of(tensor: torch.Tensor, split: int | str | None, *, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``tensor`` split as ``split`` says (a dimension, GATED_SPLIT, or
    None for replicated): a view where it can be one."""
    if tp == 1 or split is None:
        return tensor
    if split == GATED_SPLIT:
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return tensor.chunk(tp, dim=split)[rank]


def rank_pieces(size: int, *, tp: int, gated_split: bool) -> list[tuple[int, int]]:
    """(offset, size) along the split dimension of each rank's part, in rank order; a gated
    tensor gives two pieces per rank (its gate and up slices), also at TP 1. One piece when the
    dimension does not divide."""
    if gated_split and size % (2 * tp) == 0:
        half, part = size // 2, size // (2 * tp)
        return [(h * half + r * part, part) for r in range(tp) for h in (0, 1)]
    if tp > 1 and size % tp == 0:
        part = size // tp
        return [(r * part, part) for r in range(tp)]
    return [(0, size)]
