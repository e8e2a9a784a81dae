"""BERT: Hugging Face's BertForPreTraining / BertForMaskedLM (the original post-LN BERT: a LayerNorm
after the embeddings and after each residual sum, no final norm) and MegatronBertForPreTraining /
MegatronBertForMaskedLM (its port of Megatron-LM's pre-LN BERT: a LayerNorm before attention and
before the MLP, and a final one). Both become Megatron-Core's BertModel (``model.norm_position``
post or pre): learned positions, two token types, the masked-LM head (dense, activation,
LayerNorm, decoder tied to the word embeddings with its own bias). *ForPreTraining adds the pooler
and the next-sentence (binary) head; *ForMaskedLM has neither (a pretraining checkpoint's pooler
and NSP weights are ignored on import, as Hugging Face ignores them)."""

from __future__ import annotations

import re

from megacli.convert.families import require
from megacli.convert.mapping import MappingTable, Rule, direct, qkv
from megacli.errors import UserError

ARCHITECTURES = ("BertForPreTraining", "BertForMaskedLM", "MegatronBertForPreTraining", "MegatronBertForMaskedLM")
ARCH = "bert"

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def _pre_ln(architecture: str) -> bool:
    return architecture.startswith("MegatronBert")


def model_section(c: dict) -> dict:
    architecture = c["architectures"][0]
    act = c.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise UserError(f"hidden_act {act!r} is not supported for {architecture}; supported: {', '.join(_ACTIVATIONS)}")
    if c.get("type_vocab_size", 2) != 2:
        raise UserError(f"type_vocab_size = {c['type_vocab_size']}: Megatron's BERT has exactly 2 token types")
    if c.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(f"position_embedding_type {c['position_embedding_type']!r}: only absolute (learned) positions convert")
    if c.get("is_decoder") or c.get("add_cross_attention"):
        raise UserError(f"{architecture} configured as a decoder (is_decoder / add_cross_attention) does not convert")
    positions = require(c, "max_position_embeddings")
    pretraining = architecture.endswith("ForPreTraining")
    return dict(
        arch="bert",
        num_layers=require(c, "num_hidden_layers"),
        hidden_size=require(c, "hidden_size"),
        num_attention_heads=require(c, "num_attention_heads"),
        ffn_hidden_size=require(c, "intermediate_size"),
        seq_length=positions,
        max_position_embeddings=positions,
        position_embedding="learned",
        normalization="layernorm",
        norm_position="pre" if _pre_ln(architecture) else "post",
        norm_epsilon=c.get("layer_norm_eps", 1e-12),
        activation=_ACTIVATIONS[act],
        add_bias_linear=True,
        untie_embeddings=not c.get("tie_word_embeddings", True),
        vocab_size=require(c, "vocab_size"),
        init_method_std=c.get("initializer_range", 0.02),
        dropout=c.get("hidden_dropout_prob", 0.1),
        attention_dropout=c.get("attention_probs_dropout_prob", 0.1),
        bert_binary_head=pretraining,
        bert_token_types=2,
    )


def architecture_for(m, preferred: str | None = None) -> str | None:
    if m.arch != "bert":
        return None
    ok = (m.position_embedding == "learned" and m.normalization == "layernorm" and m.activation in _HF_ACTIVATION
          and m.add_bias_linear and m.query_groups == m.num_attention_heads
          and m.head_dim * m.num_attention_heads == m.hidden_size and not m.untie_embeddings)
    if not ok:
        return None
    if m.token_types != 2:
        raise UserError("this BERT has no token-type embeddings (model.bert_binary_head: false without "
                        "model.bert_token_types: 2); every Hugging Face BERT class has them, so it does not export. "
                        "Pretrain with model.bert_token_types: 2 to get a BertForMaskedLM-style model")
    prefix = "MegatronBert" if m.norm_position == "pre" else "Bert"
    return prefix + ("ForPreTraining" if m.bert_binary_head else "ForMaskedLM")


