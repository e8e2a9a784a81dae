"""The `megacli` command: one small module per subcommand, each loading a recipe and making one
engine call. Subcommand modules import only typer/pydantic at module level so --help is instant."""

from __future__ import annotations

from megacli.cli.root import app


def _register() -> None:
    import megacli.cli.preprocess  # noqa: F401
    import megacli.cli.pretrain  # noqa: F401
    import megacli.cli.finetune  # noqa: F401
    import megacli.cli.plot  # noqa: F401
    import megacli.cli.generate  # noqa: F401
    import megacli.cli.eval  # noqa: F401
    import megacli.cli.serve  # noqa: F401
    import megacli.cli.convert  # noqa: F401
    import megacli.cli.reshard  # noqa: F401
    import megacli.cli.recipe  # noqa: F401
    import megacli.cli.submit  # noqa: F401
    import megacli.cli.plan  # noqa: F401


def main() -> None:
    from megacli.lifetime import exit_now

    _register()
    try:
        app()
    except SystemExit as done:
        if not isinstance(done.code, (int, type(None))):
            raise
        exit_now(done.code or 0)
