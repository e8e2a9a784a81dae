"""BERT with pre-LN layers: MegatronBertForPreTraining (Hugging Face's port of Megatron-LM's BERT),
whose layout is Megatron-Core's BertModel: LayerNorm before attention and MLP, a final LayerNorm,
learned positions and two token types, the masked-LM head (dense, GELU, LayerNorm, decoder tied to
the word embeddings with its own bias), the pooler and the next-sentence (binary) head.

Not convertible: BertForPreTraining / BertForMaskedLM (post-LN: LayerNorm after each residual sum,
which Megatron-Core's transformer layer cannot express) and MegatronBertForMaskedLM (token-type
embeddings without the binary head, which megacli's BertModel keeps only together)."""

from __future__ import annotations

from megacli.convert.families import require
from megacli.convert.mapping import MappingTable, Rule, direct, qkv
from megacli.errors import UserError

ARCHITECTURES = ("MegatronBertForPreTraining", "BertForPreTraining", "BertForMaskedLM", "MegatronBertForMaskedLM")
ARCH = "bert"

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def model_section(c: dict) -> dict:
    architecture = c["architectures"][0]
    if architecture in ("BertForPreTraining", "BertForMaskedLM"):
        raise UserError(f"{architecture} is post-LN (LayerNorm after each residual sum); Megatron-Core's BERT layers "
                        f"are pre-LN, so its weights cannot give the same outputs. MegatronBertForPreTraining (pre-LN) "
                        f"converts")
    if architecture == "MegatronBertForMaskedLM":
        raise UserError("MegatronBertForMaskedLM has token-type embeddings but no next-sentence head; megacli's BERT "
                        "has both or neither: convert the MegatronBertForPreTraining checkpoint")
    act = c.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise UserError(f"hidden_act {act!r} is not supported for {architecture}; supported: {', '.join(_ACTIVATIONS)}")
    if c.get("type_vocab_size", 2) != 2:
        raise UserError(f"type_vocab_size = {c['type_vocab_size']}: Megatron's BERT has exactly 2 token types")
    if c.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(f"position_embedding_type {c['position_embedding_type']!r}: only absolute (learned) positions convert")
    positions = require(c, "max_position_embeddings")
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
        norm_epsilon=c.get("layer_norm_eps", 1e-12),
        activation=_ACTIVATIONS[act],
        add_bias_linear=True,
        untie_embeddings=not c.get("tie_word_embeddings", True),
        vocab_size=require(c, "vocab_size"),
        init_method_std=c.get("initializer_range", 0.02),
        dropout=c.get("hidden_dropout_prob", 0.1),
        attention_dropout=c.get("attention_probs_dropout_prob", 0.1),
        bert_binary_head=True,
    )


def architecture_for(m, preferred: str | None = None) -> str | None:
    ok = (m.arch == "bert" and m.bert_binary_head and m.position_embedding == "learned" and m.normalization == "layernorm"
          and m.activation in _HF_ACTIVATION and m.add_bias_linear and m.query_groups == m.num_attention_heads
          and m.head_dim * m.num_attention_heads == m.hidden_size and not m.untie_embeddings)
    return "MegatronBertForPreTraining" if ok else None


def hf_config(m, *, architecture: str, vocab_size: int, base: dict | None) -> dict:
    base = dict(base or {})
    act = base.get("hidden_act")
    derived = {
        "architectures": [architecture],
        "model_type": "megatron-bert",
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


def table(m) -> MappingTable:
    L, H = "encoder.layers.*.", "bert.encoder.layer.*."
    heads = m.num_attention_heads
    attn = H + "attention."
    rules = [
        Rule("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight", *direct()),
        Rule("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight", *direct()),
        Rule("embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight", *direct()),
        Rule(L + "self_attention.linear_qkv.layer_norm_weight", attn + "ln.weight", *direct()),
        Rule(L + "self_attention.linear_qkv.layer_norm_bias", attn + "ln.bias", *direct()),
        Rule(L + "self_attention.linear_qkv.weight",
             (attn + "self.query.weight", attn + "self.key.weight", attn + "self.value.weight"), *qkv(groups=heads, heads=heads)),
        Rule(L + "self_attention.linear_qkv.bias",
             (attn + "self.query.bias", attn + "self.key.bias", attn + "self.value.bias"), *qkv(groups=heads, heads=heads)),
        Rule(L + "self_attention.linear_proj.weight", attn + "output.dense.weight", *direct()),
        Rule(L + "self_attention.linear_proj.bias", attn + "output.dense.bias", *direct()),
        Rule(L + "mlp.linear_fc1.layer_norm_weight", H + "ln.weight", *direct()),
        Rule(L + "mlp.linear_fc1.layer_norm_bias", H + "ln.bias", *direct()),
        Rule(L + "mlp.linear_fc1.weight", H + "intermediate.dense.weight", *direct()),
        Rule(L + "mlp.linear_fc1.bias", H + "intermediate.dense.bias", *direct()),
        Rule(L + "mlp.linear_fc2.weight", H + "output.dense.weight", *direct()),
        Rule(L + "mlp.linear_fc2.bias", H + "output.dense.bias", *direct()),
        Rule("encoder.final_layernorm.weight", "bert.encoder.ln.weight", *direct()),
        Rule("encoder.final_layernorm.bias", "bert.encoder.ln.bias", *direct()),
        Rule("lm_head.dense.weight", "cls.predictions.transform.dense.weight", *direct()),
        Rule("lm_head.dense.bias", "cls.predictions.transform.dense.bias", *direct()),
        Rule("lm_head.layer_norm.weight", "cls.predictions.transform.LayerNorm.weight", *direct()),
        Rule("lm_head.layer_norm.bias", "cls.predictions.transform.LayerNorm.bias", *direct()),
        Rule("output_layer.bias", "cls.predictions.bias", *direct()),
        Rule("pooler.dense.weight", "bert.pooler.dense.weight", *direct()),
        Rule("pooler.dense.bias", "bert.pooler.dense.bias", *direct()),
        Rule("binary_head.weight", "cls.seq_relationship.weight", *direct()),
        Rule("binary_head.bias", "cls.seq_relationship.bias", *direct()),
    ]
    # The decoder is the word embedding (tied) and its bias the head's bias: copies some checkpoints store.
    drop = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "bert.embeddings.position_ids")
    return MappingTable(rules, drop=drop)
