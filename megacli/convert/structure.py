"""`megacli convert PATH --print-structure`: keys, shapes and dtypes of any checkpoint, read from
headers and metadata where the format allows (no tensor data for safetensors and megacli)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator


def structure(path: Path, *, trust_pickle: bool = False) -> Iterator[str]:
    from megacli.checkpoint.contents import row
    from megacli.checkpoint.source import HF, kind_of
    from megacli.convert import hf_io

    if kind_of(path) == HF:
        config = hf_io.read_json(path / hf_io.CONFIG)
        weights = hf_io.HFWeights(path, trust_pickle=trust_pickle)
        yield f"Hugging Face model {path}: {(config.get('architectures') or ['?'])[0]}, {len(weights.keys())} tensors"
        for key in weights.keys():
            yield row(key, *weights.describe(key))
    else:  # a megacli or a Megatron-LM legacy checkpoint
        from megacli.checkpoint.contents import structure as checkpoint_structure

        yield from checkpoint_structure(path, trust_pickle=trust_pickle)
