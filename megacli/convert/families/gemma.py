"""The Gemma family: Gemma 2 and Gemma 3 text (Gemma2ForCausalLM, Gemma3ForCausalLM with its
text-only ``gemma3_text`` config).

What sets them apart from Llama, each a recipe field:

* RMSNorm applied as ``1 + weight`` (``model.norm_zero_centered_gamma``: HF's stored weight is
  Megatron's zero-centered gain, copied as is), on the q/k heads too in Gemma 3 (``qk_layernorm``);
* input embeddings times sqrt(hidden_size) in the embedding dtype (``model.scale_embeddings``);
* a norm before and after attention and before and after the MLP (``model.norm_placement: sandwich``: the
  post norms live in the layer's bias-dropout-add slots, ``self_attn_bda.norm`` / ``mlp_bda.norm``);
* GeGLU with tanh-approximate GELU (``activation: geglu``), an explicit head_dim (``kv_channels``);
* scores scaled by query_pre_attn_scalar**-0.5 (``model.softmax_scale``);
* soft-capped attention scores and final logits (``model.attention_softcap``,
  ``model.final_logit_softcap``; Gemma 2 sets both);
* local (sliding-window) and global layers from ``layer_types`` (``model.sliding_window`` +
  ``model.sliding_window_layers``); Gemma 3's local layers rotate with their own base
  (``model.rotary_base_local``, HF's rope_parameters.sliding_attention / rope_local_base_freq), its
  global ones with rope_parameters.full_attention (optionally scaled).
"""

from __future__ import annotations

from megacli.convert.families import llama, require
from megacli.convert.mapping import MappingTable, Rule, direct, gate_up, qkv
from megacli.errors import UserError
from megacli.recipe.model import every_nth_global

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
ARCH = "gpt"

_MODEL_TYPES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")  # HF's names of the tanh-approximate GELU
_DEFAULT_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}  # every N-th layer global


def _layer_flags(c: dict, architecture: str, layers: int) -> list[int]:
    if c.get("layer_types"):
        if len(c["layer_types"]) != layers:
            raise UserError(f"{architecture}: layer_types has {len(c['layer_types'])} entries for {layers} layers")
        return llama.window_flags(c["layer_types"], architecture)
    n = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or _DEFAULT_PATTERN[architecture]
    return every_nth_global(n, layers)


def _rope(c: dict, architecture: str, windowed: bool) -> dict:
    """rotary_base, rope_scaling and (Gemma 3 with local layers) rotary_base_local."""
    params = c.get("rope_parameters") or {}
    if architecture == "Gemma2ForCausalLM" or "full_attention" not in params:
        # Gemma 2, or a transformers 4 Gemma 3 config (rope_theta, rope_scaling, rope_local_base_freq)
        section = {"rotary_base": llama.rope_theta(c), "rope_scaling": llama.rope_scaling(c)}
        local = c.get("rope_local_base_freq")
    else:
        full, sliding = params["full_attention"], params.get("sliding_attention") or {}
        section = {"rotary_base": llama.rope_theta({"rope_parameters": full}),
                   "rope_scaling": llama.rope_scaling({"rope_parameters": full})}
        if sliding.get("rope_type", "default") != "default":
            raise UserError(f"{architecture}: RoPE scaling of the sliding-window layers (rope_parameters."
                            f"sliding_attention) is not supported; their RoPE converts plain")
        local = sliding.get("rope_theta")
    if architecture == "Gemma3ForCausalLM" and windowed:
        section["rotary_base_local"] = float(local if local is not None else 10000.0)
    return section


def model_section(c: dict) -> dict:
    architecture = c["architectures"][0]
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise UserError(f"hidden_activation {act!r} is not supported for {architecture}; only gelu_pytorch_tanh "
                        f"(GeGLU with tanh-approximate GELU) converts")
    if c.get("attention_bias"):
        raise UserError(f"{architecture} with attention_bias = true cannot be expressed: Megatron has biases on all "
                        f"linear layers or on the QKV projection only, Gemma's would be on q/k/v/o but not the MLP")
    if c.get("use_bidirectional_attention"):
        raise UserError(f"{architecture} with use_bidirectional_attention (an embedding model) does not convert: "
                        f"megacli's gpt is causal")
    hidden = require(c, "hidden_size")
    heads = require(c, "num_attention_heads")
    layers = require(c, "num_hidden_layers")
    head_dim = c.get("head_dim") or hidden // heads
    positions = require(c, "max_position_embeddings")
    flags = _layer_flags(c, architecture, layers)
    window = c.get("sliding_window")
    windowed = window is not None and any(flags)
    scalar = c.get("query_pre_attn_scalar") or head_dim
    section = dict(
        arch="gpt",
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads") or heads,
        kv_channels=head_dim,
        ffn_hidden_size=require(c, "intermediate_size"),
        seq_length=min(positions, 4096),
        max_position_embeddings=positions,
        position_embedding="rope",
        **_rope(c, architecture, windowed),
        normalization="rmsnorm",
        norm_epsilon=c.get("rms_norm_eps", 1e-6),
        norm_zero_centered_gamma=True,
        norm_placement="sandwich",
        scale_embeddings=True,
        activation="geglu",
        add_bias_linear=False,
        qk_layernorm=architecture == "Gemma3ForCausalLM",
        softmax_scale=float(scalar) ** -0.5,
        attention_softcap=c.get("attn_logit_softcapping"),
        final_logit_softcap=c.get("final_logit_softcapping"),
        untie_embeddings=not c.get("tie_word_embeddings", True),
        vocab_size=require(c, "vocab_size"),
        init_method_std=c.get("initializer_range", 0.02),
        dropout=0.0,
        attention_dropout=c.get("attention_dropout", 0.0),
    )
    if windowed:
        section.update(sliding_window=window, sliding_window_layers=llama.window_pattern(flags))
    return section


