"""T5 on Megatron-Core: ``T5Model`` (encoder and decoder blocks, decoder layers with cross-attention;
learned, RoPE or T5 relative position biases) with our norm and core attention. Encoder
self-attention and cross-attention take the encoder padding mask [b, 1, 1, s_enc]; decoder
self-attention is causal.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.T5 import T5Model as _MegatronT5Model
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import TransformerBlock

from megacli.engine.models.common import POSITION_TYPES, mask_padded_vocab
from megacli.engine.models.layers import block_spec, layer_spec


class _BiasGradient(torch.autograd.Function):
    """Identity on a block's input hidden states that, in backward, also hands ``bias`` the gradient
    collected on ``leaf`` (its detached copy that the block's layers used). The block's input is
    the last thing its backward reaches, so by then every layer has added its share to leaf.grad."""

    @staticmethod
    def forward(ctx, hidden, bias, leaf):
        ctx.leaf = leaf
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        leaf, ctx.leaf = ctx.leaf, None
        bias_grad, leaf.grad = leaf.grad, None
        return grad, bias_grad, None


class _RecomputableBiasBlock(TransformerBlock):
    """A TransformerBlock whose attention bias survives activation recompute. Megatron-Core's
    recompute (full: TransformerBlock._checkpointed_forward; selective: the attention's
    _checkpointed_attention_forward) closes over ``attention_bias`` instead of passing it as a
    checkpoint input, so every checkpoint's backward walks back into the bias's graph - the T5
    relative position embedding shared by all layers - and the second one fails ("backward through
    the graph a second time"). Here the layers get a detached leaf copy; its gradient, summed over
    the layers, flows into the bias graph once (see _BiasGradient)."""

    def forward(self, hidden_states, *args, attention_bias=None, **kwargs):
        if (attention_bias is None or not attention_bias.requires_grad or hidden_states is None
                or not self.training or self.config.recompute_granularity is None):
            return super().forward(hidden_states, *args, attention_bias=attention_bias, **kwargs)
        leaf = attention_bias.detach().requires_grad_()
        hidden_states = _BiasGradient.apply(hidden_states, attention_bias, leaf)
        return super().forward(hidden_states, *args, attention_bias=leaf, **kwargs)


class T5Model(_MegatronT5Model):
    """Megatron-Core's T5Model whose relative position biases work with activation recompute
    (see _RecomputableBiasBlock)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for block in (self.encoder, self.decoder):
            if block is not None and self.position_embedding_type == "relative":
                block.__class__ = _RecomputableBiasBlock  # T5Model builds plain TransformerBlocks itself

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """Megatron's, with the LM head also stored as lm_head.output_layer (the module output_layer
        aliases) following the vocabulary padding as output_layer does: a checkpoint then loads at
        any TP size."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in ("weight", "bias"):
            entry = state.get(f"{prefix}lm_head.output_layer.{name}")
            if entry is not None and hasattr(entry, "allow_shape_mismatch"):
                entry.allow_shape_mismatch = True
        return state


def build_t5(*, recipe, config, padded_vocab: int, vocab_size: int) -> list:
    """One chunk: encoder and decoder on every rank (Megatron-Core 0.16.1 has no T5 pipelining; the
    recipe refuses parallel.pipeline > 1). ``config`` is the decoder's (num_layers = decoder
    layers); the encoder gets a copy with the encoder's layer count, as Megatron-LM builds it."""
    m = recipe.model
    encoder_config = copy.deepcopy(config)
    encoder_config.num_layers = m.num_layers
    encoder = block_spec(layer_spec(model=m, self_attn_mask=AttnMaskType.padding, cross_attention=False), m.num_layers)
    decoder = block_spec(layer_spec(model=m, self_attn_mask=AttnMaskType.causal, cross_attention=True), config.num_layers)
    model = T5Model(
        config=config,
        encoder_config=encoder_config,
        transformer_encoder_layer_spec=encoder,
        transformer_decoder_layer_spec=decoder,
        vocab_size=padded_vocab,
        max_sequence_length=m.max_positions,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=not m.untie_embeddings,
        position_embedding_type=POSITION_TYPES[m.position_embedding],
        rotary_percent=m.rotary_percent,
        add_encoder=True,
        add_decoder=True,
    )
    mask_padded_vocab(model.lm_head.output_layer, vocab_size=vocab_size)
    if m.scale_decoder_output:
        scale = m.hidden_size ** -0.5
        model.lm_head.register_forward_pre_hook(lambda _module, args: (args[0] * scale, *args[1:]))
    return [model]