def hf_config(m, *, architecture: str, vocab_size: int, base: dict | None) -> dict:
    base = dict(base or {})
    act = base.get("hidden_act")
    derived = {
        "architectures": [architecture],
        "model_type": "megatron-bert" if _pre_ln(architecture) else "bert",
        "vocab_size": vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "intermediate_size": m.ffn_size,
        "hidden_act": act if _ACTIVATIONS.get(act) == m.activation else _HF_ACTIVATION[m.activation],
        "hidden_dropout_prob": m.dropout,
        "attention_probs_dropout_prob": m.attention_dropout,
        "max_position_embeddings": m.max_positions,
        "type_vocab_size": 2,
        "initializer_range": m.init_method_std,
        "layer_norm_eps": m.norm_epsilon,
        "tie_word_embeddings": True,
    }
    return {**base, **derived}


def _normalize(key: str) -> str:
    """Checkpoints saved by the original BERT code (bert-base-uncased's among them) name LayerNorm
    parameters gamma and beta; Hugging Face renames them on load, and so does this."""
    return re.sub(r"LayerNorm\.gamma\Z", "LayerNorm.weight", re.sub(r"LayerNorm\.beta\Z", "LayerNorm.bias", key))


def _norm(megatron: str, hf: str) -> list[Rule]:
    return [Rule(f"{megatron}weight", f"{hf}weight", *direct()), Rule(f"{megatron}bias", f"{hf}bias", *direct())]


def table(m) -> MappingTable:
    L, H = "encoder.layers.*.", "bert.encoder.layer.*."
    heads = m.num_attention_heads
    attn = H + "attention."
    if m.norm_position == "pre":
        norms = [*_norm(L + "self_attention.linear_qkv.layer_norm_", attn + "ln."),
                 *_norm(L + "mlp.linear_fc1.layer_norm_", H + "ln."),
                 *_norm("encoder.final_layernorm.", "bert.encoder.ln.")]
    else:
        norms = [*_norm("embedding.layernorm.", "bert.embeddings.LayerNorm."),
                 *_norm(L + "self_attn_bda.norm.", attn + "output.LayerNorm."),
                 *_norm(L + "mlp_bda.norm.", H + "output.LayerNorm.")]
    rules = [
        Rule("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight", *direct()),
        Rule("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight", *direct()),
        Rule("embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight", *direct()),
        *norms,
        Rule(L + "self_attention.linear_qkv.weight",
             (attn + "self.query.weight", attn + "self.key.weight", attn + "self.value.weight"), *qkv(groups=heads, heads=heads)),
        Rule(L + "self_attention.linear_qkv.bias",
             (attn + "self.query.bias", attn + "self.key.bias", attn + "self.value.bias"), *qkv(groups=heads, heads=heads)),
        Rule(L + "self_attention.linear_proj.weight", attn + "output.dense.weight", *direct()),
        Rule(L + "self_attention.linear_proj.bias", attn + "output.dense.bias", *direct()),
        Rule(L + "mlp.linear_fc1.weight", H + "intermediate.dense.weight", *direct()),
        Rule(L + "mlp.linear_fc1.bias", H + "intermediate.dense.bias", *direct()),
        Rule(L + "mlp.linear_fc2.weight", H + "output.dense.weight", *direct()),
        Rule(L + "mlp.linear_fc2.bias", H + "output.dense.bias", *direct()),
        Rule("lm_head.dense.weight", "cls.predictions.transform.dense.weight", *direct()),
        Rule("lm_head.dense.bias", "cls.predictions.transform.dense.bias", *direct()),
        *_norm("lm_head.layer_norm.", "cls.predictions.transform.LayerNorm."),
        Rule("output_layer.bias", "cls.predictions.bias", *direct()),
        Rule("pooler.dense.weight", "bert.pooler.dense.weight", *direct()),
        Rule("pooler.dense.bias", "bert.pooler.dense.bias", *direct()),
        Rule("binary_head.weight", "cls.seq_relationship.weight", *direct()),
        Rule("binary_head.bias", "cls.seq_relationship.bias", *direct()),
    ]
    # The decoder is the word embedding (tied) and its bias the head's bias: copies some checkpoints store.
    drop = ["cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "bert.embeddings.position_ids",
            "bert.embeddings.token_type_ids"]
    if not m.bert_binary_head:  # a masked-LM model ignores a pretraining checkpoint's pooler and NSP head
        drop += ["bert.pooler.dense.weight", "bert.pooler.dense.bias", "cls.seq_relationship.weight",
                 "cls.seq_relationship.bias"]
    return MappingTable(rules, drop=tuple(drop), normalize_hf=_normalize)
