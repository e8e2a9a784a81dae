"""Decode-time shortcuts for Megatron-Core's GPT layers, with the same arithmetic and the same
communication: at one token per step on a CPU, the per-layer Python around the GEMMs costs more
than the GEMMs themselves.

* ``CachedRotarySelfAttention``: Megatron's static KV cache stores keys before RoPE and rotates
  the whole cached prefix again at every step (O(length) per layer per token); this rotates each
  new key once, at its own positions, before it is cached, and the query with it. The cosines and
  sines of a step are computed by the first layer and shared by the others (``DecodeContext``).
* ``lean_linears``: forwards for the tensor-parallel linear layers without the autograd
  Functions, autocast decorators and process-group lookups they go through for training.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, _yarn_get_concentration_factor_from_config


class DecodeContext(StaticInferenceContext):
    """Megatron-Core's static inference context (the KV cache) plus the RoPE cosines and sines of
    the positions being decoded, computed by the first layer of a step and shared by the others."""

    def __init__(self, max_batch_size: int, max_sequence_length: int):
        super().__init__(max_batch_size, max_sequence_length)
        self.rotary_cos_sin = None  # (positions, rotary table, cos, sin) of the current step


def _cos_sin(context, freqs: torch.Tensor, start: int, end: int, dtype):
    if not isinstance(context, DecodeContext):
        part = freqs[start:end]
        return part.cos().to(dtype), part.sin().to(dtype)
    cached = context.rotary_cos_sin
    if cached is None or cached[0] != (start, end) or cached[1] is not freqs:
        part = freqs[start:end]
        context.rotary_cos_sin = cached = ((start, end), freqs, part.cos().to(dtype), part.sin().to(dtype))
    return cached[2], cached[3]


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Megatron's non-interleaved RoPE (rope_utils._apply_rotary_pos_emb_bshd, mscale 1):
    the first cos.shape[-1] features rotate by halves, the rest pass through."""
    dim = cos.shape[-1]
    x, rest = t[..., :dim], t[..., dim:]
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class CachedRotarySelfAttention(SelfAttention):
    """Megatron-Core's SelfAttention whose static KV cache holds keys already rotated."""

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb, rotary_pos_cos=None,
                                        rotary_pos_sin=None, rotary_pos_cos_sin=None, sequence_len_offset=None, **kwargs):
        c = self.config
        plain_rope = not (c.flash_decode or c.rotary_interleaved or c.apply_rope_fusion
                          or _yarn_get_concentration_factor_from_config(c) != 1.0)
        if inference_context is None or not inference_context.is_static_batching() or rotary_pos_emb is None or not plain_rope:
            return super()._adjust_key_value_for_inference(inference_context, query, key, value, rotary_pos_emb,
                                                           rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                                                           sequence_len_offset, **kwargs)
        q_pos, k_pos = rotary_pos_emb
        start = inference_context.sequence_len_offset
        end = start + key.size(0)
        cos, sin = _cos_sin(inference_context, k_pos, start, end, key.dtype)
        key = _rotate(key, cos, sin)
        if q_pos is k_pos:
            query = _rotate(query, cos, sin)
        else:
            query = apply_rotary_pos_emb(query, q_pos[start:end], config=c, cp_group=self.pg_collection.cp)
        # Both rotated: Megatron's forward then applies no rotary embedding (None).
        return super()._adjust_key_value_for_inference(inference_context, query, key, value, None, rotary_pos_cos,
                                                       rotary_pos_sin, rotary_pos_cos_sin, sequence_len_offset, **kwargs)


def _column_forward(layer, input_, weight=None, runtime_gather_output=None):
    weight = layer.weight if weight is None else weight
    bias = None if layer.skip_bias_add else layer.bias
    output = F.linear(input_, weight, bias)
    gather = layer.gather_output if runtime_gather_output is None else runtime_gather_output
    if gather and layer.tp_group.size() > 1:
        parts = [torch.empty_like(output) for _ in range(layer.tp_group.size())]
        dist.all_gather(parts, output.contiguous(), group=layer.tp_group)
        output = torch.cat(parts, dim=-1)
    return output, (layer.bias if layer.skip_bias_add else None)


def _row_forward(layer, input_):
    output = F.linear(input_, layer.weight)
    if layer.tp_group.size() > 1:
        dist.all_reduce(output, group=layer.tp_group)
    if layer.skip_bias_add or layer.bias is None:
        return output, (layer.bias if layer.skip_bias_add else None)
    return output + layer.bias, None


def lean_linears(net) -> None:
    """Give every plain (not sequence-parallel, not LoRA) tensor-parallel linear layer of an
    inference-only model the lean forward."""
    for module in net.modules():
        if type(module) is ColumnParallelLinear and not module.sequence_parallel:
            module.forward = functools.partial(_column_forward, module)
        elif type(module) is RowParallelLinear and not module.sequence_parallel and module.input_is_parallel:
            module.forward = functools.partial(_row_forward, module)


def _decode_layer(layer, hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None,
                  attention_bias=None, **_unused):
    """TransformerLayer.forward of a pre-norm GPT layer in eval mode (dropout off, so each
    bias-dropout-add is a plain sum), without its recompute, offload and CUDA-graph plumbing."""
    out, bias = layer.self_attention(layer.input_layernorm(hidden_states), attention_mask=attention_mask,
                                     inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                                     attention_bias=attention_bias)
    hidden_states = hidden_states + (out if bias is None else out + bias)
    out, bias = layer.mlp(layer.pre_mlp_layernorm(hidden_states))
    return hidden_states + (out if bias is None else out + bias), None


def lean_layers(net) -> None:
    """Give every plain GPT layer (self-attention, dense MLP, residual taken before the norm) of
    an inference-only model the lean forward."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for layer in net.modules():
        if (isinstance(layer, TransformerLayer) and type(layer.mlp) is MLP and isinstance(layer.cross_attention, IdentityOp)
                and not layer.config.apply_residual_connection_post_layernorm and not layer.config.fp32_residual_connection):
            layer.forward = functools.partial(_decode_layer, layer)
