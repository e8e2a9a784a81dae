"""The one reader of line-oriented inputs (prompts, instruction and preference data, on-the-fly
JSONL documents): every problem is named by ``file:line``, in the words preprocess uses for a
record (not_utf8: its message for a line that is not UTF-8). Lines end at "\\n" only (a JSON string
may hold U+2028 and other characters str.splitlines would cut at); a "\\r" before it and a UTF-8 byte
order mark at the start are dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from megacli.errors import UserError
from megacli.filekind import not_regular
from megacli.paths import shown


def not_utf8(exc: UnicodeDecodeError) -> str:
    """What is wrong with a line that is not UTF-8."""
    return f"not UTF-8 ({exc.reason} at byte {exc.start})"


def text_lines(path: str | Path) -> Iterator[tuple[str, str]]:
    """(``file:line``, text) for each line that is not blank, read lazily."""
    problem = not_regular(path)
    if problem is not None:
        raise UserError(f"{shown(path) if problem == 'no such file' else path}: {problem}")
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                where = f"{path}:{n}"
                try:
                    line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    raise UserError(f"{where}: {not_utf8(exc)}") from None
                line = line.rstrip("\n").removesuffix("\r")
                if line.strip():
                    yield where, line
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None


def iter_lines(path: str | Path, *, plain_text: bool = False) -> Iterator[tuple[str, object]]:
    """(``file:line``, parsed JSON) for each non-empty line; with ``plain_text`` a line that is not
    a JSON object is passed on as its text."""
    for where, line in text_lines(path):
        if plain_text and not line.lstrip().startswith("{"):
            yield where, line
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python converts
            raise UserError(f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
        except RecursionError:
            raise UserError(f"{where}: not valid JSON (nested too deeply)") from None
        yield where, record
