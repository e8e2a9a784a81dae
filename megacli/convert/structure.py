"""`megacli convert PATH --print-structure`: keys, shapes and dtypes of any checkpoint, read from
headers and metadata where the format allows (no tensor data for safetensors and megacli)."""

from __future__ import annotations

from typing import Iterator
from megacli.checkpoint.source import Source


def structure(source: Source) -> Iterator[str]:
    from megacli.checkpoint.contents import row
    from megacli.checkpoint.source import HF
    from megacli.convert import hf_io
    from megacli.checkpoint.hf_config import read_config

    path = source.path
    if source.kind == HF:
        config = read_config(path / hf_io.CONFIG)
        weights = hf_io.HFWeights(source)
        yield f"Hugging Face model {path}: {(config.get('architectures') or ['?'])[0]}, {len(weights.keys())} tensors"
        for key in weights.keys():
            yield row(key, *weights.describe(key))
    else:  # a megacli or a Megatron-LM legacy checkpoint
        from megacli.checkpoint.contents import structure as checkpoint_structure

        yield from checkpoint_structure(source)
