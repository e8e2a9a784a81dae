"""Decode-time shortcuts for Megatron-Core's GPT layers, with the same arithmetic and the same
communication: at one token per step on a CPU, the per-layer Python around the GEMMs costs more
than the GEMMs themselves. ``lean_linears`` and ``lean_layers`` give an inference-only model
forwards without the autograd Functions, autocast decorators, process-group lookups, recompute,
offload and CUDA-graph plumbing they go through for training.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megacli.engine.models.layers import OutputNormAdd


def _column_forward(layer, tp: int, input_, weight=None, runtime_gather_output=None):
    weight = layer.weight if weight is None else weight
    bias = None if layer.skip_bias_add else layer.bias
    output = F.linear(input_, weight, bias)
    gather = layer.gather_output if runtime_gather_output is None else runtime_gather_output
    if gather and tp > 1:
        parts = [torch.empty_like(output) for _ in range(tp)]
        dist.all_gather(parts, output.contiguous(), group=layer.tp_group)
        output = torch.cat(parts, dim=-1)
    return output, (layer.bias if layer.skip_bias_add else None)


def _row_forward(layer, tp: int, input_):
    output = F.linear(input_, layer.weight)
    if tp > 1:
        dist.all_reduce(output, group=layer.tp_group)
    if layer.skip_bias_add or layer.bias is None:
        return output, (layer.bias if layer.skip_bias_add else None)
    return output + layer.bias, None


def lean_linears(net) -> None:
    """Give every plain (not sequence-parallel, not LoRA, not an expert's) tensor-parallel linear
    layer of an inference-only model the lean forward. An expert's linears leave their
    communication to the MoE token dispatcher (Megatron's explicit_expert_comm): a lean row-parallel
    expert would all-reduce what the dispatcher reduces again."""
    for module in net.modules():
        if getattr(module, "explicit_expert_comm", False):
            continue
        # the group's size asked once: each ask is a call into the process-group library
        if type(module) is ColumnParallelLinear and not module.sequence_parallel:
            module.forward = functools.partial(_column_forward, module, module.tp_group.size())
        elif type(module) is RowParallelLinear and not module.sequence_parallel and module.input_is_parallel:
            module.forward = functools.partial(_row_forward, module, module.tp_group.size())


def _cached_attention(attn, hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None,
                      attention_bias=None, **rest):
    """SelfAttention.forward over a static KV cache (``CachedRotarySelfAttention`` with plain RoPE
    or none): the cache step rotates the new keys and the query itself, so nothing follows it but
    the core attention and the output projection. Anything else runs the full forward."""
    if inference_context is None or not inference_context.is_static_batching() or any(
            v is not None for v in rest.values()):
        return type(attn).forward(attn, hidden_states, attention_mask, inference_context=inference_context,
                                  rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias, **rest)
    if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
        rotary_pos_emb = (rotary_pos_emb,) * 2
    query, key, value = attn.get_query_key_value_tensors(hidden_states)
    query, key, value, rotary_left, mask_type, _ = attn._adjust_key_value_for_inference(
        inference_context, query, key, value, rotary_pos_emb)
    assert rotary_left is None, "plain RoPE is applied by the cache step"
    out = attn.core_attention(query, key, value, attention_mask, attn_mask_type=mask_type,
                              attention_bias=attention_bias)
    return attn.linear_proj(out)


def _dense_mlp(mlp, hidden_states, per_token_scale=None, **rest):
    """MLP.forward without fused activations: fc1, its bias, the (gated) activation, fc2."""
    if per_token_scale is not None:
        return type(mlp).forward(mlp, hidden_states, per_token_scale, **rest)
    c = mlp.config
    out, bias = mlp.linear_fc1(hidden_states)
    if bias is not None:
        out = out + bias
    if c.gated_linear_unit:
        gate, linear = torch.chunk(out, 2, dim=-1)
        out = c.activation_func(gate) * (linear + c.glu_linear_offset if c.glu_linear_offset else linear)
    else:
        out = c.activation_func(out)
    return mlp.linear_fc2(out)


def lean_attention_and_mlp(net) -> None:
    """Give every cached-rotary self-attention with plain RoPE (or none) and every dense MLP without
    fused activations of an inference-only model the lean forward."""
    from megatron.core.transformer.mlp import MLP

    from megacli.engine.models.kv_cache import CachedRotarySelfAttention, plain_rope

    for module in net.modules():
        c = getattr(module, "config", None)
        if (type(module) is CachedRotarySelfAttention and plain_rope(c) and not module.local_rope
                and not c.no_rope_freq and not c.attention_output_gate):
            module.forward = functools.partial(_cached_attention, module)
        elif (type(module) is MLP and not c.use_te_activation_func and not c.bias_activation_fusion
              and c.activation_func_clamp_value is None):
            module.forward = functools.partial(_dense_mlp, module)


def _decode_layer(layer, hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None,
                  attention_bias=None, **_unused):
    """TransformerLayer.forward of a GPT layer in eval mode (dropout off, so each
    bias-dropout-add is a plain sum, after the output norm of ``model.norm_placement: output``),
    without its recompute, offload and CUDA-graph plumbing."""
    out = layer.self_attention(layer.input_layernorm(hidden_states), attention_mask=attention_mask,
                               inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                               attention_bias=attention_bias)
    hidden_states = hidden_states + _sublayer_output(layer.self_attn_bda, out)
    out = layer.mlp(layer.pre_mlp_layernorm(hidden_states))
    return hidden_states + _sublayer_output(layer.mlp_bda, out), None


def _sublayer_output(bda, output_with_bias):
    if isinstance(bda, OutputNormAdd):
        return bda.normed(output_with_bias)
    out, bias = output_with_bias
    return out if bias is None else out + bias


def lean_layers(net) -> None:
    """Give every plain GPT layer (self-attention, dense MLP, residual taken before the norm,
    bias-dropout-add or OutputNormAdd) of an inference-only model the lean forward."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for layer in net.modules():
        if (isinstance(layer, TransformerLayer) and type(layer.mlp) is MLP and isinstance(layer.cross_attention, IdentityOp)
                and not layer.config.apply_residual_connection_post_layernorm and not layer.config.fp32_residual_connection
                and all(_plain_residual(bda) for bda in (layer.self_attn_bda, layer.mlp_bda))):
            layer.forward = functools.partial(_decode_layer, layer)


def _plain_residual(bda) -> bool:
    return isinstance(bda, OutputNormAdd) or not isinstance(bda, torch.nn.Module)
