"""Megatron-LM's run arguments (the ``args`` Namespace in every checkpoint it writes) <-> a megacli
recipe: ``FLAGS``, the one table of Megatron-LM argument <-> recipe key, each row both ways.

``value(recipe)``: the argument for a validated recipe (args_namespace.py writes the whole Namespace
with it; docs/megatron-lm/flags.md is generated from the table). ``read(args)``, on the one row that
reads its key back: the key's value for a run's args (``model_section_from_args``; keys only some
models have are read below the table). ``parse_args_defaults()``: every field the installed
Megatron-Core's release of Megatron-LM ``parse_args`` defines, with its default: core_v0.16.1's
(defaults.json), changed by each later release's differences (defaults_since.json; both written by
``benchmarks/megatron_lm_args_check.py``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from megacli.errors import UserError
from megacli.recipe.model import every_nth_global

_DEFAULTS_FILE = Path(__file__).with_name("defaults.json")
_DEFAULTS_SINCE_FILE = Path(__file__).with_name("defaults_since.json")
DEFAULTS_RELEASE = "0.16"  # the release defaults.json is; defaults_since.json: {release: {"removed", "defaults"}}


@functools.cache
def parse_args_defaults() -> Mapping[str, Any]:
    """name -> default of every argument the installed Megatron-Core's release of Megatron-LM's
    parse_args defines (enum defaults by member name): defaults.json, then for each later release up
    to the installed one, the fields it removed and its new or changed defaults (defaults_since.json),
    both written from checkouts by ``benchmarks/megatron_lm_args_check.py CHECKOUT --write-defaults``."""
    from megacli.core_release import core_since

    defaults = json.loads(_DEFAULTS_FILE.read_text())
    for release, change in sorted(json.loads(_DEFAULTS_SINCE_FILE.read_text()).items(),
                                  key=lambda item: tuple(map(int, item[0].split(".")))):
        if core_since(release):
            for name in change["removed"]:
                del defaults[name]
            defaults.update(change["defaults"])
    return MappingProxyType(defaults)


def arg(args, name, default=None):
    """``args.name``, or ``default`` when the run did not set it (absent or None)."""
    value = getattr(args, name, default)
    return default if value is None else value


def _given(name: str, default=None, as_type: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], Any]:
    """A backward read: the run's ``name`` (``default`` when it did not set it), as ``as_type``."""
    return lambda a: as_type(arg(a, name, default))


# The Llama 3.1 scaling Megatron-Core's RotaryEmbedding hard-codes for --use-rope-scaling (low/high
# frequency factors and original context are fixed; pretrain_gpt.py's gpt_builder does not pass
# --rope-scaling-factor on, so its model always scales by 8), as model.rope_scaling.
MEGATRON_ROPE_SCALING = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_positions": 8192}
POSITIONS = {"learned": "learned_absolute", "rope": "rope", "none": "none", "relative": "relative"}
_DECAY = {"wsd": "WSD"}
_TOKENIZERS = {"huggingface": "HuggingFaceTokenizer", "sentencepiece": "GPTSentencePieceTokenizer",
               "wordpiece": "BertWordPieceLowerCase", "none": "NullTokenizer"}


@dataclass(frozen=True)
class Flag:
    """One Megatron-LM argument and the recipe key it corresponds to: ``value(recipe)`` is the
    argument's value for a validated recipe; ``read(args)``, on the row that reads the key back,
    the key's value for a run's args."""

    arg: str
    key: str
    value: Callable[[Any], Any]
    cli: str | None = None
    """The command-line option where its name is not the field's (``--apply-layernorm-1p``), or
    the environment variable parse_args reads the field from (``WORLD_SIZE``)."""
    off: bool = False
    """The option stores False (``--disable-bias-linear``: the field is True unless it is given)."""
    read: Callable[[Any], Any] | None = None

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


