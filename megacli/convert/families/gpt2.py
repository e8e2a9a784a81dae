"""GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm, biases everywhere, gelu_new, Conv1D
weights ([in, out], transposed against Megatron's Linear), one fused [Q|K|V] projection, tied
embeddings unless the config says otherwise."""

from __future__ import annotations

from megacli.convert.families import require
from megacli.convert.mapping import MappingTable, Rule, direct, fused_qkv, transposed
from megacli.errors import UserError

ARCHITECTURES = ("GPT2LMHeadModel",)
ARCH = "gpt"

# HF activation_function -> recipe model.activation (and back: the first name listed wins).
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_HF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


def model_section(c: dict) -> dict:
    if c.get("add_cross_attention"):
        raise UserError("GPT-2 with add_cross_attention is not supported (decoder-only GPT has no cross-attention)")
    if c.get("scale_attn_by_inverse_layer_idx"):
        raise UserError("GPT-2 with scale_attn_by_inverse_layer_idx is not supported by the Megatron model")
    if c.get("scale_attn_weights") is False:
        raise UserError("GPT-2 with scale_attn_weights: false is not supported by the Megatron model")
    act = c.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise UserError(f"GPT-2 activation_function {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    hidden = require(c, "n_embd", "hidden_size")
    positions = require(c, "n_positions", "max_position_embeddings")
    dropout = c.get("resid_pdrop", 0.1)
    return dict(
        arch="gpt",
        num_layers=require(c, "n_layer", "num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=require(c, "n_head", "num_attention_heads"),
        ffn_hidden_size=c.get("n_inner") or 4 * hidden,
        seq_length=positions,
        max_position_embeddings=positions,
        position_embedding="learned",
        normalization="layernorm",
        norm_epsilon=c.get("layer_norm_epsilon", 1e-5),
        activation=_ACTIVATIONS[act],
        add_bias_linear=True,
        untie_embeddings=not c.get("tie_word_embeddings", True),
        vocab_size=require(c, "vocab_size"),
        init_method_std=c.get("initializer_range", 0.02),
        dropout=dropout,
        attention_dropout=c.get("attn_pdrop", 0.1),
    )


def architecture_for(m, preferred: str | None = None) -> str | None:
    ok = (m.arch == "gpt" and m.position_embedding == "learned" and m.normalization == "layernorm"
          and m.activation in _HF_ACTIVATION and m.add_bias_linear and m.query_groups == m.num_attention_heads
          and m.head_dim * m.num_attention_heads == m.hidden_size and not m.qk_layernorm and m.moe is None
          and m.norm_placement == "pre")
    return "GPT2LMHeadModel" if ok else None


def hf_config(m, *, architecture: str, vocab_size: int, base: dict | None) -> dict:
    base = dict(base or {})
    act = base.get("activation_function")
    derived = {
        "architectures": [architecture],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": m.max_positions,
        "n_embd": m.hidden_size,
        "n_layer": m.num_layers,
        "n_head": m.num_attention_heads,
        "n_inner": None if m.ffn_size == 4 * m.hidden_size else m.ffn_size,
        "activation_function": act if _ACTIVATIONS.get(act) == m.activation else _HF_ACTIVATION[m.activation],
        "layer_norm_epsilon": m.norm_epsilon,
        "initializer_range": m.init_method_std,
        "resid_pdrop": m.dropout,
        "embd_pdrop": m.dropout,
        "attn_pdrop": m.attention_dropout,
        "tie_word_embeddings": not m.untie_embeddings,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
    }
    return {**base, **derived}


def table(m) -> MappingTable:
    L, H = "decoder.layers.*.", "transformer.h.*."
    heads = m.num_attention_heads
    rules = [
        Rule("embedding.word_embeddings.weight", "transformer.wte.weight", *direct()),
        Rule("embedding.position_embeddings.weight", "transformer.wpe.weight", *direct()),
        Rule(L + "self_attention.linear_qkv.layer_norm_weight", H + "ln_1.weight", *direct()),
        Rule(L + "self_attention.linear_qkv.layer_norm_bias", H + "ln_1.bias", *direct()),
        Rule(L + "self_attention.linear_qkv.weight", H + "attn.c_attn.weight", *fused_qkv(heads=heads, conv1d=True)),
        Rule(L + "self_attention.linear_qkv.bias", H + "attn.c_attn.bias", *fused_qkv(heads=heads, conv1d=False)),
        Rule(L + "self_attention.linear_proj.weight", H + "attn.c_proj.weight", *transposed()),
        Rule(L + "self_attention.linear_proj.bias", H + "attn.c_proj.bias", *direct()),
        Rule(L + "mlp.linear_fc1.layer_norm_weight", H + "ln_2.weight", *direct()),
        Rule(L + "mlp.linear_fc1.layer_norm_bias", H + "ln_2.bias", *direct()),
        Rule(L + "mlp.linear_fc1.weight", H + "mlp.c_fc.weight", *transposed()),
        Rule(L + "mlp.linear_fc1.bias", H + "mlp.c_fc.bias", *direct()),
        Rule(L + "mlp.linear_fc2.weight", H + "mlp.c_proj.weight", *transposed()),
        Rule(L + "mlp.linear_fc2.bias", H + "mlp.c_proj.bias", *direct()),
        Rule("decoder.final_layernorm.weight", "transformer.ln_f.weight", *direct()),
        Rule("decoder.final_layernorm.bias", "transformer.ln_f.bias", *direct()),
    ]
    drop = [H + "attn.bias", H + "attn.masked_bias"]  # causal-mask buffers of old checkpoints
    if m.untie_embeddings:
        rules.append(Rule("output_layer.weight", "lm_head.weight", *direct()))
    else:
        drop.append("lm_head.weight")  # a tied copy some checkpoints store
    return MappingTable(rules, drop=tuple(drop), normalize_hf=_with_prefix)


def _with_prefix(key: str) -> str:
    """GPT2Model checkpoints (the original `gpt2` upload) name weights without `transformer.`."""
    return key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
