"""Worker process entry: `python -m megacli.worker JOB RECIPE.yaml`.

The recipe file is the resolved recipe the CLI wrote into the run directory, so every worker
runs exactly what the user saw validated. Imports stay inside main(): Megatron's async checkpoint
writer spawns processes that import this module.
"""

from __future__ import annotations

import sys
import traceback


def run_job(job: str, recipe) -> None:
    """Run one job in this (already launched) process."""
    if job in ("pretrain", "finetune"):
        from megacli.engine.loop import train

        harness = None
        if recipe.eval is not None:
            from megacli.inference.evaluate import InTraining as harness
        train(recipe, harness=harness)
    elif job == "generate":
        from megacli.inference.job import run

        run(recipe)
    elif job == "eval":
        from megacli.inference.evaluate import run

        run(recipe)
    elif job == "serve":
        from megacli.inference.serve.job import run

        run(recipe)
    else:
        raise ValueError(f"unknown job {job!r}")


def run_guarded(job: str, recipe) -> int:
    """run_job, recording an error for the launcher instead of printing a traceback on every rank."""
    from megacli.rundir import record_worker_error

    try:
        run_job(job, recipe)
        return 0
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:  # every failure is reported through the launcher
        code = record_worker_error(recipe.run.dir, exc, traceback.format_exc())
        import os

        if os.environ.get("MEGACLI_IN_PROCESS"):
            raise
        return code


def main(argv: list[str] | None = None) -> int:
    from megacli.lifetime import worker_dies_with_launcher

    worker_dies_with_launcher()
    job, recipe_file = (argv or sys.argv[1:])[:2]
    from megacli.recipe.jobs import load_job_recipe

    recipe = load_job_recipe(job, recipe_file)
    return run_guarded(job, recipe)


if __name__ == "__main__":
    from megacli.lifetime import exit_now

    exit_now(main())
elif __name__ == "__mp_main__":  # a helper process a worker spawned (Megatron's checkpoint writers)
    from megacli.lifetime import die_with_parent

    die_with_parent()
