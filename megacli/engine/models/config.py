"""The Megatron-Core TransformerConfig a recipe describes."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from megacli.engine.models import moe, rope
from megacli.precision import params_dtype


def _activation(name: str):
    """(activation_func, gated_linear_unit) for a recipe activation name."""
    return {
        "gelu": (F.gelu, False),
        "gelu_tanh": (functools.partial(F.gelu, approximate="tanh"), False),
        "swiglu": (F.silu, True),
        "geglu": (functools.partial(F.gelu, approximate="tanh"), True),
        "relu": (F.relu, False),
        "squared_relu": (lambda x: torch.pow(F.relu(x), 2), False),
    }[name]


def bias_activation_fusion(model, on_cuda: bool) -> bool:
    """Whether the MLP adds its bias and applies the activation in one of Megatron-Core's fused
    kernels. Its bias-GeLU and bias-GeGLU kernels compute the tanh approximation, so they serve
    gelu_tanh and geglu (GPT-2's activation, the same maths), never exact GeLU; only a GPT's dense
    MLP calls them (BERT's head and MoE experts call ``activation_func`` itself)."""
    if not (on_cuda and model.add_bias_linear):
        return False
    tanh_gelu = model.activation in ("gelu_tanh", "geglu") and model.arch == "gpt" and model.moe is None
    return model.activation == "swiglu" or tanh_gelu


def _drawn_later(tensor):
    """Init method placeholder: init_weights draws every weight by name after the model is built."""
    return tensor


def _softmax_scale(model) -> float | None:
    """The recipe's attention scale (null: Megatron's 1/sqrt(head dim)) times RoPE scaling's factor."""
    factor = rope.softmax_scale_factor(model.rope_scaling)
    if factor == 1.0:
        return model.softmax_scale
    return (model.softmax_scale or 1.0 / math.sqrt(model.head_dim)) * factor


def transformer_config(*, model, parallel, precision: str, on_cuda: bool, **overrides):
    """The TransformerConfig for a recipe. Fusions that need CUDA kernels are on only on CUDA."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megacli.engine.models import mla

    kwargs = {**_architecture_kwargs(model, on_cuda), **_layout_kwargs(parallel, precision),
              **_kernel_kwargs(model, parallel, precision, on_cuda)}
    if model.arch == "t5":
        kwargs["num_layers"] = model.dec_num_layers  # the decoder's; build_t5 gives the encoder a copy with its own
    if model.arch == "bert":
        # Megatron's BERT objective: per micro-batch masked-LM mean + sentence-order mean, averaged
        # over micro-batches and data-parallel ranks (see steps.bert_loss_func).
        kwargs["calculate_per_token_loss"] = False
    if model.moe is not None:
        kwargs.update(moe.config_kwargs(model=model, parallel=parallel, on_cuda=on_cuda))
    kwargs.update(mla.config_kwargs(model=model))
    kwargs.update(overrides)
    return (MLATransformerConfig if model.mla is not None else TransformerConfig)(**kwargs)


def _architecture_kwargs(model, on_cuda: bool) -> dict:
    """The model section's shapes, norms, attention and activation."""
    activation, gated = _activation(model.activation)
    if bias_activation_fusion(model, on_cuda) and model.activation in ("gelu_tanh", "geglu"):
        activation = F.gelu  # what selects the fused (tanh) kernels in Megatron-Core's MLP
    return dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        softmax_scale=_softmax_scale(model),
        ffn_hidden_size=model.ffn_size,
        hidden_dropout=model.dropout,
        attention_dropout=model.attention_dropout,
        normalization="RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=model.norm_epsilon,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        layernorm_zero_centered_gamma=model.norm_zero_centered_gamma,
        window_size=model.megatron_window,  # skip frequency as the recipe says
        window_attn_skip_freq=model.sliding_window_layers,
        activation_func=activation,
        gated_linear_unit=gated,
        init_method_std=model.init_method_std,
    )


def _layout_kwargs(parallel, precision: str) -> dict:
    """The parallel layout, the dtypes and activation recompute."""
    dtype = params_dtype(precision)
    recompute = None if parallel.recompute == "none" else parallel.recompute
    return dict(
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        num_layers_in_first_pipeline_stage=parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=parallel.last_stage_layers,
        sequence_parallel=parallel.sp_enabled,
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        recompute_granularity=recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=parallel.recompute_num_layers if recompute == "full" else None,
    )


def _kernel_kwargs(model, parallel, precision: str, on_cuda: bool) -> dict:
    """Initialisation, the loss's normalisation, fused kernels and pipeline communication."""
    return dict(
        # Weights are drawn by name (see init_weights), the same in every layout. Megatron's own init
        # must still run: it is what marks weights tensor_model_parallel (used by grad clipping and
        # checkpointing), so it runs with a no-op init method on the device.
        use_cpu_initialization=False,
        perform_initialization=True,
        init_method=_drawn_later,
        output_layer_init_method=_drawn_later,
        embedding_init_method=_drawn_later,
        # Loss is summed per token and normalised by the global token count (exact across DP/PP).
        calculate_per_token_loss=True,
        apply_query_key_layer_scaling=False,
        gradient_accumulation_fusion=False,  # needs Apex's fused weight-gradient kernel
        bias_activation_fusion=bias_activation_fusion(model, on_cuda),
        # Megatron-Core's own fused vocab-parallel cross-entropy (no Transformer Engine) returns the
        # logits' gradient in bf16 whatever their dtype: the same maths for bf16 logits only
        cross_entropy_loss_fusion=on_cuda and precision == "bf16",
        cross_entropy_fusion_impl="native",
        bias_dropout_fusion=on_cuda,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        deallocate_pipeline_outputs=True,
        # Batched p2p puts both directions to the same peer on one communicator. With PP=2 and
        # interleaving, prev == next and sends get paired with the wrong receives (measured on gloo;
        # Megatron-LM forbids it on CUDA too). The unbatched path uses two communicators for size-2
        # pipeline groups; on CUDA the interleaved schedule also overlaps p2p with compute.
        batch_p2p_comm=on_cuda and not parallel.virtual_pipeline,
        overlap_p2p_comm=on_cuda and bool(parallel.virtual_pipeline),
    )
