"""What every subcommand shares: the recipe arguments, error rendering, and a group that runs a
default command when the first word is not one of its subcommands (``megacli preprocess RECIPE``
beside ``megacli preprocess merge ...``)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, Callable, List, Optional

import typer
from typer.core import TyperGroup

RecipeArg = Annotated[Optional[Path], typer.Argument(help="YAML recipe (omit for the built-in default where there is one).", show_default=False)]
SetOpt = Annotated[Optional[List[str]], typer.Option("--set", "-s", help="Override a recipe field: dotted.key=value (repeatable).", show_default=False)]
TRUST_PICKLE_HELP = ("Unpickle any object the checkpoint holds (by default only tensors and known-safe types; a pickle "
                     "can run code: only for checkpoints you trust).")
TRUST_TASK_CODE_HELP = ("Let --include-path task YAMLs run Python (!function, or a metric Hugging Face evaluate loads) "
                        "and render task templates outside Jinja's sandbox; without it such a task is refused. Only "
                        "for task files you trust.")
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the resolved recipe, layout and memory estimate; do not run.")]


# Into a file or pipe rich assumes 80 columns and folds table cells to fit; this is wider than any
# table, so each is laid out at its content's width and no cell (a tensor name, a path) wraps.
UNWRAPPED_WIDTH = 100_000


def output_console(**kwargs):
    """The console tables and plans print to: as wide as the terminal, or unwrapped into a file or
    pipe (one table row per line, for grep and for reading)."""
    from rich.console import Console

    console = Console(highlight=False, **kwargs)
    if not console.is_terminal:
        console.width = UNWRAPPED_WIDTH
    return console


def fail(message: str, code: int = 2) -> "typer.Exit":
    """Print one error line; the message is plain text (paths and values may hold "[x]" or ":smile:"),
    cut to a readable length (megacli.errors.readable)."""
    from rich.console import Console
    from rich.text import Text

    from megacli.errors import readable

    Console(stderr=True, highlight=False, emoji=False).print(Text.assemble(("error:", "bold red"), " ",
                                                                           readable(message)), soft_wrap=True)
    return typer.Exit(code)


def guarded(fn: Callable) -> Callable:
    """Turn recipe and user errors into one message and exit code 2 instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from megacli.errors import UserError
        from megacli.recipe.base import RecipeErrors

        try:
            return fn(*args, **kwargs)
        except RecipeErrors as exc:
            raise fail(exc.render()) from None
        except UserError as exc:
            raise fail(str(exc), getattr(exc, "exit_code", 2)) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None

    return wrapper


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


class DefaultCommandGroup(TyperGroup):
    """A group whose first argument, when it is not a subcommand name, goes to ``default_command``."""

    default_command = "run"

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx, formatter):
        formatter.write_usage(ctx.command_path, "[RECIPE] [OPTIONS] | COMMAND [ARGS]...")


def is_help_request() -> bool:
    return any(a in ("--help", "-h") for a in sys.argv[1:])


def write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling renamed into place (never half a file)."""
    import os
    import tempfile

    from megacli.errors import UserError

    if not path.parent.is_dir():
        raise UserError(f"{path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
