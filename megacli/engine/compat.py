"""Whether a checkpoint can be resumed under this run's recipe: the saved recipe (recipe.yaml in the
checkpoint) against the run's. Fields that decide what the weights mean - shapes, layer kinds,
vocabulary - must match; a different sequence length or batch size is fine and is noted."""

from __future__ import annotations

from pathlib import Path

from megacli.checkpoint.carried import same_tokenizer
from megacli.checkpoint.layout import read_recipe
from megacli.checkpoint.source import MEGATRON_LM, Source, kind_of, user_source
from megacli.errors import UserError

# Dotted recipe fields that change the meaning (or the shape) of the saved weights.
WEIGHT_FIELDS = tuple(f"model.{k}" for k in (
    "arch", "num_layers", "decoder_num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "ffn_hidden_size", "max_position_embeddings", "position_embedding", "rotary_percent",
    "normalization", "activation", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "qk_norm_scope",
    "norm_placement", "untie_embeddings",
    "softmax_scale", "vocab_size", "make_vocab_size_divisible_by", "norm_position", "bert_binary_head",
    "bert_token_types", "scale_decoder_output", "moe.num_experts", "moe.router_topk", "moe.ffn_hidden_size",
    "moe.shared_expert_ffn_hidden_size", "moe.shared_expert_gate", "moe.layer_freq", "moe.router_pre_softmax",
    "moe.router_score_function", "moe.router_expert_bias", "moe.router_num_groups", "moe.router_group_topk",
    "moe.router_topk_scaling_factor", "sliding_window", "sliding_window_layers", "rotary_base_local",
    "attention_softcap", "final_logit_softcap", "scale_embeddings", "norm_zero_centered_gamma", "mla.q_lora_rank",
    "mla.kv_lora_rank", "mla.qk_head_dim", "mla.qk_pos_emb_head_dim", "mla.v_head_dim",
)) + ("tokenizer.type", "masking.sentinel_tokens", "lora.rank", "lora.targets")

# Fields a resumed run may change; the change is reported in one line.
NOTED_FIELDS = ("model.seq_length", "model.decoder_seq_length", "model.rotary_base", "model.rope_scaling", "train.micro_batch_size",
                "train.global_batch_size", "tokenizer.path")

_ABSENT = object()


def _get(tree, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def check_resumable(ckpt: Path, recipe) -> str | None:
    """Refuse (UserError naming each field, old and new) a checkpoint whose weights this recipe would
    read differently; return a note on allowed changes (None when nothing changed)."""
    saved_file = Path(ckpt) / "recipe.yaml"
    foreign = False
    if saved_file.is_file():
        saved = read_recipe(Path(ckpt))
    elif kind_of(ckpt) == MEGATRON_LM:
        saved, foreign = _megatron_lm_recipe(user_source(ckpt, recipe.checkpoint)), True
    else:
        return None
    current = recipe.model_dump(mode="json")

    def changed(fields):
        out = []
        for f in fields:
            old, new = _get(saved, f), _get(current, f)
            # A Megatron-LM run's args leave unset what its tokenizer decides; the run's recipe may leave a
            # field to its tokenizer (None) that the args spell out.
            if foreign and (old is None or new is None or f == "tokenizer.type"):
                continue
            if f == "tokenizer.path" and same_tokenizer(old, new):  # the checkpoint's copy of the run's tokenizer
                continue
            if old is not _ABSENT and new is not _ABSENT and old != new:
                out.append(f"{f} = {new!r} (checkpoint: {old!r})")
        return out

    refused = changed(WEIGHT_FIELDS)
    for section in ("model.moe", "model.mla"):
        old_section, new_section = _get(saved, section), _get(current, section)
        if old_section is not _ABSENT and (old_section is None) != (new_section is None):
            refused.append(f"{section} {'set' if new_section else 'null'} (checkpoint: {'set' if old_section else 'null'})")
    if _get(current, "model.position_embedding") == "learned":
        old_pos, new_pos = _learned_positions(saved), _learned_positions(current)
        if old_pos is not None and old_pos != new_pos:
            refused.append(f"learned position embeddings for {new_pos} positions (checkpoint: {old_pos}; "
                           f"model.max_position_embeddings, else model.seq_length)")
    if refused:
        raise UserError(f"cannot resume {ckpt}: this recipe changes what its weights mean: {'; '.join(refused)}. "
                        f"Use the checkpoint's values, or start a new run (checkpoint.resume: none, another checkpoint.dir)")
    noted = changed(NOTED_FIELDS)
    note = f"resuming with changed settings: {'; '.join(noted)}" if noted else None
    if foreign and not recipe.model.padded_vocab_in_loss:
        padding = ("Megatron-LM trains with the padded vocabulary rows in the softmax, this run masks them out: set "
                   "model.padded_vocab_in_loss=true to continue with its losses")
        note = f"{note}; {padding}" if note else padding
    return note


def _megatron_lm_recipe(source: Source) -> dict:
    """The recipe a Megatron-LM checkpoint's args map to; a model megacli cannot express is refused."""
    from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint

    src = MegatronLMCheckpoint(source)
    raw = src.recipe()
    if raw is None:
        raise UserError(f"cannot resume {source.path}: " + "; ".join(src.unmapped()))
    return raw


def _learned_positions(tree) -> int | None:
    """How many positions a learned position embedding has (as ModelSection.max_positions)."""
    given, seq = _get(tree, "model.max_position_embeddings"), _get(tree, "model.seq_length")
    if seq is _ABSENT:
        return None
    return given if given not in (None, _ABSENT) else seq
