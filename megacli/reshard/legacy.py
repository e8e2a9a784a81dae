"""Megatron-LM legacy (``torch``) checkpoints <-> torch_dist, for reshard (placeholder)."""

from __future__ import annotations

from pathlib import Path

from megacli.errors import UserError


def is_legacy(path: Path) -> bool:
    path = Path(path)
    if not path.is_dir():
        return False
    if (path / "latest_checkpointed_iteration.txt").is_file():
        return True
    return any(p.name.startswith("mp_rank_") for p in path.iterdir() if p.is_dir())


def import_to_staging(path: Path, *, trust_pickle: bool = False, progress=None) -> Path:
    raise UserError("Megatron-LM legacy checkpoints are not supported by reshard yet")


def export(it_dir: Path, out: Path, *, trust_pickle: bool = False, progress=None) -> None:
    raise UserError("writing Megatron-LM legacy checkpoints is not supported by reshard yet")


def cleanup_staging(path: Path) -> None:
    return None
