"""A checkpoint to read, recognised once. ``open_checkpoint`` is the one place megacli tells its
formats apart: a megacli checkpoint (run or iteration directory), Megatron-LM's torch_dist or legacy
(``--ckpt-format torch``) one, a Hugging Face model directory. The Source it returns carries the
user's trust decision (``--trust-pickle``) to what reads it; only the command line sets it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from megacli.checkpoint.layout import (HF_CONFIG, LATEST, META, TRACKER, find_checkpoint, is_legacy_dir,
                                       is_megatron_lm_dir, lora_base_of)
from megacli.errors import UserError

MEGACLI, MEGATRON_LM, LEGACY, HF = "megacli", "megatron-lm", "legacy", "hf"


def is_hf_dir(path: Path) -> bool:
    """A Hugging Face model directory: its config.json."""
    return (path / HF_CONFIG).is_file()


def kind_of(path: str | Path) -> str | None:
    """The format of the checkpoint at ``path`` (megacli, megatron-lm, legacy or hf); None when it is
    none of them. A checkpoint's own markers come before a Hugging Face config.json."""
    path = Path(path)
    if find_checkpoint(path) is not None:
        return MEGACLI
    if is_megatron_lm_dir(path):
        return MEGATRON_LM
    if path.is_dir() and is_legacy_dir(path):
        return LEGACY
    if is_hf_dir(path):
        return HF
    return None


@dataclass(frozen=True)
class Source:
    """A recognised checkpoint: ``kind`` (megacli, megatron-lm, legacy or hf), the path as given and,
    for a megacli checkpoint, its iteration directory ``ckpt``; ``trust``: unpickle what it holds
    without the allow-list (the user's --trust-pickle)."""

    path: Path
    kind: str
    trust: bool = False
    ckpt: Path | None = None

    @functools.cached_property
    def recipe(self):
        """A megacli checkpoint's training recipe (its recipe.yaml)."""
        from megacli.checkpoint.layout import RECIPE
        from megacli.recipe.base import load
        from megacli.recipe.pretrain import TrainingRecipe

        return load(TrainingRecipe, self.ckpt / RECIPE)

    @property
    def lora_base(self) -> Path | None:
        """The base checkpoint of a LoRA run's megacli checkpoint (which holds adapters only)."""
        return lora_base_of(self.ckpt) if self.ckpt is not None else None


def open_checkpoint(path: str | Path, *, trust: bool = False) -> Source | None:
    """The checkpoint at ``path``, recognised (None when it is in no format megacli reads)."""
    path = Path(path)
    kind = kind_of(path)
    if kind is None:
        return None
    return Source(path, kind, trust=trust, ckpt=find_checkpoint(path) if kind == MEGACLI else None)


def locate(path: str | Path) -> tuple[Path, str]:
    """A checkpoint at ``path``: (the megacli iteration directory, "megacli"), or (``path``,
    "megatron-lm") for Megatron-LM's torch_dist format, or (``path``, "legacy") for its legacy one."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such checkpoint")
    source = open_checkpoint(path)
    if source is not None and source.kind != HF:
        return source.ckpt or path, source.kind
    raise UserError(f"{path}: not a checkpoint (expected a directory with '{LATEST}' or '{META}', or a Megatron-LM "
                    f"checkpoint with {TRACKER}, an iter_* directory holding .metadata and common.pt, or mp_rank_* "
                    f"directories)")
