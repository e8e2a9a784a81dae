"""Rewrite the files generated from the recipe models: docs/reference/recipe.md and
recipes/schemas/<kind>.json. ``--check`` writes nothing and exits 1 when one is out of date.

    python -m megacli.recipe.regenerate [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def generated() -> dict[Path, str]:
    """Each generated file (under the checkout) -> the text it must hold."""
    from megacli.recipe.jobs import SCHEMA_KINDS
    from megacli.recipe.reference import render
    from megacli.recipe.schema import schema_text

    files = {ROOT / "docs" / "reference" / "recipe.md": render()}
    files.update({ROOT / "recipes" / "schemas" / f"{kind}.json": schema_text(kind) for kind in SCHEMA_KINDS})
    return files


def stale() -> list[Path]:
    return [path for path, text in generated().items() if not path.is_file() or path.read_text(encoding="utf-8") != text]


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        out = stale()
        for path in out:
            print(f"{path.relative_to(ROOT)} is out of date: run python -m megacli.recipe.regenerate")
        return 1 if out else 0
    if argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path, text in generated().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