def _moe(name: str, value: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A MoE argument: ``value(recipe)`` for a model with model.moe, parse_args' default for a dense one."""
    return lambda r: value(r) if r.model.moe is not None else parse_args_defaults()[name]


def _t5(name: str, value: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A T5 argument: ``value(recipe)`` for model.arch t5, parse_args' default for other models."""
    return lambda r: value(r) if r.model.arch == "t5" else parse_args_defaults()[name]


def _e(name: str, field: str, default=None, as_type: Callable[[Any], Any] = lambda v: v) -> Flag:
    """A MoE argument that is model.moe's ``field`` as it is (read back as ``as_type``, ``default``
    when the run did not set it)."""
    return Flag(name, f"model.moe.{field}", _moe(name, lambda r: getattr(r.model.moe, field)),
                read=_given(name, default, as_type))


def moe_layer_freq(recipe) -> list[int]:
    """--moe-layer-freq as the one-per-layer pattern, also for an integer model.moe.layer_freq:
    megacli's MoE models store each layer under its own key, which is Megatron-Core's layout for a
    pattern list (an integer giving all MoE layers stacks them under one key)."""
    return recipe.model.moe_layers()


def _position(a) -> str:
    pos = "rope" if arg(a, "use_rotary_position_embeddings", False) else arg(a, "position_embedding_type", "learned_absolute")
    found = {megatron: ours for ours, megatron in POSITIONS.items()}.get(pos)
    if found is None:
        raise UserError(f"position_embedding_type {pos!r} is not supported")
    return found


def _activation(a) -> str:
    if arg(a, "swiglu", False):
        return "swiglu"
    if arg(a, "squared_relu", False):
        return "squared_relu"
    if arg(a, "openai_gelu", False) or (arg(a, "add_bias_linear", True) and arg(a, "bias_gelu_fusion", False)):
        # Megatron-Core's fused bias-GeLU (its default with biases) is the tanh approximation
        return "gelu_tanh"
    return "gelu"


def _balancing(a):
    return _single(arg(a, "moe_router_load_balancing_type", "aux_loss"))


def _single(value):
    """A list-valued MoE argument (--moe-router-load-balancing-type and --moe-aux-loss-coeff take
    several) as its one value; a list of several stays a list."""
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


FLAGS: tuple[Flag, ...] = (
    # model
    Flag("num_layers", "model.num_layers", _m("num_layers"), read=lambda a: a.num_layers),
    Flag("hidden_size", "model.hidden_size", _m("hidden_size"), read=lambda a: a.hidden_size),
    Flag("num_attention_heads", "model.num_attention_heads", _m("num_attention_heads"), read=lambda a: a.num_attention_heads),
    Flag("group_query_attention", "model.num_query_groups", lambda r: r.model.query_groups != r.model.num_attention_heads,
         read=lambda a: arg(a, "num_query_groups", a.num_attention_heads) if arg(a, "group_query_attention", False)
         else a.num_attention_heads),
    Flag("num_query_groups", "model.num_query_groups", lambda r: r.model.query_groups),
    Flag("kv_channels", "model.kv_channels", lambda r: r.model.head_dim,
         read=lambda a: arg(a, "kv_channels", a.hidden_size // a.num_attention_heads)),
    Flag("ffn_hidden_size", "model.ffn_hidden_size", lambda r: r.model.ffn_size,
         read=lambda a: arg(a, "ffn_hidden_size", 4 * a.hidden_size)),
    Flag("seq_length", "model.seq_length", _m("seq_length"), read=_given("seq_length", 1024)),
    Flag("max_position_embeddings", "model.max_position_embeddings", lambda r: r.model.max_positions,
         read=lambda a: arg(a, "max_position_embeddings", arg(a, "seq_length", 1024))),
    Flag("position_embedding_type", "model.position_embedding", lambda r: POSITIONS[r.model.position_embedding],
         read=_position),
    Flag("add_position_embedding", "model.position_embedding", lambda r: r.model.position_embedding != "none",
         cli="--no-position-embedding", off=True),
    Flag("rotary_base", "model.rotary_base", lambda r: int(r.model.rotary_base) if float(r.model.rotary_base).is_integer()
         else r.model.rotary_base, read=_given("rotary_base", 10000, float)),
    Flag("rotary_percent", "model.rotary_percent", _m("rotary_percent"), read=_given("rotary_percent", 1.0, float)),
    Flag("normalization", "model.normalization", lambda r: "RMSNorm" if r.model.normalization == "rmsnorm" else "LayerNorm",
         read=lambda a: "rmsnorm" if arg(a, "normalization", "LayerNorm") == "RMSNorm" else "layernorm"),
    Flag("layernorm_epsilon", "model.norm_epsilon", _m("norm_epsilon"), cli="--norm-epsilon",
         read=lambda a: arg(a, "norm_epsilon", arg(a, "layernorm_epsilon", 1e-5))),
    Flag("swiglu", "model.activation", lambda r: r.model.activation == "swiglu", read=_activation),
    Flag("squared_relu", "model.activation", lambda r: r.model.activation == "squared_relu"),
    Flag("openai_gelu", "model.activation", lambda r: r.model.activation == "gelu_tanh"),
    Flag("add_bias_linear", "model.add_bias_linear", _m("add_bias_linear"), cli="--disable-bias-linear", off=True,
         read=lambda a: arg(a, "add_bias_linear", not arg(a, "disable_bias_linear", False))),
    Flag("add_qkv_bias", "model.add_qkv_bias", lambda r: r.model.add_qkv_bias or r.model.add_bias_linear,
         read=_given("add_qkv_bias", False)),
    # Megatron-Core's fused bias-GeLU is the tanh approximation (and refuses other activations): on for
    # gelu_tanh with biases only (validate_args turns it off without biases)
    Flag("bias_gelu_fusion", "model.activation", lambda r: r.model.activation == "gelu_tanh" and r.model.add_bias_linear,
         cli="--no-bias-gelu-fusion", off=True),
    Flag("qk_layernorm", "model.qk_layernorm", _m("qk_layernorm"), read=_given("qk_layernorm", False)),
    Flag("use_rope_scaling", "model.rope_scaling", lambda r: r.model.rope_scaling is not None),
    Flag("rope_scaling_factor", "model.rope_scaling.factor", lambda r: MEGATRON_ROPE_SCALING["factor"]),
    Flag("window_size", "model.sliding_window", lambda r: r.model.megatron_window),
    Flag("window_attn_skip_freq", "model.sliding_window_layers", _m("sliding_window_layers")),
    Flag("untie_embeddings_and_output_weights", "model.untie_embeddings", _m("untie_embeddings"),
         read=_given("untie_embeddings_and_output_weights", False)),
    Flag("hidden_dropout", "model.dropout", _m("dropout"), read=_given("hidden_dropout", 0.0)),
    Flag("attention_dropout", "model.attention_dropout", _m("attention_dropout"), read=_given("attention_dropout", 0.0)),
    Flag("vocab_size", "model.vocab_size", _m("vocab_size"), read=_given("vocab_size")),
    Flag("make_vocab_size_divisible_by", "model.make_vocab_size_divisible_by", _m("make_vocab_size_divisible_by"),
         read=_given("make_vocab_size_divisible_by", 128)),
    Flag("init_method_std", "model.init_method_std", _m("init_method_std"), read=_given("init_method_std", 0.02)),
    # --apply-layernorm-1p (args.layernorm_zero_centered_gamma; apply_layernorm_1p before core_r0.8)
    Flag("layernorm_zero_centered_gamma", "model.norm_zero_centered_gamma", _m("norm_zero_centered_gamma"),
         cli="--apply-layernorm-1p", read=lambda a: bool(arg(a, "layernorm_zero_centered_gamma", False)
                                                          or arg(a, "apply_layernorm_1p", False))),
    Flag("bert_binary_head", "model.bert_binary_head", _m("bert_binary_head"), cli="--bert-no-binary-head", off=True),
    # T5 (pretrain_t5.py; validate_args makes --num-layers / --seq-length the encoder's)
    Flag("decoder_num_layers", "model.decoder_num_layers", _t5("decoder_num_layers", lambda r: r.model.dec_num_layers)),
    Flag("decoder_seq_length", "model.decoder_seq_length", _t5("decoder_seq_length", lambda r: r.model.dec_seq_length)),
    Flag("vocab_extra_ids", "masking.sentinel_tokens", _t5("vocab_extra_ids", lambda r: r.masking.sentinel_tokens)),
    # mixture of experts
    _e("num_experts", "num_experts", as_type=int),
    _e("moe_router_topk", "router_topk", 2, int),
    Flag("moe_ffn_hidden_size", "model.moe.ffn_hidden_size", _moe("moe_ffn_hidden_size", lambda r: r.model.expert_ffn_size),
         # validate_args: moe_ffn_hidden_size defaults to ffn_hidden_size
         read=lambda a: arg(a, "moe_ffn_hidden_size", arg(a, "ffn_hidden_size", 4 * a.hidden_size))),
    Flag("moe_router_load_balancing_type", "model.moe.aux_loss_coeff",
         _moe("moe_router_load_balancing_type", lambda r: "aux_loss" if r.model.moe.aux_loss_coeff > 0 else "none")),
    Flag("moe_aux_loss_coeff", "model.moe.aux_loss_coeff", _moe("moe_aux_loss_coeff", lambda r: r.model.moe.aux_loss_coeff),
         read=lambda a: float(_single(arg(a, "moe_aux_loss_coeff", 0.0))) if _balancing(a) == "aux_loss" else 0.0),
    _e("moe_expert_capacity_factor", "capacity_factor"),
    _e("moe_token_drop_policy", "drop_policy", "probs"),
    _e("moe_pad_expert_input_to_capacity", "pad_to_capacity", False, bool),
    _e("moe_shared_expert_intermediate_size", "shared_expert_ffn_hidden_size"),
    _e("moe_shared_expert_gate", "shared_expert_gate", False, bool),
    Flag("moe_layer_freq", "model.moe.layer_freq", _moe("moe_layer_freq", moe_layer_freq),
         read=_given("moe_layer_freq", 1, lambda f: list(f) if isinstance(f, (list, tuple)) else int(f))),
    _e("moe_router_dtype", "router_dtype"),  # None: the model's precision
    _e("moe_router_pre_softmax", "router_pre_softmax", False, bool),
    # flex (DeepEP / HybridEP kernels) routes the same tokens as all-to-all, which megacli runs
    _e("moe_token_dispatcher_type", "dispatcher", "allgather", lambda d: "allgather" if d == "allgather" else "alltoall"),
    _e("moe_grouped_gemm", "grouped_gemm", False, bool),
    _e("moe_router_score_function", "router_score_function", "softmax"),
    _e("moe_router_enable_expert_bias", "router_expert_bias", False, bool),
    _e("moe_router_bias_update_rate", "router_bias_update_rate", 1e-3, float),
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


def _read(args, prefix: str) -> dict:
    """The recipe keys directly under ``prefix`` that the table reads back, in its order."""
    return {flag.key[len(prefix):]: flag.read(args) for flag in FLAGS
            if flag.read is not None and flag.key.startswith(prefix) and "." not in flag.key[len(prefix):]}


def _rope_scaling(args) -> dict | None:
    if not arg(args, "use_rope_scaling", False):
        return None
    factor = float(arg(args, "rope_scaling_factor", MEGATRON_ROPE_SCALING["factor"]))
    if factor != MEGATRON_ROPE_SCALING["factor"]:
        raise UserError(f"use_rope_scaling with rope_scaling_factor {factor}: Megatron-LM's pretrain_gpt.py does not "
                        f"pass --rope-scaling-factor to the model (it scales by {MEGATRON_ROPE_SCALING['factor']}), so "
                        f"which factor the weights were trained with is not known")
    return dict(MEGATRON_ROPE_SCALING)


def _sliding_window(args, num_layers: int) -> dict:
    """model.sliding_window (+ sliding_window_layers) for window_size / window_attn_skip_freq: Megatron's
    window (left, 0) lets token i see i - left .. i, Hugging Face's window left + 1."""
    window = arg(args, "window_size")
    if window is None:
        return {}
    window = tuple(window)
    if len(window) != 2 or window[1] != 0 or window[0] < 0:
        raise UserError(f"window_size {window}: only causal sliding windows (w, 0) with w >= 0 are supported")
    skip = arg(args, "window_attn_skip_freq")
    if isinstance(skip, int):
        windowed = every_nth_global(skip, num_layers)
    elif skip is None:
        windowed = [1] * num_layers
    else:
        windowed = [int(bool(x)) for x in skip]
        if len(windowed) != num_layers:
            raise UserError(f"window_attn_skip_freq {skip}: {len(windowed)} entries for num_layers = {num_layers}")
        skip = windowed
    if not any(windowed):  # every layer attends to the whole prefix
        return {}
    return {"sliding_window": window[0] + 1, "sliding_window_layers": skip}


def model_section_from_args(args, vocab_size: int, arch: str = "gpt") -> dict:
    """The recipe ``model:`` section for a Megatron-LM run's arguments (``arch``: gpt, bert or t5);
    ``vocab_size``: the real vocabulary (ArgsDescribed.vocab_size)."""
    if arg(args, "apply_residual_connection_post_layernorm", False):
        raise UserError("apply_residual_connection_post_layernorm checkpoints are not supported (the residual "
                        "stream takes the normalised input, which megacli's layers do not express)")
    if arg(args, "rotary_interleaved", False):
        raise UserError("rotary_interleaved checkpoints are not supported (megacli uses non-interleaved RoPE, as HF)")
    section = {"arch": arch, **_read(args, "model.")}
    if section["position_embedding"] == "relative" and arch != "t5":
        raise UserError("position_embedding_type 'relative' is not supported")
    section["vocab_size"] = vocab_size
    scaling = _rope_scaling(args) if section["position_embedding"] == "rope" else None  # nothing to scale without RoPE
    if scaling is not None:
        section.update(rope_scaling=scaling)
    section.update(_sliding_window(args, args.num_layers))
    if arch == "t5":  # pretrain_t5.py: --encoder-seq-length is seq_length
        section.update(decoder_seq_length=arg(args, "decoder_seq_length", None))
        if section["decoder_seq_length"] is None:
            del section["decoder_seq_length"]
    if arch == "bert":  # pretrain_bert.py: token types and the pooler come with the binary head
        section.update(bert_binary_head=bool(arg(args, "bert_binary_head", True)))
    moe = moe_section_from_args(args)
    if moe is not None:
        section["moe"] = moe
    return section


# Megatron-LM MoE arguments that change the model in ways model.moe does not express: name ->
# (its value for a model without that change, why).
_MOE_UNMAPPED = {
    "moe_z_loss_coeff": (None, "the router z-loss (moe_z_loss_coeff) is not expressed by model.moe"),
    "moe_input_jitter_eps": (None, "router input jitter (moe_input_jitter_eps) is not expressed by model.moe"),
    "moe_latent_size": (None, "latent MoE (moe_latent_size) is not supported"),
    "moe_apply_probs_on_input": (False, "router probabilities applied to the expert input (moe_apply_probs_on_input) "
                                        "are not expressed by model.moe"),
    "moe_router_force_load_balancing": (False, "forced load balancing (moe_router_force_load_balancing, a "
                                               "benchmarking mode) is not expressed by model.moe"),
    "moe_use_upcycling": (False, "upcycling a dense checkpoint (moe_use_upcycling) is not supported"),
}
# Balancing losses model.moe expresses: Switch/GShard's aux loss (its coefficient) or none.
_MOE_BALANCING = ("aux_loss", "none")
# Megatron-Core's T5 relative position buckets / maximum distance, the ones megacli's T5 builds with.
T5_RELATIVE = {"relative_attention_num_buckets": 32, "relative_attention_max_distance": 128}


def t5_refusals(args) -> list[str]:
    """Why a Megatron-LM T5 run's model is not megacli's T5 (empty when it is)."""
    if arg(args, "position_embedding_type") != "relative":
        return []
    return [f"{name} {arg(args, name)} (megacli's T5 uses Megatron-Core's default {value})"
            for name, value in T5_RELATIVE.items() if arg(args, name, value) != value]


def moe_refusals(args) -> list[str]:
    """Why this run's mixture of experts cannot be expressed as model.moe (empty when it can, or
    the model is dense)."""
    if not arg(args, "num_experts"):
        return []
    out = [why for name, (plain, why) in _MOE_UNMAPPED.items() if arg(args, name, plain) not in (plain, 0, 0.0)]
    balancing = _balancing(args)
    if balancing not in _MOE_BALANCING:
        out.append(f"moe_router_load_balancing_type {balancing!r} is not supported (model.moe expresses "
                   f"{' and '.join(_MOE_BALANCING)}: its aux_loss_coeff)")
    return out


def moe_section_from_args(args) -> dict | None:
    """The recipe ``model.moe`` section for a Megatron-LM run's MoE arguments (None: a dense model)."""
    if not arg(args, "num_experts"):
        return None
    problems = moe_refusals(args)
    if problems:
        raise UserError("; ".join(problems))
    return _read(args, "model.moe.")


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
