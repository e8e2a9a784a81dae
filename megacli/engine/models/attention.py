"""Core attention for Megatron-Core layer specs: SDPA underneath, ALiBi, ring context parallelism.

``CoreAttention`` is a drop-in for Megatron-Core's ``DotProductAttention`` (same constructor and
forward) as the ``core_attention`` of ``SelfAttentionSubmodules``, e.g.
``ModuleSpec(module=CoreAttention, params={"position_bias": "alibi"})`` (``build_module`` passes
spec params as keyword arguments).

* Context-parallel size 1: ``torch.nn.functional.scaled_dot_product_attention`` (flash / cuDNN /
  memory-efficient kernels on CUDA), with ``is_causal`` when no explicit mask or bias is needed.
* Sliding-window attention (Megatron's ``window_size`` = (w, 0) on the layers
  ``window_attn_skip_freq`` selects): query i sees keys i - w .. i, a banded causal mask; keys no
  query can see (a long KV cache while decoding) are dropped before the kernel runs.
* ``softcap``: scores capped to softcap * tanh(score / softcap) before the mask (Gemma 2), as
  explicit matmuls (no SDPA kernel takes a cap).
* Context-parallel size > 1: exact ring attention over the CP group (``ring_attention``).

Masks follow Megatron: ``attention_mask`` is boolean with True = masked. Rows with every key masked
produce zeros (Megatron's ``DotProductAttention`` averages all values there instead).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from megacli.engine.models.alibi import alibi_bias, alibi_slopes
from megacli.engine.models.ring_attention import ring_attention

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)
_POSITION_BIASES = ("none", "alibi")


class CoreAttention(MegatronModule):
    """Megatron-Core core attention on ``scaled_dot_product_attention``, with optional ALiBi
    (``position_bias="alibi"``) and ring context parallelism.

    query [sq, b, np, hn], key/value [sk, b, ng, hn] (ng query groups, np a multiple of ng),
    output [sq, b, np * hn]; heads are this tensor-parallel rank's.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        position_bias: str = "none",
        softcap: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        _check_supported(config, attention_type, cp_comm_type, position_bias)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.position_bias = position_bias

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        cp_group = getattr(pg_collection, "cp", None)
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        self.softcap = softcap
        # keys before i - window are hidden from query i (None: the whole prefix)
        self.window = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number):
            left, right = config.window_size
            if right != 0 or left < 0 or attention_type != "self" or attn_mask_type not in _CAUSAL_TYPES:
                raise NotImplementedError(f"CoreAttention's sliding window is causal self-attention with window_size "
                                          f"(w, 0), not {config.window_size} on {attention_type} {attn_mask_type}")
            self.window = left
        if self.cp_group is not None and softcap is not None:
            raise NotImplementedError("soft-capped attention has no context-parallel ring yet")

        tp_size = self.tp_group.size()
        # Multi-latent attention passes its query/key (k_channels) and value (v_channels) head widths.
        if v_channels is not None and v_channels != (k_channels or config.kv_channels) and self.cp_group is not None:
            raise NotImplementedError("ring attention needs keys and values of one head width")
        self.hidden_size_per_attention_head = config.kv_channels
        self.hidden_size_per_partition = divide(config.kv_channels * config.num_attention_heads, tp_size)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

        # As DotProductAttention: with query-key layer scaling its matmul runs at scale/layer and
        # the softmax multiplies the layer back, so the net scale is unchanged. Our kernels keep
        # scores in fp32 (the fp16 overflow that scaling guards against cannot happen): apply it.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        layer_scale = self.layer_number if config.apply_query_key_layer_scaling else 1
        self.softmax_scale /= layer_scale
        self.effective_scale = self.softmax_scale * layer_scale

        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

        self.alibi_slopes = None
        if position_bias == "alibi":
            first = self.tp_group.rank() * self.num_attention_heads_per_partition
            heads = alibi_slopes(config.num_attention_heads)
            self.alibi_slopes = heads[first : first + self.num_attention_heads_per_partition]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("CoreAttention does not support packed sequences (THD) yet")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        # A windowed layer is causal self-attention; decoding calls it with no_mask (one query, last)
        causal = mask_type in _CAUSAL_TYPES or self.window is not None
        dropout_p = self.dropout_p if self.training else 0.0
        with self._dropout_rng(dropout_p):
            if self.cp_group is None:
                return self._attend_local(query, key, value, attention_mask, causal, attention_bias,
                                          dropout_p)
            if attention_bias is not None:
                raise NotImplementedError("attention_bias with context parallelism is not supported yet")
            return self._attend_ring(query, key, value, attention_mask, causal, dropout_p)

    def _dropout_rng(self, dropout_p: float):
        """Dropout draws from the model-parallel RNG stream, as in DotProductAttention."""
        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _slopes(self, shape, device) -> torch.Tensor | None:
        if self.alibi_slopes is None:
            return None
        return torch.tensor(self.alibi_slopes, dtype=torch.float32, device=device).view(shape)

    def _attend_local(self, query, key, value, attention_mask, causal, attention_bias, dropout_p):
        sq, b, np_, hn = query.shape
        window = self.window if causal else None
        if attention_mask is not None and attention_mask.size(-1) > key.size(0):
            attention_mask = attention_mask[..., -key.size(0):]  # the KV cache gave its last keys only
        drop = 0 if window is None else key.size(0) - sq - window
        if drop > 0:  # keys no query sees (queries are the last sq positions)
            key, value = key[drop:], value[drop:]
            if attention_mask is not None and attention_mask.size(-1) > 1:
                attention_mask = attention_mask[..., drop:]
            if attention_bias is not None and attention_bias.size(-1) > 1:
                attention_bias = attention_bias[..., drop:]
        sk, ng = key.size(0), key.size(2)
        if window is not None and window >= sk - 1:
            window = None  # every key is inside it
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        bias = attention_bias
        slopes = self._slopes((np_, 1, 1), query.device)
        if slopes is not None:  # queries are the last sq of sk positions (bottom-right aligned)
            positions = torch.arange(sk, device=query.device)
            alibi = alibi_bias(slopes, positions[sk - sq :], positions)
            bias = alibi if bias is None else bias + alibi
        attn_mask, is_causal = _sdpa_mask(sq, sk, causal and sq > 1, attention_mask, bias, q.dtype, q.device, window)
        if self.softcap is not None:
            if is_causal:
                attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
            out = _capped_attention(q, k, v, attn_mask, scale=self.effective_scale, cap=self.softcap,
                                    dropout_p=dropout_p)
            return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * value.size(-1))
        # Native GQA is a flash-kernel feature; the kernels that take a mask need as many key heads
        # as query heads: either a query group's heads become rows of one head (a boolean mask
        # shared by all heads), or keys and values are repeated (a per-head bias).
        gqa = np_ != ng and attn_mask is None
        fold = np_ != ng and not gqa and attn_mask.dtype == torch.bool and attn_mask.dim() <= 4 and (
            attn_mask.dim() < 4 or attn_mask.size(1) == 1)
        if fold:
            r = np_ // ng
            q = q.reshape(b, ng, r * sq, hn)  # head g·r + j, position t -> head g, row j·sq + t
            mask4 = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
            attn_mask = mask4.expand(mask4.size(0), 1, sq, sk).unsqueeze(2).expand(-1, -1, r, -1, -1)
            attn_mask = attn_mask.reshape(mask4.size(0), 1, r * sq, sk)
        elif np_ != ng and not gqa:
            k, v = (t.repeat_interleave(np_ // ng, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=self.effective_scale, enable_gqa=gqa,
        )
        hv = value.size(-1)
        return out.reshape(b, np_, sq, hv).permute(2, 0, 1, 3).reshape(sq, b, np_ * hv)

    def _attend_ring(self, query, key, value, attention_mask, causal, dropout_p):
        s, b, np_, hn = query.shape
        ng = key.size(2)
        # Heads as (group, member): query head h uses key/value group h // (np/ng).
        q = query.permute(1, 2, 0, 3).reshape(b, ng, np_ // ng, s, hn)
        k, v = (t.permute(1, 2, 0, 3).unsqueeze(2) for t in (key, value))  # [b, ng, 1, sk, hn]
        slopes = self._slopes((ng, np_ // ng, 1, 1), query.device)
        out = ring_attention(q, k, v, self.cp_group, causal=causal, scale=self.effective_scale, window=self.window,
                             slopes=slopes, mask=attention_mask, dropout_p=dropout_p)
        return out.reshape(b, np_, s, hn).permute(2, 0, 1, 3).reshape(s, b, np_ * hn)


def _check_supported(config, attention_type, cp_comm_type, position_bias) -> None:
    if position_bias not in _POSITION_BIASES:
        raise ValueError(f"position_bias must be one of {_POSITION_BIASES}, got {position_bias!r}")
    if position_bias == "alibi" and attention_type != "self":
        raise ValueError("ALiBi is a self-attention position bias")
    if cp_comm_type not in (None, "p2p"):
        raise NotImplementedError(f"CoreAttention's context parallelism is a p2p ring, not {cp_comm_type!r}")
    if config.softmax_type != "vanilla":
        raise NotImplementedError(f"CoreAttention has the vanilla softmax only, not {config.softmax_type!r}")


def _sdpa_mask(sq, sk, causal, attention_mask, bias, dtype, device, window=None):
    """SDPA's (attn_mask, is_causal) from Megatron's convention (boolean, True = masked) plus an
    optional additive bias. SDPA wants True = attend, or a float mask in the query dtype. With
    ``window`` (causal only), query i (bottom-right aligned) sees keys i - window .. i."""
    if causal and attention_mask is None and bias is None and sq == sk and window is None:
        return None, True
    allowed = None if attention_mask is None else ~attention_mask
    if causal:
        below = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)
        if window is not None:
            below = below.triu(diagonal=sk - sq - window)
        allowed = below if allowed is None else allowed & below
    if bias is None:
        return allowed, False
    bias = bias.to(dtype)
    return (bias if allowed is None else torch.where(allowed, bias, float("-inf"))), False


def _capped_attention(q, k, v, attn_mask, *, scale: float, cap: float, dropout_p: float):
    """Attention with soft-capped scores (as Hugging Face's Gemma 2 eager attention): softmax over
    cap * tanh(scale * q.k / cap) plus the mask, in fp32. q [b, np, sq, hn], k/v [b, ng, sk, hn];
    attn_mask: boolean (True = attend) or additive, broadcastable to [b, np, sq, sk], or None.
    Rows with nothing to attend to give zeros. Returns [b, np, sq, hn]."""
    np_, ng = q.size(1), k.size(1)
    if np_ != ng:
        k, v = (t.repeat_interleave(np_ // ng, dim=1) for t in (k, v))
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(acc)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(v.dtype), v)
