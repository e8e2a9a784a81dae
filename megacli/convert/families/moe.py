"""Mixture-of-experts Llama-style models: Mixtral (MixtralForCausalLM), Qwen2-MoE
(Qwen2MoeForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM). Attention, norms and embeddings are the Llama family's; each MoE layer has
a router (``mlp.router.weight`` <- the HF gate) and experts that Megatron-Core stores stacked along
a leading expert axis (``mlp.experts.experts.linear_fc1.weight``: [experts, 2·ffn, hidden], each
[gate; up] as in a dense SwiGLU MLP). Qwen2-MoE adds a shared expert with a sigmoid gate, QKV
biases, dense layers (``mlp_only_layers``, ``decoder_sparse_step``) and top-k probabilities that
are not renormalised (``norm_topk_prob: false``: Megatron's softmax before top-k). Qwen3-MoE has
Qwen3's attention (per-head q/k RMSNorm, explicit head_dim, no biases), no shared expert, and the
same dense-layer rule and ``norm_topk_prob`` (true in its released checkpoints: renormalised).

Routing: Mixtral takes the softmax over all experts and renormalises the top k, which equals
Megatron's default (top-k of the logits, softmax over those k); no capacity limit (dropless), as
in Hugging Face.
"""

from __future__ import annotations

import torch

from megacli.convert.families import llama, require
from megacli.convert.mapping import MappingTable, Rule, direct, fuse_gate_up, split_gate_up
from megacli.errors import UserError
from megacli.recipe.model import every_nth

ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
ARCH = "gpt"

# Per architecture: the attention layout it shares with a dense family, where its MoE block lives,
# and the names of the router and of an expert's three projections.
_LAYOUT = {
    "MixtralForCausalLM": dict(dense="MistralForCausalLM", model_type="mixtral", block="block_sparse_moe",
                               gate="w1", up="w3", down="w2"),
    "Qwen2MoeForCausalLM": dict(dense="Qwen2ForCausalLM", model_type="qwen2_moe", block="mlp",
                                gate="gate_proj", up="up_proj", down="down_proj"),
    "Qwen3MoeForCausalLM": dict(dense="Qwen3ForCausalLM", model_type="qwen3_moe", block="mlp",
                                gate="gate_proj", up="up_proj", down="down_proj"),
}


def _moe_layers(c: dict, architecture: str, num_layers: int) -> list[int]:
    """1 for a layer with experts, 0 for a dense one (Qwen2-/Qwen3-MoE's rule in modeling_qwen*_moe)."""
    if architecture == "MixtralForCausalLM":
        return [1] * num_layers
    dense = set(c.get("mlp_only_layers") or [])
    step = c.get("decoder_sparse_step", 1) or 1
    return [0 if i in dense else flag for i, flag in enumerate(every_nth(step, num_layers))]


def model_section(c: dict) -> dict:
    architecture = c["architectures"][0]
    layout = _LAYOUT[architecture]
    experts = require(c, "num_local_experts", "num_experts")
    dense = {k: v for k, v in c.items() if k not in ("num_local_experts", "num_experts")}
    dense["architectures"] = [layout["dense"]]
    if architecture == "MixtralForCausalLM":
        dense["use_sliding_window"] = c.get("sliding_window") is not None
    section = llama.model_section(dense)
    if architecture == "Qwen2MoeForCausalLM":
        section["add_qkv_bias"] = bool(c.get("qkv_bias", True))
    layers = _moe_layers(c, architecture, section["num_layers"])
    moe = dict(
        num_experts=experts,
        router_topk=require(c, "num_experts_per_tok"),
        ffn_hidden_size=require(c, "intermediate_size") if architecture == "MixtralForCausalLM"
        else require(c, "moe_intermediate_size"),
        aux_loss_coeff=c.get("router_aux_loss_coef", 0.001),
        layer_freq=1 if all(layers) else layers,
        router_pre_softmax=architecture != "MixtralForCausalLM" and not c.get("norm_topk_prob", False),
    )
    if architecture == "Qwen2MoeForCausalLM":
        shared = c.get("shared_expert_intermediate_size") or 0
        if shared <= 0:
            raise UserError("Qwen2-MoE without a shared expert (shared_expert_intermediate_size: 0) is not supported")
        moe.update(shared_expert_ffn_hidden_size=shared, shared_expert_gate=True)
    if c.get("router_jitter_noise"):
        raise UserError(f"router_jitter_noise = {c['router_jitter_noise']} is not supported by the Megatron router")
    return {**section, "moe": moe}


