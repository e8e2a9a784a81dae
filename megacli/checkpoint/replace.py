"""The one rule for a directory a command deletes to put a new one in its place (reshard
--overwrite, a run's earlier conversion, a save over an iteration of the same number).

Only a checkpoint may be replaced: a directory megacli recognises as one (checkpoint.source.kind_of:
megacli, Megatron-LM torch_dist or legacy) and that holds nothing else, or an empty directory.
Never the directory of a checkpoint the command reads, one holding it, the working directory or one
holding it. A Hugging Face model directory is not replaced either: its mark, a config.json, is
found in too many other folders. A refusal says what is there and never suggests deleting it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from megacli.checkpoint.layout import META, RANK_DIR, is_torch_dist_iteration
from megacli.errors import UserError

# What the top level of a checkpoint directory holds: iterations, the pointers to the newest, a
# converted checkpoint's hf/ folder, the lock of the run that writes it.
_CHECKPOINT_ENTRY = re.compile(r"(iter_\d+|release|latest|latest\.tmp|latest_checkpointed_iteration\.txt|hf|"
                               r"megacli\.lock)\Z")
_SHOWN = 4  # entries named in a refusal


def check_replaceable(path: str | Path, *, reads: Iterable[str | Path] = (), field: str = "DST") -> None:
    """Raise a UserError unless the directory at ``path`` (``field``: how the user named it) may be
    deleted and replaced: absent, empty, or a checkpoint and nothing else. ``reads``: the
    checkpoints the command reads, which it must neither hold nor be."""
    reason = why_not_replaceable(path, reads=reads)
    if reason is not None:
        raise UserError(f"{field} {path}: {reason}")


def why_not_replaceable(path: str | Path, *, reads: Iterable[str | Path] = ()) -> str | None:
    """Why the directory at ``path`` may not be replaced (check_replaceable's rule), None when it may."""
    path = Path(path)
    here = Path.cwd().resolve()
    target = path.resolve()
    if target == here or target in here.parents:
        return ("is the working directory or holds it; megacli never replaces that. Choose a new directory "
                "for the output")
    for source in reads:
        src = Path(source).resolve()
        if target == src or target in src.parents:
            return f"holds the checkpoint being read ({source}); write the output to another directory"
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink():
        return "is a symbolic link; give the directory itself or a new path for the output"
    if not path.is_dir():
        return "exists and is not a directory; choose another output path"
    try:
        entries = sorted(p.name for p in path.iterdir())
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc}); choose another output path"
    if not entries:
        return None
    kind = _checkpoint_kind(path)
    if kind is None:
        return (f"is not a checkpoint (it holds {_names(entries)}); only a checkpoint is replaced. "
                f"Choose a new or empty directory for the output")
    if _is_iteration(path):
        return None
    foreign = [name for name in entries if not _CHECKPOINT_ENTRY.match(name)]
    if foreign:
        return (f"holds a {kind} checkpoint and also {_names(foreign)}, which are not part of it; only a directory "
                f"holding nothing but a checkpoint is replaced. Choose a new or empty directory for the output")
    return None


def _checkpoint_kind(path: Path) -> str | None:
    from megacli.checkpoint.source import HF, kind_of

    try:
        kind = kind_of(path)
    except (UserError, OSError, ValueError):  # a broken pointer: not a checkpoint megacli can read
        return None
    return None if kind == HF else kind


def _is_iteration(path: Path) -> bool:
    """An iteration directory itself (everything in it belongs to the checkpoint)."""
    return ((path / META).is_file() or is_torch_dist_iteration(path)
            or any(RANK_DIR.match(p.name) for p in path.iterdir() if p.is_dir()))


def _names(entries: list[str]) -> str:
    shown = ", ".join(repr(e) for e in entries[:_SHOWN])
    return shown + (f" and {len(entries) - _SHOWN} more" if len(entries) > _SHOWN else "")

