"""What `pretrain` and `finetune` share: load the recipe, print the plan (--dry-run), or start the
workers (our own launcher, or in-process under torchrun / srun)."""

from __future__ import annotations

import os
from pathlib import Path


def run_training_job(job: str, recipe_path: Path | None, overrides: list[str], dry_run: bool) -> None:
    from megacli.recipe.jobs import load_job_recipe

    recipe = load_job_recipe(job, recipe_path, overrides)
    recipe.check_trainable()
    from megacli.engine.core_compat import check_optimizer_available

    check_optimizer_available(recipe.optim)
    if job == "finetune" and not recipe.checkpoint.pretrained:
        from megacli.errors import UserError

        raise UserError("finetune needs checkpoint.pretrained, the weights to start from (e.g. a checkpoint from "
                        "`megacli convert`); to train from scratch use `megacli pretrain`")
    if dry_run:
        from megacli.cli.plan_view import print_plan

        if recipe.data.on_the_fly:
            from megacli.data.stream import check_sources

            check_sources(recipe)
        print_plan(recipe)
        _say_missing_files(recipe)
        return
    from megacli import launch, rundir

    check_inputs(recipe)
    ln = recipe.launch
    job_id = launch.job_id(given=ln.job_id, rdzv_endpoint=ln.rdzv_endpoint)
    directories = {"run.dir": recipe.run.dir, **({"checkpoint.dir": recipe.checkpoint.dir} if recipe.checkpoint.dir else {})}
    with rundir.locked(directories, job_id=job_id):
        _run(job, recipe, job_id)


def _run(job: str, recipe, job_id: str) -> None:
    from megacli import launch, rundir

    if launch.inside_torchrun() or launch.inside_srun_per_process():
        if not launch.inside_torchrun():
            os.environ.update(launch.slurm_to_torch_env(dict(os.environ)))
        from megacli.worker import run_guarded

        rundir.prepare(recipe, recipe.run.dir) if os.environ.get("RANK") == "0" else None
        code = run_guarded(job, recipe)
        if code:
            raise launch.first_worker_error(recipe.run.dir)
        return
    recipe_file = rundir.prepare(recipe, recipe.run.dir)
    ln = recipe.launch
    if ln.nproc * ln.nnodes == 1 and os.environ.get("MEGACLI_IN_PROCESS"):
        # Tests: run the single worker in this process (same code path, no subprocess).
        from megacli.worker import run_job

        with launch.as_single_worker():
            run_job(job, recipe)
        return
    launch.launch_workers(job, recipe_file, run_dir=recipe.run.dir, nproc=ln.nproc, nnodes=ln.nnodes,
                          node_rank=ln.node_rank, rdzv_endpoint=ln.rdzv_endpoint, job_id=job_id,
                          timeout_minutes=ln.timeout_minutes)


def missing_files(recipe) -> list[str]:
    """What is wrong with each file the recipe names that does not exist: indexed data prefixes,
    instruction data, pretrained weights, the tokenizer."""
    from megacli.paths import shown

    problems = []
    named = {f"data.valid.{name}": prefix for name, prefix in recipe.data.named_valid.items()}
    for field, prefix in [("data prefix", p) for p in recipe.data.prefixes] + list(named.items()):
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not Path(p).is_file()]
        if missing:
            problems.append(f"{field} {shown(prefix)}: missing {' and '.join(missing)} "
                            f"(build it with `megacli preprocess`; the prefix is the path without .bin/.idx)")
    sft = getattr(recipe, "sft", None)
    files = [("sft data", sft.train), ("sft data", sft.valid_file),
             *((f"sft.valid.{name}", path) for name, path in sft.named_valid.items())] if sft else []
    problems += [f"{field} {shown(path)} does not exist" for field, path in files if path and not Path(path).is_file()]
    ck = recipe.checkpoint
    if ck.pretrained and not Path(ck.pretrained).exists():
        problems.append(f"checkpoint.pretrained {shown(ck.pretrained)} does not exist")
    tok = recipe.tokenizer
    if tok.type in ("huggingface", "sentencepiece", "wordpiece") and not Path(tok.path).exists():
        problems.append(f"tokenizer.path {shown(tok.path)} does not exist")
    return problems


def _say_missing_files(recipe) -> None:
    """--dry-run: the files a run would stop at (a dry run plans without them)."""
    from megacli.cli.common import output_console

    console = output_console()
    for problem in missing_files(recipe):
        console.print(f"note: a run would refuse this: {problem}", soft_wrap=True, markup=False, highlight=False)


def check_inputs(recipe) -> None:
    """Fail before starting workers when a named file is missing or malformed."""
    from megacli.errors import UserError

    pref = getattr(recipe, "preference", None)
    if pref is not None:
        from megacli.data.preference import read_pairs

        for path in [pref.train, pref.valid_file, *pref.named_valid.values()]:
            if path:
                read_pairs(path)  # a malformed pair stops the run here, named by file:line
    problems = missing_files(recipe)
    if problems:
        raise UserError(problems[0])
    _check_pickles(recipe.checkpoint)
    if recipe.eval is not None:
        from megacli.inference.evaluate import check_tasks

        check_tasks(recipe.eval)  # the harness is installed, the tasks are known and their data loads
    if recipe.data.on_the_fly:
        from megacli.data.stream import check_sources

        check_sources(recipe)


def _check_pickles(ck) -> None:
    """Refuse checkpoints the run may load whose pickles could run code, once, before any worker
    unpickles them (each worker checks again before loading)."""
    from megacli.checkpoint.safe_pickle import check_checkpoint
    from megacli.checkpoint.source import user_source

    resume = {"none": None, "auto": ck.dir}.get(ck.resume, ck.resume)
    for path in (resume, ck.pretrained):
        if path:
            check_checkpoint(user_source(path, ck))