def architecture_for(m, preferred: str | None = None) -> str | None:
    moe = m.moe
    if moe is None or llama.architecture_for(m.model_copy(update={"moe": None})) is None or m.add_bias_linear:
        return None
    expressible = {
        "MixtralForCausalLM": (not m.add_qkv_bias and moe.shared_expert_ffn_hidden_size is None
                               and not moe.router_pre_softmax and all(m.moe_layers()) and not m.qk_layernorm),
        "Qwen2MoeForCausalLM": moe.shared_expert_ffn_hidden_size is not None and moe.shared_expert_gate
                               and m.head_dim * m.num_attention_heads == m.hidden_size and not m.qk_layernorm,
        "Qwen3MoeForCausalLM": m.qk_layernorm and not m.add_qkv_bias and moe.shared_expert_ffn_hidden_size is None,
    }
    if preferred is not None and expressible.get(preferred):
        return preferred
    return next((a for a in ARCHITECTURES if expressible[a]), None)


def hf_config(m, *, architecture: str, vocab_size: int, base: dict | None) -> dict:
    layout, moe, base = _LAYOUT[architecture], m.moe, dict(base or {})
    derived = llama.hf_config(m, architecture=layout["dense"], vocab_size=vocab_size, base=base)
    derived.update(architectures=[architecture], model_type=layout["model_type"], num_experts_per_tok=moe.router_topk,
                   router_aux_loss_coef=moe.aux_loss_coeff, output_router_logits=False)
    if architecture == "MixtralForCausalLM":
        derived.update(num_local_experts=moe.num_experts, intermediate_size=m.expert_ffn_size, sliding_window=None)
        if base.get("head_dim") is None and m.head_dim * m.num_attention_heads == m.hidden_size:
            derived.pop("head_dim")  # Mixtral configs usually leave it implicit (absent or null)
            if "head_dim" in base:
                derived["head_dim"] = None
    elif architecture == "Qwen2MoeForCausalLM":
        derived.update(num_experts=moe.num_experts, moe_intermediate_size=m.expert_ffn_size,
                       shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
                       **_dense_layers(m, base), norm_topk_prob=not moe.router_pre_softmax,
                       qkv_bias=m.add_qkv_bias, use_sliding_window=False)
        derived.pop("head_dim", None)
    else:  # transformers 5 writes num_local_experts, the released configs num_experts: keep the source's
        experts_key = "num_local_experts" if "num_local_experts" in base else "num_experts"
        derived.update({experts_key: moe.num_experts}, moe_intermediate_size=m.expert_ffn_size, **_dense_layers(m, base),
                       norm_topk_prob=not moe.router_pre_softmax, use_sliding_window=False)
    return derived


def _dense_layers(m, base: dict) -> dict:
    """decoder_sparse_step and mlp_only_layers for the model's dense layers: the source's when they
    give the same layers, else every layer a candidate (step 1) and the dense ones listed."""
    layers = m.moe_layers()
    kept = {"decoder_sparse_step": base.get("decoder_sparse_step", 1), "mlp_only_layers": base.get("mlp_only_layers", [])}
    if _moe_layers(kept, "Qwen2MoeForCausalLM", m.num_layers) == layers:
        return kept
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, x in enumerate(layers) if not x]}


def _stacked_gate_up(n: int):
    def to_megatron(*ts):
        return torch.stack([fuse_gate_up(ts[2 * e], ts[2 * e + 1]) for e in range(n)])

    def to_hf(t):
        return [half for expert in t for half in split_gate_up(expert)]

    return to_megatron, to_hf


def _stacked(n: int):
    return (lambda *ts: torch.stack(ts)), (lambda t: [expert.contiguous() for expert in t])


def table(m) -> MappingTable:
    architecture = architecture_for(m)
    if architecture is None:
        raise UserError("this MoE model has no Hugging Face family (Mixtral, Qwen2-MoE or Qwen3-MoE)")
    layout, n = _LAYOUT[architecture], m.moe.num_experts
    dense = llama.table(m.model_copy(update={"moe": None}))
    L, H = "decoder.layers.*.", "model.layers.*."
    block = H + layout["block"] + "."
    experts = [block + f"experts.{e}." for e in range(n)]
    rules = dense.rules + [
        Rule(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight", *direct()),
        Rule(L + "mlp.router.weight", block + "gate.weight", *direct()),
        Rule(L + "mlp.experts.experts.linear_fc1.weight",
             tuple(p + layout[w] + ".weight" for p in experts for w in ("gate", "up")), *_stacked_gate_up(n)),
        Rule(L + "mlp.experts.experts.linear_fc2.weight", tuple(p + layout["down"] + ".weight" for p in experts),
             *_stacked(n)),
    ]
    if m.moe.shared_expert_ffn_hidden_size is not None:
        shared = block + "shared_expert."
        rules += [
            Rule(L + "mlp.shared_experts.linear_fc1.weight", (shared + "gate_proj.weight", shared + "up_proj.weight"),
                 fuse_gate_up, split_gate_up),
            Rule(L + "mlp.shared_experts.linear_fc2.weight", shared + "down_proj.weight", *direct()),
            Rule(L + "mlp.shared_experts.gate_weight", block + "shared_expert_gate.weight", *direct()),
        ]
    return MappingTable(rules, drop=dense.drop)
