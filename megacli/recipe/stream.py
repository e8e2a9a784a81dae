"""Recipe sections of on-the-fly training data: where documents come from (jsonl files or a
Hugging Face dataset), mixture entries, and fill-in-the-middle."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, PositiveFloat, model_validator

from megacli.recipe.base import Section


class StreamFields(Section):
    """Where on-the-fly documents come from (data.source jsonl or hf, or one entry of data.sources)."""

    files: Optional[list[str]] = None
    """jsonl: JSONL files or glob patterns, read in the order given (each pattern's matches sorted)."""
    name: Optional[str] = None
    """hf: a `datasets` dataset name, a load_from_disk directory, or Arrow/Parquet/JSONL files
    (read with datasets' builder for that extension)."""
    config: Optional[str] = None
    """hf: the dataset's configuration (subset) name."""
    hf_split: str = "train"
    """hf: which split of the dataset to read."""
    streaming: bool = False
    """hf: read the dataset as a stream (nothing downloaded or cached up front)."""
    text_field: str = "text"
    """The field of each record holding the document text."""


class StreamSource(StreamFields):
    """One source of a weighted mixture (data.sources)."""

    source: Literal["hf", "jsonl"]
    """jsonl files or a Hugging Face dataset."""
    weight: PositiveFloat = 1.0
    """Share of the samples drawn from this source (weights need not sum to 1)."""

    @model_validator(mode="after")
    def _located(self):
        check_stream_location(self, self.source, where="data.sources")
        return self


def check_stream_location(fields: StreamFields, source: str, *, where: str) -> None:
    """jsonl needs files, hf needs a name; the other kind's fields must stay unset."""
    if source == "jsonl" and not fields.files:
        raise ValueError(f"{where}: source jsonl needs files (JSONL paths or globs)")
    if source == "hf" and not fields.name:
        raise ValueError(f"{where}: source hf needs name (a dataset name or a local path)")
    if source == "hf" and fields.files:
        raise ValueError(f"{where}: files is for source jsonl; hf reads name")
    if source == "jsonl" and fields.name:
        raise ValueError(f"{where}: name is for source hf; jsonl reads files")


class FIMSection(Section):
    """Fill-in-the-middle, as Megatron-LM's FIM dataset: a document (or fragment) is cut at two
    random character positions into prefix, middle and suffix and rewritten as
    <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle (PSM) or
    <fim_prefix> <fim_suffix> suffix <fim_middle> prefix middle (SPM); the sample keeps its length
    (cut at its end, or <fim_pad> padded there)."""

    rate: float = Field(0.5, ge=0, le=1)
    """Probability that a document of a sample is rewritten."""
    spm_rate: float = Field(0.5, ge=0, le=1)
    """Probability that a rewritten document uses the SPM order instead of PSM."""
    split_sample: Optional[str] = None
    """A token (e.g. a file separator) at which documents are cut into fragments, each rewritten on its own."""
    fragment_rate: float = Field(0.5, ge=0, le=1)
    """With split_sample: probability that a fragment is rewritten (once rate chose its document)."""
    no_prefix: Optional[str] = None
    """Documents (fragments) whose text starts with this string are never rewritten (Megatron-LM's fim_no_prefix)."""
    prefix_token: str = "<fim_prefix>"
    """The tokenizer's token that opens the prefix."""
    middle_token: str = "<fim_middle>"
    """The tokenizer's token that opens the middle."""
    suffix_token: str = "<fim_suffix>"
    """The tokenizer's token that opens the suffix."""
    pad_token: str = "<fim_pad>"
    """The tokenizer's token that pads a rewritten sample to its old length."""
