"""The `megacli` command: one small module per subcommand, each loading a recipe and making one
engine call. Subcommand modules import only typer/pydantic at module level so --help is instant."""

from __future__ import annotations

import typer
import typer.core

# Plain click help: rich-formatted help costs ~0.2 s of imports, and --help must be instant.
typer.core.HAS_RICH = False

ORDER = ["preprocess", "pretrain", "finetune", "plot", "generate", "convert", "reshard"]


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


def _register() -> None:
    import megacli.cli.preprocess  # noqa: F401
    import megacli.cli.pretrain  # noqa: F401
    import megacli.cli.finetune  # noqa: F401
    import megacli.cli.plot  # noqa: F401
    import megacli.cli.generate  # noqa: F401
    import megacli.cli.convert  # noqa: F401
    import megacli.cli.reshard  # noqa: F401


def main() -> None:
    _register()
    app()
