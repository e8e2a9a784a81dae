"""GPT on Megatron-Core: its layer spec (our norm, core attention, KV cache, LoRA, MoE) and builder."""

from __future__ import annotations

from megacli.checkpoint.megatron_lm.keys import fused_prefix
from megacli.engine.models import rope
from megacli.engine.models.common import POSITION_TYPES, build_chunks, mask_padded_vocab


def build_gpt(*, recipe, config, padded_vocab: int, vocab_size: int) -> list:
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel

    from megacli.engine.core_compat import quiet_gpt_model_deprecation

    quiet_gpt_model_deprecation()
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
        if chunk.pre_process and m.scale_embeddings:
            scale_embeddings(chunk.embedding.word_embeddings, factor=m.hidden_size ** 0.5)
        if chunk.post_process:
            if m.final_logit_softcap is not None:  # before the padded rows are masked to the lowest value
                softcap_logits(chunk.output_layer, cap=m.final_logit_softcap)
            if not m.padded_vocab_in_loss:
                mask_padded_vocab(chunk.output_layer, vocab_size=vocab_size)
        return chunk

    return build_chunks(build_chunk, virtual_pipeline=recipe.parallel.virtual_pipeline)


def scale_embeddings(embedding, *, factor: float) -> None:
    """Multiply the word embeddings by ``factor`` rounded to their dtype first (Gemma's
    sqrt(hidden_size), as Hugging Face's scaled word embedding does)."""
    import torch

    def hook(_module, _inputs, output):
        return output * torch.tensor(factor, dtype=output.dtype, device=output.device)

    embedding.register_forward_hook(hook)


def softcap_logits(output_layer, *, cap: float) -> None:
    """Output logits soft-capped to cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping)."""
    import torch

    def hook(_module, _inputs, output):
        logits, bias = output
        return torch.tanh(logits / cap) * cap, bias

    output_layer.register_forward_hook(hook)


def gpt_block_spec(*, model, config, vp_stage, lora=None):
    """This chunk's layers plus a final norm of ours (Megatron's default final norm refuses SP)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (TransformerBlock, TransformerBlockSubmodules,
                                                             get_num_layers_to_build, get_transformer_layer_offset)

    from megacli.engine.models.layers import Norm

    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    pattern = model.moe_layers()[offset:offset + layers]
    specs = {kind: gpt_layer_spec(model=model, config=config, moe=bool(kind), lora=lora) for kind in set(pattern)}
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[specs[kind] for kind in pattern], layer_norm=Norm))


def gpt_layer_spec(*, model, config, moe: bool = False, lora=None):
    """Megatron-Core's local GPT layer with our pieces: a norm that works under sequence
    parallelism, SDPA core attention (ALiBi, sliding window from ``config.window_size`` per layer
    number, soft-cap, ring context parallelism) and, with a lora section, adapters on the targeted
    linear layers. Checkpoint keys stay those of Megatron's TE layout (norms fused into the
    following linear's key names). With ``moe``, the MLP is a mixture of experts (models.moe).
    ``model.norm_placement`` output / sandwich puts OutputNormAdd (models.layers) in the residual
    steps (without / with the norms before the sublayers); ``model.qk_norm_scope: projection`` makes
    the q/k norms ProjectionNorms; ``model.mla`` is multi-latent attention (models.mla)."""
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
    from megacli.engine.models.layers import Norm, OutputNormAdd, ProjectionNorm
    from megacli.engine.models.lora import linear_spec

    bias = "alibi" if model.position_embedding == "alibi" else "none"
    q_norm = k_norm = Norm if model.qk_layernorm else IdentityOp
    if model.qk_layernorm and model.qk_norm_scope == "projection":
        q_norm = ModuleSpec(module=ProjectionNorm, params={"heads": model.num_attention_heads})
        k_norm = ModuleSpec(module=ProjectionNorm, params={"heads": model.query_groups})
    pre_norm, residual = Norm, get_bias_dropout_add
    if model.norm_placement != "pre":
        residual = ModuleSpec(module=OutputNormAdd, params={"config": config})
        if model.norm_placement == "output":
            pre_norm = IdentityOp
    if model.mla is None:
        keys_map = {"input_layernorm.": fused_prefix("input_layernorm")}
        self_attention = ModuleSpec(
            module=CachedRotarySelfAttention,  # Megatron's, with a KV cache of rotated keys
            params={"attn_mask_type": AttnMaskType.causal, "local_rope": model.rotary_base_local is not None},
            submodules=SelfAttentionSubmodules(
                linear_qkv=linear_spec(ColumnParallelLinear, "linear_qkv", lora),
                core_attention=ModuleSpec(module=CoreAttention, params={"position_bias": bias,
                                                                        "softcap": model.attention_softcap}),
                linear_proj=linear_spec(RowParallelLinear, "linear_proj", lora),
                q_layernorm=q_norm,
                k_layernorm=k_norm,
            ),
        )
    else:  # multi-latent attention: its input norm is not fused into a linear layer (its keys: mla.KEYS_MAP)
        from megacli.engine.models import mla

        keys_map = dict(mla.KEYS_MAP)
        self_attention = mla.attention_spec(model=model, lora=lora)
    if not moe:
        mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=linear_spec(ColumnParallelLinear, "linear_fc1", lora, swiglu=model.gated),
            linear_fc2=linear_spec(RowParallelLinear, "linear_fc2", lora)))
        keys_map["pre_mlp_layernorm."] = fused_prefix("pre_mlp_layernorm")
    else:  # a MoE layer keeps pre_mlp_layernorm under its own name, as Megatron's TE spec does
        from megacli.engine.models.moe import moe_mlp_spec

        mlp = moe_mlp_spec(config=config)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=pre_norm,
            self_attention=self_attention,
            self_attn_bda=residual,
            pre_mlp_layernorm=pre_norm,
            mlp=mlp,
            mlp_bda=residual,
            sharded_state_dict_keys_map=keys_map,
        ),
    )
