"""Megatron-LM legacy (``--ckpt-format torch``) checkpoints, read into canonical global tensors.

Layout (megatron/training/checkpointing.py):

    CKPT/latest_checkpointed_iteration.txt     "1000" (or "release")
    CKPT/iter_0001000/mp_rank_TT/model_optim_rng.pt          pipeline size 1
    CKPT/iter_0001000/mp_rank_TT_PPP/model_optim_rng.pt      pipeline size > 1

Each file is a torch.save'd dict: ``args`` (the argparse Namespace of the run),
``checkpoint_version`` (3.0), ``iteration``, ``model`` (``model0``, ``model1``, ... with virtual
pipeline stages), ``optimizer``, ``opt_param_scheduler``, ``rng_state``. Model keys are either
Megatron-Core's (``decoder.layers.N.self_attention.linear_qkv.weight``, with the norm keys of the
Transformer-Engine or the local spec) or the legacy model's nested ``language_model`` dicts
(``encoder.layers.N.self_attention.query_key_value.weight``); N counts layers within the chunk.

GPT and BERT (pretrain_bert.py) checkpoints are read; BERT is told apart by its masked-LM head
(``lm_head.*``) and its layers become ``encoder.layers.N`` (Megatron-Core's BertModel names). T5
checkpoints (a decoder with cross-attention) are refused.

Tensor-parallel shards are merged as tools/checkpoint/loader_core.py does: column-parallel
weights along dim 0 (SwiGLU's [gate; up] halves per rank), row-parallel along dim 1, the rest
taken from rank 0. Files are unpickled with megacli.checkpoint.safe_pickle's allow-list.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import torch

from megacli.checkpoint import sharding
from megacli.checkpoint.layout import iteration_dir, rank_files
from megacli.checkpoint.safe_pickle import torch_load
from megacli.errors import UserError

# Legacy-model (megatron/legacy/model) and local-spec names -> canonical (TE-style) names.
_RENAMES = [
    (r"language_model\.embedding\.(word|position|tokentype)_embeddings\.", r"embedding.\1_embeddings."),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(?:input_norm|input_layernorm)\.(weight|bias)",
     r"decoder.layers.\1.self_attention.linear_qkv.layer_norm_\2"),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.self_attention\.query_key_value\.",
     r"decoder.layers.\1.self_attention.linear_qkv."),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.self_attention\.dense\.", r"decoder.layers.\1.self_attention.linear_proj."),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(?:post_attention_norm|post_attention_layernorm)\.(weight|bias)",
     r"decoder.layers.\1.mlp.linear_fc1.layer_norm_\2"),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.mlp\.dense_h_to_4h\.", r"decoder.layers.\1.mlp.linear_fc1."),
    (r"language_model\.(?:encoder|transformer)\.layers\.(\d+)\.mlp\.dense_4h_to_h\.", r"decoder.layers.\1.mlp.linear_fc2."),
    (r"language_model\.(?:encoder|transformer)\.(?:final_norm|final_layernorm)\.", r"decoder.final_layernorm."),
    (r"language_model\.output_layer\.", r"output_layer."),
    (r"(decoder|encoder)\.layers\.(\d+)\.input_layernorm\.(weight|bias)", r"\1.layers.\2.self_attention.linear_qkv.layer_norm_\3"),
    (r"(decoder|encoder)\.layers\.(\d+)\.pre_mlp_layernorm\.(weight|bias)", r"\1.layers.\2.mlp.linear_fc1.layer_norm_\3"),
    # BERT: the legacy model's pooler and masked-LM head (its vocabulary bias, its norm named norm or layernorm).
    (r"language_model\.pooler\.", r"pooler."),
    (r"lm_head\.bias\Z", r"output_layer.bias"),
    (r"lm_head\.(?:norm|layernorm)\.", r"lm_head.layer_norm."),
]
_RENAMES = [(re.compile(a), b) for a, b in _RENAMES]
# Not weights: TE/fp8 extra state, RoPE frequency buffers, the last stage's copy of a tied embedding.
_SKIP = re.compile(r"(_extra_state$|inv_freq$|^word_embeddings_for_head\.)")

_LAYER = re.compile(r"^(?:decoder|encoder)\.layers\.(\d+)\.(.*)$")
_CROSS_ATTENTION = re.compile(r"(inter_attention|cross_attention|language_model\.decoder\.)")


# ---------------------------------------------------------------- key names


def flatten(state: dict, prefix: str = "") -> dict:
    """Nested legacy-model state dicts -> dotted keys (Megatron-Core state dicts are flat already)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def canonical_name(key: str) -> str | None:
    """Canonical (TE-style) name of a legacy or local-spec key; None for entries that are not weights."""
    if _SKIP.search(key):
        return None
    for pat, repl in _RENAMES:
        if pat.match(key):
            return pat.sub(repl, key, count=1)
    return key


