"""A Megatron-LM run's arguments (the ``args`` Namespace every legacy checkpoint file carries) as a
megacli recipe: the model section, and the training recipe a resharded run continues with."""

from __future__ import annotations

from pathlib import Path

from megacli.errors import UserError
from megacli.recipe.model import every_nth_global


def arg(args, name, default=None):
    """``args.name``, or ``default`` when the run did not set it (absent or None)."""
    value = getattr(args, name, default)
    return default if value is None else value


def tokenizer_dir(args) -> Path | None:
    """The run's Hugging Face tokenizer directory, when args name one that exists here."""
    if arg(args, "tokenizer_type") == "HuggingFaceTokenizer":
        p = Path(str(arg(args, "tokenizer_model", "")))
        if p.is_dir() and (p / "tokenizer.json").is_file():
            return p
    return None


def wordpiece_vocab(args) -> Path | None:
    """The run's BERT WordPiece vocab.txt (tokenizer_type BertWordPiece*), when it exists here."""
    if arg(args, "tokenizer_type") in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        p = Path(str(arg(args, "vocab_file", "")))
        if p.is_file():
            return p
    return None


# The Llama 3.1 scaling Megatron-Core's RotaryEmbedding hard-codes for --use-rope-scaling (low/high
# frequency factors and original context are fixed; pretrain_gpt.py's gpt_builder does not pass
# --rope-scaling-factor on, so its model always scales by 8), as model.rope_scaling.
MEGATRON_ROPE_SCALING = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_positions": 8192}


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
    """The recipe ``model:`` section for a Megatron-LM run's arguments (``arch``: gpt or bert)."""
    if arg(args, "apply_residual_connection_post_layernorm", False):
        raise UserError("apply_residual_connection_post_layernorm checkpoints are not supported (the residual "
                        "stream takes the normalised input, which megacli's layers do not express)")
    if arg(args, "rotary_interleaved", False):
        raise UserError("rotary_interleaved checkpoints are not supported (megacli uses non-interleaved RoPE, as HF)")
    hidden, heads = args.hidden_size, args.num_attention_heads
    pos = arg(args, "position_embedding_type", "learned_absolute")
    if arg(args, "use_rotary_position_embeddings", False):
        pos = "rope"
    positions = {"learned_absolute": "learned", "rope": "rope", "none": "none"}.get(pos)
    if arch == "t5" and pos == "relative":
        positions = "relative"
    if positions is None:
        raise UserError(f"position_embedding_type {pos!r} is not supported")
    if arg(args, "swiglu", False):
        activation = "swiglu"
    elif arg(args, "squared_relu", False):
        activation = "squared_relu"
    elif arg(args, "openai_gelu", False) or (arg(args, "add_bias_linear", True) and arg(args, "bias_gelu_fusion", False)):
        # Megatron-Core's fused bias-GeLU (its default with biases) is the tanh approximation
        activation = "gelu_tanh"
    else:
        activation = "gelu"
    seq = arg(args, "seq_length", 1024)
    section = dict(
        arch=arch,
        num_layers=args.num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=arg(args, "num_query_groups", heads) if arg(args, "group_query_attention", False) else heads,
        kv_channels=arg(args, "kv_channels", hidden // heads),
        ffn_hidden_size=arg(args, "ffn_hidden_size", 4 * hidden),
        seq_length=seq,
        max_position_embeddings=arg(args, "max_position_embeddings", seq),
        position_embedding=positions,
        rotary_base=float(arg(args, "rotary_base", 10000)),
        rotary_percent=float(arg(args, "rotary_percent", 1.0)),
        normalization="rmsnorm" if arg(args, "normalization", "LayerNorm") == "RMSNorm" else "layernorm",
        norm_epsilon=arg(args, "norm_epsilon", arg(args, "layernorm_epsilon", 1e-5)),
        activation=activation,
        add_bias_linear=arg(args, "add_bias_linear", not arg(args, "disable_bias_linear", False)),
        add_qkv_bias=arg(args, "add_qkv_bias", False),
        qk_layernorm=arg(args, "qk_layernorm", False),
        untie_embeddings=arg(args, "untie_embeddings_and_output_weights", False),
        dropout=arg(args, "hidden_dropout", 0.0),
        attention_dropout=arg(args, "attention_dropout", 0.0),
        vocab_size=vocab_size,
        make_vocab_size_divisible_by=arg(args, "make_vocab_size_divisible_by", 128),
        init_method_std=arg(args, "init_method_std", 0.02),
        # --apply-layernorm-1p (args.layernorm_zero_centered_gamma; apply_layernorm_1p before core_r0.8)
        norm_zero_centered_gamma=bool(arg(args, "layernorm_zero_centered_gamma", False)
                                      or arg(args, "apply_layernorm_1p", False)),
    )
    scaling = _rope_scaling(args) if positions == "rope" else None  # without RoPE there is nothing to scale
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


def _single(value):
    """A list-valued MoE argument (--moe-router-load-balancing-type and --moe-aux-loss-coeff take
    several) as its one value; a list of several stays a list."""
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


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
    balancing = _single(arg(args, "moe_router_load_balancing_type", "aux_loss"))
    if balancing not in _MOE_BALANCING:
        out.append(f"moe_router_load_balancing_type {balancing!r} is not supported (model.moe expresses "
                   f"{' and '.join(_MOE_BALANCING)}: its aux_loss_coeff)")
    return out


def moe_section_from_args(args) -> dict | None:
    """The recipe ``model.moe`` section for a Megatron-LM run's MoE arguments (None: a dense model)."""
    experts = arg(args, "num_experts")
    if not experts:
        return None
    problems = moe_refusals(args)
    if problems:
        raise UserError("; ".join(problems))
    balancing = _single(arg(args, "moe_router_load_balancing_type", "aux_loss"))
    freq = arg(args, "moe_layer_freq", 1)
    return dict(
        num_experts=int(experts),
        router_topk=int(arg(args, "moe_router_topk", 2)),
        # validate_args: moe_ffn_hidden_size defaults to ffn_hidden_size
        ffn_hidden_size=arg(args, "moe_ffn_hidden_size", arg(args, "ffn_hidden_size", 4 * args.hidden_size)),
        aux_loss_coeff=float(_single(arg(args, "moe_aux_loss_coeff", 0.0))) if balancing == "aux_loss" else 0.0,
        capacity_factor=arg(args, "moe_expert_capacity_factor"),
        drop_policy=arg(args, "moe_token_drop_policy", "probs"),
        pad_to_capacity=bool(arg(args, "moe_pad_expert_input_to_capacity", False)),
        shared_expert_ffn_hidden_size=arg(args, "moe_shared_expert_intermediate_size"),
        shared_expert_gate=bool(arg(args, "moe_shared_expert_gate", False)),
        layer_freq=list(freq) if isinstance(freq, (list, tuple)) else int(freq),
        router_dtype=getattr(args, "moe_router_dtype", None),  # None: the model's precision
        router_pre_softmax=bool(arg(args, "moe_router_pre_softmax", False)),
        # flex (DeepEP / HybridEP kernels) routes the same tokens as all-to-all, which megacli runs
        dispatcher="allgather" if arg(args, "moe_token_dispatcher_type", "allgather") == "allgather" else "alltoall",
        grouped_gemm=bool(arg(args, "moe_grouped_gemm", False)),
        router_score_function=arg(args, "moe_router_score_function", "softmax"),
        router_expert_bias=bool(arg(args, "moe_router_enable_expert_bias", False)),
        router_bias_update_rate=float(arg(args, "moe_router_bias_update_rate", 1e-3)),
        router_num_groups=arg(args, "moe_router_num_groups"),
        router_group_topk=arg(args, "moe_router_group_topk"),
        router_topk_scaling_factor=arg(args, "moe_router_topk_scaling_factor"),
    )


def recipe_from_args(src) -> dict:
    """The raw training recipe of a legacy checkpoint (a LegacyCheckpoint), from its run's arguments."""
    a = src.args
    model = src.model_section()
    vocab = model.get("vocab_size")
    tok_dir = src.tokenizer_dir()
    tokenizer = {"type": "huggingface", "path": str(tok_dir)} if tok_dir else {"type": "none", "path": None}
    if not tok_dir:
        model["vocab_size"] = vocab
    gbs = int(arg(a, "global_batch_size", 1))
    mbs = int(arg(a, "micro_batch_size", 1))
    world = int(arg(a, "world_size", src.tp * src.pp))
    cp = int(arg(a, "context_parallel_size", 1))
    etp = arg(a, "expert_tensor_parallel_size")  # validate_args: the tensor-parallel size when not given
    train_iters = arg(a, "train_iters") or max(1, int(arg(a, "train_samples", gbs)) // gbs)
    warmup = arg(a, "lr_warmup_iters", 0) or 0
    if not warmup and arg(a, "lr_warmup_samples"):
        warmup = int(a.lr_warmup_samples) // gbs
    style = str(arg(a, "lr_decay_style", "linear"))
    data_path = arg(a, "data_path")
    if isinstance(data_path, (list, tuple)) and len(data_path) == 1:
        data = {"path": str(data_path[0]), "mock": False}
    elif isinstance(data_path, (list, tuple)) and len(data_path) > 1 and len(data_path) % 2 == 0:
        data = {"blend": [[float(data_path[i]), str(data_path[i + 1])] for i in range(0, len(data_path), 2)], "mock": False}
    else:
        data = {"mock": True}
    if arg(a, "split"):
        data["split"] = str(a.split).replace(" ", "")
    data.update(reset_position_ids=bool(arg(a, "reset_position_ids", False)), eod_mask_loss=bool(arg(a, "eod_mask_loss", False)))
    extra = {}
    if model["arch"] == "t5" and arg(a, "vocab_extra_ids", 0):  # the T5 span-masking sentinels
        extra["masking"] = {"sentinel_tokens": int(a.vocab_extra_ids)}
    return extra | {
        "model": model,
        "parallel": {"tensor": src.tp, "pipeline": src.pp, "virtual_pipeline": src.vp if src.vp > 1 else None,
                     "first_stage_layers": src.first_stage_layers, "last_stage_layers": src.last_stage_layers,
                     "sequence_parallel": bool(arg(a, "sequence_parallel", False)) and src.tp > 1, "context": cp,
                     "expert": int(arg(a, "expert_model_parallel_size", 1)),
                     "expert_tensor": int(etp) if etp is not None and int(etp) != src.tp else None,
                     "distributed_optimizer": False},
        "launch": {"nproc": world},
        "tokenizer": tokenizer,
        "data": data,
        "train": {"iters": int(train_iters), "micro_batch_size": mbs, "global_batch_size": gbs,
                  "seed": int(arg(a, "seed", 1234)),
                  "precision": "bf16" if arg(a, "bf16", False) else "fp16" if arg(a, "fp16", False) else "fp32",
                  # None: the run evaluated never (megacli writes train.eval_interval: null so)
                  "eval_interval": getattr(a, "eval_interval", 1000), "eval_iters": int(arg(a, "eval_iters", 10) or 10),
                  "log_interval": int(arg(a, "log_interval", 100) or 100)},
        "optim": {"optimizer": str(arg(a, "optimizer", "adam")), "lr": float(arg(a, "lr", 3e-4)),
                  "min_lr": float(arg(a, "min_lr", 0.0)), "warmup_iters": int(warmup),
                  "decay_style": {"WSD": "wsd", "inverse-square-root": "cosine"}.get(style, style),
                  "decay_iters": arg(a, "lr_decay_iters"), "weight_decay": float(arg(a, "weight_decay", 0.01)),
                  "clip_grad": float(arg(a, "clip_grad", 1.0)), "adam_beta1": float(arg(a, "adam_beta1", 0.9)),
                  "adam_beta2": float(arg(a, "adam_beta2", 0.999)), "adam_eps": float(arg(a, "adam_eps", 1e-8))},
        "checkpoint": {"save_interval": arg(a, "save_interval")},
    }


class ArgsDescribed:
    """What a checkpoint described by Megatron-LM's run arguments (``self.args``; legacy or torch_dist)
    says about its tokenizer and vocabulary. Subclasses give ``padded_vocab_rows()``."""

    def vocab_size(self) -> int:
        """The real vocabulary: args.vocab_size, else the tokenizer's, else the padded rows."""
        given = arg(self.args, "vocab_size")
        if given:  # Megatron-LM's NullTokenizer appends its end-of-document id to the --vocab-size ids
            return int(given) + (1 if arg(self.args, "tokenizer_type") == "NullTokenizer" else 0)
        from megacli.data.tokenizers import load_tokenizer

        tok = self.tokenizer_dir()
        if tok is not None:
            return load_tokenizer(type="huggingface", path=str(tok)).vocab_size
        vocab = self.wordpiece_vocab()
        if vocab is not None:  # with the [BOS]/[EOS] (and --vocab-extra-ids) Megatron's WordPiece tokenizer appends
            return load_tokenizer(type="wordpiece", path=str(vocab)).vocab_size + int(arg(self.args, "vocab_extra_ids", 0))
        return self.padded_vocab_rows()

    def tokenizer_dir(self) -> Path | None:
        return tokenizer_dir(self.args)

    def tokenizer_not_found(self) -> list[str]:
        """The run's tokenizer, when its files are not on this machine (a recipe cannot name them)."""
        tok = arg(self.args, "tokenizer_type")
        if not tok or self.tokenizer_dir() is not None or self.wordpiece_vocab() is not None:
            return []
        where = arg(self.args, "tokenizer_model") or arg(self.args, "vocab_file")
        return [f"tokenizer {tok}" + (f" ({where}: not found on this machine)" if where else "")
                + "; set tokenizer.type and tokenizer.path"]

    def wordpiece_vocab(self) -> Path | None:
        return wordpiece_vocab(self.args)


# Megatron-LM counts scheduler steps in samples, megacli in iterations (global batches).
SCHED_STEPS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "wsd_decay_steps")


def scale_scheduler(sched: dict, factor: float, where: str) -> dict:
    out = dict(sched)
    for k in SCHED_STEPS:
        v = out.get(k)
        if v is None:
            continue
        scaled = v * factor
        if abs(scaled - round(scaled)) > 1e-6:
            raise UserError(f"{where}: scheduler {k} = {v} is not a whole number of global batches")
        out[k] = int(round(scaled))
    return out