def architecture_for(m, preferred: str | None = None) -> str | None:
    if not (m.arch == "gpt" and m.position_embedding == "rope" and m.normalization == "rmsnorm"
            and m.activation == "geglu" and m.rotary_percent == 1.0 and m.moe is None and not m.add_bias_linear
            and not m.add_qkv_bias and m.norm_zero_centered_gamma and m.norm_placement == "sandwich" and m.scale_embeddings):
        return None
    if m.qk_layernorm:
        return "Gemma3ForCausalLM"
    return "Gemma2ForCausalLM" if m.rotary_base_local is None else None


def _query_pre_attn_scalar(m):
    """HF's query_pre_attn_scalar for model.softmax_scale (an integer when it is one)."""
    if m.softmax_scale is None:
        return m.head_dim
    value = m.softmax_scale ** -2
    return round(value) if abs(value - round(value)) < 1e-6 * value else value


def _gemma3_rope(m, base: dict) -> dict:
    full = llama._hf_rope(m, {"rope_parameters": (base.get("rope_parameters") or {}).get("full_attention") or {}})
    local = {"rope_type": "default", "rope_theta": m.rotary_base_local if m.rotary_base_local is not None else m.rotary_base}
    if m.rotary_base_local is None and m.rope_scaling is not None:
        local = full["rope_parameters"]  # the same RoPE in every layer
    return {"rope_parameters": {"sliding_attention": local, "full_attention": full["rope_parameters"]}}


def hf_config(m, *, architecture: str, vocab_size: int, base: dict | None) -> dict:
    base = dict(base or {})
    derived = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES[architecture],
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.query_groups,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.norm_epsilon,
        "hidden_activation": base.get("hidden_activation") or "gelu_pytorch_tanh",
        "tie_word_embeddings": not m.untie_embeddings,
        "initializer_range": m.init_method_std,
        "attention_dropout": m.attention_dropout,
        "attention_bias": False,
        "query_pre_attn_scalar": _query_pre_attn_scalar(m),
        "attn_logit_softcapping": m.attention_softcap,
        "final_logit_softcapping": m.final_logit_softcap,
        "layer_types": llama.layer_types(m),
    }
    if m.sliding_window is not None:
        derived["sliding_window"] = m.sliding_window
    legacy_gemma3 = architecture == "Gemma3ForCausalLM" and "rope_local_base_freq" in base and "rope_parameters" not in base
    if architecture == "Gemma2ForCausalLM" or legacy_gemma3:
        rope = llama._hf_rope(m, base)
        if legacy_gemma3:
            rope["rope_local_base_freq"] = m.rotary_base_local if m.rotary_base_local is not None else m.rotary_base
    else:
        rope = _gemma3_rope(m, base)
    return {**base, **derived, **rope}


def table(m) -> MappingTable:
    L, H = "decoder.layers.*.", "model.layers.*."
    groups, heads = m.query_groups, m.num_attention_heads
    attn = H + "self_attn."
    rules = [
        Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", *direct()),
        Rule(L + "self_attention.linear_qkv.layer_norm_weight", H + "input_layernorm.weight", *direct()),
        Rule(L + "self_attention.linear_qkv.weight", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
             *qkv(groups=groups, heads=heads)),
        Rule(L + "self_attention.linear_proj.weight", attn + "o_proj.weight", *direct()),
        Rule(L + "self_attn_bda.norm.weight", H + "post_attention_layernorm.weight", *direct()),
        Rule(L + "mlp.linear_fc1.layer_norm_weight", H + "pre_feedforward_layernorm.weight", *direct()),
        Rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), *gate_up()),
        Rule(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight", *direct()),
        Rule(L + "mlp_bda.norm.weight", H + "post_feedforward_layernorm.weight", *direct()),
        Rule("decoder.final_layernorm.weight", "model.norm.weight", *direct()),
    ]
    if m.qk_layernorm:
        rules += [Rule(L + "self_attention.q_layernorm.weight", attn + "q_norm.weight", *direct()),
                  Rule(L + "self_attention.k_layernorm.weight", attn + "k_norm.weight", *direct())]
    drop = []
    if m.untie_embeddings:
        rules.append(Rule("output_layer.weight", "lm_head.weight", *direct()))
    else:
        drop.append("lm_head.weight")
    return MappingTable(rules, drop=tuple(drop))
