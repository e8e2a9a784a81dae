"""`megacli eval`: lm-evaluation-harness tasks on a megacli (or converted) checkpoint at any TP/PP."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from megacli.cli.common import TRUST_PICKLE_HELP, TRUST_TASK_CODE_HELP, SetOpt, guarded
from megacli.cli.root import app


def _opt(help: str, *names: str):
    return typer.Option(*names, help=help, show_default=False)


@app.command(name="eval", help="Run lm-evaluation-harness tasks on a checkpoint (needs megacli[eval]). "
                               "megacli eval CHECKPOINT --tasks a,b [...] | megacli eval --recipe RECIPE")
@guarded
def eval_(
    checkpoint: Annotated[Optional[Path], typer.Argument(help="Checkpoint directory; the model and tokenizer come from its recipe.", show_default=False)] = None,
    tasks: Annotated[Optional[str], _opt("Comma-separated harness task names.", "--tasks")] = None,
    num_fewshot: Annotated[Optional[int], _opt("Few-shot examples per prompt (default: the task's).", "--num-fewshot")] = None,
    limit: Annotated[Optional[int], _opt("At most this many documents per task.", "--limit")] = None,
    batch_size: Annotated[Optional[int], _opt("Requests run together (default 8).", "--batch-size")] = None,
    tensor: Annotated[Optional[int], _opt("Tensor-parallel size to run in (default 1).", "--tensor", "-t")] = None,
    pipeline: Annotated[Optional[int], _opt("Pipeline-parallel size to run in (default 1).", "--pipeline")] = None,
    include_path: Annotated[Optional[Path], _opt("Directory of custom task YAMLs (local data).", "--include-path")] = None,
    output: Annotated[Optional[Path], _opt("Write the harness's results JSON here.", "--output", "-o")] = None,
    recipe: Annotated[Optional[Path], _opt("YAML recipe with an `eval:` section (flags override it).", "--recipe")] = None,
    trust_task_code: Annotated[bool, typer.Option("--trust-task-code", help=TRUST_TASK_CODE_HELP)] = False,
    trusted: Annotated[bool, typer.Option("--trust-pickle", help=TRUST_PICKLE_HELP)] = False,
    set_: SetOpt = None,
) -> None:
    from megacli.cli.generate import build_recipe, launch_job
    from megacli.inference.evaluate import check_tasks

    flags = {"checkpoint": checkpoint and str(checkpoint), "num_fewshot": num_fewshot, "limit": limit,
             "batch_size": batch_size, "include_path": include_path and str(include_path), "output": output and str(output)}
    flags = {k: v for k, v in flags.items() if v is not None}
    if tasks is not None:
        flags["tasks"] = [t.strip() for t in tasks.split(",") if t.strip()]
    if trust_task_code:
        flags["trust_task_code"] = True
    job = build_recipe(recipe, flags, tensor=tensor, pipeline=pipeline, overrides=set_ or [], job="eval",
                       trusted=trusted)
    check_tasks(job.eval)  # before any model is loaded: unknown tasks, data not available
    launch_job(job, "eval")
