"""Phi-3 and Phi-4-mini (Phi3ForCausalLM): Llama's layer with the q/k/v projections fused into one
``qkv_proj`` ([Q; K; V] rows, grouped-query) and the MLP's gate and up projections into one
``gate_up_proj`` ([gate; up] rows, which is Megatron's linear_fc1 as it is), no biases, tied
(Phi-4-mini) or untied embeddings, and RoPE on the first ``partial_rotary_factor`` of each head's
dimensions (Phi-4-mini: 0.75; Megatron's ``rotary_percent``, rotating halves of those dimensions
as Hugging Face does).

``longrope`` scaling (Phi-3-*-128k, Phi-4-mini; older configs say ``su`` or ``yarn``, which Hugging
Face's Phi-3 reads as longrope) does not convert: its per-dimension short and long factors switch
with the sequence length, which Megatron-Core's rotary embedding cannot express. A sliding window
(Phi-3-mini-4k: 2047) applies to every layer, as Mistral's (``model.sliding_window``).
"""

from __future__ import annotations

from megacli.convert.families import llama, require
from megacli.convert.mapping import MappingTable, Rule, direct, packed_qkv
from megacli.errors import UserError

ARCHITECTURES = ("Phi3ForCausalLM",)
ARCH = "gpt"


def _partial_rotary_factor(c: dict) -> float:
    return float((c.get("rope_parameters") or {}).get("partial_rotary_factor") or c.get("partial_rotary_factor") or 1.0)


def model_section(c: dict) -> dict:
    params = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type not in (None, "default"):
        read_as = "" if rope_type == "longrope" else " (Hugging Face's Phi-3 reads it as longrope)"
        raise UserError(f"Phi3ForCausalLM RoPE scaling {rope_type!r}{read_as} (rope_scaling / rope_parameters) does not "
                        f"convert: longrope's per-dimension short and long factors are chosen by the sequence length, "
                        f"which Megatron-Core's rotary embedding has no equivalent for; only unscaled Phi-3 configs convert")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise UserError("Phi3ForCausalLM has no biases; this config asks for attention_bias / mlp_bias")
    windowed = c.get("sliding_window") is not None
    dense = {**c, "architectures": ["MistralForCausalLM" if windowed else "LlamaForCausalLM"]}
    section = llama.model_section(dense)
    factor = _partial_rotary_factor(c)
    if int(section["kv_channels"] * factor) % 2:
        raise UserError(f"partial_rotary_factor = {factor} rotates {section['kv_channels'] * factor:g} of "
                        f"{section['kv_channels']} head dimensions; RoPE rotates an even number")
    resid, embd = c.get("resid_pdrop", 0.0) or 0.0, c.get("embd_pdrop", 0.0) or 0.0
    if resid != embd:
        raise UserError(f"resid_pdrop = {resid} with embd_pdrop = {embd}: Megatron has one hidden dropout "
                        f"(model.dropout); set them equal")
    return {**section, "rotary_percent": factor, "dropout": resid}


def architecture_for(m, preferred: str | None = None) -> str | None:
    if m.rope_scaling is not None or m.add_bias_linear or m.add_qkv_bias:
        return None
    if llama.architecture_for(m.model_copy(update={"rotary_percent": 1.0})) is None or m.qk_layernorm:
        return None
    if m.rotary_percent == 1.0 and preferred != "Phi3ForCausalLM":
        return None  # the Llama family expresses it
    return "Phi3ForCausalLM"


def hf_config(m, *, architecture: str, vocab_size: int, base: dict | None) -> dict:
    base = dict(base or {})
    as_llama = "MistralForCausalLM" if m.sliding_window is not None else "LlamaForCausalLM"
    derived = llama.hf_config(m, architecture=as_llama, vocab_size=vocab_size, base=base)
    for key in ("attention_bias", "mlp_bias", "head_dim"):
        if key not in base:
            derived.pop(key, None)
    if m.head_dim * m.num_attention_heads != m.hidden_size:
        derived["head_dim"] = m.head_dim
    derived.update(architectures=[architecture], model_type="phi3", resid_pdrop=m.dropout,
                   embd_pdrop=m.dropout)
    derived.setdefault("original_max_position_embeddings", m.max_positions)
    derived.setdefault("sliding_window", None)
    if isinstance(derived.get("rope_parameters"), dict):
        derived["rope_parameters"]["partial_rotary_factor"] = m.rotary_percent
    else:
        derived["partial_rotary_factor"] = m.rotary_percent
    return derived


def table(m) -> MappingTable:
    L, H = "decoder.layers.*.", "model.layers.*."
    attn = H + "self_attn."
    rules = [
        Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", *direct()),
        Rule(L + "self_attention.linear_qkv.layer_norm_weight", H + "input_layernorm.weight", *direct()),
        Rule(L + "self_attention.linear_qkv.weight", attn + "qkv_proj.weight",
             *packed_qkv(groups=m.query_groups, heads=m.num_attention_heads)),
        Rule(L + "self_attention.linear_proj.weight", attn + "o_proj.weight", *direct()),
        Rule(L + "mlp.linear_fc1.layer_norm_weight", H + "post_attention_layernorm.weight", *direct()),
        Rule(L + "mlp.linear_fc1.weight", H + "mlp.gate_up_proj.weight", *direct()),
        Rule(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight", *direct()),
        Rule("decoder.final_layernorm.weight", "model.norm.weight", *direct()),
    ]
    drop = [attn + "rotary_emb.inv_freq"]
    if m.untie_embeddings:
        rules.append(Rule("output_layer.weight", "lm_head.weight", *direct()))
    else:
        drop.append("lm_head.weight")
    return MappingTable(rules, drop=tuple(drop))
