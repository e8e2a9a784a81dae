"""BERT and T5 on Megatron-Core: layer specs with our norm and core attention, and the model builders.

Imported only by workers (it imports Megatron); it does no work at import. ``models.build_model``
dispatches here for ``model.arch: bert`` and ``t5``.

* BERT: Megatron-Core's ``BertModel`` (pre-LN layers, masked-LM head, optional pooler + sentence-order
  binary head, token types). Its self-attention takes a padding mask [b, 1, 1, s] (True = pad).
* T5: Megatron-Core's ``T5Model`` (encoder and decoder blocks, decoder layers with cross-attention;
  learned, RoPE or T5 relative position biases). Encoder self-attention and cross-attention take the
  encoder padding mask [b, 1, 1, s_enc]; decoder self-attention is causal.

Where Megatron's local specs use torch's LayerNorm (which refuses sequence parallelism) and
``DotProductAttention``, these use ``layers.Norm`` and ``attention.CoreAttention``.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.bert.bert_model import BertModel as _MegatronBertModel
from megatron.core.models.T5 import T5Model as _MegatronT5Model
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules, SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megacli.engine.attention import CoreAttention
from megacli.engine.layers import Norm
from megacli.engine.models import mask_padded_vocab

POSITION_TYPES = {"learned": "learned_absolute", "rope": "rope", "relative": "relative"}


class PostNormAdd(torch.nn.Module):
    """The residual step of a post-LN layer, norm(residual + dropout(output + bias)), in the
    bias-dropout-add slot of Megatron's TransformerLayer (which calls ``bda(training, fused)`` and
    then the function it returns). Its norm is stored as ``<layer>.self_attn_bda.norm.*`` /
    ``<layer>.mlp_bda.norm.*``."""

    def __init__(self, config):
        super().__init__()
        self.norm = Norm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, training: bool, fused: bool):
        add = get_bias_dropout_add(training, fused)
        return lambda output_with_bias, residual, prob: self.norm(add(output_with_bias, residual, prob))


def layer_spec(*, model, self_attn_mask: AttnMaskType, cross_attention: bool, config=None) -> ModuleSpec:
    """A transformer layer: self-attention, optionally cross-attention (T5 decoder), MLP. Pre-LN,
    or post-LN for ``model.norm_position: post`` (then ``config``, the TransformerConfig, builds
    the norms in the residual steps). Checkpoint keys are those of Megatron's local BERT/T5 specs."""
    qk_norm = Norm if model.qk_layernorm else IdentityOp
    post = model.norm_position == "post"
    residual = ModuleSpec(module=PostNormAdd, params={"config": config}) if post else get_bias_dropout_add
    cross = {}
    if cross_attention:
        cross = dict(
            pre_cross_attn_layernorm=Norm,
            cross_attention=ModuleSpec(
                module=CrossAttention,
                params={"attn_mask_type": AttnMaskType.padding},
                submodules=CrossAttentionSubmodules(linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear,
                                                    core_attention=CoreAttention, linear_proj=RowParallelLinear),
            ),
            cross_attn_bda=get_bias_dropout_add,
        )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if post else Norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": self_attn_mask},
                submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=CoreAttention,
                                                   linear_proj=RowParallelLinear, q_layernorm=qk_norm, k_layernorm=qk_norm),
            ),
            self_attn_bda=residual,
            **cross,
            pre_mlp_layernorm=IdentityOp if post else Norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=residual,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def block_spec(layer: ModuleSpec, num_layers: int, *, final_norm: bool = True) -> ModuleSpec:
    """``num_layers`` copies of ``layer`` and (unless post-LN) our final norm (Megatron's default
    one refuses SP)."""
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=Norm if final_norm else None))


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
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    m = recipe.model
    post = m.norm_position == "post"
    layer = layer_spec(model=m, self_attn_mask=AttnMaskType.padding, cross_attention=False, config=config)
    vp = recipe.parallel.virtual_pipeline
    chunks = []
    for stage in range(vp or 1):
        vp_stage = stage if vp else None
        with _bert_lm_head_norm():
            chunk = BertModel(
                config=config,
                num_tokentypes=m.token_types,
                transformer_layer_spec=block_spec(layer, get_num_layers_to_build(config, vp_stage=vp_stage),
                                                  final_norm=not post),
                vocab_size=padded_vocab,
                max_sequence_length=m.max_positions,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                parallel_output=True,
                share_embeddings_and_output_weights=not m.untie_embeddings,
                position_embedding_type=POSITION_TYPES[m.position_embedding],
                rotary_percent=m.rotary_percent,
                add_binary_head=m.bert_binary_head,
                vp_stage=vp_stage,
            )
        if chunk.post_process:
            mask_padded_vocab(chunk.output_layer, vocab_size=vocab_size)
            if not config.gated_linear_unit:  # Megatron's head hard-codes exact GELU; HF's uses the model's activation
                chunk.lm_head.gelu = config.activation_func
        if post and chunk.pre_process:
            _norm_embeddings(chunk.embedding, config)
        chunks.append(chunk)
    return chunks


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
