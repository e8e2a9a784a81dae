"""The rules for relative paths. In a recipe (data, tokenizer, SFT and preference files,
checkpoints) and on the command line they are read from the working directory the command runs
in, as the shell reads them; messages that name such a path show what it resolved to. The one
exception: a checkpoint's own recipe.yaml names the tokenizer it carries relative to itself
(``../hf``, megacli.checkpoint.carried), wherever that recipe is read."""

from __future__ import annotations

import os
from pathlib import Path

RULE = "relative paths are read from the working directory"
CHECKPOINT_RECORD = "megacli.json"  # beside a checkpoint's recipe.yaml (megacli.checkpoint.layout.META)


def shown(path: str | os.PathLike) -> str:
    """``path`` as a message names it: as given and, when relative, where that is (the working
    directory joined with it)."""
    given = os.fspath(path)
    if os.path.isabs(os.path.expanduser(given)):
        return repr(given)
    return f"{given!r} ({os.path.abspath(given)}; {RULE})"


def with_carried_tokenizer(ckpt: Path, recipe: dict) -> dict:
    """The recipe with a relative tokenizer.path that names a file or directory of the checkpoint
    (``../hf``: what it carries) made absolute, so it is found wherever the checkpoint is and
    wherever the command runs. Any other relative path (a checkpoint written before megacli carried
    its tokenizer) is kept: it is read from the working directory, as it was then."""
    tokenizer = recipe.get("tokenizer")
    path = tokenizer.get("path") if isinstance(tokenizer, dict) else None
    if not isinstance(path, str) or not path or os.path.isabs(os.path.expanduser(path)):
        return recipe
    carried = Path(os.path.normpath(ckpt.absolute() / path))
    if not carried.exists():
        return recipe
    return {**recipe, "tokenizer": {**tokenizer, "path": str(carried)}}

