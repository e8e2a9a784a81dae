"""The one way megacli unpickles what a checkpoint holds: only an allow-list of harmless globals.

A pickle can name any importable function and call it while loading, so a checkpoint from
elsewhere could run code. Every pickled file megacli reads goes through here:

* torch.save'd files (legacy ``model_optim_rng.pt``, ``common.pt``, sharded objects such as RNG
  state, Hugging Face ``pytorch_model.bin``): ``torch.load(weights_only=True)`` - tensors,
  storages and containers - plus the globals of ``_torch_load_globals()``;
* torch_dist ``.metadata`` (a plain pickle, which torch's reader loads with ``pickle.load``):
  ``_MetadataUnpickler``, which builds torch.distributed.checkpoint's metadata classes only.

``check_torch_dist`` validates a whole torch_dist directory this way before Megatron or torch
reads it. ``trust=True`` (``--trust-pickle``, ``checkpoint.trust_pickle: true``) lifts the
restriction, for checkpoints whose origin is known.
"""

from __future__ import annotations

import argparse
import enum
import functools
import io
import os
import pickle
import re
import signal
import warnings
from pathlib import Path

import torch

from megacli.checkpoint.files import check_members, named_inside, require_regular
from megacli.checkpoint.source import Source
from megacli.errors import UserError

DCP_METADATA = ".metadata"
COMMON = "common.pt"
TRUST_HINT = ("if you trust where this checkpoint came from, rerun with --trust-pickle (or set "
              "checkpoint.trust_pickle: true in the recipe)")

# .metadata: torch.distributed.checkpoint's metadata and save-plan classes, torch sizes, dtypes, layouts.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "LoadPlan", "WriteItem", "WriteItemType", "ReadItem",
                                             "LoadItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
}


_GLOBAL_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


class RefusedPickle(UserError):
    """A pickled file needs a global outside the allow-list."""


def _refused(path, what: str) -> RefusedPickle:
    return RefusedPickle(f"{path}: refused to unpickle {what}: loading it could run code; {TRUST_HINT}")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path):
        super().__init__(f)
        self._path = path

    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise _refused(self._path, f"{module}.{name}")


def load_metadata(path: Path, *, trust: bool):
    """A torch_dist ``.metadata`` file, unpickled with the allow-list (unless ``trust``)."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f) if trust else _MetadataUnpickler(f, path).load()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - a torn or corrupt file
        raise UserError(f"{path}: cannot read the checkpoint metadata ({first_line(exc)})") from None


@functools.cache
def _torch_load_globals(megatron: bool) -> tuple:
    """Globals beyond torch's weights-only set that checkpoints hold as plain data: the run's
    argparse Namespace (legacy args) and the signal enum in it, NumPy RNG state (arrays, dtypes,
    scalars), Transformer Engine's BytesIO extra state and, with ``megatron``, Megatron's enums (importing Megatron is
    slow, so only for files that name them)."""
    import numpy as np

    # signal.Signals: Megatron-LM's args hold exit_signal (SIGTERM by default).
    allowed: list = [argparse.Namespace, io.BytesIO, bytes, np.ndarray, np.dtype, signal.Signals]
    for mod_name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            allowed += [__import__(mod_name, fromlist=["_reconstruct"])._reconstruct,
                        __import__(mod_name, fromlist=["scalar"]).scalar]
            break
        except (ImportError, AttributeError):
            continue
    numeric = (np.uint8, np.uint32, np.int32, np.int64, np.float32, np.float64, np.bool_)
    allowed += [type(np.dtype(t)) for t in numeric] + list(numeric)
    for mod_name in ("megatron.core.transformer.enums", "megatron.core.enums") if megatron else ():
        with warnings.catch_warnings():  # Megatron warns at import about every missing TE/Apex kernel
            warnings.simplefilter("ignore")
            try:
                mod = __import__(mod_name, fromlist=["*"])
            except ImportError:
                continue
        allowed += [v for v in vars(mod).values() if isinstance(v, type) and issubclass(v, enum.Enum) and v.__module__ == mod_name]
    return tuple(allowed)


def allow_checked_globals():
    """A context in which torch.load(weights_only=True) - Megatron's own loader of ``common.pt`` -
    accepts the allow-listed globals (after check_torch_dist has checked the files with them)."""
    return torch.serialization.safe_globals(list(_torch_load_globals(True)))


def torch_load(source, *, trust: bool, name, mmap: bool = False):
    """``torch.load`` of a file or file object ``source`` (``name``: the file, for messages),
    restricted to tensors and the allow-listed globals unless ``trust``."""
    if isinstance(source, (str, Path)):
        require_regular(Path(source))
    if trust:
        return torch.load(source, map_location="cpu", weights_only=False, mmap=mmap)
    megatron = False
    while True:
        try:
            with torch.serialization.safe_globals(list(_torch_load_globals(megatron))):
                return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            if not megatron and "GLOBAL megatron." in str(exc):
                megatron = True
                if hasattr(source, "seek"):
                    source.seek(0)
                continue
            unsafe = _unsafe_globals(source, exc, megatron)
            if unsafe is None:  # torch reports every unpickling failure so, a torn file's too
                raise _corrupt(name, exc) from None
            raise _refused(name, unsafe) from None
        except RuntimeError as exc:
            if mmap and "mmap" in str(exc):  # legacy (non-zip) serialization cannot be memory-mapped
                mmap = False
                continue
            raise _corrupt(name, exc) from None
        except Exception as exc:  # noqa: BLE001 - whatever a torn file makes the unpickler raise
            raise _corrupt(name, exc) from None


def _corrupt(name, exc: BaseException) -> UserError:
    # torch's weights-only failures carry a long, terminal-formatted advice text; the cause is enough.
    cause = "malformed pickle data" if isinstance(exc, pickle.UnpicklingError) else first_line(exc)
    return UserError(f"{name}: cannot read ({cause}); the file is truncated or corrupt")


def _unsafe_globals(source, exc: Exception, megatron: bool) -> str | None:
    """The globals the file needs that are not allowed, as torch reports them; None when the
    failure names none."""
    if isinstance(source, (str, Path)):
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in _torch_load_globals(megatron) if hasattr(g, "__qualname__")}
        try:
            unsafe = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(str(source)) if g not in allowed]
        except Exception:  # noqa: BLE001 - the message below still says what failed
            unsafe = []
        if unsafe:
            return ", ".join(unsafe)
    return _global_named_in(str(exc))


def _global_named_in(text: str) -> str | None:
    """The global torch's weights-only unpickler refused, as its message names it."""
    marker = "Unsupported global: GLOBAL "
    if marker in text:
        name = text.split(marker, 1)[1].split()[0]
        name = name if "." in name else f"builtins.{name}"
        if _GLOBAL_NAME.fullmatch(name):  # not the garbage a torn file can decode to
            return name
    return None


