"""torch_dist checkpoints as global tensors, read and written in one process, one tensor at a time.

A Megatron torch_dist checkpoint is a torch.distributed.checkpoint (DCP) directory: ``.metadata``
lists every entry with its *global* shape and the chunks (offsets, sizes) the saving ranks wrote,
and where each chunk is stored (a torch.save'd tensor at a byte range of a ``__R_F.distcp``
file); ``common.pt`` holds the non-tensor state every rank shares; ``metadata.json`` names the
backend. Reading needs neither Megatron's parallel state nor a process group:
``FileSystemReader.read_metadata()`` gives the index, and any box of a global tensor is
assembled from the stored chunks that overlap it.

Writing goes through ``dcp.save`` with a planner of our own: one write item per target chunk,
whose data is produced only when the writer asks for it (one writer thread, no copy-ahead). So
peak memory is a few chunks - the one being written and the source chunks it is cut from - never
a whole stacked tensor, let alone the model.
"""

from __future__ import annotations

import bisect
import io
import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from megacli.checkpoint.layout import BACKEND_META
from megacli.checkpoint.safe_pickle import COMMON, DCP_METADATA, check_torch_dist, first_line, torch_load
from megacli.checkpoint.source import Source
from megacli.errors import UserError

# A layer-stacked key (``decoder.layers.self_attention...``): its tensors have a leading layer axis.
STACKED = re.compile(r"(?:^|\.)layers\.(?!\d)")

def is_extra_state(key: str) -> bool:
    """A module's ``_extra_state`` entry (Transformer Engine's FP8 bookkeeping; None in the local
    spec), stored as a sharded object (``..._extra_state/shard_...``): not a weight."""
    return key.endswith("_extra_state") or "._extra_state/" in key


# First key components of the checkpoint entries that are not model weights.
NOT_MODEL = ("optimizer", "rng_state", "scheduler")

# Megatron-Core 0.19 saves the common state (common.pt's dictionary) as this sharded object, in a
# one-element list, instead of common.pt; it is no model or optimizer object.
COMMON_STATE_OBJECT = "common_state/shard_0_1"

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}


def _quiet_dcp():
    """dcp.save with no_dist warns that it assumes a single process (it does)."""
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")


@dataclass(frozen=True)
class TensorInfo:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (offsets, sizes)

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.shape, self.dtype)


