"""The preprocessing recipe: a corpus, how to read and tokenize it, and where the indexed
datasets go."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, PositiveFloat, PositiveInt, field_validator, model_validator

from megacli.recipe.base import RecipeError, Section
from megacli.recipe.data_sections import TokenizerSection


class PreprocessSection(Section):
    input: Union[str, list[str]]
    """Corpus file(s), directories or globs, read in the order given (globs and directories
    sorted): .jsonl/.json (optionally .gz), .txt (optionally .gz), .parquet, .arrow, or a
    Hugging Face datasets directory saved with save_to_disk."""
    input_format: Literal["auto", "jsonl", "text", "parquet", "arrow", "hf"] = "auto"
    """How to read the input; auto decides from each file's extension (or a datasets directory)."""
    split: str = "train"
    """Split to read from a datasets directory that holds several (a DatasetDict)."""
    document_per_line: bool = True
    """Plain-text input: each non-blank line is a document (true) or each file is one (false)."""
    output_prefix: str
    """Output path prefix: writes {output_prefix}_{key}_{document|sentence}.bin/.idx per json key."""
    json_keys: list[str] = ["text"]
    """Keys (or columns) whose text to tokenize; one dataset per key."""
    split_sentences: bool = False
    """Split documents into sentences with nltk Punkt (for BERT); writes *_sentence datasets."""
    keep_newlines: bool = False
    """With split_sentences: keep the newlines between sentences, as Megatron's --keep-newlines."""
    lang: str = "english"
    """Punkt model language for split_sentences."""
    append_eod: bool = False
    """Append the tokenizer's end-of-document token to every non-empty document (GPT training)."""
    add_bos: bool = False
    """Prepend the tokenizer's beginning-of-sequence token to every non-empty document."""
    workers: Optional[int] = Field(None, ge=0)
    """Tokenizing worker processes; null = all cores, 0 = tokenize in the main process."""
    chunk_mb: PositiveFloat = 1.0
    """Input handed to a worker at a time, in MB (documents are tokenized in one batched call)."""
    skip_bad_records: bool = False
    """Skip malformed JSON lines and records without a key (reporting how many) instead of stopping."""
    partitions: PositiveInt = 1
    """Write the output as this many partial datasets, then merge them; a rerun after an
    interruption redoes only the partitions that did not finish. The result is the same."""
    progress: bool = True
    """Show a progress bar."""

    @field_validator("input")
    @classmethod
    def _some_input(cls, v):
        items = [v] if isinstance(v, str) else v
        if not items or any(not str(i).strip() for i in items):
            raise ValueError("give at least one input path or glob")
        return v

    @field_validator("json_keys")
    @classmethod
    def _keys(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("give at least one key")
        if len(set(v)) != len(v):
            raise ValueError("keys repeat")
        return v

    @field_validator("output_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.strip() or v.endswith(("/", ".bin", ".idx")):
            raise ValueError("expected a path prefix such as data/corpus (no trailing / or .bin/.idx)")
        return v

    @model_validator(mode="after")
    def _newlines_need_splitting(self):
        if self.keep_newlines and not self.split_sentences:
            raise RecipeError("preprocess.keep_newlines", True, "only applies with preprocess.split_sentences: true")
        return self

    @property
    def inputs(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class PreprocessRecipe(Section):
    """What `megacli preprocess` runs: a corpus and the tokenizer to turn it into indexed datasets."""

    preprocess: PreprocessSection
    """Input, output and processing options."""
    tokenizer: TokenizerSection = TokenizerSection(type="byte")
    """Tokenizer (the same section the training recipes use)."""

    @model_validator(mode="after")
    def _tokenizer_can_preprocess(self):
        if self.tokenizer.type == "none":
            raise RecipeError("tokenizer.type", "none", "preprocessing needs a real tokenizer (huggingface, "
                              "sentencepiece, wordpiece or byte)")
        return self
