"""Multi-latent attention (DeepSeek-V2/V3, model.mla) for the GPT layer spec: Megatron-Core's
``MLASelfAttention`` with our core attention and norms, and its RoPE computed as Hugging Face does.

Megatron's MLA builds its own rotary embedding from the config (plain RoPE, or its YaRN module,
whose ramp and attention factor follow other conventions than Hugging Face's for some settings).
Here every layer's rotary embedding is replaced by one holding the recipe's inverse frequencies
(``rope.inverse_frequencies`` over the rotated dimensions) and Hugging Face's attention factor on
cos and sin. The config says ``rope_type="yarn"`` so that MLA takes that factor from the rotary
embedding (its plain-RoPE path has none). The softmax scale is Megatron's, which is DeepSeek's:
1/sqrt(qk_head_dim + qk_pos_emb_head_dim) times (0.1 mscale_all_dim ln factor + 1)^2 under yarn.

Checkpoint keys follow Megatron's Transformer Engine spec: the query and key/value latent norms are
fused into the up-projections there (``linear_q_up_proj.layer_norm_weight``,
``linear_kv_up_proj.layer_norm_weight``); the input norm keeps its own key.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import RotaryEmbedding
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megacli.engine.models import rope

KEYS_MAP = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
            "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}


def config_kwargs(*, model) -> dict:
    """MLATransformerConfig arguments for ``model.mla`` (empty without it)."""
    mla = model.mla
    if mla is None:
        return {}
    s = model.rope_scaling
    yarn = s is not None and s.type == "yarn"
    return dict(
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_head_dim,
        qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim,
        v_head_dim=mla.v_head_dim,
        kv_channels=mla.qk_head_dim + mla.qk_pos_emb_head_dim,
        softmax_scale=None,
        rope_type="yarn",
        rotary_base=float(model.rotary_base),
        rotary_percent=1.0,
        # These two set MLA's softmax scale (mscale_all_dim 0: factor 1, as HF without it).
        rotary_scaling_factor=float(s.factor) if yarn else 1.0,
        mscale_all_dim=float(s.mscale_all_dim or 0.0) if yarn else 0.0,
        original_max_position_embeddings=(s.original_max_positions if yarn and s.original_max_positions
                                          else model.max_positions),
    )


def _no_absent_te() -> None:
    """Without Transformer Engine, Megatron-Core 0.16.1's MLA module still imports placeholders for
    its TE classes, takes TE for present and calls isinstance() with a placeholder; tell it."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def attention_spec(*, model, lora=None):
    """ModuleSpec of a layer's multi-latent self-attention."""
    _no_absent_te()
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megacli.engine.models.attention import CoreAttention
    from megacli.engine.models.layers import Norm
    from megacli.engine.models.lora import linear_spec

    # MLA checks the class of its down-projections, so those stay plain (no LoRA adapters).
    return ModuleSpec(
        module=RecipeRopeMLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "inv_freq": rope.inverse_frequencies(model=model),
                "rope_factor": rope.attention_factor(model.rope_scaling)},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=CoreAttention,
            linear_proj=linear_spec(RowParallelLinear, "linear_proj", lora),
            q_layernorm=Norm,
            kv_layernorm=Norm,
        ),
    )


class RecipeRotary(RotaryEmbedding):
    """Megatron's RotaryEmbedding with given inverse frequencies; its forward returns
    (frequencies, factor on cos and sin), as MLA's yarn path expects."""

    def __init__(self, dim: int, *, inv_freq: torch.Tensor, factor: float, cp_group):
        super().__init__(dim, rotary_percent=1.0, cp_group=cp_group)
        self.inv_freq = inv_freq.clone().to(self.inv_freq.device)
        self.factor = factor

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        return super().forward(max_seq_len, offset, packed_seq, cp_group), self.factor


class RecipeRopeMLASelfAttention(MLASelfAttention):
    """Megatron-Core's MLASelfAttention whose rotary embedding is the recipe's (see the module doc)."""

    def _resolve_qk_norm_config(self, submodules) -> dict:
        """The spec's projections and latent norms as they are (Megatron-Core 0.19 asks this): the
        compressed keys' and values' norm always, the compressed query's with a q_lora_rank, no
        norm fused into a projection, as DeepSeek's models have them. Megatron-Core's own rule ties
        them to qk_layernorm and, without a q_lora_rank, fuses a query norm into linear_q_proj."""
        return {"linear_q_proj": submodules.linear_q_proj, "linear_q_up_proj": submodules.linear_q_up_proj,
                "linear_kv_up_proj": submodules.linear_kv_up_proj, "q_layernorm": submodules.q_layernorm,
                "kv_layernorm": submodules.kv_layernorm}

    def __init__(self, *args, inv_freq: torch.Tensor, rope_factor: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.rotary_pos_emb = RecipeRotary(self.config.qk_pos_emb_head_dim, inv_freq=inv_freq, factor=rope_factor,
                                           cp_group=self.pg_collection.cp)
