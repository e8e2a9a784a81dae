"""The KV cache of GPT decoding: Megatron-Core's static inference context and a self-attention whose
cache holds keys already rotated.

Megatron's static KV cache stores keys before RoPE and rotates the whole cached prefix again at
every step (O(length) per layer per token); ``CachedRotarySelfAttention`` rotates each new key
once, at its own positions, before it is cached, and the query with it. The cosines and sines of
a step are computed by the first layer and shared by the others (``DecodeContext``). The GPT layer
spec uses it in training too, where it is Megatron's SelfAttention unchanged, except that with
``local_rope`` its sliding-window layers rotate by a local RoPE table of the same length (Gemma 3's
rope_local_base_freq; ``rope.install`` gives them its RotaryEmbedding as ``local_rotary``).
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention, _yarn_get_concentration_factor_from_config
from megatron.core.transformer.utils import is_layer_window_attention


class DecodeContext(StaticInferenceContext):
    """Megatron-Core's static inference context (the KV cache) plus the RoPE cosines and sines of
    the positions being decoded, computed by the first layer of a step and shared by the others."""

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        super().__init__(max_batch_size, max_sequence_length)
        self.rotary_cos_sin = {}  # id(rotary table) -> (positions, table, cos, signed sin) of the current step
        # [b, s] RoPE position of each row's tokens (a ragged batch: megacli serve), or None: the
        # cache columns sequence_len_offset.. are the positions of every row
        self.rope_positions: torch.Tensor | None = None
        # cache columns before it hold no key a running sequence sees (megacli serve's rows start at
        # different columns): attention skips them
        self.first_column = 0


def _cos_sin(context, freqs: torch.Tensor, start: int, end: int, dtype):
    """The cosines and the signed sines (``_rotate``'s) of the positions start..end of ``freqs``,
    or of the context's per-row positions; computed once per step in a DecodeContext."""
    if not isinstance(context, DecodeContext):
        return _cos_signed_sin(freqs[start:end], dtype)
    rows = context.rope_positions
    where = (start, end) if rows is None else rows
    cached = context.rotary_cos_sin.get(id(freqs))
    if cached is None or cached[1] is not freqs or not (
            cached[0] is where or (rows is None and isinstance(cached[0], tuple) and cached[0] == where)):
        # freqs: [max_len, 1, 1, d]; per-row positions give [s, b, 1, d]
        part = freqs[start:end] if rows is None else freqs[rows.t()].squeeze(3)
        context.rotary_cos_sin[id(freqs)] = cached = (where, freqs, *_cos_signed_sin(part, dtype))
    return cached[2], cached[3]


def _cos_signed_sin(angles: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    sin = angles.sin().to(dtype)
    half = sin.shape[-1] // 2
    return angles.cos().to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Megatron's non-interleaved RoPE (rope_utils._apply_rotary_pos_emb_bshd, mscale 1):
    the first cos.shape[-1] features rotate by halves, the rest pass through. Its
    x * cos + cat(-x2, x1) * sin, bit for bit, as x * cos + cat(x2, x1) * cat(-sin1, sin2): the
    halves swapped by one roll, with the sign in the step's table, in fewer operations."""
    dim = cos.shape[-1]
    x, rest = t[..., :dim], t[..., dim:]
    out = x * cos + x.roll(dim // 2, dims=-1) * signed_sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def plain_rope(config) -> bool:
    """Whether ``CachedRotarySelfAttention`` rotates a static cache's keys and queries itself (then
    Megatron's forward rotates nothing): RoPE, if any, neither interleaved, fused, YaRN-scaled nor
    left to flash decoding."""
    return not (config.flash_decode or config.rotary_interleaved or config.apply_rope_fusion
                or _yarn_get_concentration_factor_from_config(config) != 1.0)


class CachedRotarySelfAttention(SelfAttention):
    """Megatron-Core's SelfAttention whose static KV cache holds keys already rotated (a sliding-window
    layer's holds only the window); with ``local_rope``, a sliding-window layer rotates by the
    chunk's local RoPE table."""

    def __init__(self, *args, local_rope: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        windowed = is_layer_window_attention(c.window_size, c.window_attn_skip_freq, self.layer_number)
        self.window = c.window_size[0] if windowed else None  # keys before query i - window are never seen
        self.local_rope = local_rope and windowed

    def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
        if self.local_rope and rotary_pos_emb is not None:
            # the chunk's table is this context-parallel rank's share of the whole sequence's; the
            # local table is cut the same way (it is a copy of the chunk's RotaryEmbedding)
            cp = self.pg_collection.cp.size() if self.pg_collection.cp is not None else 1
            rotary_pos_emb = self.local_rotary(rotary_pos_emb.size(0) * cp)
        return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb, rotary_pos_cos=None,
                                        rotary_pos_sin=None, rotary_pos_cos_sin=None, sequence_len_offset=None, **kwargs):
        c = self.config
        static = inference_context is not None and inference_context.is_static_batching()
        if not static or (rotary_pos_emb is not None and not plain_rope(c)):
            return super()._adjust_key_value_for_inference(inference_context, query, key, value, rotary_pos_emb,
                                                           rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                                                           sequence_len_offset, **kwargs)
        if rotary_pos_emb is not None:
            q_pos, k_pos = rotary_pos_emb
            start = inference_context.sequence_len_offset
            end = start + key.size(0)
            cos, signed_sin = _cos_sin(inference_context, k_pos, start, end, key.dtype)
            key = _rotate(key, cos, signed_sin)
            if q_pos is k_pos:
                query = _rotate(query, cos, signed_sin)
            else:
                query = apply_rotary_pos_emb(query, q_pos[start:end], config=c, cp_group=self.pg_collection.cp)
        # Both rotated: Megatron's forward then applies no rotary embedding (None).
        # a windowed layer of a batch decoded together keeps only its window; megacli serve's rows
        # (per-row positions) keep every column, and the core attention's window masks them
        if self.window is not None and inference_context.batch_size_offset == 0 \
                and key.size(1) == inference_context.max_batch_size \
                and getattr(inference_context, "rope_positions", None) is None:
            return self._windowed(inference_context, query, key, value)
        query, key, value, *rest = super()._adjust_key_value_for_inference(
            inference_context, query, key, value, None, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
            sequence_len_offset, **kwargs)
        first = getattr(inference_context, "first_column", 0)
        return (query, key[first:], value[first:], *rest)

    def _windowed(self, context, query, key, value):
        """A sliding-window layer's cache: only the last ``window`` keys and values, which are all the
        next query can see (it sees itself and the window before it). Kept in the context's
        key_value_memory_dict, so beam search reorders it with the others ([s, b, ...])."""
        from megatron.core.transformer.enums import AttnMaskType

        start = context.sequence_len_offset
        if start == 0 or self.layer_number not in context.key_value_memory_dict:
            keys, values = key, value
        else:
            past_k, past_v = context.key_value_memory_dict[self.layer_number]
            keys, values = torch.cat((past_k, key)), torch.cat((past_v, value))
        keep = keys.size(0) - min(self.window, keys.size(0))
        context.key_value_memory_dict[self.layer_number] = (keys[keep:], values[keep:])
        return query, keys, values, None, self.attn_mask_type if start == 0 else AttnMaskType.no_mask, None
