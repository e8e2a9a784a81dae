"""Hugging Face model directories: config.json, weights (safetensors or PyTorch .bin, sharded
with an index or not), generation_config.json and tokenizer files.

Reading is lazy, tensor by tensor (safetensors: plain reads of just that tensor; .bin shards are
memory-mapped). Writing streams: shards are planned from the names, shapes and dtypes up front,
each file's header is written first and every tensor's bytes as it arrives, so no shard is ever
held in memory.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

from megacli.checkpoint.files import named_inside, require_regular
from megacli.checkpoint.layout import GENERATION_CONFIG, HF_CONFIG as CONFIG, TOKENIZER_FILES
from megacli.checkpoint.source import Source
from megacli.errors import UserError

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


_SAFE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}
_SAFE_CODES = {v: k for k, v in _SAFE_DTYPES.items()}


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


def read_safetensors_header(f: Path) -> tuple[dict, int]:
    with open(f, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if 8 + size > os.fstat(fh.fileno()).st_size:  # read no more than the file holds
            raise UserError(f"{f}: not a safetensors file (its header length {size} runs past the end)")
        try:
            header = json.loads(fh.read(size))
        except ValueError:
            raise UserError(f"{f}: not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise UserError(f"{f}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return header, 8 + size


def read_safetensors_tensor(f: Path, entry: dict, data_start: int) -> torch.Tensor:
    """One tensor read with plain file reads into its own memory (no memory map: a mapped file
    would stay resident and count against this process for the whole conversion)."""
    dtype = _SAFE_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise UserError(f"{f}: unsupported safetensors dtype {entry['dtype']}")
    start, end = entry["data_offsets"]
    out = torch.empty(entry["shape"], dtype=dtype)
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    if len(view) != end - start:
        raise UserError(f"{f}: tensor data size {end - start} does not match shape {entry['shape']} {entry['dtype']}")
    with open(f, "rb") as fh:
        fh.seek(data_start + start)
        done = 0
        while done < len(view):
            n = fh.readinto(view[done:])
            if not n:
                raise UserError(f"{f}: truncated file")
            done += n
    return out


class HFWeights:
    """The tensors of an HF directory, read one at a time (safetensors headers parsed once)."""

    def __init__(self, source: Source):
        self.source = source
        self.root = root = source.path
        self._where: dict[str, Path] = {}
        self._headers: dict[Path, tuple[dict, int]] = {}
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
                weight_map = read_json(self.root / index)
                weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
                if not isinstance(weight_map, dict):
                    raise UserError(f"{self.root / index}: no weight_map (a JSON object of tensor name -> shard file)")
                files = sorted({named_inside(self.root, name, named_by=str(self.root / index))
                                for name in weight_map.values()})
                missing = [f.name for f in files if not os.path.lexists(f)]
                if missing:
                    raise UserError(f"{self.root / index} names shards that are missing: {', '.join(missing)}")
                break
        else:
            files = sorted(self.root.glob("*.safetensors")) or sorted(self.root.glob("pytorch_model*.bin"))
        for f in files:
            require_regular(f)
        return files

    def _keys_of(self, f: Path) -> list[str]:
        if f.suffix == ".safetensors":
            return list(self._safe(f)[0])
        return list(self._bin(f).keys())

    def _safe(self, f: Path) -> tuple[dict, int]:
        """(header without __metadata__, offset of the data) of a safetensors file."""
        if f not in self._headers:
            self._headers[f] = read_safetensors_header(f)
        return self._headers[f]

    def _bin(self, f: Path) -> dict:
        if self._bin_cache is None or self._bin_cache[0] != f:
            from megacli.checkpoint.safe_pickle import torch_load

            sd = torch_load(f, trust=self.source.trust, name=f, mmap=True)
            if not isinstance(sd, dict):
                raise UserError(f"{f}: holds a {type(sd).__name__}, not a state dict of tensors")
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
            header, data_start = self._safe(f)
            return read_safetensors_tensor(f, header[key], data_start)
        return self._bin(f)[key]

    def describe(self, key: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype name) without reading the data (for safetensors)."""
        f = self._where[key]
        if f.suffix == ".safetensors":
            entry = self._safe(f)[0][key]
            return tuple(entry["shape"]), str(_SAFE_DTYPES.get(entry["dtype"], entry["dtype"])).replace("torch.", "")
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


Planned = tuple[str, tuple[int, ...], torch.dtype]  # (name, shape, dtype) of a tensor to write


def plan_shards(planned: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """Consecutive tensors into shards of at most ``max_bytes`` (a larger tensor gets its own)."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for entry in planned:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


class SafetensorsStream:
    """A safetensors file written tensor by tensor: the header is written first from the planned
    names, shapes and dtypes, then each tensor's bytes as it arrives, in plan order."""

    def __init__(self, path: Path, entries: list[Planned]):
        self.path = path
        self.entries = list(entries)
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in self.entries:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._file = open(path, "wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, shape, dtype = self.entries[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != (want_name, tuple(shape), dtype):
            raise RuntimeError(f"{self.path.name}: got {name} {list(tensor.shape)} {tensor.dtype}, planned "
                               f"{want_name} {list(shape)} {dtype}")
        self._file.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        self._file.close()

    def finish(self) -> None:
        self.close()
        if self._next != len(self.entries):
            raise RuntimeError(f"{self.path.name}: {len(self.entries) - self._next} planned tensors never arrived")


def write_weights(root: Path, planned: list[Planned], tensors: Iterable[tuple[str, torch.Tensor]], *,
                  max_shard_size: str | int) -> list[str]:
    """Write ``tensors`` (arriving in the order of ``planned``) as safetensors shards of at most
    ``max_shard_size``, plus the index when there is more than one. Holds no tensor beyond the one
    being written. Returns the file names."""
    shards = plan_shards(planned, parse_size(max_shard_size))
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    stream = iter(tensors)
    for name, entries in zip(names, shards):
        out = SafetensorsStream(root / name, entries)
        try:
            for _ in entries:
                out.write(*next(stream))
        finally:
            out.close()
        out.finish()
    if next(stream, None) is not None:
        raise RuntimeError("more tensors arrived than were planned")
    if n == 1:
        return names
    weight_map = {entry[0]: name for name, entries in zip(names, shards) for entry in entries}
    total = sum(math.prod(e[1]) * e[2].itemsize for e in planned)
    write_json(root / SAFE_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names + [SAFE_INDEX]


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files of an HF directory (those that exist); returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def save_wordpiece_tokenizer(vocab: Path, dst: Path, *, lower_case: bool) -> None:
    """Hugging Face BERT tokenizer files (BertTokenizerFast) for a WordPiece vocab.txt. Built through
    the tokenizers library: transformers 5's BertTokenizerFast ignores a vocab_file argument."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    wordpiece = BertWordPieceTokenizer(str(vocab), lowercase=lower_case)
    BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, do_lower_case=lower_case).save_pretrained(dst)
