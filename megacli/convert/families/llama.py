"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM). RoPE (optionally scaled), grouped-query attention, SwiGLU,
RMSNorm, tied or untied embeddings; Qwen2 adds a bias to the q/k/v projections only
(``add_qkv_bias``); Qwen3 normalises queries and keys per head before RoPE (``qk_layernorm``).

Sliding windows: Mistral's ``sliding_window`` applies to every layer; Qwen2/Qwen3's (with
``use_sliding_window``) to the layers from ``max_window_layers`` on (``layer_types`` in transformers
5). Both are ``model.sliding_window`` (+ ``model.sliding_window_layers``), with HF's definition.

RoPE convention: HF rotates halves (``rotate_half``, non-interleaved), which is Megatron's default
``rotary_interleaved=False``; the inverse frequencies are computed the same way from rope_theta.
"""

from __future__ import annotations

from megacli.convert.families import require
from megacli.convert.mapping import MappingTable, Rule, direct, gate_up, qkv
from megacli.errors import UserError
from megacli.recipe.model import every_nth_global

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ARCH = "gpt"

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3"}


# HF rope parameter key -> model.rope_scaling field (type: rope_type, or the older "type")
_ROPE_KEYS = {"rope_type": "type", "factor": "factor", "low_freq_factor": "low_freq_factor",
              "high_freq_factor": "high_freq_factor", "original_max_position_embeddings": "original_max_positions",
              "beta_fast": "beta_fast", "beta_slow": "beta_slow", "attention_factor": "attention_factor",
              "mscale": "mscale", "mscale_all_dim": "mscale_all_dim", "truncate": "truncate"}
_SCALING_TYPES = ("linear", "llama3", "yarn")


def _rope_params(c: dict) -> dict:
    """The RoPE parameters of a transformers 5 (rope_parameters) or 4 (rope_theta, rope_scaling) config."""
    return {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}


def rope_theta(c: dict) -> float:
    return float(_rope_params(c).get("rope_theta", c.get("rope_theta", 10000.0)))


def rope_scaling(c: dict) -> dict | None:
    """model.rope_scaling for an HF config (None for plain RoPE)."""
    params = _rope_params(c)
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "dynamic":
        raise UserError("RoPE scaling 'dynamic' (NTK) recomputes the frequencies from each batch's length; Megatron-Core "
                        "has no position-dependent rotary embedding, so it does not convert")
    if rope_type not in _SCALING_TYPES:
        raise UserError(f"RoPE scaling {rope_type!r} (rope_scaling / rope_parameters) is not supported; "
                        f"{', '.join(_SCALING_TYPES)} and plain RoPE convert")
    section = {field: params[key] for key, field in _ROPE_KEYS.items() if params.get(key) is not None and key != "rope_type"}
    return {**section, "type": rope_type}


def _hf_rope(m, base: dict) -> dict:
    """The RoPE keys of an exported config.json, in the source's style (rope_parameters or rope_theta
    / rope_scaling)."""
    scaling = {}
    if m.rope_scaling is not None:
        scaling = {key: getattr(m.rope_scaling, field) for key, field in _ROPE_KEYS.items()
                   if getattr(m.rope_scaling, field) is not None}
        scaling["rope_type"] = m.rope_scaling.type
    if isinstance(base.get("rope_parameters"), dict):
        kept = {k: v for k, v in base["rope_parameters"].items() if k not in _ROPE_KEYS and k != "type"}
        return {"rope_parameters": {**kept, "rope_theta": m.rotary_base, "rope_type": "default", **scaling}}
    keys = {"rope_theta": m.rotary_base}
    if scaling or "rope_scaling" in base:
        keys["rope_scaling"] = scaling or None
    return keys


def _biases(c: dict, architecture: str) -> tuple[bool, bool]:
    """(add_bias_linear, add_qkv_bias) for an HF config."""
    if architecture == "Qwen2ForCausalLM":
        return False, True
    attn, mlp = bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False))
    if attn != mlp:
        raise UserError(f"attention_bias = {attn} with mlp_bias = {mlp} cannot be expressed: Megatron has biases on "
                        f"all linear layers (add_bias_linear) or on the QKV projection only (add_qkv_bias)")
    return attn, False


SLIDING, FULL = "sliding_attention", "full_attention"


def window_pattern(flags: list[int]):
    """model.sliding_window_layers for per-layer flags (1 = windowed): None when all are, N when
    every N-th layer is global (Megatron's window_attn_skip_freq), else the list."""
    if all(flags):
        return None
    for n in range(2, len(flags) + 1):
        if flags == every_nth_global(n, len(flags)):
            return n
    return list(flags)


def window_flags(layer_types: list[str], where: str) -> list[int]:
    """Per-layer flags (1 = windowed) of an HF ``layer_types`` list."""
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown:
        raise UserError(f"{where} layer_types {unknown} are not supported; {SLIDING} and {FULL} convert")
    return [int(t == SLIDING) for t in layer_types]


def layer_types(m) -> list[str]:
    """The HF ``layer_types`` of a recipe model."""
    return [SLIDING if w else FULL for w in m.window_layers()]


def _window(c: dict, architecture: str, layers: int) -> dict:
    """model.sliding_window (+ sliding_window_layers) of a Mistral / Qwen2 / Qwen3 config."""
    window = c.get("sliding_window")
    if architecture == "MistralForCausalLM":
        if c.get("layer_types") and set(c["layer_types"]) != {FULL}:
            raise UserError("MistralForCausalLM with layer_types: Mistral windows every layer (Ministral's "
                            "alternating layers are another architecture)")
        return {"sliding_window": window}
    if architecture == "LlamaForCausalLM" or not c.get("use_sliding_window") or window is None:
        return {}
    if c.get("layer_types"):
        flags = window_flags(c["layer_types"], architecture)
    else:
        flags = [int(i >= c.get("max_window_layers", 28)) for i in range(layers)]
    if not any(flags):
        return {}
    return {"sliding_window": window, "sliding_window_layers": window_pattern(flags)}


def _qwen_windows(m) -> int | None:
    """Qwen2/Qwen3's max_window_layers for a recipe model (the windowed layers must be a suffix),
    None when it cannot say which layers are windowed."""
    flags = m.window_layers()
    first = flags.index(1) if 1 in flags else len(flags)
    return first if flags == [0] * first + [1] * (len(flags) - first) else None


def model_section(c: dict) -> dict:
    architecture = c["architectures"][0]
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"hidden_act {act!r} is not supported for {architecture}; only silu (SwiGLU) converts")
    if c.get("num_experts") or c.get("num_local_experts"):
        raise UserError(f"{architecture} with experts (MoE) is not supported by megacli convert yet")
    hidden = require(c, "hidden_size")
    heads = require(c, "num_attention_heads")
    positions = require(c, "max_position_embeddings")
    bias_linear, qkv_bias = _biases(c, architecture)
    return dict(
        arch="gpt",
        num_layers=require(c, "num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads") or heads,
        kv_channels=c.get("head_dim") or hidden // heads,
        ffn_hidden_size=require(c, "intermediate_size"),
        seq_length=min(positions, 4096),
        max_position_embeddings=positions,
        position_embedding="rope",
        rotary_base=rope_theta(c),
        rope_scaling=rope_scaling(c),
        normalization="rmsnorm",
        norm_epsilon=c.get("rms_norm_eps", 1e-6),
        activation="swiglu",
        add_bias_linear=bias_linear,
        add_qkv_bias=qkv_bias,
        qk_layernorm=architecture == "Qwen3ForCausalLM",
        untie_embeddings=not c.get("tie_word_embeddings", False),
        vocab_size=require(c, "vocab_size"),
        init_method_std=c.get("initializer_range", 0.02),
        dropout=0.0,
        attention_dropout=c.get("attention_dropout", 0.0),
        **_window(c, architecture, require(c, "num_hidden_layers")),
    )


