"""`megacli submit`: a training recipe as a Slurm batch job."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from megacli.cli.common import RecipeArg, SetOpt, guarded
from megacli.cli.root import app

JobOpt = Annotated[str, typer.Option("--job", help="The training command the job runs: pretrain or finetune.")]
SbatchArgs = Annotated[Optional[List[str]], typer.Argument(help="More sbatch options, after --.", show_default=False)]
ScriptOnlyOpt = Annotated[bool, typer.Option("--dry-run", help="Print the sbatch script; write and submit nothing.")]


@app.command(help="Submit a training recipe to Slurm: write an sbatch script from its launch section and run sbatch.")
@guarded
def submit(recipe: RecipeArg = None, sbatch_args: SbatchArgs = None, set_: SetOpt = None, job: JobOpt = "pretrain",
           dry_run: ScriptOnlyOpt = False) -> None:
    from megacli import slurm
    from megacli.errors import UserError
    from megacli.recipe.jobs import load_job_recipe

    if job not in ("pretrain", "finetune"):
        raise UserError(f"--job {job!r}: expected pretrain or finetune")
    loaded = load_job_recipe(job, recipe, set_ or [])
    loaded.check_trainable()
    extra = list(sbatch_args or [])
    if dry_run:
        recipe_file = slurm.script_dir(loaded.run.dir) / slurm.RECIPE_FILE
        gpus = slurm.gpus_per_node(loaded.launch, None)
        typer.echo(slurm.batch_script(loaded, job=job, recipe_file=recipe_file, gpus=gpus, extra=extra), nl=False)
        return
    from megacli.cli.training import check_inputs

    check_inputs(loaded)  # a missing file is named here, not after a wait in the queue
    done = slurm.submit(loaded, job=job, extra=extra)
    typer.echo(f"submitted job {done.job_id}: {loaded.launch.nnodes} node(s) × {loaded.launch.nproc} task(s)\n"
               f"script:  {done.script}\n"
               f"log:     {done.output} (errors: {done.error})\n"
               f"follow:  tail -f {done.output}   (squeue -j {done.job_id} for its state)\n"
               f"stop:    scancel --full --signal=TERM {done.job_id}   (saves at the next step boundary; "
               f"`scancel {done.job_id}` stops at once)")
