"""Declarative weight mappings between Hugging Face and Megatron-Core checkpoints.

A mapping table is a list of rules. Each rule names one Megatron key pattern, the Hugging Face key
patterns it is made from, and a pair of pure tensor functions (HF -> Megatron and back). ``*`` in
a pattern stands for a layer number and matches the same number on both sides:

    Rule("decoder.layers.*.self_attention.linear_qkv.weight",
         ("model.layers.*.self_attn.q_proj.weight", "model.layers.*.self_attn.k_proj.weight",
          "model.layers.*.self_attn.v_proj.weight"),
         *qkv(groups=8))

Megatron keys are the canonical, layout-free names of a checkpoint: the keys of
``GPTModel.sharded_state_dict()`` (TE-style, norms named after the linear they feed) with the
global layer number after ``layers.``. Tensors on both sides are global (unsharded). Vocabulary
padding is not a rule: it depends on the target layout, see ``fit_vocab_rows``.

The transforms here are small and pure so each can be tested on CPU on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from megacli.errors import UserError


ToMegatron = Callable[..., torch.Tensor]
ToHF = Callable[[torch.Tensor], Sequence[torch.Tensor]]


# ---------------------------------------------------------------- transforms


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def transpose(t: torch.Tensor) -> torch.Tensor:
    """GPT-2's Conv1D stores [in, out]; a Linear stores [out, in]. Its own inverse."""
    return t.t().contiguous()


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, groups: int) -> torch.Tensor:
    """[Q; K; V] (rows: heads·d, groups·d, groups·d) -> Megatron's fused QKV, grouped per query
    group: for each group its heads' queries, then its key head, then its value head. Tensor
    parallelism then splits whole groups. Works for weights [rows, in] and biases [rows]."""
    rest = q.shape[1:]
    parts = [x.reshape(groups, -1, *rest) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, *, groups: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``interleave_qkv``: Megatron's fused QKV -> (Q, K, V)."""
    rest = qkv.shape[1:]
    rows_per_group = qkv.shape[0] // groups
    head_dim = rows_per_group // (heads // groups + 2)
    per_group = qkv.reshape(groups, rows_per_group, *rest)
    q, k, v = per_group.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
    return tuple(x.reshape(-1, *rest).contiguous() for x in (q, k, v))  # type: ignore[return-value]


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: Megatron's linear_fc1 holds [gate; up] (the first half goes through the activation)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def fit_vocab_rows(t: torch.Tensor, *, rows: int, vocab_size: int, key: str) -> torch.Tensor:
    """Keep the first ``vocab_size`` rows (the real vocabulary) and zero-pad to ``rows``: padding on
    import (to a multiple of make_vocab_size_divisible_by × TP), trimming on export (rows =
    vocab_size), re-padding between layouts."""
    if t.shape[0] < vocab_size:
        raise UserError(f"{key}: the source has {t.shape[0]} vocabulary rows but the vocabulary has {vocab_size} "
                        f"tokens (model.vocab_size / the tokenizer is larger than the embedding: wrong tokenizer?)")
    if rows < vocab_size:
        raise UserError(f"{key}: cannot fit a {vocab_size}-token vocabulary into {rows} rows")
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[:vocab_size] = t[:vocab_size]
    return out


# ---------------------------------------------------------------- rule helpers (pairs of transforms)


def direct() -> tuple[ToMegatron, ToHF]:
    return identity, lambda t: (t,)


def transposed() -> tuple[ToMegatron, ToHF]:
    return transpose, lambda t: (transpose(t),)


def qkv(*, groups: int, heads: int) -> tuple[ToMegatron, ToHF]:
    """Separate q/k/v projections (weights or biases) <-> Megatron's grouped fused QKV."""
    return (lambda q, k, v: interleave_qkv(q, k, v, groups=groups),
            lambda t: split_qkv(t, groups=groups, heads=heads))


def fused_qkv(*, heads: int, conv1d: bool) -> tuple[ToMegatron, ToHF]:
    """One [Q|K|V] projection (GPT-2's c_attn, Conv1D when ``conv1d``; multi-head, so one group per
    head) <-> Megatron's grouped fused QKV."""

    def to_megatron(t):
        rows = transpose(t) if conv1d else t
        return interleave_qkv(*rows.chunk(3, dim=0), groups=heads)

    def to_hf(t):
        rows = torch.cat(split_qkv(t, groups=heads, heads=heads), dim=0)
        return (transpose(rows) if conv1d else rows,)

    return to_megatron, to_hf


def packed_qkv(*, groups: int, heads: int) -> tuple[ToMegatron, ToHF]:
    """One [Q; K; V] projection with grouped keys and values (Phi-3's qkv_proj: heads·d, groups·d,
    groups·d rows) <-> Megatron's grouped fused QKV."""

    def to_megatron(t):
        d = t.shape[0] // (heads + 2 * groups)
        return interleave_qkv(*t.split([heads * d, groups * d, groups * d], dim=0), groups=groups)

    return to_megatron, lambda t: (torch.cat(split_qkv(t, groups=groups, heads=heads), dim=0),)


def gate_up() -> tuple[ToMegatron, ToHF]:
    return fuse_gate_up, split_gate_up


# ---------------------------------------------------------------- rules and tables


def _pattern(p: str) -> re.Pattern:
    return re.compile(re.escape(p).replace(r"\*", r"(\d+)") + r"\Z")


def _fill(p: str, numbers: Sequence[str]) -> str:
    parts = p.split("*")
    if len(parts) - 1 != len(numbers):
        raise ValueError(f"pattern {p!r} needs {len(parts) - 1} numbers, got {len(numbers)}")
    out = parts[0]
    for n, tail in zip(numbers, parts[1:]):
        out += n + tail
    return out


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor from one or more HF tensors (same ``*`` numbers on both sides)."""

    megatron: str
    hf: tuple[str, ...]
    to_megatron: ToMegatron
    to_hf: ToHF

    def __post_init__(self):
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))


@dataclass
class MappingTable:
    """A family's rules for one model, plus the HF keys to ignore (buffers such as GPT-2's causal
    mask or a tied lm_head copy) and an optional HF key normaliser (e.g. GPT-2 checkpoints saved
    without the ``transformer.`` prefix)."""

    rules: list[Rule]
    drop: tuple[str, ...] = ()
    normalize_hf: Callable[[str], str] = identity
    _compiled: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        self._compiled = [(_pattern(r.megatron), r) for r in self.rules]
        self._drop = [_pattern(p) for p in self.drop]

    def rule_for(self, megatron_key: str) -> tuple[Rule, tuple[str, ...]]:
        for pat, rule in self._compiled:
            m = pat.match(megatron_key)
            if m:
                return rule, m.groups()
        raise UserError(f"no conversion rule for Megatron tensor {megatron_key!r} (a model feature this "
                        f"family's mapping does not cover)")

    def hf_keys_for(self, megatron_key: str) -> list[str]:
        rule, numbers = self.rule_for(megatron_key)
        return [_fill(p, numbers) for p in rule.hf]

    def is_dropped(self, hf_key: str) -> bool:
        return any(p.match(hf_key) for p in self._drop)

    def to_megatron(self, megatron_key: str, read_hf: Callable[[str], torch.Tensor]) -> torch.Tensor:
        rule, numbers = self.rule_for(megatron_key)
        return rule.to_megatron(*(read_hf(_fill(p, numbers)) for p in rule.hf))

    def to_hf(self, megatron_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        rule, numbers = self.rule_for(megatron_key)
        out = rule.to_hf(tensor)
        return [(_fill(p, numbers), t) for p, t in zip(rule.hf, out)]


def unconsumed(hf_keys: Iterable[str], consumed: set[str], table: MappingTable) -> list[str]:
    """HF tensors no rule used and no drop pattern covers (a sign of an unsupported feature)."""
    return sorted(k for k in hf_keys if k not in consumed and not table.is_dropped(k))
