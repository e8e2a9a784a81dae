"""T5 (T5ForConditionalGeneration): encoder-decoder, RMSNorm without bias, relative position
biases (one table per stack, in its first layer on the HF side), no attention scaling (the query
weights carry it: ``model.softmax_scale: 1.0``), ReLU (T5) or gated tanh-GELU (T5 v1.1, flan-T5)
MLPs without biases, one embedding shared by encoder and decoder; the original T5 scales the decoder
output by d_model**-0.5 before its tied head (``model.scale_decoder_output``).

Megatron-Core's cross-attention keeps queries (``linear_q``) apart from keys and values
(``linear_kv``: per head, its key rows then its value rows). Its LM head has a bias when tied to the
embedding (HF has none: zeros in, and an export refuses a trained non-zero one); the head is also
reachable as ``output_layer``, an alias stored twice in a checkpoint."""

from __future__ import annotations

import torch

from megacli.convert.families import require
from megacli.convert.mapping import MappingTable, Rule, direct, gate_up, identity, qkv
from megacli.errors import UserError

ARCHITECTURES = ("T5ForConditionalGeneration",)
ARCH = "t5"

# "gelu" (erf) and "gated-silu" are the MLPs of a Megatron-LM T5 (its default GELU, --swiglu).
_ACTIVATIONS = {"relu": "relu", "gated-gelu": "geglu", "gelu": "gelu", "gated-silu": "swiglu"}
_HF_ACTIVATION = {v: k for k, v in _ACTIVATIONS.items()}
_BUCKETS, _MAX_DISTANCE = 32, 128  # Megatron-Core's T5Model defaults


def _scales_decoder_output(c: dict) -> bool:
    """HF T5 multiplies the decoder output by d_model**-0.5 before a tied LM head (transformers 5
    names it scale_decoder_outputs; older configs imply it by tie_word_embeddings)."""
    return bool(c.get("scale_decoder_outputs", c.get("tie_word_embeddings", True)))


