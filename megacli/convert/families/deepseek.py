"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-latent
attention (model.mla) and mixture of experts with shared experts after ``first_k_dense_replace``
dense layers; RMSNorm, SwiGLU, RoPE on the rotated part of each head (optionally yarn-scaled).

Attention: HF's q_a_proj / q_a_layernorm / q_b_proj (or q_proj without q_lora_rank),
kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj and o_proj are Megatron's linear_q_down_proj /
linear_q_up_proj (with the fused norm) / linear_q_proj, linear_kv_down_proj / linear_kv_up_proj and
linear_proj, row for row: both lay a head's query out as [no position | rotated] and the latent
as [kv_lora_rank | rotated key]. HF rotates interleaved pairs (V2's complex product, V3's
rope_interleave), Megatron's MLA de-interleaves them first: the same rotation of the same pairs.

Routing: V3 takes sigmoid scores, adds e_score_correction_bias (Megatron's router expert bias) to
choose n_group-limited top k, renormalises the chosen scores and multiplies them by
routed_scaling_factor. V2 takes the softmax over all experts, keeps the top k as they are
(``greedy``; norm_topk_prob is not read by HF's V2) and scales them. Megatron ranks groups by the
sum of their top (k / topk_group) scores: V3's top-2 sum when k = 2·topk_group, V2's
group_limited_greedy maximum when k < 2·topk_group; other settings are refused.

Multi-token-prediction layers (num_nextn_predict_layers, stored as layers beyond
num_hidden_layers) are not used by HF's DeepSeek models and are dropped on import.
"""

from __future__ import annotations

import re

from megacli.convert.families import llama, require
from megacli.convert.families.moe import _stacked, _stacked_gate_up
from megacli.convert.mapping import MappingTable, Rule, direct, gate_up
from megacli.errors import UserError

ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
ARCH = "gpt"

_MODEL_TYPES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}
# HF's latent norms (q_a_layernorm, kv_a_layernorm) keep RMSNorm's default epsilon; Megatron's MLA
# gives them the model's, so the two must agree.
_LATENT_NORM_EPS = 1e-6
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _mtp_layers(c: dict) -> int:
    return int(c.get("num_nextn_predict_layers") or c.get("num_mtp_layers") or 0)


def import_notes(c: dict) -> list[str]:
    """What a conversion from this HF config leaves out (printed by ``megacli convert``)."""
    n = _mtp_layers(c)
    if not n:
        return []
    first = require(c, "num_hidden_layers")
    return [f"dropped {n} multi-token-prediction layer(s) (num_nextn_predict_layers; model.layers.{first}"
            f"{f'-{first + n - 1}' if n > 1 else ''}.*): Hugging Face's DeepSeek models do not use them either"]


def _check(c: dict, architecture: str) -> None:
    def refuse(field, why):
        raise UserError(f"{architecture}: {field} = {c.get(field)!r} is not supported: {why}")

    quant = c.get("quantization_config")
    if quant:
        raise UserError(f"{architecture}: the checkpoint is quantized ({quant.get('quant_method', 'quantization_config')}"
                        f"{', ' + str(quant.get('fmt')) if quant.get('fmt') else ''}); dequantize it to bf16 first (DeepSeek's "
                        f"inference/fp8_cast_bf16.py for DeepSeek-V3's fp8 weights)")
    if c.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "only silu (SwiGLU) converts")
    if c.get("attention_bias"):
        refuse("attention_bias", "Megatron-Core's MLA down-projections have no bias")
    if c.get("mlp_bias"):
        refuse("mlp_bias", "the experts' and shared experts' biases have no Megatron counterpart")
    heads = require(c, "num_attention_heads")
    if (c.get("num_key_value_heads") or heads) != heads:
        refuse("num_key_value_heads", f"MLA has one key/value head per query head ({heads})")
    if c.get("rope_interleave", True) is not True:
        refuse("rope_interleave", "Megatron-Core's MLA rotates interleaved pairs")
    if c.get("rms_norm_eps", _LATENT_NORM_EPS) != _LATENT_NORM_EPS:
        refuse("rms_norm_eps", f"HF's latent norms use {_LATENT_NORM_EPS} and Megatron-Core's MLA uses the model's "
                               f"epsilon for them too, so it must be {_LATENT_NORM_EPS}")
    if c.get("pretraining_tp", 1) not in (None, 1):
        refuse("pretraining_tp", "only 1 (HF ignores it in the forward too)")


def _routing(c: dict, architecture: str, topk: int, experts: int) -> dict:
    """model.moe's router fields for an HF config."""
    scale = c.get("routed_scaling_factor", 1.0)
    out = dict(router_topk_scaling_factor=None if scale in (None, 1, 1.0) else float(scale))
    groups, picked = c.get("n_group"), c.get("topk_group")
    if architecture == "DeepseekV3ForCausalLM":
        if topk > 1 and not c.get("norm_topk_prob", True):
            raise UserError(f"{architecture}: norm_topk_prob = false is not supported: Megatron-Core renormalises the "
                            f"top-k sigmoid scores")
        out.update(router_score_function="sigmoid", router_expert_bias=True, aux_loss_coeff=0.0)
        per_group = 2  # HF ranks a group by the sum of its two best scores
    else:
        method = c.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise UserError(f"{architecture}: topk_method = {method!r} is not supported (greedy, group_limited_greedy)")
        out.update(router_pre_softmax=True, aux_loss_coeff=float(c.get("aux_loss_alpha", 0.001)))
        if method == "greedy":
            groups = None
        per_group = 1  # HF ranks a group by its best score
    if groups and groups > 1:
        if not picked or topk // picked != per_group:
            raise UserError(f"{architecture}: num_experts_per_tok = {topk} with topk_group = {picked} is not supported: "
                            f"Megatron-Core ranks a group by the sum of its top num_experts_per_tok // topk_group scores "
                            f"and HF by its top {per_group}")
        if experts % groups:
            raise UserError(f"{architecture}: n_group = {groups} does not divide n_routed_experts = {experts}")
        out.update(router_num_groups=groups, router_group_topk=picked)
    return out


def model_section(c: dict) -> dict:
    architecture = c["architectures"][0]
    _check(c, architecture)
    layers = require(c, "num_hidden_layers")
    positions = require(c, "max_position_embeddings")
    experts = require(c, "n_routed_experts", "num_local_experts", "num_experts")
    topk = require(c, "num_experts_per_tok")
    dense = min(int(c.get("first_k_dense_replace") or 0), layers)
    moe_ffn = require(c, "moe_intermediate_size")
    shared = int(c.get("n_shared_experts") or 0)
    section = dict(
        arch="gpt",
        num_layers=layers,
        hidden_size=require(c, "hidden_size"),
        num_attention_heads=require(c, "num_attention_heads"),
        ffn_hidden_size=require(c, "intermediate_size"),
        seq_length=min(positions, 4096),
        max_position_embeddings=positions,
        position_embedding="rope",
        rotary_base=llama.rope_theta(c),
        rope_scaling=llama.rope_scaling(c),
        normalization="rmsnorm",
        norm_epsilon=c.get("rms_norm_eps", _LATENT_NORM_EPS),
        activation="swiglu",
        add_bias_linear=False,
        untie_embeddings=not c.get("tie_word_embeddings", False),
        vocab_size=require(c, "vocab_size"),
        init_method_std=c.get("initializer_range", 0.02),
        dropout=0.0,
        attention_dropout=c.get("attention_dropout", 0.0) or 0.0,
        mla=dict(q_lora_rank=c.get("q_lora_rank"), kv_lora_rank=require(c, "kv_lora_rank"),
                 qk_head_dim=require(c, "qk_nope_head_dim"), qk_pos_emb_head_dim=require(c, "qk_rope_head_dim"),
                 v_head_dim=require(c, "v_head_dim")),
    )
    if dense < layers:
        pattern = [0] * dense + [1] * (layers - dense)
        section["moe"] = dict(
            num_experts=experts,
            router_topk=topk,
            ffn_hidden_size=moe_ffn,
            layer_freq=1 if dense == 0 else pattern,
            shared_expert_ffn_hidden_size=moe_ffn * shared if shared else None,
            **_routing(c, architecture, topk, experts),
        )
    return section


def _first_dense(m) -> int | None:
    """first_k_dense_replace for a recipe model: its MoE layers must be all those after the first k."""
    layers = m.moe_layers()
    k = layers.index(1) if 1 in layers else len(layers)
    return k if all(layers[k:]) else None


def architecture_for(m, preferred: str | None = None) -> str | None:
    if not (m.arch == "gpt" and m.mla is not None and m.normalization == "rmsnorm" and m.activation == "swiglu"
            and not m.add_bias_linear and m.norm_epsilon == _LATENT_NORM_EPS and _first_dense(m) is not None):
        return None
    moe = m.moe
    if moe is None:
        expressible = dict.fromkeys(ARCHITECTURES, True)
    else:
        shared = moe.shared_expert_ffn_hidden_size
        common = not moe.shared_expert_gate and (shared is None or shared % m.expert_ffn_size == 0)
        groups = moe.router_group_topk and moe.router_topk // moe.router_group_topk
        expressible = {
            "DeepseekV3ForCausalLM": common and moe.router_score_function == "sigmoid" and moe.router_expert_bias
                                     and groups in (None, 2),
            "DeepseekV2ForCausalLM": common and moe.router_score_function == "softmax" and moe.router_pre_softmax
                                     and groups in (None, 1),
        }
    if preferred is not None and expressible.get(preferred):
        return preferred
    return next((a for a in ARCHITECTURES if expressible[a]), None)


def hf_config(m, *, architecture: str, vocab_size: int, base: dict | None) -> dict:
    base, mla, moe = dict(base or {}), m.mla, m.moe
    k = _first_dense(m)
    derived = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES[architecture],
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_attention_heads,
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.norm_epsilon,
        "hidden_act": "silu",
        "tie_word_embeddings": not m.untie_embeddings,
        "initializer_range": m.init_method_std,
        "attention_dropout": m.attention_dropout,
        "attention_bias": False,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_head_dim,
        "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
        "qk_head_dim": mla.qk_head_dim + mla.qk_pos_emb_head_dim,
        "head_dim": mla.qk_pos_emb_head_dim,
        "v_head_dim": mla.v_head_dim,
        "first_k_dense_replace": k,
    }
    if moe is not None:
        shared = moe.shared_expert_ffn_hidden_size
        derived.update(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.router_topk,
                       moe_intermediate_size=m.expert_ffn_size, n_shared_experts=shared // m.expert_ffn_size if shared else 0,
                       routed_scaling_factor=moe.router_topk_scaling_factor or 1.0,
                       n_group=moe.router_num_groups or 1, topk_group=moe.router_group_topk or 1)
        if architecture == "DeepseekV2ForCausalLM":
            grouped = moe.router_num_groups is not None
            derived.update(topk_method="group_limited_greedy" if grouped else "greedy",
                           n_group=moe.router_num_groups if grouped else base.get("n_group"),
                           topk_group=moe.router_group_topk if grouped else base.get("topk_group"))
    if architecture == "DeepseekV3ForCausalLM":
        derived.update(rope_interleave=True, norm_topk_prob=True, num_nextn_predict_layers=0)
    else:
        derived["mlp_bias"] = False
    return {**base, **derived, **llama._hf_rope(m, base)}


def _normalize(num_layers: int):
    """HF key -> itself, or ``model.mtp.<n>`` for a multi-token-prediction layer's tensors (dropped)."""

    def normalize(key: str) -> str:
        match = _LAYER.match(key)
        return f"model.mtp.{match.group(1)}" if match and int(match.group(1)) >= num_layers else key

    return normalize


def table(m) -> MappingTable:
    if architecture_for(m) is None:
        raise UserError("this model has no Hugging Face DeepSeek family (needs model.mla, RMSNorm, SwiGLU, no linear "
                        "biases, dense layers only before the MoE layers, and a DeepSeek-V2 or -V3 router)")
    L, H = "decoder.layers.*.", "model.layers.*."
    A, attn = L + "self_attention.", H + "self_attn."
    rules = [
        Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", *direct()),
        Rule(L + "input_layernorm.weight", H + "input_layernorm.weight", *direct()),
        Rule(A + "linear_kv_down_proj.weight", attn + "kv_a_proj_with_mqa.weight", *direct()),
        Rule(A + "linear_kv_up_proj.layer_norm_weight", attn + "kv_a_layernorm.weight", *direct()),
        Rule(A + "linear_kv_up_proj.weight", attn + "kv_b_proj.weight", *direct()),
        Rule(A + "linear_proj.weight", attn + "o_proj.weight", *direct()),
        Rule(L + "mlp.linear_fc1.layer_norm_weight", H + "post_attention_layernorm.weight", *direct()),
        Rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), *gate_up()),
        Rule(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight", *direct()),
        Rule("decoder.final_layernorm.weight", "model.norm.weight", *direct()),
    ]
    if m.mla.q_lora_rank is None:
        rules.append(Rule(A + "linear_q_proj.weight", attn + "q_proj.weight", *direct()))
    else:
        rules += [Rule(A + "linear_q_down_proj.weight", attn + "q_a_proj.weight", *direct()),
                  Rule(A + "linear_q_up_proj.layer_norm_weight", attn + "q_a_layernorm.weight", *direct()),
                  Rule(A + "linear_q_up_proj.weight", attn + "q_b_proj.weight", *direct())]
    moe = m.moe
    if moe is not None:
        n, block = moe.num_experts, H + "mlp."
        experts = [block + f"experts.{e}." for e in range(n)]
        rules += [
            Rule(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight", *direct()),
            Rule(L + "mlp.router.weight", block + "gate.weight", *direct()),
            Rule(L + "mlp.experts.experts.linear_fc1.weight",
                 tuple(p + w + ".weight" for p in experts for w in ("gate_proj", "up_proj")), *_stacked_gate_up(n)),
            Rule(L + "mlp.experts.experts.linear_fc2.weight", tuple(p + "down_proj.weight" for p in experts),
                 *_stacked(n)),
        ]
        if moe.router_expert_bias:
            rules.append(Rule(L + "mlp.router.expert_bias", block + "gate.e_score_correction_bias", *direct()))
        if moe.shared_expert_ffn_hidden_size is not None:
            shared = block + "shared_experts."
            rules += [Rule(L + "mlp.shared_experts.linear_fc1.weight", (shared + "gate_proj.weight", shared + "up_proj.weight"),
                           *gate_up()),
                      Rule(L + "mlp.shared_experts.linear_fc2.weight", shared + "down_proj.weight", *direct())]
    drop = [attn + "rotary_emb.inv_freq", "model.mtp.*"]
    if m.untie_embeddings:
        rules.append(Rule("output_layer.weight", "lm_head.weight", *direct()))
    else:
        drop.append("lm_head.weight")
    return MappingTable(rules, drop=tuple(drop), normalize_hf=_normalize(m.num_layers))
