"""The whole ``args`` Namespace Megatron-LM holds for a megacli recipe (the release of the installed
Megatron-Core: core_v0.16.1 or core_v0.19.x): parse_args' defaults, what ``validate_args`` drops and derives, and the recipe's values through the flag table
(args.py); what of a recipe's model no argument expresses."""

from __future__ import annotations

import argparse
from typing import Any

from megacli.checkpoint.megatron_lm.args import POSITIONS, FLAGS, MEGATRON_ROPE_SCALING, parse_args_defaults
from megacli.core_release import core_since
from megacli.errors import UserError

DROPPED_BY_VALIDATION = ("batch_size", "warmup", "model_parallel_size", "checkpoint_activations", "recompute_activations")
# What validate_args of a release after core_v0.16.1 also drops, adds (no parse_args field), converts
# from a precision name to a torch dtype, and sets from the other fields.
VALIDATION_SINCE = {
    "0.19": {"drops": ("cuda_graph_scope_deprecated",),
             "adds": ("gtp_weight_remat_size", "expert_gtp_weight_remat_size", "use_layer_wise_distributed_optimizer"),
             "dtypes": ("mamba_inference_conv_states_dtype", "mamba_inference_ssm_states_dtype",
                        "megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype"),
             "sets": lambda f: {
                 "_is_global_batch_size_explicitly_specified": f["global_batch_size"] is not None,
                 "eval_global_batch_size": _given(f, "eval_global_batch_size", "global_batch_size"),
                 "eval_micro_batch_size": _given(f, "eval_micro_batch_size", "micro_batch_size"),
                 "tensor_parallel_num_weight_shards": f["tensor_model_parallel_size"], "gtp_weight_remat_size": 1,
                 "expert_tensor_parallel_num_weight_shards": f["expert_tensor_parallel_size"],
                 "expert_gtp_weight_remat_size": 1,
                 "use_layer_wise_distributed_optimizer": f["optimizer"] not in ("sgd", "adam")
                 and f["use_distributed_optimizer"],
                 "async_strategy": f["async_strategy"] if f["async_save"] else "mcore",
                 "inference_cuda_graph_scope": _inference_cuda_graph_scope(f["cuda_graph_impl"])}},
}


def namespace_fields() -> set[str]:
    """The fields of megatron_args's Namespace under the installed Megatron-Core's release."""
    since = [change for release, change in VALIDATION_SINCE.items() if core_since(release)]
    return ((set(parse_args_defaults()) - set(DROPPED_BY_VALIDATION) - {n for c in since for n in c["drops"]})
            | set(DERIVED) | {n for c in since for n in c["adds"]})


def _given(fields, name: str, otherwise: str):
    return fields[otherwise] if fields[name] is None else fields[name]


def _inference_cuda_graph_scope(cuda_graph_impl: str):
    from megatron.core.transformer.cuda_graph_config import InferenceCudaGraphScope

    return InferenceCudaGraphScope.layer if cuda_graph_impl == "local" else InferenceCudaGraphScope.none


# Fields validate_args converts from a precision name to a torch dtype.
_DTYPE_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
# Fields validate_args and Megatron-LM's training add to the Namespace (set by megatron_args below).
DERIVED = ("consumed_train_samples", "consumed_valid_samples", "skipped_train_samples", "data_parallel_size",
           "params_dtype", "transformer_pipeline_model_parallel_size", "use_dist_ckpt", "variable_seq_lengths",
           "virtual_pipeline_model_parallel_size", "padded_vocab_size", "iteration", "curr_iteration",
           "num_floating_point_operations_so_far", "model_type", "do_train", "do_valid", "do_test")


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
    if m.position_embedding not in POSITIONS:
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
    """The ``args`` Megatron-LM (the installed Megatron-Core's release) would hold after ``parse_args`` + ``validate_args`` and
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
    for release, change in VALIDATION_SINCE.items():
        if core_since(release):
            for name in change["drops"]:
                fields.pop(name, None)
            for name in change["dtypes"]:
                fields[name] = {**dtypes, "auto": None, None: None}[fields[name]]
            fields.update(change["sets"](fields))
    return argparse.Namespace(**fields)


def _tokenizer_vocab(recipe) -> int | None:
    from megacli.data.tokenizers import load_tokenizer

    try:
        return load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path).vocab_size
    except Exception:  # noqa: BLE001 - args.vocab_size stays unset, as for a run that never named it
        return None