def model_section(c: dict) -> dict:
    act = c.get("feed_forward_proj", "relu")
    if act not in _ACTIVATIONS:
        raise UserError(f"T5 feed_forward_proj {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    buckets = c.get("relative_attention_num_buckets", _BUCKETS)
    distance = c.get("relative_attention_max_distance", _MAX_DISTANCE)
    if (buckets, distance) != (_BUCKETS, _MAX_DISTANCE):
        raise UserError(f"relative_attention_num_buckets / max_distance = {buckets} / {distance}: Megatron-Core's T5 "
                        f"uses {_BUCKETS} / {_MAX_DISTANCE}")
    layers = require(c, "num_layers")
    return dict(
        arch="t5",
        num_layers=layers,
        decoder_num_layers=c.get("num_decoder_layers") or layers,
        hidden_size=require(c, "d_model"),
        num_attention_heads=require(c, "num_heads"),
        kv_channels=require(c, "d_kv"),
        ffn_hidden_size=require(c, "d_ff"),
        seq_length=512,
        decoder_seq_length=128,
        max_position_embeddings=512,
        position_embedding="relative",
        normalization="rmsnorm",
        norm_epsilon=c.get("layer_norm_epsilon", 1e-6),
        activation=_ACTIVATIONS[act],
        add_bias_linear=False,
        softmax_scale=1.0,
        scale_decoder_output=_scales_decoder_output(c),
        untie_embeddings=not c.get("tie_word_embeddings", True),
        vocab_size=require(c, "vocab_size"),
        dropout=c.get("dropout_rate", 0.1),
        attention_dropout=c.get("dropout_rate", 0.1),
    )


def architecture_for(m, preferred: str | None = None) -> str | None:
    ok = (m.arch == "t5" and m.position_embedding == "relative" and m.normalization == "rmsnorm"
          and m.activation in _HF_ACTIVATION and not m.add_bias_linear and not m.add_qkv_bias
          and m.softmax_scale in (1.0, None) and m.query_groups == m.num_attention_heads)
    return "T5ForConditionalGeneration" if ok else None


def hf_config(m, *, architecture: str, vocab_size: int, base: dict | None) -> dict:
    derived = {
        "architectures": [architecture],
        "model_type": "t5",
        "vocab_size": vocab_size,
        "d_model": m.hidden_size,
        "d_kv": m.head_dim,
        "d_ff": m.ffn_size,
        "num_layers": m.num_layers,
        "num_decoder_layers": m.dec_num_layers,
        "num_heads": m.num_attention_heads,
        "relative_attention_num_buckets": _BUCKETS,
        "relative_attention_max_distance": _MAX_DISTANCE,
        "dropout_rate": m.dropout,
        "layer_norm_epsilon": m.norm_epsilon,
        "feed_forward_proj": _HF_ACTIVATION[m.activation],
        "is_encoder_decoder": True,
        "tie_word_embeddings": not m.untie_embeddings,
        "scale_decoder_outputs": m.scale_decoder_output,
    }
    return {**dict(base or {}), **derived}


def _one_embedding(shared, encoder, decoder):
    if not (torch.equal(shared, encoder) and torch.equal(shared, decoder)):
        raise UserError("encoder.embed_tokens / decoder.embed_tokens differ from shared.weight: Megatron's T5 has one "
                        "input embedding for both stacks")
    return shared


def _kv(heads: int):
    """Separate key and value projections <-> Megatron's linear_kv (per head: keys, then values)."""

    def to_megatron(k, v):
        return torch.cat([k.reshape(heads, -1, *k.shape[1:]), v.reshape(heads, -1, *v.shape[1:])], dim=1).reshape(
            -1, *k.shape[1:])

    def to_hf(t):
        pairs = t.reshape(heads, 2, -1, *t.shape[1:])
        return tuple(x.reshape(-1, *t.shape[1:]).contiguous() for x in pairs.unbind(1))

    return to_megatron, to_hf


def _absent_bias(vocab: int, key: str):
    """A bias HF does not have: zeros on import; on export it must still be zero."""

    def to_hf(t):
        if not t.is_meta and t.abs().max() > 0:  # (export plans its shards on meta tensors first)
            raise UserError(f"{key} is not zero (trained): Hugging Face's T5 has no LM-head bias to hold it")
        return ()

    return (lambda: torch.zeros(vocab)), to_hf


def _query_scaled(to_megatron, to_hf, scale: float):
    """A rule whose first HF tensor is the queries: exported times ``scale`` (HF's T5 attention does
    not scale; a model with Megatron's 1/sqrt(head_dim), as Megatron-LM trains T5, carries it in
    its query weights). Imported as is (HF T5 models become ``softmax_scale: 1.0``)."""
    if scale == 1.0:
        return to_megatron, to_hf

    def scaled(t):
        out = to_hf(t)
        return (out * scale,) if isinstance(out, torch.Tensor) else (out[0] * scale, *out[1:])

    return to_megatron, scaled


def table(m) -> MappingTable:
    heads = m.num_attention_heads
    q_scale = 1.0 if m.softmax_scale == 1.0 else m.head_dim ** -0.5
    mlp = ("DenseReluDense.wi_0.weight", "DenseReluDense.wi_1.weight") if m.gated else ("DenseReluDense.wi.weight",)
    fc1 = gate_up() if m.gated else direct()
    if m.untie_embeddings:  # such checkpoints also store the encoder's and decoder's (tied) copies
        embed = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
        rules = [Rule("embedding.word_embeddings.weight", embed, _one_embedding, lambda t: (t, t.clone(), t.clone()))]
    else:
        rules = [Rule("embedding.word_embeddings.weight", "shared.weight", *direct())]
    for stack, mlp_sub in (("encoder", 1), ("decoder", 2)):
        L, H = f"{stack}.layers.*.", f"{stack}.block.*.layer."
        attn = H + "0.SelfAttention."
        rules += [
            Rule(f"{stack}_relative_pos_emb.relative_attention_bias.weight",
                 f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", *direct()),
            Rule(L + "self_attention.linear_qkv.layer_norm_weight", H + "0.layer_norm.weight", *direct()),
            Rule(L + "self_attention.linear_qkv.weight", (attn + "q.weight", attn + "k.weight", attn + "v.weight"),
                 *_query_scaled(*qkv(groups=heads, heads=heads), q_scale)),
            Rule(L + "self_attention.linear_proj.weight", attn + "o.weight", *direct()),
            Rule(L + "mlp.linear_fc1.layer_norm_weight", H + f"{mlp_sub}.layer_norm.weight", *direct()),
            Rule(L + "mlp.linear_fc1.weight", tuple(H + f"{mlp_sub}." + w for w in mlp), *fc1),
            Rule(L + "mlp.linear_fc2.weight", H + f"{mlp_sub}.DenseReluDense.wo.weight", *direct()),
            Rule(f"{stack}.final_layernorm.weight", f"{stack}.final_layer_norm.weight", *direct()),
        ]
    L, cross = "decoder.layers.*.", "decoder.block.*.layer.1."
    rules += [
        Rule(L + "pre_cross_attn_layernorm.weight", cross + "layer_norm.weight", *direct()),
        Rule(L + "cross_attention.linear_q.weight", cross + "EncDecAttention.q.weight", *_query_scaled(*direct(), q_scale)),
        Rule(L + "cross_attention.linear_kv.weight", (cross + "EncDecAttention.k.weight", cross + "EncDecAttention.v.weight"),
             *_kv(heads)),
        Rule(L + "cross_attention.linear_proj.weight", cross + "EncDecAttention.o.weight", *direct()),
    ]
    drop = [] if m.untie_embeddings else ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]
    if m.untie_embeddings:
        rules += [Rule("lm_head.output_layer.weight", "lm_head.weight", *direct()),
                  Rule("output_layer.weight", "lm_head.weight", identity, lambda t: ())]  # the same tensor again
    else:
        drop.append("lm_head.weight")
        rules += [Rule(key, (), *_absent_bias(m.vocab_size, key)) for key in ("lm_head.output_layer.bias", "output_layer.bias")]
    return MappingTable(rules, drop=tuple(drop))

