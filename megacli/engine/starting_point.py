"""Where a training run starts: the checkpoint it resumes (checkpoint.resume) or the weights it
starts from (checkpoint.pretrained), with the refusals that keep earlier checkpoints safe."""

from __future__ import annotations

from pathlib import Path

from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint, weights_dir
from megacli.checkpoint.source import MEGATRON_LM, kind_of, user_source
from megacli.engine import checkpoint
from megacli.errors import UserError


def pretrained_source(ck) -> Path | None:
    """The checkpoint whose weights a run starts from when there is nothing to resume (or None)."""
    if not ck.pretrained:
        return None
    found = checkpoint.find_checkpoint(ck.pretrained)
    if found is None and kind_of(ck.pretrained) == MEGATRON_LM:
        return weights_dir(user_source(ck.pretrained, ck))
    if found is None:
        raise UserError(f"checkpoint.pretrained = {ck.pretrained!r}: no checkpoint there (convert a Hugging Face "
                        f"model with `megacli convert`, or give a megacli or Megatron-LM torch_dist checkpoint directory)")
    return found


def resume_source(ck) -> tuple[Path | None, str | None]:
    """The checkpoint to start from (or None) and a note to print. resume: auto uses ck.dir's latest,
    or, with `latest` gone, its newest complete iteration; resume: none refuses a directory that
    already holds checkpoints unless checkpoint.overwrite is set."""

    saved = checkpoint.saved_iterations(ck.dir) if ck.dir else []
    has_pointer = bool(ck.dir) and (Path(ck.dir) / checkpoint.LATEST).is_file()
    if ck.resume == "none":
        if (saved or has_pointer) and not ck.overwrite:
            held = ("..., " if len(saved) > 3 else "") + (", ".join(p.name for p in saved[-3:]) or checkpoint.LATEST)
            raise UserError(f"checkpoint.dir {ck.dir} already holds checkpoints ({held}) and checkpoint.resume = none: "
                            f"set checkpoint.resume: auto "
                            f"to continue them, checkpoint.overwrite: true to save over them, or another checkpoint.dir")
        return None, None
    if ck.resume == "auto":
        found = checkpoint.find_checkpoint(ck.dir) if ck.dir and Path(ck.dir).exists() else None
        if found is not None or not saved:
            return found, None
        complete = [p for p in saved if (p / checkpoint.META).is_file()]
        if not complete:
            raise UserError(f"checkpoint.dir {ck.dir} has no '{checkpoint.LATEST}' and none of its iterations "
                            f"({', '.join(p.name for p in saved)}) is complete (no {checkpoint.META}): nothing to resume. "
                            f"Remove them, or set checkpoint.resume: none with checkpoint.overwrite: true to start over")
        return complete[-1], (f"{Path(ck.dir) / checkpoint.LATEST} is missing: resuming from the newest complete "
                              f"checkpoint, {complete[-1].name}")
    found = checkpoint.find_checkpoint(ck.resume)
    if found is None and kind_of(ck.resume) == MEGATRON_LM:
        return MegatronLMCheckpoint(user_source(ck.resume, ck)).it_dir, None
    if found is None:
        raise UserError(f"checkpoint.resume = {ck.resume!r}: no checkpoint there (expected a directory with "
                        f"'{checkpoint.LATEST}' or '{checkpoint.META}')")
    return found, None
