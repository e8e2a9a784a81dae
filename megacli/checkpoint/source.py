"""A checkpoint to read. ``kind_of`` is the one place megacli tells its formats apart: a megacli
checkpoint (run or iteration directory), Megatron-LM's torch_dist or legacy (``--ckpt-format torch``)
one, a Hugging Face model directory. A Source carries the user's trust decision (``--trust-pickle``)
to what reads it; ``user_source`` is the one place it is made from the user's choice."""

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
    """A checkpoint to read at ``path`` and the user's trust in it: ``trust``, unpickle what it
    holds without the allow-list (their --trust-pickle). Its ``kind`` (megacli, megatron-lm, legacy,
    hf; None: none of them) and, for a megacli checkpoint, its iteration directory ``ckpt`` are
    recognised when first asked. What reads a checkpoint takes its Source and passes ``trust`` on."""

    path: Path
    trust: bool = False

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    def at(self, path: str | Path) -> Source:
        """``path`` (this checkpoint's iteration directory, a staged copy of it, the base it names)
        read with this one's trust."""
        return Source(Path(path), self.trust)

    @functools.cached_property
    def kind(self) -> str | None:
        return kind_of(self.path)

    @functools.cached_property
    def ckpt(self) -> Path | None:
        return find_checkpoint(self.path) if self.kind == MEGACLI else None

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


def user_source(path: str | Path, trusted) -> Source:
    """The checkpoint the user named at ``path``, with the trust they gave it: ``trusted`` is their
    --trust-pickle flag, or the recipe section (checkpoint, convert, reshard) that holds their choice.
    Commands and the engine make every Source they read from here; readers only pass it on."""
    from megacli.recipe.trust import trusts_pickles

    return Source(Path(path), trusted if isinstance(trusted, bool) else trusts_pickles(trusted))


def locate(path: str | Path) -> tuple[Path, str]:
    """A checkpoint at ``path``: (the megacli iteration directory, "megacli"), or (``path``,
    "megatron-lm") for Megatron-LM's torch_dist format, or (``path``, "legacy") for its legacy one."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such checkpoint")
    source = Source(path)
    if source.kind not in (None, HF):
        return source.ckpt or path, source.kind
    raise UserError(f"{path}: not a checkpoint (expected a directory with '{LATEST}' or '{META}', or a Megatron-LM "
                    f"checkpoint with {TRACKER}, an iter_* directory holding .metadata and common.pt or "
                    f"metadata.json, or mp_rank_* directories)")
