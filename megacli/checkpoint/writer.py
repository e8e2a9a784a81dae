"""The one writer of megacli's checkpoint format for offline tools (convert, reshard).

A ``Plan`` says what a checkpoint holds: lazy tensor entries (each produces any box of its global
tensor on demand), sharded objects, the common state, the recipe and ``megacli.json``. ``write_plan``
writes it as one iteration directory (torch_dist shards, common.pt, recipe.yaml, megacli.json and,
for a conversion, manifest.json as the engine's saves have it); ``write_checkpoint`` adds the
``latest`` pointer beside it. Both write into a directory the caller renames into place once it is
complete, so nothing half-written is published.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megacli.checkpoint import manifest
from megacli.checkpoint.layout import LATEST, META, RECIPE, fsync_dir
from megacli.checkpoint.megacli_checkpoint import Checkpoint, Layout
from megacli.checkpoint.torch_dist import ObjectEntry, TensorEntry, tensor_nbytes, write_torch_dist


@dataclass(frozen=True)
class Target:
    """The layout a reshard writes, and its optimizer kind."""

    layout: Layout
    distributed_optimizer: bool
    sequence_parallel: bool
    overrides: tuple[str, ...] = ()


@dataclass
class Plan:
    """A checkpoint to write. ``source``/``target``: the checkpoint and layout a reshard plans
    from and for (None for a conversion, whose tensors come from another format)."""

    source: Optional[Checkpoint]
    target: Optional[Target]
    recipe: object
    tensors: list[TensorEntry]
    objects: list[ObjectEntry]
    common: dict
    meta: dict
    notes: list[str] = field(default_factory=list)

    @property
    def origin(self) -> Path:
        """What the plan's tensors are read from (for messages)."""
        return self.source.path if self.source is not None else Path(self.meta["converted_from"]["path"])

    @property
    def total_bytes(self) -> int:
        return sum(tensor_nbytes(t.shape, t.dtype) for t in self.tensors)


def write_plan(plan: Plan, it_dir: Path, progress=None, *, with_manifest: bool = False, carry_tokenizer: bool = True) -> None:
    """The torch_dist shards, common state, recipe.yaml, megacli.json and (``with_manifest``),
    last, the manifest of them all into an existing empty directory. ``carry_tokenizer``: copy the
    recipe's tokenizer beside it (megacli.checkpoint.carried); not for a stage exported then removed."""
    from megacli.checkpoint.carried import carry
    from megacli.recipe.base import dump

    done = progress("writing", len(plan.tensors) + len(plan.objects)) if progress else (lambda key: None)
    write_torch_dist(it_dir, plan.tensors, plan.objects, plan.common, on_done=done)
    tokenizer = carry(it_dir.parent, plan.recipe.tokenizer) if carry_tokenizer else None
    (it_dir / RECIPE).write_text(dump(plan.recipe, carried=True, tokenizer=tokenizer))
    (it_dir / META).write_text(json.dumps(plan.meta, indent=2) + "\n")
    if with_manifest:
        manifest.write(it_dir, [manifest.describe(it_dir, manifest.files_of_rank(it_dir, 0, 1))])
    fsync_dir(it_dir)


def write_checkpoint(plan: Plan, root: Path, it_name: str, progress=None, *, with_manifest: bool = False,
                     carry_tokenizer: bool = True) -> Path:
    """``root/it_name`` (write_plan) and ``root/latest`` naming it, in ``root`` (an unpublished
    directory). Returns the iteration directory."""
    it_dir = root / it_name
    it_dir.mkdir(parents=True)
    write_plan(plan, it_dir, progress, with_manifest=with_manifest, carry_tokenizer=carry_tokenizer)
    (root / LATEST).write_text(it_name + "\n")
    fsync_dir(root)
    return it_dir
