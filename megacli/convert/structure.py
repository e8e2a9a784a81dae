"""`megacli convert PATH --print-structure`: keys, shapes and dtypes of any checkpoint, read from
headers and metadata where the format allows (no tensor data for safetensors and megacli)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator


def _row(key: str, shape, dtype) -> str:
    return f"  {key}  {list(shape)}  {str(dtype).replace('torch.', '')}"


def structure(path: Path, *, trust_pickle: bool = False) -> Iterator[str]:
    from megacli.convert import hf_io
    from megacli.convert.run import resolve_source

    source = resolve_source(path)
    if source.kind == "hf":
        config = hf_io.read_json(path / hf_io.CONFIG)
        weights = hf_io.HFWeights(path, trust_pickle=trust_pickle)
        yield f"Hugging Face model {path}: {(config.get('architectures') or ['?'])[0]}, {len(weights.keys())} tensors"
        for key in weights.keys():
            yield _row(key, *weights.describe(key))
    elif source.kind == "megacli":
        from megacli.checkpoint.layout import read_meta
        from megacli.convert.megatron_io import CheckpointReader

        ckpt = source.ckpt
        meta = read_meta(ckpt)
        reader = CheckpointReader(ckpt, trust_pickle=trust_pickle)
        yield (f"megacli checkpoint {ckpt}: iteration {meta.get('iteration')}, saved under {meta.get('layout')}, "
               f"optimizer state: {'yes' if meta.get('has_optimizer', True) else 'no'}; global shapes "
               f"(layers stacked along the first axis)")
        for key, (shape, dtype) in sorted(reader.all_tensors.items()):
            yield _row(key, shape, dtype)
    else:
        from megacli.checkpoint.legacy import LegacyCheckpoint

        legacy = LegacyCheckpoint(path, trust_pickle=trust_pickle)
        a = legacy.args
        yield (f"Megatron-LM legacy checkpoint {legacy.it_dir}: iteration {legacy.iteration}, TP={legacy.tp} PP={legacy.pp} "
               f"VPP={legacy.vp}; {a.num_layers} layers, hidden {a.hidden_size}, {a.num_attention_heads} heads; "
               f"per-rank shapes")
        for name, rows in legacy.describe():
            yield f"{name}:"
            for key, shape, dtype in rows:
                yield _row(key, shape, dtype)
