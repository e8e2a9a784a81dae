"""The root ``megacli`` command group, on which every subcommand module registers its command."""

from __future__ import annotations

import typer
import typer.core

# Plain click help: rich-formatted help costs ~0.2 s of imports, and --help must be instant.
typer.core.HAS_RICH = False

ORDER = ["preprocess", "plan", "pretrain", "finetune", "submit", "plot", "generate", "eval", "serve", "convert", "reshard", "recipe"]


class OrderedGroup(typer.core.TyperGroup):
    """Lists subcommands in pipeline order (data → train → use → move), not alphabetically."""

    def list_commands(self, ctx):
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))


app = typer.Typer(
    name="megacli",
    cls=OrderedGroup,
    help="Megatron-Core pretraining behind a clean command line. Each subcommand reads a YAML recipe (plus --set overrides).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
