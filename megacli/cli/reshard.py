"""`megacli reshard`."""

from __future__ import annotations

from megacli.cli import app
from megacli.cli.common import RecipeArg, SetOpt, fail


@app.command(help="(not available in this version yet)")
def reshard(recipe: RecipeArg = None, set_: SetOpt = None) -> None:
    raise fail("megacli reshard is not available in this version yet")
