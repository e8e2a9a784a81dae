"""`megacli reshard`: change a checkpoint's TP/PP/VP/DP layout offline, in one process.

    reshard(SRC, DST, tensor=1, pipeline=1)     plan (tensor_plan.py), write to a temporary directory,
                                                 optionally verify, then rename into place
    verify(SRC, DST)                             every global tensor of DST against SRC (verification.py)
    checkpoint.contents.inspect(CKPT)            format, layout, iteration, recipe, tensors

DST is a checkpoint directory like the engine's: ``DST/latest`` names ``DST/iter_NNNNNNN/``, so
``checkpoint.resume=DST`` (or ``checkpoint.dir=DST``) continues training under the new layout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from megacli.checkpoint.layout import (
    RECIPE,
    fsync_dir,
    iter_name,
    tmp_sibling,
)
from megacli.checkpoint.megacli_checkpoint import Checkpoint, Layout
from megacli.checkpoint.replace import why_not_replaceable
from megacli.checkpoint.source import LEGACY, MEGACLI, MEGATRON_LM, Source, kind_of, locate, user_source
from megacli.checkpoint.writer import Plan, write_checkpoint
from megacli.errors import UserError
from megacli.reshard.tensor_plan import Target, build_plan, resolve_target
from megacli.reshard.verification import VerifyReport, verify_against, verify_plan


class VerifyFailed(UserError):
    """The target does not hold what the source does (exit 1)."""

    exit_code = 1


@dataclass
class Result:
    output: Path
    iteration_dir: Path
    source: Path
    source_layout: str
    target_layout: str
    tensors: int
    objects: int
    bytes: int
    seconds: float
    notes: list[str] = field(default_factory=list)
    verified: Optional[VerifyReport] = None
    format: str = "torch_dist"
    action: str = "resharded"


# ---------------------------------------------------------------- locating checkpoints


def find_source(path: str | Path) -> Path:
    """The iteration directory of a megacli checkpoint, or a Megatron-LM (legacy or torch_dist) checkpoint's path."""
    found, _ = locate(path)
    return found


def _stage(found: Source, kind: str, where: Path, progress) -> tuple[Path, list[str]]:
    """A checkpoint located as ``kind`` (checkpoint.source.locate): a Megatron-LM one staged as a
    megacli one (and what was left out); a megacli one as it is."""
    from megacli.checkpoint.megatron_lm import dist_staging, legacy_staging

    if kind == MEGATRON_LM:
        return dist_staging.import_to_staging(found, where=where)
    if kind == LEGACY:
        return legacy_staging.import_to_staging(found, where=where, progress=progress), []
    return found.path, []


def _check_output(output: Path, source: Path, overwrite: bool) -> None:
    """Refuse an output the reshard may not write: inside the source, or (checkpoint.replace's
    rule) one that cannot be replaced; an existing checkpoint only with --overwrite."""
    if source.resolve() in output.resolve().parents:
        raise UserError(f"{output} is inside the source checkpoint {source}; write somewhere else")
    reason = why_not_replaceable(output, reads=[source])
    if reason is not None:
        raise UserError(f"{output}: {reason}")
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise UserError(f"{output} already holds a checkpoint; pass --overwrite to replace it")


# ---------------------------------------------------------------- reshard


@contextlib.contextmanager
def _one_thread():
    """Resharding copies boxes of tensors; torch's intra-op threads only add synchronisation to
    such small copies (orders of magnitude on a busy machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reshard(job, *, source: Source | None = None,
            progress: Callable[[str, int], Callable[[str], None]] | None = None) -> Result:
    """Write ``job.source`` (a ReshardSection) under a new layout to ``job.output`` (a checkpoint
    directory with `latest`), atomically; ``source``: what to read there, when another command
    decided the user's trust in it (default: job.source with the job's own).

    ``progress(description, total)`` returns a callback called with each finished entry's key."""
    with _one_thread():
        return _reshard(job, source or user_source(job.source, job), progress)


