"""Where a training run starts: the checkpoint it resumes (checkpoint.resume) or the weights it
starts from (checkpoint.pretrained), with the refusals that keep earlier checkpoints safe, and
loading them into the built trainer."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint, weights_dir
from megacli.checkpoint.source import MEGATRON_LM, kind_of, user_source
from megacli.engine import checkpoint
from megacli.errors import UserError
from megacli.paths import shown


def pretrained_source(ck) -> Path | None:
    """The checkpoint whose weights a run starts from when there is nothing to resume (or None)."""
    if not ck.pretrained:
        return None
    found = checkpoint.find_checkpoint(ck.pretrained)
    if found is None and kind_of(ck.pretrained) == MEGATRON_LM:
        return weights_dir(user_source(ck.pretrained, ck))
    if found is None:
        raise UserError(f"checkpoint.pretrained = {shown(ck.pretrained)}: no checkpoint there (convert a Hugging Face "
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
        raise UserError(f"checkpoint.resume = {shown(ck.resume)}: no checkpoint there (expected a directory with "
                        f"'{checkpoint.LATEST}' or '{checkpoint.META}')")
    return found, None


@dataclass(frozen=True)
class Start:
    """Where training starts: a resumed checkpoint's position, or pretrained weights, or nothing."""

    iteration: int = 0
    consumed: int = 0
    run_id: str | None = None
    source: object | None = None  # the checkpoint resumed
    pretrained: object | None = None  # the weights started from, when nothing is resumed
    notes: tuple[str, ...] = ()  # what to say about the resume


def load_start(recipe, trainer) -> Start:
    """Load what checkpoint.resume / checkpoint.pretrained name into the built trainer (engine.loop.Trainer)."""
    ck = recipe.checkpoint
    source, resume_note = resume_source(ck)
    notes = (resume_note,) if resume_note else ()
    if source is None:
        pretrained = pretrained_source(ck)
        if pretrained is not None:
            checkpoint.load(source=user_source(pretrained, ck), chunks=trainer.chunks, optimizer=trainer.optimizer,
                            scheduler=trainer.scheduler, load_optimizer=False, verify=ck.verify)
        return Start(pretrained=pretrained, notes=notes)
    from megacli.engine.compat import check_resumable

    changes_note = check_resumable(source, recipe)
    restored = checkpoint.load(source=user_source(source, ck), chunks=trainer.chunks, optimizer=trainer.optimizer,
                               scheduler=trainer.scheduler, load_optimizer=ck.load_optimizer, verify=ck.verify)
    if recipe.data.on_the_fly and (restored.path / checkpoint.META).is_file():
        stream_notes = _resume_stream(trainer, checkpoint.read_meta(restored.path), restored.path)
        restored = replace(restored, notes=(*restored.notes, *stream_notes))
    notes += (f"resumed from {source} at iteration {restored.iteration}",) + ((changes_note,) if changes_note else ())
    notes += restored.notes
    if restored.iteration >= recipe.train.iters:
        notes += (f"nothing to train: the checkpoint is at iteration {restored.iteration} and train.iters = "
                  f"{recipe.train.iters} (raise train.iters, or set checkpoint.resume: none to start over)",)
    return Start(iteration=restored.iteration, consumed=restored.consumed_samples, run_id=restored.run_id, source=source,
                 notes=notes)


def _resume_stream(trainer, meta: dict, path) -> list[str]:
    """On-the-fly data: this rank's stream continues where the checkpoint's left off; the notes to say."""
    from megatron.core import parallel_state as ps

    from megacli.engine.stream_data import resumed_state

    trainer.train_data.start_state, notes = resumed_state(
        trainer.train_data, meta, checkpoint=path, dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size())
    return notes
