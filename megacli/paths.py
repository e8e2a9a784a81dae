"""The one rule for relative paths in a recipe (data, tokenizer, SFT and preference files,
checkpoints) and on the command line: they are read from the working directory the command runs
in, as the shell reads them. (A checkpoint's own recipe.yaml names the tokenizer it carries
relative to itself: megacli.checkpoint.carried.) Messages that name a path show what it resolved to."""

from __future__ import annotations

import os

RULE = "relative paths are read from the working directory"


def shown(path: str | os.PathLike) -> str:
    """``path`` as a message names it: as given and, when relative, where that is (the working
    directory joined with it)."""
    given = os.fspath(path)
    if os.path.isabs(os.path.expanduser(given)):
        return repr(given)
    return f"{given!r} ({os.path.abspath(given)}; {RULE})"
