"""Reading small line-oriented inputs (prompts, instruction data) with errors that name the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from megacli.errors import UserError
from megacli.paths import shown


def iter_lines(path: str, *, plain_text: bool = False) -> Iterator[tuple[str, object]]:
    """(``file:line``, parsed JSON) for each non-empty line; with ``plain_text`` a line that is not
    a JSON object is passed on as its text."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{shown(path)}: no such file")
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        if plain_text and not line.lstrip().startswith("{"):
            yield where, line
            continue
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not valid JSON ({exc.msg})") from None
