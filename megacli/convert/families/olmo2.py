"""OLMo 2 (Olmo2ForCausalLM): Llama's RoPE, grouped-query attention and SwiGLU, with the norms
moved to the sublayer outputs and RMSNorm over whole query and key projections.

Each layer is h = x + norm(attention(x)), out = h + norm(mlp(h)): no norm before attention or the
MLP (``model.norm_placement: output``; the two norms are stored as ``self_attn_bda.norm`` and
``mlp_bda.norm``), a final norm as in Llama. q_norm spans num_heads × head_dim features and
k_norm num_kv_heads × head_dim (``model.qk_norm_scope: projection``), applied before RoPE.
"""

from __future__ import annotations

from megacli.convert.families import llama
from megacli.convert.mapping import MappingTable, Rule, direct, gate_up, qkv
from megacli.errors import UserError

ARCHITECTURES = ("Olmo2ForCausalLM",)
ARCH = "gpt"


def model_section(c: dict) -> dict:
    if c.get("attention_bias"):
        raise UserError("Olmo2ForCausalLM with attention_bias = true (biases on the attention projections, none in "
                        "the MLP) cannot be expressed: Megatron has biases on all linear layers or on QKV only")
    section = llama.model_section({**c, "architectures": ["LlamaForCausalLM"], "mlp_bias": False})
    return {**section, "qk_layernorm": True, "qk_norm_scope": "projection", "norm_placement": "output"}


def architecture_for(m, preferred: str | None = None) -> str | None:
    if not (m.norm_placement == "output" and m.qk_layernorm and m.qk_norm_scope == "projection"):
        return None
    as_llama = m.model_copy(update={"norm_placement": "pre", "qk_layernorm": False, "qk_norm_scope": "head"})
    if llama.architecture_for(as_llama) is None or m.add_bias_linear or m.add_qkv_bias:
        return None
    return "Olmo2ForCausalLM"


def hf_config(m, *, architecture: str, vocab_size: int, base: dict | None) -> dict:
    base = dict(base or {})
    derived = llama.hf_config(m, architecture="LlamaForCausalLM", vocab_size=vocab_size, base=base)
    derived.update(architectures=[architecture], model_type="olmo2", attention_bias=False)
    derived.pop("mlp_bias")
    if "head_dim" not in base and m.head_dim * m.num_attention_heads == m.hidden_size:
        derived.pop("head_dim")  # OLMo 2 configs leave it implicit
    return derived


def table(m) -> MappingTable:
    L, H = "decoder.layers.*.", "model.layers.*."
    attn = H + "self_attn."
    rules = [
        Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", *direct()),
        Rule(L + "self_attention.linear_qkv.weight", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
             *qkv(groups=m.query_groups, heads=m.num_attention_heads)),
        Rule(L + "self_attention.q_layernorm.weight", attn + "q_norm.weight", *direct()),
        Rule(L + "self_attention.k_layernorm.weight", attn + "k_norm.weight", *direct()),
        Rule(L + "self_attention.linear_proj.weight", attn + "o_proj.weight", *direct()),
        Rule(L + "self_attn_bda.norm.weight", H + "post_attention_layernorm.weight", *direct()),
        Rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), *gate_up()),
        Rule(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight", *direct()),
        Rule(L + "mlp_bda.norm.weight", H + "post_feedforward_layernorm.weight", *direct()),
        Rule("decoder.final_layernorm.weight", "model.norm.weight", *direct()),
    ]
    drop = [attn + "rotary_emb.inv_freq"]
    if m.untie_embeddings:
        rules.append(Rule("output_layer.weight", "lm_head.weight", *direct()))
    else:
        drop.append("lm_head.weight")
    return MappingTable(rules, drop=tuple(drop))