def tensor_nbytes(shape, dtype: torch.dtype) -> int:
    """The bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


class TorchDistReader:
    """The entries of one torch_dist checkpoint directory."""

    def __init__(self, source: Source):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        self.source = source
        self.path = source.path
        if not (self.path / DCP_METADATA).is_file():
            raise UserError(f"{self.path}: no {DCP_METADATA} (not a torch_dist checkpoint, or an incomplete one)")
        backend = self.path / BACKEND_META
        if backend.is_file():
            try:
                kind = json.loads(backend.read_text())
            except (OSError, ValueError) as exc:
                raise UserError(f"{backend}: cannot read ({exc})") from None
            kind = kind.get("sharded_backend") if isinstance(kind, dict) else None
            if kind != "torch_dist":
                raise UserError(f"{self.path}: sharded backend {kind!r}; only torch_dist checkpoints can be resharded")
        self.metadata = check_torch_dist(self.path, trust=source.trust)
        self._cache: list[tuple[tuple, torch.Tensor]] = []
        self._index: dict[str, tuple] = {}
        self.cache_chunks = 2
        self.tensors: dict[str, TensorInfo] = {}
        self.objects: list[str] = []
        for key, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                chunks = tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
                self.tensors[key] = TensorInfo(key, tuple(md.size), md.properties.dtype, chunks)
            elif isinstance(md, BytesStorageMetadata) and key != COMMON_STATE_OBJECT:
                self.objects.append(key)

    @property
    def common_in_shards(self) -> bool:
        """Whether the common (non-sharded) state is the shards' common_state object (what
        Megatron-Core 0.19 and newer save) rather than common.pt (0.16's, and megacli's own writes
        under every release): common.pt wins where there is one, as in 0.19's load_common_state_dict."""
        return not (self.path / COMMON).is_file() and COMMON_STATE_OBJECT in self.metadata.state_dict_metadata

    @property
    def common_where(self) -> str | None:
        """Where the common state is, for messages; None when there is none."""
        if self.common_in_shards:
            return f"{self.path} ({COMMON_STATE_OBJECT})"
        return str(self.path / COMMON) if (self.path / COMMON).is_file() else None

    def common(self) -> dict:
        """The common state ({} when there is none)."""
        if self.common_in_shards:
            stored = self.read_object(COMMON_STATE_OBJECT)
            if not (isinstance(stored, list) and len(stored) == 1 and isinstance(stored[0], dict)):
                raise UserError(f"{self.common_where}: not Megatron-Core's common state (a dictionary in a "
                                f"one-element list)")
            return stored[0]
        path = self.path / COMMON
        return torch_load(path, trust=self.source.trust, name=path) if path.is_file() else {}

    def read(self, key: str) -> torch.Tensor:
        """The global tensor ``key``, assembled from all its chunks."""
        info = self._info(key)
        return self.read_region(key, (0,) * len(info.shape), info.shape)

    def read_region(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The box [offsets, offsets + sizes) of the global tensor ``key``, from the stored chunks that
        overlap it (each read whole: a torch.save'd tensor at a byte range of a .distcp file). The
        last few chunks read are kept, so walking a chunk piece by piece reads it once."""
        info = self._info(key)
        offsets, sizes = tuple(offsets), tuple(sizes)
        out = torch.empty(sizes, dtype=info.dtype)
        covered = 0
        for c_off, c_size in self._overlapping(info, offsets, sizes):
            lo = [max(a, b) for a, b in zip(offsets, c_off)]
            hi = [min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, c_off, c_size)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            chunk = self._chunk(key, c_off, c_size, info.dtype)
            src = chunk[tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, c_off))]
            out[tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, offsets))] = src
            n = 1
            for l, h in zip(lo, hi):
                n *= h - l
            covered += n
        want = 1
        for s in sizes:
            want *= s
        if covered != want:
            raise UserError(f"{self.path}: the stored chunks of {key} do not cover {list(offsets)}+{list(sizes)} "
                            f"({covered} of {want} elements)")
        return out

    def _overlapping(self, info: TensorInfo, offsets, sizes):
        """The stored chunks that may overlap a box (an index over dim 0: stacked layers have
        hundreds of chunks, and a reshard asks for hundreds of boxes)."""
        if not info.shape:
            return info.chunks
        index = self._index.get(info.key)
        if index is None:
            ordered = sorted(info.chunks, key=lambda c: c[0][0])
            index = ([c[0][0] for c in ordered], ordered, max(c[1][0] for c in ordered))
            self._index[info.key] = index
        starts, ordered, longest = index
        lo = bisect.bisect_right(starts, offsets[0] - longest)
        hi = bisect.bisect_left(starts, offsets[0] + sizes[0])
        return ordered[lo:hi]

    def _info(self, key: str) -> TensorInfo:
        info = self.tensors.get(key)
        if info is None:
            raise UserError(f"{self.path}: no tensor {key!r}")
        return info

    def _chunk(self, key: str, offsets, sizes, dtype) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        cache_key = (key, tuple(offsets))
        for i, (k, t) in enumerate(self._cache):
            if k == cache_key:
                self._cache.append(self._cache.pop(i))
                return t
        storage = self.metadata.storage_data.get(MetadataIndex(key, torch.Size(offsets)))
        if storage is None:
            raise UserError(f"{self.path}: {key} chunk at {list(offsets)} is listed but not stored")
        where = f"{key} chunk at {list(offsets)} ({storage.relative_path})"
        if getattr(storage, "transform_descriptors", None):
            raise UserError(f"{self.path}: {where} is stored with transforms {storage.transform_descriptors} (not supported)")
        self._cache.clear() if self.cache_chunks <= 1 else None  # free before allocating the next
        try:
            with open(self.path / storage.relative_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() < storage.offset + storage.length:
                    raise UserError(f"{self.path / storage.relative_path}: truncated ({where} needs bytes up to "
                                    f"{storage.offset + storage.length})")
                t = torch_load(_RangeFile(f, storage.offset, storage.length), trust=self.source.trust,
                               name=f"{self.path / storage.relative_path} ({where})")
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - a torn or corrupt shard file
            raise UserError(f"{self.path}: cannot decode {where}: {first_line(exc)}") from None
        if isinstance(t, torch.Tensor) and tuple(t.shape) == (1, *sizes):
            t = t[0]  # one layer of a layer-stacked tensor, keyed per layer (checkpoint/megatron_lm/dist_staging.py)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(sizes) or t.dtype != dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise UserError(f"{self.path}: {where} holds {got}, the metadata says {tuple(sizes)} {dtype}")
        self._cache.append((cache_key, t))
        while len(self._cache) > self.cache_chunks:
            self._cache.pop(0)
        return t

    def _bytes(self, storage, where: str) -> bytes:
        try:
            with open(self.path / storage.relative_path, "rb") as f:
                f.seek(storage.offset)
                data = f.read(storage.length)
        except OSError as exc:
            raise UserError(f"{self.path}: cannot read {where} ({exc})") from None
        if len(data) != storage.length:
            raise UserError(f"{self.path / storage.relative_path}: truncated ({where} needs {storage.length} bytes at "
                            f"{storage.offset})")
        return data

    def drop_cache(self) -> None:
        self._cache.clear()

    def read_object_bytes(self, key: str) -> bytes:
        """The stored bytes of a sharded object (a torch.save'd list of the objects)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        storage = self.metadata.storage_data.get(MetadataIndex(key))
        if storage is None:
            raise UserError(f"{self.path}: no object {key!r}")
        if getattr(storage, "transform_descriptors", None):
            raise UserError(f"{self.path}: {key} is stored with transforms {storage.transform_descriptors} (not supported)")
        return self._bytes(storage, key)

    def read_object(self, key: str):
        return torch_load(io.BytesIO(self.read_object_bytes(key)), trust=self.source.trust, name=f"{self.path} ({key})")

    def files(self) -> list[Path]:
        return sorted(self.path.glob("*.distcp"))


class _RangeFile(io.RawIOBase):
    """A read-only view of bytes [offset, offset + length) of an open file, so torch.load reads a
    stored chunk straight from the shard file (no copy of its bytes in memory)."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buf)[:n])
        self._pos += got or 0
        return got or 0


# ---------------------------------------------------------------- writing


@dataclass
class TensorEntry:
    """A tensor of the checkpoint to write: its global shape and dtype, the chunks to store and
    ``region(offsets, sizes)``, which produces any box of the global tensor on demand."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]
    region: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor]
    how: str = "copy"
    sort_key: Optional[Callable[[tuple[int, ...]], tuple]] = None  # write order of chunks (default: plan order)

    def produce(self) -> torch.Tensor:
        """The whole global tensor (small tensors and tests)."""
        return self.region((0,) * len(self.shape), tuple(self.shape))


@dataclass
class ObjectEntry:
    key: str
    produce: Callable[[], bytes]
    how: str = "copy"


class _LazyPlanner:
    """A DCP SavePlanner over TensorEntry/ObjectEntry: write items per chunk, data on demand."""

    def __new__(cls, tensors: Sequence[TensorEntry], objects: Sequence[ObjectEntry], on_done: Callable[[str], None]):
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
        from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType

        by_key = {t.key: t for t in tensors}
        obj_by_key = {o.key: o for o in objects}

        class Planner(SavePlanner):
            def __init__(self):
                self._remaining = {t.key: len(t.chunks) for t in tensors}
                self._written: torch.Tensor | None = None

            def _release(self) -> None:
                # DCP's writer keeps the last chunk of every key it wrote (for its safetensors
                # format) until the file is closed; we write with torch.save, so once the writer
                # asks for the next item the previous chunk's memory can go.
                if self._written is not None:
                    self._written.untyped_storage().resize_(0)
                    self._written = None

            def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
                pass

            def create_local_plan(self):
                return SavePlan(_write_items(tensors, objects))

            def create_global_plan(self, all_plans):
                plans, metadata = create_default_global_save_plan(all_plans)
                return plans, metadata

            def finish_plan(self, new_plan):
                return new_plan

            def resolve_data(self, write_item):
                key = write_item.index.fqn
                if write_item.type == WriteItemType.BYTE_IO:
                    data = obj_by_key[key].produce()
                    on_done(key)
                    return io.BytesIO(data)
                self._release()
                chunk = _chunk(by_key[key], write_item)
                self._remaining[key] -= 1
                if self._remaining[key] == 0:
                    on_done(key)
                self._written = chunk
                return chunk

        return Planner()


def _write_items(tensors: Sequence[TensorEntry], objects: Sequence[ObjectEntry]) -> list:
    """DCP's write items: every object, then every tensor chunk (in the entries' sort_key order
    where they have one)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    items = [WriteItem(index=MetadataIndex(o.key), type=WriteItemType.BYTE_IO) for o in objects]
    pieces = [(t, offsets, sizes) for t in tensors for offsets, sizes in t.chunks]
    if any(t.sort_key for t in tensors):
        # e.g. a legacy import: all chunks of one pipeline stage's files, then the next
        pieces.sort(key=lambda x: x[0].sort_key(x[1]) if x[0].sort_key else ())
    for t, offsets, sizes in pieces:
        items.append(WriteItem(
            index=MetadataIndex(t.key, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                                        properties=TensorProperties(dtype=t.dtype), size=torch.Size(t.shape)),
        ))
    return items


def _chunk(entry: TensorEntry, write_item) -> torch.Tensor:
    """The chunk ``write_item`` asks of ``entry``, produced now, checked against the plan and
    contiguous in a storage of its own size (torch.save writes a view's whole storage)."""
    offsets = tuple(write_item.tensor_data.chunk.offsets)
    sizes = tuple(write_item.tensor_data.chunk.sizes)
    chunk = entry.region(offsets, sizes)
    if tuple(chunk.shape) != sizes or chunk.dtype != entry.dtype:
        raise UserError(f"internal error: {entry.key} at {list(offsets)} produced {tuple(chunk.shape)} {chunk.dtype}, "
                        f"planned {sizes} {entry.dtype}")
    chunk = chunk.contiguous()
    if chunk.untyped_storage().nbytes() != chunk.nbytes:
        chunk = chunk.clone()
    return chunk


def write_torch_dist(path: Path, tensors: Sequence[TensorEntry], objects: Sequence[ObjectEntry], common: dict,
                     on_done: Callable[[str], None] = lambda key: None) -> None:
    """Write a torch_dist checkpoint directory (which must exist and be empty) from lazy entries."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    keys = [t.key for t in tensors] + [o.key for o in objects]
    if len(set(keys)) != len(keys):
        raise UserError("internal error: duplicate checkpoint keys in the reshard plan")
    _quiet_dcp()
    writer = FileSystemWriter(str(path), single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0,
                              sync_files=True)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save({}, storage_writer=writer, planner=_LazyPlanner(tensors, objects, on_done), no_dist=True)
    except CheckpointException as exc:
        # DCP wraps whatever failed while writing (our UserError for a bad source chunk, Ctrl-C, an
        # OSError for a full disk); re-raise the original.
        failures = list(getattr(exc, "failures", {}).values())
        cause = failures[0][0] if failures and isinstance(failures[0], tuple) else None
        if isinstance(cause, BaseException):
            raise cause from None
        raise UserError(f"writing {path} failed: {str(exc).strip().splitlines()[-1]}") from None
    torch.save(common, path / COMMON)
    (path / BACKEND_META).write_text(json.dumps(BACKEND))