def load_failure(exc: BaseException, where) -> UserError | None:
    """torch's weights-only refusal, met inside a load that Megatron or torch runs (they read tensor
    shards with it), as megacli's own message about ``where``; None for any other failure."""
    text = str(exc)
    if "Weights only load failed" not in text:
        return None
    unsafe = _global_named_in(text)
    if unsafe is not None:
        return _refused(where, unsafe)
    return UserError(f"{where}: cannot read (malformed pickle data); a file is truncated or corrupt")


def check_torch_dist(ckpt: Path, *, trust: bool):
    """Refuse a torch_dist checkpoint directory whose pickles (``.metadata``, ``common.pt``, the
    sharded objects) need globals beyond the allow-lists, before Megatron or torch unpickles
    them without restriction. Corrupt files are refused too, naming the file, and so (trusted or
    not) are files that are not regular or lie outside the checkpoint (megacli.checkpoint.files).
    Returns the checkpoint's metadata."""
    check_members(ckpt)
    metadata = load_metadata(ckpt / DCP_METADATA, trust=trust)
    for relative in sorted({s.relative_path for s in getattr(metadata, "storage_data", {}).values()}, key=str):
        shard = named_inside(ckpt, relative, named_by=str(ckpt / DCP_METADATA))
        if os.path.lexists(shard):  # a missing one: the reader names it
            require_regular(shard)
    if trust:
        return metadata
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if (ckpt / COMMON).is_file():
        torch_load(ckpt / COMMON, trust=False, name=ckpt / COMMON)
    for index, storage in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            shard = ckpt / storage.relative_path
            try:
                with open(shard, "rb") as f:
                    f.seek(storage.offset)
                    data = f.read(storage.length)
            except OSError as exc:
                raise UserError(f"{shard}: cannot read {index.fqn} ({exc})") from None
            if len(data) != storage.length:
                raise UserError(f"{shard}: truncated ({index.fqn} needs {storage.length} bytes at {storage.offset})")
            torch_load(io.BytesIO(data), trust=False, name=f"{shard} ({index.fqn})")
    return metadata


def check_checkpoint(source: Source) -> None:
    """``check_torch_dist`` for the megacli checkpoint ``source`` (if it is one) and the LoRA
    base checkpoint it names: a launcher's check before its workers load them."""
    from megacli.checkpoint.layout import find_checkpoint, lora_base_of

    ckpt = find_checkpoint(source.path) if source.path.exists() else None
    if ckpt is None or source.trust:
        return
    for each in (ckpt, lora_base_of(ckpt)):
        if each is not None:
            check_torch_dist(each, trust=False)


def first_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
