"""Megatron-LM's run arguments (the ``args`` Namespace in every checkpoint it writes) for a megacli recipe.

``parse_args_defaults()`` lists every field Megatron-LM core_v0.16.1's ``parse_args`` defines, with
its default (``benchmarks/megatron_lm_args_check.py CHECKOUT`` compares it with a checkout). A
written ``args`` starts from these, drops what ``validate_args`` deletes, and sets what the recipe
implies through ``FLAGS``: the one table of Megatron-LM argument <-> recipe key (the docs' flag
table, docs/megatron-lm/flags.md, is generated from it), then the fields ``validate_args`` and
training derive (data-parallel size, params dtype, padded vocabulary, iteration, ...).
The reverse direction (args -> recipe) is megacli.checkpoint.megatron_lm.args_to_recipe; tests check that both
agree on every model field.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from megacli.checkpoint.megatron_lm.args_to_recipe import MEGATRON_ROPE_SCALING
from megacli.errors import UserError

_DEFAULTS_FILE = Path(__file__).with_name("defaults.json")


@functools.cache
def parse_args_defaults() -> Mapping[str, Any]:
    """name -> default of every argument Megatron-LM core_v0.16.1's parse_args defines (enum defaults
    by member name): defaults.json, written from a checkout by
    ``benchmarks/megatron_lm_args_check.py CHECKOUT --write-defaults``."""
    return MappingProxyType(json.loads(_DEFAULTS_FILE.read_text()))


DROPPED_BY_VALIDATION = ("batch_size", "warmup", "model_parallel_size", "checkpoint_activations", "recompute_activations")
# Fields validate_args converts from a precision name to a torch dtype.
_DTYPE_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
# Fields validate_args and Megatron-LM's training add to the Namespace (set by megatron_args below).
DERIVED = ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples", "data_parallel_size",
           "params_dtype", "transformer_pipeline_model_parallel_size", "use_dist_ckpt", "variable_seq_lengths",
           "virtual_pipeline_model_parallel_size", "padded_vocab_size", "iteration", "curr_iteration",
           "num_floating_point_operations_so_far", "model_type", "do_train", "do_valid", "do_test")

_POSITIONS = {"learned": "learned_absolute", "rope": "rope", "none": "none", "relative": "relative"}
_DECAY = {"wsd": "WSD"}
_TOKENIZERS = {"huggingface": "HuggingFaceTokenizer", "sentencepiece": "GPTSentencePieceTokenizer",
               "wordpiece": "BertWordPieceLowerCase", "none": "NullTokenizer"}


@dataclass(frozen=True)
class Flag:
    """One Megatron-LM argument and the recipe key it corresponds to: ``value(recipe)`` is the
    argument's value for a validated recipe."""

    arg: str
    key: str
    value: Callable[[Any], Any]
    cli: str | None = None
    """The command-line option where its name is not the field's (``--apply-layernorm-1p``), or
    the environment variable parse_args reads the field from (``WORLD_SIZE``)."""
    off: bool = False
    """The option stores False (``--disable-bias-linear``: the field is True unless it is given)."""

    @property
    def option(self) -> str:
        """The command-line spelling (``--num-layers``), or the environment variable."""
        return self.cli or "--" + self.arg.replace("_", "-")

    @property
    def from_environment(self) -> bool:
        return not self.option.startswith("--")

    def table_cell(self) -> str:
        """The flag table's cell: ``--disable-bias-linear`` (off), ``WORLD_SIZE`` (environment)."""
        if self.from_environment:
            return f"`{self.option}` (environment: nodes × processes per node, set by torchrun)"
        return f"`{self.option}` (off)" if self.off else f"`{self.option}`"


def _m(field):
    return lambda r: getattr(r.model, field)


