"""Hugging Face model directories: config.json, weights (safetensors or PyTorch .bin, sharded
with an index or not), generation_config.json and tokenizer files.

Reading is lazy, tensor by tensor (safetensors reads only the requested tensor; .bin shards are
memory-mapped). Writing fills shards up to ``max_shard_size`` and writes each as soon as it is
full, so at most one shard is held in memory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

from megacli.errors import UserError

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")

_SAFE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


def is_hf_dir(path: Path) -> bool:
    return (path / CONFIG).is_file()


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def parse_size(text: str | int) -> int:
    from megacli.recipe.convert import parse_size as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise UserError(f"max_shard_size = {exc}") from None


class HFWeights:
    """The tensors of an HF directory, read one at a time."""

    def __init__(self, root: Path):
        self.root = root
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._bin_cache: tuple[Path, dict] | None = None
        files = self._weight_files()
        if not files:
            raise UserError(f"{root}: no weights (model.safetensors, model-*.safetensors or pytorch_model*.bin)")
        for f in files:
            for key in self._keys_of(f):
                self._where[key] = f

    def _weight_files(self) -> list[Path]:
        for index in (SAFE_INDEX, BIN_INDEX):
            if (self.root / index).is_file():
                weight_map = read_json(self.root / index).get("weight_map", {})
                files = sorted({self.root / f for f in weight_map.values()})
                missing = [f.name for f in files if not f.is_file()]
                if missing:
                    raise UserError(f"{self.root / index} names shards that are missing: {', '.join(missing)}")
                return files
        safe = sorted(self.root.glob("*.safetensors"))
        return safe or sorted(self.root.glob("pytorch_model*.bin"))

    def _keys_of(self, f: Path) -> list[str]:
        if f.suffix == ".safetensors":
            return list(self._safe(f).keys())
        return list(self._bin(f).keys())

    def _safe(self, f: Path):
        from safetensors import safe_open

        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f]

    def _bin(self, f: Path) -> dict:
        if self._bin_cache is None or self._bin_cache[0] != f:
            try:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (non-zip) serialization cannot be memory-mapped
                sd = torch.load(f, map_location="cpu", weights_only=True)
            self._bin_cache = (f, sd)
        return self._bin_cache[1]

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> torch.Tensor:
        f = self._where.get(key)
        if f is None:
            raise UserError(f"{self.root}: the weights have no tensor {key!r} (the config and the weights disagree?)")
        if f.suffix == ".safetensors":
            return self._safe(f).get_tensor(key)
        return self._bin(f)[key]

    def describe(self, key: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype name) without reading the data (for safetensors)."""
        f = self._where[key]
        if f.suffix == ".safetensors":
            sl = self._safe(f).get_slice(key)
            return tuple(sl.get_shape()), str(_SAFE_DTYPES.get(sl.get_dtype(), sl.get_dtype())).replace("torch.", "")
        t = self._bin(f)[key]
        return tuple(t.shape), str(t.dtype).replace("torch.", "")

    def dtype(self) -> torch.dtype:
        """The dtype of the floating-point weights (the first one found)."""
        for key in self._where:
            name = self.describe(key)[1]
            dt = getattr(torch, name, None)
            if isinstance(dt, torch.dtype) and dt.is_floating_point:
                return dt
        return torch.float32


class ShardWriter:
    """Writes (name, tensor) pairs into safetensors shards of at most ``max_shard_bytes`` (a
    tensor larger than that gets a shard of its own), then the index."""

    def __init__(self, root: Path, max_shard_bytes: int):
        self.root = root
        self.max_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in keys for _, keys in self._written):
            raise ValueError(f"tensor {name!r} written twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        # safetensors refuses tensors that share storage (views from a split): own each one.
        tensor = tensor.detach().contiguous()
        if tensor.untyped_storage().nbytes() != size:
            tensor = tensor.clone()
        self._pending[name] = tensor
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.root / f"model-{len(self._written) + 1:05d}.safetensors.part"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, give the shards their final names, write the index (when there is
        more than one shard). Returns the file names."""
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        if n == 1:
            final = self.root / "model.safetensors"
            os.replace(self._written[0][0], final)
            return [final.name]
        weight_map, names = {}, []
        for i, (part, keys) in enumerate(self._written, 1):
            final = self.root / f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(part, final)
            names.append(final.name)
            weight_map.update({k: final.name for k in keys})
        write_json(self.root / SAFE_INDEX, {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map})
        return names + [SAFE_INDEX]


def write_weights(root: Path, tensors: Iterable[tuple[str, torch.Tensor]], *, max_shard_size: str | int) -> list[str]:
    writer = ShardWriter(root, parse_size(max_shard_size))
    for name, tensor in tensors:
        writer.add(name, tensor)
    return writer.close()


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files of an HF directory (those that exist); returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied
