"""`megacli finetune`."""

from __future__ import annotations

from megacli.cli.root import app
from megacli.cli.common import DryRunOpt, RecipeArg, SetOpt, guarded


@app.command(help="Finetune from a checkpoint (checkpoint.pretrained, e.g. one from `megacli convert`) on "
                  "instruction data (sft:) or indexed data (data:), with the same engine as pretrain.")
@guarded
def finetune(recipe: RecipeArg = None, set_: SetOpt = None, dry_run: DryRunOpt = False) -> None:
    from megacli.cli.training import run_training_job

    run_training_job("finetune", recipe, set_ or [], dry_run)