def _moe(arg: str, value: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A MoE argument: ``value(recipe)`` for a model with model.moe, parse_args' default for a dense one."""
    return lambda r: value(r) if r.model.moe is not None else parse_args_defaults()[arg]


def _t5(arg: str, value: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A T5 argument: ``value(recipe)`` for model.arch t5, parse_args' default for other models."""
    return lambda r: value(r) if r.model.arch == "t5" else parse_args_defaults()[arg]


def _e(arg: str, field: str) -> Flag:
    """A MoE argument that is model.moe's ``field`` as it is."""
    return Flag(arg, f"model.moe.{field}", _moe(arg, lambda r: getattr(r.model.moe, field)))


def moe_layer_freq(recipe) -> list[int]:
    """--moe-layer-freq as the one-per-layer pattern, also for an integer model.moe.layer_freq:
    megacli's MoE models store each layer under its own key, which is Megatron-Core's layout for a
    pattern list (an integer giving all MoE layers stacks them under one key)."""
    return recipe.model.moe_layers()


FLAGS: tuple[Flag, ...] = (
    # model
    Flag("num_layers", "model.num_layers", _m("num_layers")),
    Flag("hidden_size", "model.hidden_size", _m("hidden_size")),
    Flag("num_attention_heads", "model.num_attention_heads", _m("num_attention_heads")),
    Flag("group_query_attention", "model.num_query_groups", lambda r: r.model.query_groups != r.model.num_attention_heads),
    Flag("num_query_groups", "model.num_query_groups", lambda r: r.model.query_groups),
    Flag("kv_channels", "model.kv_channels", lambda r: r.model.head_dim),
    Flag("ffn_hidden_size", "model.ffn_hidden_size", lambda r: r.model.ffn_size),
    Flag("seq_length", "model.seq_length", _m("seq_length")),
    Flag("max_position_embeddings", "model.max_position_embeddings", lambda r: r.model.max_positions),
    Flag("position_embedding_type", "model.position_embedding", lambda r: _POSITIONS[r.model.position_embedding]),
    Flag("add_position_embedding", "model.position_embedding", lambda r: r.model.position_embedding != "none",
         cli="--no-position-embedding", off=True),
    Flag("rotary_base", "model.rotary_base", lambda r: int(r.model.rotary_base) if float(r.model.rotary_base).is_integer()
         else r.model.rotary_base),
    Flag("rotary_percent", "model.rotary_percent", _m("rotary_percent")),
    Flag("normalization", "model.normalization", lambda r: "RMSNorm" if r.model.normalization == "rmsnorm" else "LayerNorm"),
    Flag("layernorm_epsilon", "model.norm_epsilon", _m("norm_epsilon"), cli="--norm-epsilon"),
    Flag("swiglu", "model.activation", lambda r: r.model.activation == "swiglu"),
    Flag("squared_relu", "model.activation", lambda r: r.model.activation == "squared_relu"),
    Flag("openai_gelu", "model.activation", lambda r: r.model.activation == "gelu_tanh"),
    Flag("add_bias_linear", "model.add_bias_linear", _m("add_bias_linear"), cli="--disable-bias-linear", off=True),
    Flag("add_qkv_bias", "model.add_qkv_bias", lambda r: r.model.add_qkv_bias or r.model.add_bias_linear),
    # Megatron-Core's fused bias-GeLU is the tanh approximation (and refuses other activations): on for
    # gelu_tanh with biases only (validate_args turns it off without biases)
    Flag("bias_gelu_fusion", "model.activation", lambda r: r.model.activation == "gelu_tanh" and r.model.add_bias_linear,
         cli="--no-bias-gelu-fusion", off=True),
    Flag("qk_layernorm", "model.qk_layernorm", _m("qk_layernorm")),
    Flag("layernorm_zero_centered_gamma", "model.norm_zero_centered_gamma", _m("norm_zero_centered_gamma"),
         cli="--apply-layernorm-1p"),
    Flag("use_rope_scaling", "model.rope_scaling", lambda r: r.model.rope_scaling is not None),
    Flag("rope_scaling_factor", "model.rope_scaling.factor", lambda r: MEGATRON_ROPE_SCALING["factor"]),
    Flag("window_size", "model.sliding_window", lambda r: r.model.megatron_window),
    Flag("window_attn_skip_freq", "model.sliding_window_layers", _m("sliding_window_layers")),
    Flag("untie_embeddings_and_output_weights", "model.untie_embeddings", _m("untie_embeddings")),
    Flag("hidden_dropout", "model.dropout", _m("dropout")),
    Flag("attention_dropout", "model.attention_dropout", _m("attention_dropout")),
    Flag("init_method_std", "model.init_method_std", _m("init_method_std")),
    Flag("vocab_size", "model.vocab_size", _m("vocab_size")),
    Flag("make_vocab_size_divisible_by", "model.make_vocab_size_divisible_by", _m("make_vocab_size_divisible_by")),
    Flag("bert_binary_head", "model.bert_binary_head", _m("bert_binary_head"), cli="--bert-no-binary-head", off=True),
    # T5 (pretrain_t5.py; validate_args makes --num-layers / --seq-length the encoder's)
    Flag("decoder_num_layers", "model.decoder_num_layers", _t5("decoder_num_layers", lambda r: r.model.dec_num_layers)),
    Flag("decoder_seq_length", "model.decoder_seq_length", _t5("decoder_seq_length", lambda r: r.model.dec_seq_length)),
    Flag("vocab_extra_ids", "masking.sentinel_tokens", _t5("vocab_extra_ids", lambda r: r.masking.sentinel_tokens)),
    # mixture of experts
    _e("num_experts", "num_experts"),
    _e("moe_router_topk", "router_topk"),
    Flag("moe_ffn_hidden_size", "model.moe.ffn_hidden_size", _moe("moe_ffn_hidden_size", lambda r: r.model.expert_ffn_size)),
    Flag("moe_layer_freq", "model.moe.layer_freq", _moe("moe_layer_freq", moe_layer_freq)),
    Flag("moe_router_load_balancing_type", "model.moe.aux_loss_coeff",
         _moe("moe_router_load_balancing_type", lambda r: "aux_loss" if r.model.moe.aux_loss_coeff > 0 else "none")),
    _e("moe_aux_loss_coeff", "aux_loss_coeff"),
    _e("moe_expert_capacity_factor", "capacity_factor"),
    _e("moe_token_drop_policy", "drop_policy"),
    _e("moe_pad_expert_input_to_capacity", "pad_to_capacity"),
    _e("moe_shared_expert_intermediate_size", "shared_expert_ffn_hidden_size"),
    _e("moe_shared_expert_gate", "shared_expert_gate"),
    _e("moe_router_dtype", "router_dtype"),
    _e("moe_router_pre_softmax", "router_pre_softmax"),
    _e("moe_token_dispatcher_type", "dispatcher"),
    _e("moe_grouped_gemm", "grouped_gemm"),
    _e("moe_router_score_function", "router_score_function"),
    _e("moe_router_enable_expert_bias", "router_expert_bias"),
    _e("moe_router_bias_update_rate", "router_bias_update_rate"),
    _e("moe_router_num_groups", "router_num_groups"),
    _e("moe_router_group_topk", "router_group_topk"),
    _e("moe_router_topk_scaling_factor", "router_topk_scaling_factor"),
    # parallel layout
    Flag("tensor_model_parallel_size", "parallel.tensor", lambda r: r.parallel.tensor),
    Flag("pipeline_model_parallel_size", "parallel.pipeline", lambda r: r.parallel.pipeline),
    Flag("num_virtual_stages_per_pipeline_rank", "parallel.virtual_pipeline", lambda r: r.parallel.virtual_pipeline),
    Flag("decoder_first_pipeline_num_layers", "parallel.first_stage_layers", lambda r: r.parallel.first_stage_layers),
    Flag("decoder_last_pipeline_num_layers", "parallel.last_stage_layers", lambda r: r.parallel.last_stage_layers),
    Flag("sequence_parallel", "parallel.sequence_parallel", lambda r: r.parallel.sp_enabled),
    Flag("context_parallel_size", "parallel.context", lambda r: r.parallel.context),
    Flag("expert_model_parallel_size", "parallel.expert", lambda r: r.parallel.expert),
    Flag("expert_tensor_parallel_size", "parallel.expert_tensor", lambda r: r.parallel.expert_tensor or r.parallel.tensor),
    Flag("use_distributed_optimizer", "parallel.distributed_optimizer", lambda r: r.parallel.distributed_optimizer),
    Flag("recompute_granularity", "parallel.recompute", lambda r: None if r.parallel.recompute == "none" else r.parallel.recompute),
    Flag("recompute_method", "parallel.recompute", lambda r: "uniform" if r.parallel.recompute == "full" else None),
    Flag("recompute_num_layers", "parallel.recompute_num_layers",
         lambda r: r.parallel.recompute_num_layers if r.parallel.recompute == "full" else None),
    Flag("overlap_grad_reduce", "parallel.overlap_grad_reduce", lambda r: r.parallel.overlap_grad_reduce),
    Flag("overlap_param_gather", "parallel.overlap_param_gather", lambda r: r.parallel.overlap_param_gather),
    Flag("world_size", "launch.nproc", lambda r: r.world_size, cli="WORLD_SIZE"),
    # training
    Flag("micro_batch_size", "train.micro_batch_size", lambda r: r.train.micro_batch_size),
    Flag("global_batch_size", "train.global_batch_size", lambda r: r.train.global_batch_size),
    Flag("train_iters", "train.iters", lambda r: r.train.iters),
    Flag("seed", "train.seed", lambda r: r.train.seed),
    Flag("eval_interval", "train.eval_interval", lambda r: r.train.eval_interval),
    Flag("eval_iters", "train.eval_iters", lambda r: r.train.eval_iters),
    Flag("log_interval", "train.log_interval", lambda r: r.train.log_interval),
    Flag("bf16", "train.precision", lambda r: r.train.precision == "bf16"),
    Flag("fp16", "train.precision", lambda r: r.train.precision == "fp16"),
    Flag("exit_interval", "train.exit_after_iters", lambda r: r.train.exit_after_iters),
    Flag("exit_duration_in_mins", "train.time_limit_minutes",
         lambda r: None if r.train.time_limit_minutes is None else int(r.train.time_limit_minutes)),
    Flag("deterministic_mode", "train.deterministic", lambda r: r.train.deterministic),
    # optimizer and schedule
    Flag("optimizer", "optim.optimizer", lambda r: r.optim.optimizer),
    Flag("lr", "optim.lr", lambda r: r.optim.lr),
    Flag("min_lr", "optim.min_lr", lambda r: r.optim.min_lr),
    Flag("lr_warmup_iters", "optim.warmup_iters", lambda r: r.optim.warmup_steps(r.train.iters)),
    Flag("lr_decay_style", "optim.decay_style", lambda r: _DECAY.get(r.optim.decay_style, r.optim.decay_style)),
    Flag("lr_decay_iters", "optim.decay_iters", lambda r: r.optim.decay_horizon(r.train.iters)),
    Flag("lr_wsd_decay_iters", "optim.wsd_decay_iters", lambda r: r.optim.wsd_decay_iters),
    Flag("weight_decay", "optim.weight_decay", lambda r: r.optim.weight_decay),
    Flag("start_weight_decay", "optim.weight_decay", lambda r: r.optim.weight_decay),
    Flag("end_weight_decay", "optim.weight_decay", lambda r: r.optim.weight_decay),
    Flag("clip_grad", "optim.clip_grad", lambda r: r.optim.clip_grad),
    Flag("adam_beta1", "optim.adam_beta1", lambda r: r.optim.adam_beta1),
    Flag("adam_beta2", "optim.adam_beta2", lambda r: r.optim.adam_beta2),
    Flag("adam_eps", "optim.adam_eps", lambda r: r.optim.adam_eps),
    Flag("initial_loss_scale", "optim.initial_loss_scale", lambda r: r.optim.initial_loss_scale),
    # tokenizer and data
    Flag("tokenizer_type", "tokenizer.type", lambda r: _TOKENIZERS.get(r.tokenizer.type, "NullTokenizer")),
    Flag("tokenizer_model", "tokenizer.path",
         lambda r: r.tokenizer.path if r.tokenizer.type in ("huggingface", "sentencepiece") else None),
    Flag("vocab_file", "tokenizer.path", lambda r: r.tokenizer.path if r.tokenizer.type == "wordpiece" else None),
    Flag("data_path", "data.path", lambda r: _data_path(r.data)),
    Flag("split", "data.split", lambda r: r.data.split),
    Flag("mock_data", "data.mock", lambda r: bool(r.data.mock)),
    Flag("reset_position_ids", "data.reset_position_ids", lambda r: r.data.reset_position_ids),
    Flag("reset_attention_mask", "data.reset_attention_mask", lambda r: r.data.reset_attention_mask),
    Flag("eod_mask_loss", "data.eod_mask_loss", lambda r: r.data.eod_mask_loss),
    # checkpoints
    Flag("save_interval", "checkpoint.save_interval", lambda r: r.checkpoint.save_interval),
)


def _data_path(data) -> list[str] | None:
    if data.mock:
        return None
    if data.blend:
        return [str(x) for pair in data.blend for x in pair]
    return [str(data.path)] if data.path else None


def _enum_defaults() -> dict[str, Any]:
    import signal

    from megatron.core.transformer.enums import AttnBackend

    return {"attention_backend": AttnBackend[parse_args_defaults()["attention_backend"]],
            "exit_signal": signal.Signals[parse_args_defaults()["exit_signal"]]}


# Model fields Megatron-LM core_v0.16.1's arguments cannot set: name -> (the value they imply, why).
_NO_ARGUMENT = {
    "softmax_scale": (None, "TransformerConfig.softmax_scale has no command-line argument"),
    "qk_norm_scope": ("head", "--qk-layernorm normalises each head; no argument normalises whole projections"),
    "norm_placement": ("pre", "Megatron-LM's GPT layers are pre-norm; no argument adds norms on sublayer outputs"),
    "attention_softcap": (None, "no argument soft-caps attention scores"),
    "final_logit_softcap": (None, "no argument soft-caps the output logits"),
    "scale_embeddings": (False, "no argument scales the input embeddings"),
    "rotary_base_local": (None, "one RoPE base (--rotary-base) serves every layer"),
    "mla": (None, "multi-latent attention is not mapped: Megatron-LM's local spec names its latent norms "
                  "q_layernorm / kv_layernorm (megacli stores the Transformer Engine spec's linear_q_up_proj / "
                  "linear_kv_up_proj.layer_norm_weight), and its yarn RoPE takes original_max_position_embeddings, "
                  "beta_fast and beta_slow from defaults no argument sets"),
}


def _scaling(s) -> dict:
    return {k: v for k, v in s.model_dump().items() if v is not None}


def unsupported(recipe) -> list[str]:
    """What of the recipe's model Megatron-LM's GPT arguments cannot express (empty when all can)."""
    m = recipe.model
    out = []
    if m.arch not in ("gpt", "t5"):
        out.append(f"model.arch {m.arch} (the Megatron-LM export writes GPT models and T5 ones)")
    if m.arch == "t5":
        if m.dec_num_layers != m.num_layers:
            out.append(f"model.decoder_num_layers {m.dec_num_layers} (pretrain_t5.py builds the decoder with "
                       f"--num-layers layers, here {m.num_layers}: --decoder-num-layers is not passed to the model)")
        if m.scale_decoder_output:
            out.append("model.scale_decoder_output (Megatron-Core's T5Model does not scale the decoder output)")
        if m.qk_layernorm:
            out.append("model.qk_layernorm (Megatron-LM's T5 layer specs have no query/key norms)")
    if m.position_embedding not in _POSITIONS:
        out.append(f"model.position_embedding {m.position_embedding} (Megatron-LM has no such --position-embedding-type)")
    elif m.position_embedding == "relative" and m.arch != "t5":
        out.append("model.position_embedding relative (Megatron-LM builds relative positions for T5 only)")
    if m.activation not in ("gelu", "gelu_tanh", "swiglu", "squared_relu"):
        out.append(f"model.activation {m.activation} (Megatron-LM has no flag for it)")
    elif m.activation == "gelu_tanh" and not m.add_bias_linear:
        out.append("model.activation gelu_tanh without model.add_bias_linear (Megatron-Core computes the tanh "
                   "approximation only in its fused bias-GeLU, with biases; --openai-gelu does not reach its models)")
    if m.rope_scaling is not None and _scaling(m.rope_scaling) != MEGATRON_ROPE_SCALING:
        out.append(f"model.rope_scaling {_scaling(m.rope_scaling)} (Megatron-LM's --use-rope-scaling is Llama 3.1's "
                   f"scaling with fixed parameters, {MEGATRON_ROPE_SCALING}: pretrain_gpt.py does not pass "
                   f"--rope-scaling-factor to the model)")
    out += [f"model.{name} ({why})" for name, (plain, why) in _NO_ARGUMENT.items() if getattr(m, name) != plain]
    if recipe.lora is not None:
        out.append("lora (merge the adapters first: megacli convert CKPT DST --to megacli)")
    return out


def megatron_args(recipe, *, ckpt_format: str = "torch_dist", iteration: int = 0, consumed_samples: int = 0,
                  padded_vocab_size: int | None = None, num_floating_point_operations: int = 0,
                  transformer_impl: str = "transformer_engine", vocab_size: int | None = None) -> argparse.Namespace:
    """The ``args`` Megatron-LM core_v0.16.1 would hold after ``parse_args`` + ``validate_args`` and
    ``iteration`` steps of training this (validated) recipe: every field it defines, the recipe's
    values where it implies them, the defaults elsewhere. ``transformer_impl``: the layer spec the
    weights are named for (transformer_engine or local); ``vocab_size``: the real vocabulary when
    model.vocab_size leaves it to the tokenizer (default: the recipe tokenizer's, when it loads)."""
    import torch

    from megatron.core.enums import ModelType

    problems = unsupported(recipe)
    if problems:
        raise UserError("cannot write Megatron-LM arguments for " + "; ".join(problems))
    fields = dict(parse_args_defaults())
    fields.update(_enum_defaults())
    for name in DROPPED_BY_VALIDATION:
        fields.pop(name, None)
    for flag in FLAGS:
        fields[flag.arg] = flag.value(recipe)
    if fields["vocab_size"] is None:
        fields["vocab_size"] = vocab_size if vocab_size is not None else _tokenizer_vocab(recipe)
    if fields["tokenizer_type"] == "NullTokenizer" and fields["vocab_size"] is not None:
        fields["vocab_size"] -= 1  # Megatron-LM's NullTokenizer appends its end-of-document id to the --vocab-size ids
    p, m, t = recipe.parallel, recipe.model, recipe.train
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for name in _DTYPE_FIELDS:
        fields[name] = dtypes.get(fields[name], torch.float32)
    vp = p.virtual_pipeline if p.virtual_pipeline and p.virtual_pipeline > 1 else None
    fields.update(
        # validate_args
        data_parallel_size=recipe.data_parallel_size, params_dtype=dtypes[t.precision],
        transformer_pipeline_model_parallel_size=p.pipeline, virtual_pipeline_model_parallel_size=vp,
        num_virtual_stages_per_pipeline_rank=vp, overlap_p2p_comm=vp is not None and fields["overlap_p2p_comm"],
        align_param_gather=vp is not None and fields["align_param_gather"],
        encoder_num_layers=m.num_layers,
        encoder_seq_length=m.seq_length, use_dist_ckpt=ckpt_format != "torch", ckpt_format=ckpt_format,
        variable_seq_lengths=False, dataloader_type="single", transformer_impl=transformer_impl,
        apply_rope_fusion=m.position_embedding == "rope" and fields["apply_rope_fusion"],
        # bf16 reduces gradients in fp32 (fp32 main grads); fp16's dynamic loss scaling reads NaNs as overflow
        accumulate_allreduce_grads_in_fp32=t.precision == "bf16" and not fields["grad_reduce_in_bf16"]
        and fields["main_grads_dtype"] == torch.float32 or fields["accumulate_allreduce_grads_in_fp32"],
        check_for_nan_in_loss_and_grad=fields["check_for_nan_in_loss_and_grad"]
        and not (t.precision == "fp16" and not fields["loss_scale"]),
        # training
        consumed_train_samples=consumed_samples, consumed_valid_samples=0, skipped_train_samples=0,
        padded_vocab_size=padded_vocab_size, iteration=iteration, curr_iteration=iteration,
        num_floating_point_operations_so_far=num_floating_point_operations, model_type=ModelType.encoder_or_decoder,
        do_train=True, do_valid=t.eval_interval is not None, do_test=False,
    )
    return argparse.Namespace(**fields)


def _tokenizer_vocab(recipe) -> int | None:
    from megacli.data.tokenizers import load_tokenizer

    try:
        return load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path).vocab_size
    except Exception:  # noqa: BLE001 - args.vocab_size stays unset, as for a run that never named it
        return None


def flag_table() -> list[tuple[str, str]]:
    """(Megatron-LM option as docs/megatron-lm/flags.md shows it, recipe key), one row per option, in FLAGS order."""
    return [(f.table_cell(), f"`{f.key}`") for f in FLAGS]


def args_not_reproduced(args, recipe) -> list[str]:
    """The mapped Megatron-LM arguments (FLAGS) whose value in a run's ``args`` the validated
    ``recipe`` does not give back: what a recipe made from those args leaves out or changes."""
    out = []
    for flag in FLAGS:
        if flag.arg in ("vocab_size", "tokenizer_type", "tokenizer_model", "vocab_file", "data_path", "mock_data",
                        "world_size"):
            continue  # the vocabulary, tokenizer, data and world are the recipe reader's own notes
        if not hasattr(args, flag.arg):
            continue
        given, mapped = getattr(args, flag.arg), flag.value(recipe)
        if _same_arg(given, mapped):
            continue
        out.append(f"{flag.option} {given!r} (the recipe's {flag.key} gives {mapped!r})")
    return out


def _same_arg(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_arg(x, y) for x, y in zip(a, b))
    if isinstance(a, str) and isinstance(b, str):
        return a.replace(" ", "") == b.replace(" ", "")
    return a == b
