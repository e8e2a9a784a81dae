"""torch_dist checkpoints as global tensors, read and written in one process, one tensor at a time.

A Megatron torch_dist checkpoint is a torch.distributed.checkpoint (DCP) directory: ``.metadata``
lists every entry with its *global* shape and the chunks (offsets, sizes) the saving ranks wrote;
``__R_F.distcp`` files hold the chunks; ``common.pt`` the non-tensor state every rank shares;
``metadata.json`` names the backend. Reading needs neither Megatron's parallel state nor a
process group: ``FileSystemReader`` gives the metadata and ``dcp.load(..., no_dist=True)`` fills
a global tensor from whichever chunks overlap it.

Writing goes through DCP too, with a planner of our own: the state dict holds lazy entries that
describe a tensor (global shape, dtype, the chunks to write) and produce its data only when the
writer asks for it, so peak memory is one global tensor (plus the chunk being written), not the
model. One writer thread and no copy-ahead keep the writer asking in plan order.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from megacli.errors import UserError

COMMON = "common.pt"
BACKEND_META = "metadata.json"
DCP_META = ".metadata"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}


def _quiet_dcp():
    """dcp.load/save with no_dist warn on every call that they assume a single process (we do)."""
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
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


class TorchDistReader:
    """The entries of one torch_dist checkpoint directory."""

    def __init__(self, path: str | Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        self.path = Path(path)
        if not (self.path / DCP_META).is_file():
            raise UserError(f"{self.path}: no {DCP_META} (not a torch_dist checkpoint, or an incomplete one)")
        backend = self.path / BACKEND_META
        if backend.is_file():
            kind = json.loads(backend.read_text()).get("sharded_backend")
            if kind != "torch_dist":
                raise UserError(f"{self.path}: sharded backend {kind!r}; only torch_dist checkpoints can be resharded")
        reader = FileSystemReader(str(self.path))
        try:
            self.metadata = reader.read_metadata()
        except Exception as exc:  # noqa: BLE001 - a corrupt .metadata is a user-facing problem
            raise UserError(f"{self.path / DCP_META}: cannot read the checkpoint metadata ({exc})") from None
        self._reader = _CachedReader(str(self.path), self.metadata)
        self.tensors: dict[str, TensorInfo] = {}
        self.objects: list[str] = []
        for key, md in self.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                chunks = tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
                self.tensors[key] = TensorInfo(key, tuple(md.size), md.properties.dtype, chunks)
            elif isinstance(md, BytesStorageMetadata):
                self.objects.append(key)

    def common(self) -> dict:
        path = self.path / COMMON
        if not path.is_file():
            return {}
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"{path}: cannot read ({exc})") from None

    def read(self, key: str) -> torch.Tensor:
        """The global tensor ``key``, assembled from all its chunks."""
        import torch.distributed.checkpoint as dcp

        info = self.tensors.get(key)
        if info is None:
            raise UserError(f"{self.path}: no tensor {key!r}")
        out = torch.empty(info.shape, dtype=info.dtype)
        _quiet_dcp()
        try:
            dcp.load({key: out}, storage_reader=self._reader, no_dist=True)
        except Exception as exc:  # noqa: BLE001 - a torn or corrupt shard file
            raise UserError(f"{self.path}: cannot read {key} ({_first_line(exc)})") from None
        return out

    def read_object_bytes(self, key: str) -> bytes:
        """The stored bytes of a sharded object (a torch.save'd list of the objects)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.metadata.storage_data.get(MetadataIndex(key))
        if info is None:
            raise UserError(f"{self.path}: no object {key!r}")
        if getattr(info, "transform_descriptors", None):
            raise UserError(f"{self.path}: {key} is stored with transforms {info.transform_descriptors} (not supported)")
        try:
            with open(self.path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
        except OSError as exc:
            raise UserError(f"{self.path}: cannot read {key} ({exc})") from None
        if len(data) != info.length:
            raise UserError(f"{self.path / info.relative_path}: truncated ({key} needs {info.length} bytes at {info.offset})")
        return data

    def read_object(self, key: str):
        try:
            return torch.load(io.BytesIO(self.read_object_bytes(key)), map_location="cpu", weights_only=False)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"{self.path}: cannot decode {key} ({_first_line(exc)})") from None

    def files(self) -> list[Path]:
        return sorted(self.path.glob("*.distcp"))


class _CachedReader:
    """A FileSystemReader that reads ``.metadata`` once (dcp.load asks for it on every call)."""

    def __new__(cls, path: str, metadata):
        from torch.distributed.checkpoint import FileSystemReader

        class Reader(FileSystemReader):
            def read_metadata(self, *args, **kwargs):
                return metadata

        return Reader(path)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ---------------------------------------------------------------- writing


@dataclass
class TensorEntry:
    """A tensor of the checkpoint to write: its global shape and dtype, the chunks to store and a
    function producing the global tensor (called once, when the writer reaches it)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]
    produce: Callable[[], torch.Tensor]
    how: str = "copy"


@dataclass
class ObjectEntry:
    key: str
    produce: Callable[[], bytes]
    how: str = "copy"


def _chunk_slice(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for dim, (o, s) in enumerate(zip(offsets, sizes)):
        if o != 0 or s != t.shape[dim]:
            t = t.narrow(dim, o, s)
    return t


class _LazyPlanner:
    """A DCP SavePlanner over TensorEntry/ObjectEntry: write items per chunk, data on demand."""

    def __new__(cls, tensors: Sequence[TensorEntry], objects: Sequence[ObjectEntry], on_done: Callable[[str], None]):
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType

        by_key = {t.key: t for t in tensors}
        obj_by_key = {o.key: o for o in objects}

        class Planner(SavePlanner):
            def __init__(self):
                self._current: tuple[str, torch.Tensor] | None = None
                self._remaining = {t.key: len(t.chunks) for t in tensors}

            def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
                pass

            def create_local_plan(self):
                items = []
                for o in objects:
                    items.append(WriteItem(index=MetadataIndex(o.key), type=WriteItemType.BYTE_IO))
                for t in tensors:
                    props = TensorProperties(dtype=t.dtype)
                    for offsets, sizes in t.chunks:
                        items.append(WriteItem(
                            index=MetadataIndex(t.key, torch.Size(offsets)),
                            type=WriteItemType.SHARD,
                            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                                                        properties=props, size=torch.Size(t.shape)),
                        ))
                return SavePlan(items)

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
                entry = by_key[key]
                if self._current is None or self._current[0] != key:
                    self._current = None  # free the previous tensor before producing the next
                    tensor = entry.produce()
                    if tuple(tensor.shape) != tuple(entry.shape) or tensor.dtype != entry.dtype:
                        raise UserError(f"internal error: {key} produced {tuple(tensor.shape)} {tensor.dtype}, "
                                        f"planned {entry.shape} {entry.dtype}")
                    self._current = (key, tensor)
                chunk = _chunk_slice(self._current[1], write_item.tensor_data.chunk.offsets,
                                     write_item.tensor_data.chunk.sizes).contiguous()
                self._remaining[key] -= 1
                if self._remaining[key] == 0:
                    self._current = None
                    on_done(key)
                return chunk

        return Planner()


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
    dcp.save({}, storage_writer=writer, planner=_LazyPlanner(tensors, objects, on_done), no_dist=True)
    torch.save(common, path / COMMON)
    (path / BACKEND_META).write_text(json.dumps(BACKEND))


# ---------------------------------------------------------------- checksums


def tensor_digest(t: torch.Tensor) -> str:
    """A checksum of a tensor's dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.dtype != torch.bool else flat.numpy().tobytes())
    return h.hexdigest()


def bytes_digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def object_digest(obj) -> str:
    """A checksum of a (nested) Python object with tensors, independent of how it was pickled."""
    h = hashlib.blake2b(digest_size=16)

    def feed(x):
        if isinstance(x, torch.Tensor):
            h.update(b"T")
            h.update(tensor_digest(x).encode())
        elif isinstance(x, dict):
            h.update(b"D%d" % len(x))
            for k in sorted(x, key=repr):
                feed(k)
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(b"L%d" % len(x) if isinstance(x, list) else b"U%d" % len(x))
            for v in x:
                feed(v)
        else:
            try:
                import numpy as np

                if isinstance(x, np.ndarray):
                    h.update(b"A" + str(x.dtype).encode() + repr(x.shape).encode() + x.tobytes())
                    return
            except ImportError:
                pass
            h.update(b"S" + pickle.dumps(x, protocol=4) if not isinstance(x, (int, float, str, bool, type(None))) else
                     b"P" + repr(x).encode())

    feed(obj)
    return h.hexdigest()


def tmp_sibling(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.{tag}-tmp"


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