def _reshard(job, source: Source, progress) -> Result:
    start = time.perf_counter()
    src_dir, src_kind = locate(source.path)
    output = Path(job.output)
    _check_output(output, src_dir, job.overwrite)
    from megacli.checkpoint.megatron_lm import legacy_staging, legacy_writer

    distributed_optimizer = job.distributed_optimizer
    if job.format == "legacy":
        if distributed_optimizer:
            raise UserError("the legacy format holds the standard optimizer's state; drop --distributed-optimizer "
                            "(Megatron-LM can still train the result with --use-distributed-optimizer after a torch_dist save)")
        distributed_optimizer = False
    if job.format == "megatron" and job.verify:
        raise UserError("--verify compares megacli checkpoints; for --format megatron, convert the result back "
                        "(`megacli convert DST BACK --to megacli`) and compare that")
    original = src_dir
    src_dir, import_notes = _stage(source.at(src_dir), src_kind, output.resolve().parent, progress)
    try:
        src = Checkpoint(source.at(src_dir))
        target = resolve_target(src.layout, src.section("parallel"), tensor=job.tensor, pipeline=job.pipeline,
                                virtual_pipeline=job.virtual_pipeline, data_parallel=job.data_parallel,
                                distributed_optimizer=distributed_optimizer, sequence_parallel=job.sequence_parallel,
                                overrides=tuple(job.target_set), num_layers=_num_layers(src))
        plan = build_plan(src, target)
        _check_precision(src, plan)
        if job.format == "legacy":
            legacy_writer.check_exportable(plan.recipe, src_dir)
        elif job.format == "megatron":
            from megacli.checkpoint.megatron_lm.dist_export import check_exportable

            check_exportable(plan.recipe, src_dir, job.spec)
        if original != src_dir:  # imported from Megatron-LM: name its checkpoint, not the staging copy
            fmt = "megatron-lm torch_dist" if src_kind == MEGATRON_LM else "megatron-lm torch"
            plan.meta["resharded_from"].update(path=str(original.resolve()), format=fmt)
            plan.notes[:0] = import_notes

        it_name = src_dir.name if src_dir.name.startswith("iter_") else iter_name(src.iteration)
        report = _write_output(job, plan, output, it_name, progress)
        return Result(output=output, iteration_dir=output / it_name, source=original, source_layout=str(src.layout),
                      target_layout=str(target.layout), tensors=len(plan.tensors), objects=len(plan.objects),
                      bytes=plan.total_bytes, seconds=time.perf_counter() - start, notes=plan.notes, verified=report,
                      format=job.format)
    finally:
        legacy_staging.cleanup_staging(src_dir)


def export_converted(job, plan: Plan, *, source_layout: str, progress=None) -> Result:
    """A conversion's plan (convert.weights_plan: weights read from another format) written as a
    Megatron-LM torch_dist checkpoint (``job``: a ReshardSection with format megatron), atomically."""
    from megacli.checkpoint.megatron_lm.dist_export import check_exportable

    start = time.perf_counter()
    output = Path(job.output)
    _check_output(output, plan.origin, job.overwrite)
    check_exportable(plan.recipe, plan.origin, job.spec)
    it_name = iter_name(plan.meta["iteration"])
    _write_output(job, plan, output, it_name, progress)
    p = plan.recipe.parallel
    layout = Layout(tensor=p.tensor, pipeline=p.pipeline, virtual_pipeline=p.virtual_pipeline,
                    data=plan.recipe.data_parallel_size, context=p.context, first_stage_layers=p.first_stage_layers,
                    last_stage_layers=p.last_stage_layers)
    return Result(output=output, iteration_dir=output / it_name, source=plan.origin, source_layout=source_layout,
                  target_layout=str(layout), tensors=len(plan.tensors), objects=len(plan.objects),
                  bytes=plan.total_bytes, seconds=time.perf_counter() - start, notes=plan.notes, format=job.format,
                  action="converted")


def _num_layers(src: Checkpoint) -> int:
    from megacli.recipe.model import ModelSection

    return int(src.section("model").get("num_layers", ModelSection.model_fields["num_layers"].default))


