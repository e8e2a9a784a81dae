"""Recipe -> Megatron TransformerConfig -> model chunks. With engine.bert_t5 (BERT, T5), the only
place that builds Megatron models.

A model is a list of chunks: one per virtual pipeline stage held by this rank (one without
interleaving), as Megatron's schedules expect.
"""

from __future__ import annotations

import functools
import zlib

import torch
import torch.nn.functional as F

from megacli.plan import padded_vocab_size
from megacli.precision import params_dtype

__all__ = ["transformer_config", "build_model", "padded_vocab_size", "init_weights", "unwrap"]


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


def _drawn_later(tensor):
    """Init method placeholder: init_weights draws every weight by name after the model is built."""
    return tensor


def transformer_config(*, model, parallel, precision: str, on_cuda: bool, **overrides):
    """The TransformerConfig for a recipe. Fusions that need CUDA kernels are on only on CUDA."""
    from megatron.core.transformer import TransformerConfig

    activation, gated = _activation(model.activation)
    dtype = params_dtype(precision)
    recompute = None if parallel.recompute == "none" else parallel.recompute
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        softmax_scale=model.softmax_scale,
        ffn_hidden_size=model.ffn_size,
        hidden_dropout=model.dropout,
        attention_dropout=model.attention_dropout,
        normalization="RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=model.norm_epsilon,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        activation_func=activation,
        gated_linear_unit=gated,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        sequence_parallel=parallel.sequence_parallel,
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        recompute_granularity=recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=parallel.recompute_num_layers if recompute == "full" else None,
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
        bias_activation_fusion=on_cuda and model.activation in ("gelu", "swiglu") and model.add_bias_linear,
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
    if model.arch == "t5":
        kwargs["num_layers"] = model.dec_num_layers  # the decoder's; build_t5 gives the encoder a copy with its own
    if model.arch == "bert":
        # Megatron's BERT objective: per micro-batch masked-LM mean + sentence-order mean, averaged
        # over micro-batches and data-parallel ranks (see steps.bert_loss_func).
        kwargs["calculate_per_token_loss"] = False
    if model.moe is not None:
        from megacli.engine import moe

        kwargs.update(moe.config_kwargs(model=model, parallel=parallel, on_cuda=on_cuda))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model(*, recipe, config, vocab_size: int) -> list:
    """Model chunks for this rank: GPT here, BERT and T5 in engine.bert_t5."""
    from megatron.core import parallel_state as ps

    m = recipe.model
    padded = padded_vocab_size(vocab_size, divisible_by=m.make_vocab_size_divisible_by, tensor_parallel=recipe.parallel.tensor)
    if m.arch in ("bert", "t5"):
        from megacli.engine import bert_t5

        build = bert_t5.build_bert if m.arch == "bert" else bert_t5.build_t5
        return build(recipe=recipe, config=config, padded_vocab=padded, vocab_size=vocab_size)
    from megatron.core.models.gpt import GPTModel

    pos_type = {"learned": "learned_absolute", "rope": "rope"}.get(m.position_embedding, "none")
    chunks = []
    vp = recipe.parallel.virtual_pipeline
    for stage in range(vp or 1):
        vp_stage = stage if vp else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=gpt_block_spec(model=m, config=config, vp_stage=vp_stage, lora=getattr(recipe, "lora", None)),
            vocab_size=padded,
            max_sequence_length=m.max_positions,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=not m.untie_embeddings,
            position_embedding_type=pos_type,
            rotary_percent=m.rotary_percent,
            rotary_base=int(m.rotary_base),
            vp_stage=vp_stage,
        )
        chunk.model_type = _model_type("encoder_or_decoder")
        if chunk.post_process:
            mask_padded_vocab(chunk.output_layer, vocab_size=vocab_size)
        chunks.append(chunk)
    return chunks


def mask_padded_vocab(output_layer, *, vocab_size: int) -> None:
    """Keep the padded vocabulary rows out of the softmax: their logits become the dtype's lowest
    value. The rows exist only so the vocabulary splits evenly over TP ranks; counted as tokens,
    they would make the loss depend on the TP size (the padding grows with it) and differ from
    a converted model's Hugging Face loss."""
    def hook(module, _inputs, output):
        logits, bias = output
        width = logits.shape[-1]
        first = 0 if width == module.output_size else module.output_size_per_partition * module.tp_group.rank()
        if first + width <= vocab_size:
            return output
        ids = torch.arange(first, first + width, device=logits.device)
        return logits.masked_fill(ids >= vocab_size, torch.finfo(logits.dtype).min), bias

    output_layer.register_forward_hook(hook)


