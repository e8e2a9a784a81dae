"""GPT on Megatron-Core: its layer spec (our norm, core attention, KV cache, LoRA, MoE) and builder."""

from __future__ import annotations

from megacli.engine.models import rope
from megacli.engine.models.common import POSITION_TYPES, build_chunks, mask_padded_vocab


def build_gpt(*, recipe, config, padded_vocab: int, vocab_size: int) -> list:
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel

    m = recipe.model

    def build_chunk(*, vp_stage, pre_process: bool, post_process: bool):
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=gpt_block_spec(model=m, config=config, vp_stage=vp_stage, lora=getattr(recipe, "lora", None)),
            vocab_size=padded_vocab,
            max_sequence_length=m.max_positions,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=not m.untie_embeddings,
            position_embedding_type=POSITION_TYPES.get(m.position_embedding, "none"),
            rotary_percent=m.rotary_percent,
            rotary_base=int(m.rotary_base),
            vp_stage=vp_stage,
        )
        chunk.model_type = ModelType.encoder_or_decoder
        rope.install(chunk, model=m)
        if chunk.post_process and not m.padded_vocab_in_loss:
            mask_padded_vocab(chunk.output_layer, vocab_size=vocab_size)
        return chunk

    return build_chunks(build_chunk, virtual_pipeline=recipe.parallel.virtual_pipeline)


def gpt_block_spec(*, model, config, vp_stage, lora=None):
    """This chunk's layers plus a final norm of ours (Megatron's default final norm refuses SP)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (TransformerBlock, TransformerBlockSubmodules,
                                                             get_num_layers_to_build, get_transformer_layer_offset)

    from megacli.engine.models.layers import Norm

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
    TransformerConfig), the MLP is a mixture of experts (models.moe)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megacli.engine.models.attention import CoreAttention
    from megacli.engine.models.kv_cache import CachedRotarySelfAttention
    from megacli.engine.models.layers import Norm
    from megacli.engine.models.lora import linear_spec

    bias = "alibi" if model.position_embedding == "alibi" else "none"
    qk_norm = Norm if model.qk_layernorm else IdentityOp
    keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if moe_config is None:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=linear_spec(ColumnParallelLinear, "linear_fc1", lora, swiglu=model.gated),
            linear_fc2=linear_spec(RowParallelLinear, "linear_fc2", lora)))
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    else:  # a MoE layer keeps pre_mlp_layernorm under its own name, as Megatron's TE spec does
        from megacli.engine.models.moe import moe_mlp_spec

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