def _write_output(job, plan: Plan, output: Path, it_name: str, progress) -> VerifyReport | None:
    """Write the plan (then, for the legacy format, export it) beside ``output`` and move it into
    place. A failure leaves nothing behind, except an output that failed verification."""
    from megacli.checkpoint.megatron_lm import legacy_writer

    tmp, legacy_tmp = tmp_sibling(output, "reshard"), tmp_sibling(output, "legacy")
    for stale in (tmp, legacy_tmp):  # a previous reshard that did not finish
        if stale.exists():
            shutil.rmtree(stale)
    try:
        if job.format == "megatron":
            from megacli.checkpoint.megatron_lm.dist_export import export

            tmp.mkdir(parents=True)
            plan.notes.extend(export(plan, tmp, spec=job.spec, progress=progress))
            fsync_dir(tmp)
            _replace(tmp, output)
            return None
        # a legacy export reads the stage written here, then removes it: its recipe names the source's tokenizer
        it_dir = write_checkpoint(plan, tmp, it_name, progress, carry_tokenizer=job.format != "legacy")
        report = None
        if job.verify:
            report = verify_plan(plan, it_dir, progress)
            if not report.ok:
                raise VerifyFailed(report.line() + f" (the unverified output is left in {tmp})")
        if job.format == "legacy":
            plan.notes.extend(legacy_writer.export(plan.source.source.at(it_dir), legacy_tmp, spec=job.spec,
                                                      progress=progress))
            shutil.rmtree(tmp)
            tmp = legacy_tmp
        fsync_dir(tmp)
        _replace(tmp, output)
        return report
    except VerifyFailed:
        raise
    except BaseException:
        for partial in (tmp, legacy_tmp):
            shutil.rmtree(partial, ignore_errors=True)
        raise


def _check_precision(src: Checkpoint, plan: Plan) -> None:
    before = (src.section("train").get("precision") or "bf16")
    after = plan.recipe.train.precision
    if before != after:
        raise UserError(f"train.precision {before} → {after}: reshard changes the layout, not the precision "
                        f"(the optimizer state differs between them)")


def _replace(tmp: Path, output: Path) -> None:
    """Move the finished directory into place; an existing output is moved aside first and removed
    only once the new one is there."""
    old = None
    if output.exists():
        old = tmp_sibling(output, "old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(output, old)
    output.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, output)
    fsync_dir(output.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- verify


def verify(source: Source, target: Source, *, progress=None) -> VerifyReport:
    """Rebuild the plan SRC → (TARGET's layout and optimizer kind) and compare every entry of
    TARGET with what the plan says it must hold."""
    with _one_thread():
        return _verify(source, target, progress=progress)


def _verify(source: Source, target: Source, *, progress) -> VerifyReport:
    from megacli.checkpoint.layout import find_checkpoint
    from megacli.checkpoint.megatron_lm import legacy_staging

    src_dir, src_kind = locate(source.path)
    tgt_path = target.path
    tgt_kind = kind_of(tgt_path) if tgt_path.exists() else None
    if tgt_kind not in (MEGACLI, MEGATRON_LM, LEGACY):
        raise UserError(f"{tgt_path}: not a checkpoint (megacli, Megatron-LM torch_dist or legacy)")
    where = tgt_path.resolve().parent
    tgt_dir, _ = _stage(target.at(find_checkpoint(tgt_path)) if tgt_kind == MEGACLI else target, tgt_kind, where,
                        progress)
    try:
        staged_src, _ = _stage(source.at(src_dir), src_kind, where, progress)
    except BaseException:
        legacy_staging.cleanup_staging(tgt_dir)
        raise
    try:
        src = Checkpoint(source.at(staged_src))
        tgt = Checkpoint(target.at(tgt_dir))
        t_par = tgt.section("parallel")
        from megacli.recipe.base import validate
        from megacli.recipe.pretrain import TrainingRecipe

        recipe = validate(TrainingRecipe, tgt.recipe_raw, str(tgt.path / RECIPE))
        spec = Target(layout=tgt.layout, distributed_optimizer=bool(t_par.get("distributed_optimizer", False)),
                      sequence_parallel=recipe.parallel.sp_enabled)
        return verify_against(build_plan(src, spec, recipe), tgt, progress)
    finally:
        legacy_staging.cleanup_staging(staged_src)
        legacy_staging.cleanup_staging(tgt_dir)
