"""BERT on Megatron-Core: ``BertModel`` (pre- or post-LN layers, masked-LM head, optional pooler +
sentence-order binary head, token types) with our norm and core attention. Its self-attention
takes a padding mask [b, 1, 1, s] (True = pad).
"""

from __future__ import annotations

import contextlib

from megatron.core.models.bert.bert_model import BertModel as _MegatronBertModel
from megatron.core.transformer.enums import AttnMaskType

from megacli.engine.models.common import POSITION_TYPES, build_chunks, mask_padded_vocab
from megacli.engine.models.layers import Norm, block_spec, layer_spec


class BertModel(_MegatronBertModel):
    """Megatron-Core's BertModel with our core attention: padding masks are [b, 1, 1, s]."""

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        # Megatron picks the mask layout from the spec's attention class and the TE version; it
        # reads a layer spec, ours is a block spec. CoreAttention broadcasts [b, 1, 1, s] over
        # queries, so no query row is ever fully masked (padded positions still see the sample).
        return "b11s"


@contextlib.contextmanager
def _bert_lm_head_norm():
    """BertLMHead builds its norm from its module's ``LNImpl`` (Apex, else torch's LayerNorm,
    which refuses sequence parallelism); build it with ours, whose parameters carry the
    ``sequence_parallel`` flag so their gradients are all-reduced over TP under SP."""
    from megatron.core.models.bert import bert_lm_head

    saved = bert_lm_head.LNImpl
    bert_lm_head.LNImpl = Norm
    try:
        yield
    finally:
        bert_lm_head.LNImpl = saved


def _norm_embeddings(embedding, config) -> None:
    """Post-LN BERT normalises the summed embeddings before their dropout: a norm stored as
    ``embedding.layernorm.*``, applied on the way into the embedding's dropout (after the
    sequence-parallel scatter, inside its RNG fork)."""
    embedding.layernorm = Norm(config, config.hidden_size, eps=config.layernorm_epsilon)
    embedding.embedding_dropout.register_forward_pre_hook(lambda _module, args: (embedding.layernorm(args[0]),))


def build_bert(*, recipe, config, padded_vocab: int, vocab_size: int) -> list:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    m = recipe.model
    post = m.norm_position == "post"
    layer = layer_spec(model=m, self_attn_mask=AttnMaskType.padding, cross_attention=False, config=config)

    def build_chunk(*, vp_stage, pre_process: bool, post_process: bool):
        with _bert_lm_head_norm():
            chunk = BertModel(
                config=config,
                num_tokentypes=m.token_types,
                transformer_layer_spec=block_spec(layer, get_num_layers_to_build(config, vp_stage=vp_stage),
                                                  final_norm=not post),
                vocab_size=padded_vocab,
                max_sequence_length=m.max_positions,
                pre_process=pre_process,
                post_process=post_process,
                parallel_output=True,
                share_embeddings_and_output_weights=not m.untie_embeddings,
                position_embedding_type=POSITION_TYPES[m.position_embedding],
                rotary_percent=m.rotary_percent,
                add_binary_head=m.bert_binary_head,
                vp_stage=vp_stage,
            )
        if chunk.post_process and not m.padded_vocab_in_loss:
            mask_padded_vocab(chunk.output_layer, vocab_size=vocab_size)
        if chunk.post_process:
            if not config.gated_linear_unit:  # Megatron's head hard-codes exact GELU; HF's uses the model's activation
                chunk.lm_head.gelu = config.activation_func
        if post and chunk.pre_process:
            _norm_embeddings(chunk.embedding, config)
        return chunk

    return build_chunks(build_chunk, virtual_pipeline=recipe.parallel.virtual_pipeline)