def gpt_block_spec(*, model, config, vp_stage, lora=None):
    """This chunk's layers plus a final norm of ours (Megatron's default final norm refuses SP)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (TransformerBlock, TransformerBlockSubmodules,
                                                             get_num_layers_to_build, get_transformer_layer_offset)

    from megacli.engine.layers import Norm

    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    pattern = model.moe_layers()[offset:offset + layers]
    specs = {kind: gpt_layer_spec(model=model, moe_config=config if kind else None, lora=lora) for kind in set(pattern)}
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[specs[kind] for kind in pattern], layer_norm=Norm))


def gpt_layer_spec(*, model, moe_config=None, lora=None):
    """Megatron-Core's local GPT layer with our pieces: a norm that works under sequence
    parallelism, SDPA core attention (ALiBi, ring context parallelism) and, with a lora section,
    adapters on the targeted linear layers. Checkpoint keys stay those of Megatron's TE layout
    (norms fused into the following linear's key names). With ``moe_config`` (a MoE model's
    TransformerConfig), the MLP is a mixture of experts (engine.moe)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megacli.engine.attention import CoreAttention
    from megacli.engine.inference import CachedRotarySelfAttention
    from megacli.engine.layers import Norm
    from megacli.engine.lora import linear_spec

    bias = "alibi" if model.position_embedding == "alibi" else "none"
    qk_norm = Norm if model.qk_layernorm else IdentityOp
    keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if moe_config is None:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=linear_spec(ColumnParallelLinear, "linear_fc1", lora, swiglu=model.gated),
            linear_fc2=linear_spec(RowParallelLinear, "linear_fc2", lora)))
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    else:  # a MoE layer keeps pre_mlp_layernorm under its own name, as Megatron's TE spec does
        from megacli.engine.moe import moe_mlp_spec

        mlp = moe_mlp_spec(config=moe_config)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=Norm,
            self_attention=ModuleSpec(
                module=CachedRotarySelfAttention,  # Megatron's, with a KV cache of rotated keys
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linear_spec(ColumnParallelLinear, "linear_qkv", lora),
                    core_attention=ModuleSpec(module=CoreAttention, params={"position_bias": bias}),
                    linear_proj=linear_spec(RowParallelLinear, "linear_proj", lora),
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=Norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def _model_type(name: str):
    from megatron.core.enums import ModelType

    return getattr(ModelType, name)


def unwrap(module):
    """The bare Megatron model under DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


# ---------------------------------------------------------------- initialisation by name


def _global_names(chunk) -> dict[int, str]:
    """param id -> layout-free name: global layer numbers, global expert numbers, shared output
    weight named as the embedding."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megacli.engine.moe import global_expert_name

    config = getattr(chunk, "config", None)
    experts = getattr(config, "num_moe_experts", None)
    ep_rank = ps.get_expert_model_parallel_rank() if experts else 0
    local_experts = experts // ps.get_expert_model_parallel_world_size() if experts else 0

    names: dict[int, str] = {}
    layer_prefix: dict[str, str] = {}
    for mod_name, mod in chunk.named_modules():
        if isinstance(mod, TransformerLayer):
            parent = mod_name.rsplit(".", 1)[0]
            layer_prefix[mod_name + "."] = f"{parent}.{mod.layer_number - 1}."
    for name, p in chunk.named_parameters():
        glob = name
        for local, global_ in layer_prefix.items():
            if name.startswith(local):
                glob = global_ + name[len(local):]
                break
        if getattr(p, "shared_embedding", False) or (name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False)):
            glob = "embedding.word_embeddings.weight"
        if experts:
            glob = global_expert_name(glob, ep_rank=ep_rank, local_experts=local_experts)
        names[id(p)] = glob
    return names


def _init_kind(name: str, param) -> str:
    if name.endswith(("bias", "lora_b")):  # a LoRA adapter starts as a no-op: B = 0
        return "zeros"
    if param.dim() == 1:
        return "ones"  # norm gains
    return "normal"


def init_weights(chunks, *, seed: int, std: float, num_layers: int, gated: bool, zero_centered_gamma: bool = False) -> None:
    """Draw every parameter from a generator seeded by (seed, its layout-free name), in its full
    unsharded shape, then keep this rank's shard. The same seed gives the same model under any
    TP/PP/DP/virtual-pipeline layout (Megatron's own CPU init depends on construction order).

    Output projections use Megatron's scaled init std/sqrt(2·num_layers); biases 0; norm gains 1."""
    from megatron.core import parallel_state as ps

    dense_tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    expert_tp = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    scaled_std = std / (2.0 * num_layers) ** 0.5
    for chunk in chunks:
        names = _global_names(unwrap(chunk))
        for p in unwrap(chunk).parameters():
            name = names[id(p)]
            kind = _init_kind(name, p)
            with torch.no_grad():
                if kind == "zeros":
                    p.zero_()
                    continue
                if kind == "ones":
                    p.fill_(0.0 if zero_centered_gamma else 1.0)
                    continue
                # Megatron marks routed-expert weights allreduce=False; they are split over the expert TP group.
                tp_rank, tp = dense_tp if getattr(p, "allreduce", True) else expert_tp
                full = _full_shape(p, tp)
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                sigma = scaled_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
                if name.endswith("lora_a"):
                    sigma = (3.0 * full[1]) ** -0.5  # the spread of PEFT's kaiming-uniform A
                master = torch.empty(full, dtype=torch.float32).normal_(0.0, sigma, generator=gen)
                p.copy_(_shard(master, p, tp_rank, tp, gated and name.endswith("linear_fc1.weight")).to(p.dtype))


def _full_shape(p, tp: int) -> tuple[int, ...]:
    shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False) and tp > 1:
        shape[p.partition_dim] *= tp
    return tuple(shape)


def _shard(master, p, tp_rank: int, tp: int, gated_fc1: bool):
    """This rank's slice of the unsharded tensor. The gated MLP input (SwiGLU) keeps [gate; up]
    per rank, so each rank takes its slice of the gate half and of the up half."""
    if not getattr(p, "tensor_model_parallel", False) or tp == 1:
        return master
    dim = p.partition_dim
    if gated_fc1:
        gate, up = master.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return master.chunk(tp, dim=dim)[tp_rank]