def architecture_for(m, preferred: str | None = None) -> str | None:
    if not (m.arch == "gpt" and m.position_embedding == "rope" and m.normalization == "rmsnorm"
            and m.activation == "swiglu" and m.rotary_percent == 1.0 and m.moe is None and m.mla is None
            and not _gemma_features(m) and m.norm_placement == "pre" and m.qk_norm_scope == "head"):
        return None
    qwen_windows = m.sliding_window is None or _qwen_windows(m) is not None
    if m.qk_layernorm:
        return "Qwen3ForCausalLM" if not m.add_qkv_bias and not m.add_bias_linear and qwen_windows else None
    standard_head = m.head_dim * m.num_attention_heads == m.hidden_size
    expressible = {
        "LlamaForCausalLM": (not m.add_qkv_bias or m.add_bias_linear) and m.sliding_window is None,
        "MistralForCausalLM": not m.add_qkv_bias and not m.add_bias_linear and all(m.window_layers()),
        "Qwen2ForCausalLM": m.add_qkv_bias and not m.add_bias_linear and standard_head and qwen_windows,
    }
    if m.sliding_window is not None and not expressible["Qwen2ForCausalLM"] and preferred != "MistralForCausalLM":
        return "MistralForCausalLM" if expressible["MistralForCausalLM"] else None
    if preferred is not None and expressible.get(preferred):
        return preferred
    if expressible["Qwen2ForCausalLM"]:
        return "Qwen2ForCausalLM"
    return "LlamaForCausalLM" if expressible["LlamaForCausalLM"] else None


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
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.norm_epsilon,
        "hidden_act": "silu",
        "tie_word_embeddings": not m.untie_embeddings,
        "initializer_range": m.init_method_std,
        "attention_dropout": m.attention_dropout,
    }
    if architecture != "Qwen2ForCausalLM":
        derived["head_dim"] = m.head_dim
    if architecture == "LlamaForCausalLM":
        derived["attention_bias"] = derived["mlp_bias"] = m.add_bias_linear
    if architecture == "Qwen3ForCausalLM":
        derived["attention_bias"] = False
    if architecture == "MistralForCausalLM":
        derived["sliding_window"] = m.sliding_window
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        derived["use_sliding_window"] = m.sliding_window is not None
        if m.sliding_window is not None:
            derived.update(sliding_window=m.sliding_window, max_window_layers=_qwen_windows(m))
        if "layer_types" in base or not base:
            derived["layer_types"] = layer_types(m)
    return {**base, **derived, **_hf_rope(m, base)}


