"""The one reading of a Hugging Face config.json (convert, recipe from, generate and serve of an HF
directory, export of a converted checkpoint, the T5 decoder's start token): a JSON object whose
sizes are integers a model can have, or one error naming the file and the key.

Only what a size must be is checked here (an integer, positive or at least zero, heads that divide
the hidden size, query groups that divide the heads, no more experts routed to than exist); what
megacli does not support is the families' to say."""

from __future__ import annotations

import json
from pathlib import Path

from megacli.errors import UserError

# Sizes that are positive integers wherever a config gives them (null: not set). The families read
# hidden/heads/layers under each model's own spelling.
POSITIVE = ("hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head", "num_heads", "num_hidden_layers",
            "n_layer", "num_layers", "num_decoder_layers", "intermediate_size", "n_inner", "d_ff", "d_kv",
            "vocab_size", "max_position_embeddings", "n_positions", "num_key_value_heads", "head_dim",
            "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "relative_attention_num_buckets",
            "relative_attention_max_distance")
# Counts that may be zero (0 experts: a dense model).
NON_NEGATIVE = ("num_experts", "num_local_experts", "n_shared_experts", "first_k_dense_replace", "qk_nope_head_dim",
                "type_vocab_size", "sliding_window", "num_nextn_predict_layers", "num_mtp_layers", "n_group",
                "topk_group")
_SPELLINGS = {"hidden": ("hidden_size", "n_embd", "d_model"), "heads": ("num_attention_heads", "n_head", "num_heads")}


def read_config(path: str | Path) -> dict:
    """The Hugging Face config.json at ``path``, checked (check_config)."""
    path = Path(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
        raise UserError(f"cannot read {path}: {str(exc)[:300]}") from None
    check_config(config, path)
    return config


def check_config(config, path: str | Path) -> None:
    """Refuse a config that is not a JSON object or holds a size no model has, naming ``path`` and the key."""
    if not isinstance(config, dict):
        raise UserError(f"{path}: not a Hugging Face config (a JSON object), but a JSON {type(config).__name__}")
    archs = config.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise UserError(f"{path}: architectures = {_shown(archs)}: expected a list of class names")
    for keys, least in ((POSITIVE, 1), (NON_NEGATIVE, 0)):
        for key in keys:
            value = config.get(key)
            if value is not None and not (type(value) is int and value >= least):
                what = "a positive integer" if least else "an integer of at least 0"
                raise UserError(f"{path}: {key} = {_shown(value)}: expected {what}")
    hidden, heads = (_first(config, names) for names in _SPELLINGS.values())
    own_head_size = any(config.get(k) is not None for k in ("head_dim", "d_kv", "kv_lora_rank"))
    if hidden and heads and not own_head_size and hidden[1] % heads[1]:
        raise UserError(f"{path}: {heads[0]} = {heads[1]} does not divide {hidden[0]} = {hidden[1]} "
                        f"(each head gets hidden / heads channels)")
    groups = config.get("num_key_value_heads")
    if heads and groups and heads[1] % groups:
        raise UserError(f"{path}: num_key_value_heads = {groups} does not divide {heads[0]} = {heads[1]}")
    experts = _first(config, ("n_routed_experts", "num_local_experts", "num_experts"))
    topk = config.get("num_experts_per_tok")
    if experts and experts[1] and topk and topk > experts[1]:
        raise UserError(f"{path}: num_experts_per_tok = {topk} is more than the {experts[1]} experts ({experts[0]})")


def _first(config: dict, names) -> tuple[str, int] | None:
    return next(((n, config[n]) for n in names if config.get(n) is not None), None)


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 80 else text[:77] + "..."
