"""The recipe sections that say what a run reads: the tokenizer, the training data (indexed files
or on-the-fly sources, validation sets) and how BERT/T5 samples are masked."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, field_validator, model_validator

from megacli.recipe.base import Section
from megacli.recipe.stream import FIMSection, StreamFields, StreamSource, check_stream_location


class TokenizerSection(Section):
    type: Literal["huggingface", "byte", "sentencepiece", "wordpiece", "none"] = "huggingface"
    """huggingface (a directory with tokenizer.json), byte (no files: 256 bytes + specials),
    sentencepiece (a .model file), wordpiece (a BERT vocab.txt), none (no tokenizer: data is ids
    already, Megatron-LM's NullTokenizer; needs model.vocab_size, which counts the ids and the
    end-of-document id after them, Megatron-LM's --vocab-size + 1). The old spelling null, which
    YAML reads as no value, still means none."""
    path: Optional[str] = None
    """Tokenizer directory or file (not needed for byte/none)."""

    @field_validator("type", mode="before")
    @classmethod
    def _old_none_spelling(cls, v):
        return "none" if v is None or v == "null" else v

    @model_validator(mode="after")
    def _needs_path(self):
        if self.type in ("huggingface", "sentencepiece", "wordpiece") and not self.path:
            raise ValueError(f"tokenizer type {self.type!r} needs tokenizer.path")
        return self


class DataSection(StreamFields):
    source: Literal["indexed", "hf", "jsonl"] = "indexed"
    """indexed (the default; null means it too): Megatron .bin/.idx files (data.path or data.blend);
    jsonl or hf: documents read and tokenized while training (files / name), packed like Megatron's
    GPTDataset without shuffling."""
    sources: Optional[list[StreamSource]] = None
    """Weighted mixture of on-the-fly sources, each {source, weight, files | name, ...}; leave data.source unset."""
    tokenizer_workers: NonNegativeInt = 1
    """On-the-fly data: processes tokenizing ahead of training (0: a background thread does it)."""
    restart_changed_sources: bool = False
    """On-the-fly data: resume although a source changed since the checkpoint (files replaced,
    truncated, appended to or reordered; sources reordered), reading each changed source from its
    first document. false: such a resume is refused, naming the source."""
    reset_position_ids: bool = False
    """Position ids restart after each end-of-document token (Megatron-LM's --reset-position-ids)."""
    reset_attention_mask: bool = False
    """Tokens attend only within their own document (Megatron-LM's --reset-attention-mask)."""
    eod_mask_loss: bool = False
    """No loss on end-of-document tokens (Megatron-LM's --eod-mask-loss)."""
    fim: Optional[FIMSection] = None
    """Fill-in-the-middle rewriting of on-the-fly samples; null = off."""
    path: Optional[str] = None
    """One Megatron indexed-dataset prefix (the path without .bin/.idx)."""
    blend: Optional[list[tuple[PositiveFloat, str]]] = None
    """Weighted mixture: a list of [weight, prefix] pairs (weights need not sum to 1)."""
    split: str = "969,30,1"
    """Train,validation,test proportions of each dataset, Megatron style."""
    cache_dir: Optional[str] = None
    """Where sample-index caches go; default <run.dir>/data_cache."""
    mock: bool = False
    """Random tokens instead of files (smoke tests, benchmarks). true wins: data.path, data.blend and
    data.valid are then not read (they may stay in the recipe, so `--set data.mock=true` is all a
    smoke run needs)."""
    valid: dict[str, str] = {}
    """Named validation sets (gpt), name -> indexed-dataset prefix (the whole dataset, in file order, cut
    into model.seq_length windows). At each evaluation every set gives val_loss/<name> and
    val_ppl/<name> beside the split-based val_loss: over train.eval_iters global batches, or the
    whole set when it holds fewer. Names are identifiers (letters, digits, _)."""

    @field_validator("source", mode="before")
    @classmethod
    def _null_source_is_indexed(cls, v):
        return "indexed" if v is None else v

    @field_validator("split")
    @classmethod
    def _split(cls, v: str) -> str:
        parts = v.replace("/", ",").split(",")
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            raise ValueError("expected comma-separated numbers like '969,30,1'") from None
        if len(nums) > 3 or any(n < 0 for n in nums) or sum(nums) <= 0:
            raise ValueError("expected up to three non-negative numbers with a positive sum")
        return v

    @field_validator("valid")
    @classmethod
    def _valid_names(cls, sets: dict[str, str]) -> dict[str, str]:
        check_set_names(sets)
        return sets

    @model_validator(mode="after")
    def _one_source(self):
        if self.on_the_fly:
            if self.sources and self.source != "indexed":
                raise ValueError("give data.source (one on-the-fly source) or data.sources (a mixture), not both")
            if self.path or self.blend or self.mock:
                raise ValueError("on-the-fly data (data.source / data.sources) reads no data.path, data.blend or data.mock")
            if self.source != "indexed":
                check_stream_location(self, self.source, where="data")
            return self
        if self.reset_attention_mask:
            raise ValueError("data.reset_attention_mask is for on-the-fly data (data.source jsonl or hf); indexed "
                             "batches carry no per-document mask")
        if self.fim is not None:
            raise ValueError("data.fim rewrites on-the-fly samples (data.source jsonl or hf); Megatron-Core 0.16.1 "
                             "has no FIM dataset for indexed data")
        if self.path and self.blend:
            raise ValueError("give data.path or data.blend, not both")
        return self

    @property
    def named(self) -> bool:
        """Whether a source is given (a training run needs one; instruction finetuning reads sft instead)."""
        return bool(self.path or self.blend or self.mock or self.on_the_fly)

    @property
    def on_the_fly(self) -> bool:
        """Documents are read and tokenized while training (not from indexed files)."""
        return self.source != "indexed" or bool(self.sources)

    def stream_sources(self) -> list[StreamSource]:
        """The on-the-fly sources as a mixture (one entry of weight 1 for data.source)."""
        if self.sources:
            return list(self.sources)
        fields = {k: getattr(self, k) for k in StreamFields.model_fields}
        return [StreamSource(source=self.source, **fields)]

    @property
    def prefixes(self) -> list[str]:
        """The indexed datasets the run reads (none with mock data)."""
        if self.mock:
            return []
        if self.path:
            return [self.path]
        return [p for _, p in self.blend or []]

    @property
    def named_valid(self) -> dict[str, str]:
        """The named validation sets the run reads (none with mock data)."""
        return {} if self.mock else dict(self.valid)


def check_set_names(sets: dict[str, str]) -> None:
    """Named validation sets: each name an identifier (it becomes part of a metric name)."""
    for name in sets:
        if not (name.isascii() and name.isidentifier()):
            raise ValueError(f"validation set name {name!r} is not an identifier (letters, digits and _, "
                             f"not starting with a digit): it becomes the metric val_loss/{name}")


class MaskingSection(Section):
    """How BERT and T5 samples are masked (Megatron-Core's masked WordPiece datasets); unused by gpt."""

    probability: float = Field(0.15, gt=0, lt=1)
    """Fraction of each sample's tokens to mask (bert: predict them; t5: replace spans by sentinels)."""
    short_sequence_probability: float = Field(0.1, ge=0, le=1)
    """Probability that a sample is cut shorter than the sequence length (BERT's short-sequence trick)."""
    max_ngram: Optional[PositiveInt] = None
    """Longest span of words masked together; default 3 for bert, 10 for t5 (as Megatron-LM)."""
    geometric_ngrams: Optional[bool] = None
    """Draw span lengths from a geometric distribution (p = 0.2, SpanBERT) instead of P(n) ∝ 1/n;
    default: t5 yes, bert no (as Megatron-LM)."""
    whole_word: bool = True
    """Mask whole words: WordPiece '##' continuations (or SentencePiece pieces without '▁') go with
    their word. Other tokenizers mark no word pieces, so each token is its own word there."""
    sentinel_tokens: PositiveInt = 100
    """t5: sentinel tokens <extra_id_0>, <extra_id_1>, ... that replace masked spans; those the
    tokenizer lacks are appended to its vocabulary (Megatron-LM's --vocab-extra-ids)."""

    def ngram(self, arch: str) -> int:
        return self.max_ngram or (10 if arch == "t5" else 3)

    def geometric(self, arch: str) -> bool:
        return self.geometric_ngrams if self.geometric_ngrams is not None else arch == "t5"

    def max_masked(self, seq_length: int, arch: str) -> int:
        """Most tokens one sample can have masked: Megatron masks at most probability × the
        sample's token budget (seq_length less [CLS]/[SEP]/[SEP] for bert, <bos>/<eos> for t5)."""
        import math

        budget = seq_length - (3 if arch == "bert" else 2)
        return max(0, math.floor(self.probability * budget + 1e-9))