# ---------------------------------------------------------------- the checkpoint


def _arg(args, name, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def model_section_from_args(args, vocab_size: int, arch: str = "gpt") -> dict:
    """The recipe ``model:`` section for a Megatron-LM run's arguments (``arch``: gpt or bert)."""
    if _arg(args, "apply_residual_connection_post_layernorm", False):
        raise UserError("apply_residual_connection_post_layernorm checkpoints are not supported (the residual "
                        "stream takes the normalised input, which megacli's layers do not express)")
    if _arg(args, "num_experts"):
        raise UserError("legacy MoE checkpoints (num_experts) are not supported")
    if _arg(args, "rotary_interleaved", False):
        raise UserError("rotary_interleaved checkpoints are not supported (megacli uses non-interleaved RoPE, as HF)")
    hidden, heads = args.hidden_size, args.num_attention_heads
    pos = _arg(args, "position_embedding_type", "learned_absolute")
    if _arg(args, "use_rotary_position_embeddings", False):
        pos = "rope"
    positions = {"learned_absolute": "learned", "rope": "rope", "none": "none"}.get(pos)
    if positions is None:
        raise UserError(f"position_embedding_type {pos!r} is not supported")
    if _arg(args, "swiglu", False):
        activation = "swiglu"
    elif _arg(args, "squared_relu", False):
        activation = "squared_relu"
    elif _arg(args, "openai_gelu", False):
        activation = "gelu_tanh"
    else:
        activation = "gelu"
    seq = _arg(args, "seq_length", 1024)
    section = dict(
        arch=arch,
        num_layers=args.num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=_arg(args, "num_query_groups", heads) if _arg(args, "group_query_attention", False) else heads,
        kv_channels=_arg(args, "kv_channels", hidden // heads),
        ffn_hidden_size=_arg(args, "ffn_hidden_size", 4 * hidden),
        seq_length=seq,
        max_position_embeddings=_arg(args, "max_position_embeddings", seq),
        position_embedding=positions,
        rotary_base=float(_arg(args, "rotary_base", 10000)),
        rotary_percent=float(_arg(args, "rotary_percent", 1.0)),
        normalization="rmsnorm" if _arg(args, "normalization", "LayerNorm") == "RMSNorm" else "layernorm",
        norm_epsilon=_arg(args, "norm_epsilon", _arg(args, "layernorm_epsilon", 1e-5)),
        activation=activation,
        add_bias_linear=_arg(args, "add_bias_linear", not _arg(args, "disable_bias_linear", False)),
        add_qkv_bias=_arg(args, "add_qkv_bias", False),
        qk_layernorm=_arg(args, "qk_layernorm", False),
        untie_embeddings=_arg(args, "untie_embeddings_and_output_weights", False),
        dropout=_arg(args, "hidden_dropout", 0.0),
        attention_dropout=_arg(args, "attention_dropout", 0.0),
        vocab_size=vocab_size,
        make_vocab_size_divisible_by=_arg(args, "make_vocab_size_divisible_by", 128),
        init_method_std=_arg(args, "init_method_std", 0.02),
    )
    if arch == "bert":  # pretrain_bert.py: token types and the pooler come with the binary head
        section.update(bert_binary_head=bool(_arg(args, "bert_binary_head", True)))
    return section


class LegacyCheckpoint:
    """A Megatron-LM legacy checkpoint as canonical global tensors, one pipeline stage's files
    (all its tensor-parallel ranks, memory-mapped) open at a time."""

    def __init__(self, path: Path, *, trust_pickle: bool = False):
        self.root = path
        self.trust_pickle = trust_pickle
        self.it_dir = iteration_dir(path)
        self.files = rank_files(self.it_dir)
        self.tp = 1 + max(t for t, _ in self.files)
        self.pp = 1 + max(p for _, p in self.files)
        first = self._load(self.files[(0, 0)])
        version = first.get("checkpoint_version", 0)
        if version < 3.0:
            raise UserError(f"{self.files[(0, 0)]}: checkpoint_version {version}; only version 3.0 (any Megatron-LM since "
                            f"2021) is supported")
        self.args = first.get("args")
        if self.args is None:
            raise UserError(f"{self.files[(0, 0)]} has no 'args' (needed to know the model)")
        self.iteration = int(first.get("iteration", 0) or 0)
        saved_tp, saved_pp = _arg(self.args, "tensor_model_parallel_size", 1), _arg(self.args, "pipeline_model_parallel_size", 1)
        if (saved_tp, saved_pp) != (self.tp, self.pp):
            raise UserError(f"{self.it_dir}: args say TP={saved_tp} PP={saved_pp} but the directory holds TP={self.tp} "
                            f"PP={self.pp} rank files")
        if _arg(self.args, "decoder_first_pipeline_num_layers") or _arg(self.args, "decoder_last_pipeline_num_layers"):
            raise UserError("uneven pipeline stages (decoder_first/last_pipeline_num_layers) are not supported")
        self.vp = len([k for k in first if re.fullmatch(r"model\d+", k)]) or 1
        self.num_layers = self.args.num_layers
        if self.num_layers % (self.pp * self.vp):
            raise UserError(f"num_layers = {self.num_layers} is not divisible by PP × VPP = {self.pp * self.vp}")
        self.arch = self._arch(first)
        self.untied = bool(_arg(self.args, "untie_embeddings_and_output_weights", False))
        self.swiglu = bool(_arg(self.args, "swiglu", False))
        self._stage: tuple[int, dict[str, list[torch.Tensor]]] | None = None
        self._first = first

    def _load(self, f: Path) -> dict:
        return torch_load(f, trust=self.trust_pickle, name=f, mmap=True)

    def _arch(self, first: dict) -> str:
        """gpt or bert, from the first and last stage's keys: BERT has a masked-LM head (lm_head.*)
        on its last stage; T5 (refused) has a decoder with cross-attention beside an encoder."""
        last = first if self.pp == 1 else self._load(self.files[(0, self.pp - 1)])
        keys = [k for state in (first, last) for name in state if name == "model" or re.fullmatch(r"model\d+", name)
                for k in flatten(state[name])]
        stacks = {k.split(".", 1)[0] for k in keys if re.match(r"(encoder|decoder)\.layers\.", k)}
        if any(_CROSS_ATTENTION.search(k) for k in keys) or stacks == {"encoder", "decoder"}:
            raise UserError(f"{self.it_dir}: an encoder-decoder (T5) checkpoint; Megatron-LM legacy T5 checkpoints are "
                            f"not supported (GPT and BERT are)")
        return "bert" if any(k.startswith("lm_head.") for k in keys) else "gpt"

    @property
    def _stack(self) -> str:
        """The canonical name of the layer stack: Megatron-Core's BertModel calls it encoder."""
        return "encoder" if self.arch == "bert" else "decoder"

    # --- what the model is

    def padded_vocab_rows(self) -> int:
        emb = self._stage_tensors(0).get("embedding.word_embeddings.weight")
        if emb is None:
            raise UserError(f"{self.files[(0, 0)]}: no word embeddings in the first pipeline stage")
        return sum(t.shape[0] for t in emb)

    def vocab_size(self) -> int:
        """The real vocabulary: args.vocab_size, else the tokenizer's, else the padded rows."""
        given = _arg(self.args, "vocab_size")
        if given:
            return int(given)
        from megacli.data.tokenizers import load_tokenizer

        tok = self.tokenizer_dir()
        if tok is not None:
            return load_tokenizer(type="huggingface", path=str(tok)).vocab_size
        vocab = self.wordpiece_vocab()
        if vocab is not None:  # with the [BOS]/[EOS] Megatron's WordPiece tokenizer appends
            return load_tokenizer(type="wordpiece", path=str(vocab)).vocab_size
        return self.padded_vocab_rows()

    def tokenizer_dir(self) -> Path | None:
        """The run's Hugging Face tokenizer directory, when args name one that exists here."""
        if _arg(self.args, "tokenizer_type") == "HuggingFaceTokenizer":
            p = Path(str(_arg(self.args, "tokenizer_model", "")))
            if p.is_dir() and (p / "tokenizer.json").is_file():
                return p
        return None

    def wordpiece_vocab(self) -> Path | None:
        """The run's BERT WordPiece vocab.txt (tokenizer_type BertWordPiece*), when it exists here."""
        if _arg(self.args, "tokenizer_type") in ("BertWordPieceLowerCase", "BertWordPieceCase"):
            p = Path(str(_arg(self.args, "vocab_file", "")))
            if p.is_file():
                return p
        return None

    def model_section(self) -> dict:
        return model_section_from_args(self.args, self.vocab_size(), arch=self.arch)

    def dtype(self) -> torch.dtype:
        emb = self._stage_tensors(0).get("embedding.word_embeddings.weight")
        return emb[0].dtype if emb else torch.float32

    # --- tensors

    def _chunk_offset(self, pp_rank: int, vp_rank: int) -> int:
        per_chunk = self.num_layers // (self.pp * self.vp)
        return vp_rank * (self.num_layers // self.vp) + pp_rank * per_chunk

    def _stage_tensors(self, pp_rank: int) -> dict[str, list[torch.Tensor]]:
        """Canonical key (global layer numbers) -> the TP shards, for one pipeline stage."""
        if self._stage is not None and self._stage[0] == pp_rank:
            return self._stage[1]
        self._stage = None
        shards: dict[str, list[torch.Tensor]] = {}
        for tp_rank in range(self.tp):
            f = self.files[(tp_rank, pp_rank)]
            state = self._first if (tp_rank, pp_rank) == (0, 0) else self._load(f)
            chunks = [state["model"]] if "model" in state else [state[f"model{v}"] for v in range(self.vp)]
            for vp_rank, chunk in enumerate(chunks):
                offset = self._chunk_offset(pp_rank, vp_rank)
                for key, tensor in flatten(chunk).items():
                    name = canonical_name(key)
                    if name is None or not isinstance(tensor, torch.Tensor):
                        continue
                    if name.startswith("decoder.") and self.arch == "bert":  # the legacy model's encoder
                        name = "encoder." + name[len("decoder."):]
                    m = _LAYER.match(name)
                    if m:
                        name = f"{self._stack}.layers.{int(m.group(1)) + offset}.{m.group(2)}"
                    if name == "output_layer.weight" and not self.untied:
                        continue  # the last stage's copy of the tied embedding
                    shards.setdefault(name, []).append(tensor)
        for name, parts in shards.items():
            if len(parts) != self.tp:
                raise UserError(f"{self.it_dir}: {name} is in {len(parts)} of the {self.tp} tensor-parallel files of stage {pp_rank}")
        self._stage = (pp_rank, shards)
        return shards

    def _merge(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        return sharding.merge(name, parts, gated=self.swiglu)

    def groups(self, meta: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Global tensors by canonical key, merged one group at a time: per pipeline stage its
        non-layer tensors, then each of its layers. ``meta``: shapes and dtypes only."""
        found_layers = 0
        for pp_rank in range(self.pp):
            stage = self._stage_tensors(pp_rank)
            by_layer: dict[int | None, list[str]] = {}
            for name in stage:
                m = _LAYER.match(name)
                by_layer.setdefault(int(m.group(1)) if m else None, []).append(name)
            found_layers += len([k for k in by_layer if k is not None])
            order = [None] + sorted(k for k in by_layer if k is not None) if None in by_layer else sorted(by_layer)
            for layer in order:
                yield {name: self._merge(name, [p.to("meta") for p in stage[name]] if meta else stage[name])
                       for name in by_layer[layer]}
        self._stage = None
        if found_layers != self.num_layers:
            raise UserError(f"{self.it_dir}: found {found_layers} transformer layers, args say num_layers = {self.num_layers}")

    def canonical_keys(self) -> set[str]:
        """Every canonical key in the checkpoint (opens each stage's files, memory-mapped)."""
        names: set[str] = set()
        for pp_rank in range(self.pp):
            names |= set(self._stage_tensors(pp_rank))
        return names

    def get(self, name: str) -> torch.Tensor:
        """One global tensor (for the checkpoint writer, which asks in model order)."""
        m = _LAYER.match(name)
        if m:
            layer = int(m.group(1))
            per_chunk = self.num_layers // (self.pp * self.vp)
            stages = [p for p in range(self.pp) for v in range(self.vp)
                      if self._chunk_offset(p, v) <= layer < self._chunk_offset(p, v) + per_chunk]
        elif name.startswith("embedding."):
            stages = [0]
        else:
            stages = [self.pp - 1]
        parts = self._stage_tensors(stages[0]).get(name)
        if parts is None:
            raise UserError(f"{self.it_dir}: no tensor {name} in pipeline stage {stages[0]} (the args and the weights disagree?)")
        return self._merge(name, parts)

    def describe(self) -> Iterator[tuple[str, list[tuple[str, tuple, str]]]]:
        """(file, [(key, shape, dtype)]) of every rank file's model tensors, as stored."""
        for (tp_rank, pp_rank), f in sorted(self.files.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            state = self._first if (tp_rank, pp_rank) == (0, 0) else self._load(f)
            rows = []
            for chunk_key in [k for k in state if k == "model" or re.fullmatch(r"model\d+", k)]:
                for key, t in flatten(state[chunk_key]).items():
                    if isinstance(t, torch.Tensor):
                        rows.append((f"{chunk_key}.{key}", tuple(t.shape), str(t.dtype).replace("torch.", "")))
            yield str(f.relative_to(self.root)), rows

