"""`megacli reshard`: move a checkpoint to another TP/PP/VP/DP layout offline; `inspect` and
`verify` beside it."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from megacli.cli.root import app
from megacli.cli.common import TRUST_PICKLE_HELP, DefaultCommandGroup, SetOpt, guarded

reshard_app = typer.Typer(
    cls=DefaultCommandGroup,
    help="Change a checkpoint's tensor/pipeline/data-parallel layout offline, optimizer state included "
         "(one process, any machine).\n\n"
         "megacli reshard SRC DST --tensor N --pipeline M [...] | megacli reshard RECIPE | "
         "megacli reshard inspect CKPT | megacli reshard verify SRC DST",
    no_args_is_help=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(reshard_app, name="reshard")

_TARGET = "target layout (default: the source's)"


@reshard_app.command("run", help="Write SRC under a new layout to DST (a checkpoint directory), or run a reshard RECIPE "
                                 "(the default command). --set reshard.FIELD=V edits the job; any other --set "
                                 "(train.micro_batch_size=2, ...) edits the recipe.yaml written with the checkpoint.")
@guarded
def run_command(
    paths: Annotated[Optional[List[str]], typer.Argument(help="SRC DST (checkpoints), or a RECIPE (.yaml).", show_default=False)] = None,
    tensor: Annotated[Optional[int], typer.Option("--tensor", "-t", min=1, help="Tensor-parallel size.", rich_help_panel=_TARGET, show_default=False)] = None,
    pipeline: Annotated[Optional[int], typer.Option("--pipeline", "-p", min=1, help="Pipeline-parallel size.", rich_help_panel=_TARGET, show_default=False)] = None,
    virtual_pipeline: Annotated[Optional[int], typer.Option("--virtual-pipeline", min=1, help="Model chunks per pipeline stage (1 = no interleaving).", rich_help_panel=_TARGET, show_default=False)] = None,
    data_parallel: Annotated[Optional[int], typer.Option("--data-parallel", "-d", min=1, help="Data-parallel size (sets launch.nproc).", rich_help_panel=_TARGET, show_default=False)] = None,
    distributed_optimizer: Annotated[Optional[bool], typer.Option("--distributed-optimizer/--no-distributed-optimizer", help="Optimizer state for the distributed (ZeRO-1) or the standard optimizer.", rich_help_panel=_TARGET, show_default=False)] = None,
    sequence_parallel: Annotated[Optional[bool], typer.Option("--sequence-parallel/--no-sequence-parallel", help="parallel.sequence_parallel of the written recipe.", rich_help_panel=_TARGET, show_default=False)] = None,
    output_format: Annotated[Optional[str], typer.Option("--format", help="torch_dist (megacli), legacy (Megatron-LM --ckpt-format torch) or megatron (Megatron-LM --ckpt-format torch_dist).", show_default=False)] = None,
    spec: Annotated[Optional[str], typer.Option("--spec", help="--format megatron or legacy: the Megatron-LM layer spec, te (default) or local.", show_default=False)] = None,
    overwrite: Annotated[Optional[bool], typer.Option("--overwrite", help="Replace DST when it is a checkpoint and holds nothing else, once the new one is complete.", show_default=False)] = None,
    verify: Annotated[Optional[bool], typer.Option("--verify", help="Compare every reassembled global tensor with the source before publishing.", show_default=False)] = None,
    progress: Annotated[Optional[bool], typer.Option("--progress/--no-progress", help="Show the progress bar.", show_default=False)] = None,
    trusted: Annotated[Optional[bool], typer.Option("--trust-pickle", help=TRUST_PICKLE_HELP, show_default=False)] = None,
    set_: SetOpt = None,
) -> None:
    from pathlib import Path

    from megacli.errors import UserError
    from megacli.recipe import trust
    from megacli.recipe.base import apply_overrides, read_yaml, validate
    from megacli.recipe.reshard import ReshardRecipe

    paths = paths or []
    if len(paths) == 1 and Path(paths[0]).suffix in (".yaml", ".yml"):
        recipe_path = Path(paths[0])
        raw = read_yaml(recipe_path)
        source = str(recipe_path)
    elif len(paths) == 2:
        raw, source = {"reshard": {"source": paths[0], "output": paths[1]}}, "(command line)"
    elif len(paths) == 1:
        raise UserError(f"{paths[0]}: give SRC and DST (or a .yaml reshard recipe); see megacli reshard --help")
    else:
        raise UserError("give SRC DST --tensor N --pipeline M, or a reshard RECIPE (see megacli reshard --help)")
    section = dict(raw.get("reshard") or {})
    given = {"tensor": tensor, "pipeline": pipeline, "virtual_pipeline": virtual_pipeline, "data_parallel": data_parallel,
             "distributed_optimizer": distributed_optimizer, "sequence_parallel": sequence_parallel,
             "format": output_format, "spec": spec, "overwrite": overwrite, "verify": verify, "progress": progress}
    section.update({k: v for k, v in given.items() if v is not None})
    raw["reshard"] = section
    if trusted:
        trust.grant_pickles(raw, "reshard")
    job_sets = [s for s in set_ or [] if s.split("=", 1)[0].strip().startswith("reshard.")]
    target_sets = [s for s in set_ or [] if s not in job_sets]
    raw = apply_overrides(raw, job_sets)
    if target_sets:
        raw["reshard"]["target_set"] = list(raw["reshard"].get("target_set") or []) + target_sets
    if set_:
        source += " with --set " + " ".join(set_)
    job = validate(ReshardRecipe, raw, source).reshard
    run_reshard(job)


def run_reshard(job) -> None:
    from megacli.cli.common import output_console
    from megacli.reshard import reshard
    from megacli.reshard.view import progress_bars, print_result

    with progress_bars(job.progress) as bars:
        result = reshard(job, progress=bars)
    print_result(result, output_console())


@reshard_app.command("inspect", help="Show a checkpoint: format, layout, iteration, recipe and its tensors (global shape, "
                                     "dtype, how they are split).")
@guarded
def inspect_command(
    checkpoint: Annotated[str, typer.Argument(help="Checkpoint directory (with `latest`), iteration directory, or Megatron-LM checkpoint.", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")] = False,
    trusted: Annotated[bool, typer.Option("--trust-pickle", help=TRUST_PICKLE_HELP)] = False,
) -> None:
    import json

    from megacli.checkpoint.contents import inspect
    from megacli.checkpoint.source import user_source
    from megacli.cli.common import output_console
    from megacli.reshard.inspect_tables import render

    info = inspect(user_source(checkpoint, trusted))
    if as_json:
        typer.echo(json.dumps(info, indent=2, default=str))
    else:
        render(info, output_console())


@reshard_app.command("verify", help="Check that DST holds SRC's state: each checkpoint's files against its manifest, then "
                                    "every reassembled global tensor of both by checksum (exit 1 on a mismatch).")
@guarded
def verify_command(
    source: Annotated[str, typer.Argument(help="The original checkpoint.", show_default=False)],
    target: Annotated[str, typer.Argument(help="The resharded checkpoint.", show_default=False)],
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show the progress bar.")] = True,
    trusted: Annotated[bool, typer.Option("--trust-pickle", help=TRUST_PICKLE_HELP)] = False,
) -> None:
    from rich.console import Console

    from megacli.checkpoint import manifest
    from megacli.checkpoint.source import user_source
    from megacli.errors import UserError
    from megacli.reshard import verify
    from megacli.reshard.view import progress_bars

    console = Console(highlight=False, soft_wrap=True)
    try:  # each checkpoint's files against its own manifest first
        checked = [manifest.verify(path) for path in (source, target)]
    except UserError as mismatch:
        console.print(f"verify: FAILED - {mismatch}", markup=False)
        raise typer.Exit(1) from None
    with progress_bars(progress) as bars:
        report = verify(user_source(source, trusted), user_source(target, trusted), progress=bars)
    console.print(report.line(), markup=False)
    for line in filter(None, checked):
        console.print(line, markup=False)
    if not report.ok:
        raise typer.Exit(1)
