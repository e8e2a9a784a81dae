"""The convert recipe: what to convert, to what, and the layout a megacli checkpoint is for.

    convert:
      source: hf/Llama-3.2-1B          # an HF directory, a megacli checkpoint or a Megatron-LM legacy one
      destination: checkpoints/llama-1b
      dtype: bf16
    parallel:                          # written into the checkpoint's recipe.yaml
      tensor: 2
      pipeline: 2
"""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import field_validator

from megacli.recipe.base import Section
from megacli.recipe.sections import ParallelSection

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'2GB' -> 2·10⁹ bytes, '500MiB' -> 500·2²⁰ (as transformers' max_shard_size)."""
    if isinstance(text, int):
        return text
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise ValueError(f"{text!r}: expected a size such as 2GB, 500MB or 1GiB")
    unit = (m.group(2) or "B").upper()
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(float(m.group(1)) * (1024 if "I" in unit else 1000) ** power)


class ConvertSection(Section):
    source: str
    """A Hugging Face model directory (config.json + weights), a megacli checkpoint (run or
    iteration directory) or a Megatron-LM legacy checkpoint; the format is detected."""
    destination: str
    """Directory to create (must be new or empty)."""
    to: Optional[Literal["hf", "megacli", "megatron"]] = None
    """Target format; default megacli for HF and legacy sources, hf for megacli checkpoints.
    megatron: a Megatron-LM torch_dist checkpoint (``--load DST --ckpt-format torch_dist``) with
    the source's optimizer, scheduler and RNG state when it has them."""
    spec: Literal["te", "local"] = "te"
    """to megatron: the Megatron-LM layer spec the checkpoint is for: te (--transformer-impl
    transformer_engine, what Megatron-LM trains with on GPUs) or local (--transformer-impl local)."""
    dtype: Optional[Literal["fp32", "bf16", "fp16"]] = None
    """Weights dtype of the result (and train.precision of a megacli result); default: the source's."""
    max_shard_size: str = "2GB"
    """HF export: largest safetensors shard (2GB, 500MB, 1GiB, ...)."""
    trust_pickle: bool = False
    """Unpickle any object the source holds (by default only tensors and known-safe types: a pickle
    can run code, so only for sources you trust)."""

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: str) -> str:
        parse_size(v)
        return v


class ConvertRecipe(Section):
    """What `megacli convert` runs."""

    convert: ConvertSection
    """Source, destination and format."""
    parallel: ParallelSection = ParallelSection()
    """The layout a megacli result is prepared for (its recipe.yaml; the weights load under any layout)."""
