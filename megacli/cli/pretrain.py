"""`megacli pretrain`."""

from __future__ import annotations

from megacli.cli.root import app
from megacli.cli.common import DryRunOpt, RecipeArg, SetOpt, guarded


@app.command(help="Pretrain a GPT, BERT or T5 model from a recipe (default: the tiny GPT recipe on 4 CPU processes).")
@guarded
def pretrain(recipe: RecipeArg = None, set_: SetOpt = None, dry_run: DryRunOpt = False) -> None:
    from megacli.cli.training import run_training_job

    run_training_job("pretrain", recipe, set_ or [], dry_run)