def _gemma_features(m) -> bool:
    """Features of the Gemma family (gemma.py) that these architectures lack."""
    return bool(m.norm_zero_centered_gamma or m.norm_placement == "sandwich" or m.scale_embeddings or m.attention_softcap
                or m.final_logit_softcap or m.rotary_base_local)


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
        Rule(L + "mlp.linear_fc1.layer_norm_weight", H + "post_attention_layernorm.weight", *direct()),
        Rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), *gate_up()),
        Rule(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight", *direct()),
        Rule("decoder.final_layernorm.weight", "model.norm.weight", *direct()),
    ]
    if m.qk_layernorm:
        rules += [Rule(L + "self_attention.q_layernorm.weight", attn + "q_norm.weight", *direct()),
                  Rule(L + "self_attention.k_layernorm.weight", attn + "k_norm.weight", *direct())]
    if m.add_qkv_bias or m.add_bias_linear:
        rules.append(Rule(L + "self_attention.linear_qkv.bias", (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                          *qkv(groups=groups, heads=heads)))
    if m.add_bias_linear:
        rules += [
            Rule(L + "self_attention.linear_proj.bias", attn + "o_proj.bias", *direct()),
            Rule(L + "mlp.linear_fc1.bias", (H + "mlp.gate_proj.bias", H + "mlp.up_proj.bias"), *gate_up()),
            Rule(L + "mlp.linear_fc2.bias", H + "mlp.down_proj.bias", *direct()),
        ]
    drop = [attn + "rotary_emb.inv_freq"]  # a non-persistent buffer older checkpoints stored
    if m.untie_embeddings:
        rules.append(Rule("output_layer.weight", "lm_head.weight", *direct()))
    else:
        drop.append("lm_head.weight")
    return MappingTable(rules, drop=tuple(drop))
