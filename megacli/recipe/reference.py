"""The recipe reference (docs/reference/recipe.md), rendered from the recipe models: every section
and field with its type, default, allowed values and docstring."""

from __future__ import annotations

from megacli.recipe.fields import SECTION_DEFAULTS, FieldDoc, walk
from megacli.recipe.jobs import SCHEMA_KINDS, recipe_model

TITLES = {
    "pretrain": "pretrain and finetune recipes",
    "preprocess": "preprocess recipes",
    "generate": "generate recipes",
    "eval": "eval recipes",
    "serve": "serve recipes",
    "reshard": "reshard recipes",
    "convert": "convert recipes",
}
INTRO = """\
# Recipe reference

Every field of every recipe, read from the recipe models themselves (the field descriptions are
the models' docstrings). This page is generated: `python -m megacli.recipe.regenerate` rewrites it
and the JSON Schemas in `recipes/schemas/`, and a test fails when either is out of date.

Types: `int > 0` is a positive integer, `a | b` one of the listed values or types, `null` YAML's
null (the field's "not set"), `section` a nested mapping documented under its own heading.
Cross-field rules (a value that must divide another, an option only one architecture has) are
not listed here: `megacli recipe explain FIELD` prints the ones that involve a field.
"""


def _cell(text: str) -> str:
    """Table cell text (pipes inside code spans need no escape: Python-Markdown's tables skip them)."""
    return text.replace("|", "\\|").replace("\n", " ") if text else ""


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def render() -> str:
    """The whole reference page."""
    out = [INTRO]
    anchors: dict[type, str] = {}  # section class -> the anchor of its one heading
    for kind in SCHEMA_KINDS:
        model = recipe_model(kind)
        out.append(f"## {TITLES[kind]}\n")
        if model.__doc__:
            out.append(" ".join(model.__doc__.split()) + "\n")
        out.append(f"Schema: `recipes/schemas/{kind}.json` (`megacli recipe schema {kind}`).\n")
        fields = list(walk(model))
        new = []  # sections first met in this kind: documented here, once
        for f in fields:
            if f.section is not None and f.section not in anchors:
                anchors[f.section] = f.path if f.path not in anchors.values() else f"{kind}-{f.path}"
                new.append(f)
        out.append(_table([f for f in fields if "." not in f.path.replace("[]", "")], "", anchors))
        out.extend(_section(f, fields, anchors) for f in new)
    return "\n".join(out).rstrip() + "\n"


def _section(f: FieldDoc, fields: list[FieldDoc], anchors: dict[type, str]) -> str:
    cls = f.section
    level = "#" * min(3 + f.path.replace("[]", "").count("."), 6)
    lines = [f'<a id="{anchors[cls]}"></a>\n', f"{level} `{f.path}`\n"]
    about = " ".join((cls.__doc__ or "").split())
    if f.doc:
        lines.append(f.doc + "\n")
    if about and about != f.doc:
        lines.append(about + "\n")
    prefix = f.path + ("[]." if f.type.startswith("list") else ".")
    children = [c for c in fields if c.path.startswith(prefix) and "." not in c.path[len(prefix):].replace("[]", "")]
    lines.append(_table(children, prefix, anchors))
    return "\n".join(lines)


def _table(children: list[FieldDoc], prefix: str, anchors: dict[type, str]) -> str:
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for c in children:
        name = c.path[len(prefix):]
        if c.section is not None:
            name = f"[`{name}`](#{anchors[c.section]})"
        else:
            name = f"`{name}`"
        default = c.default if c.default == SECTION_DEFAULTS else _code(c.default)
        rows.append(f"| {name} | {_code(c.type)} | {default} | {_cell(c.doc)} |")
    return "\n".join(rows) + "\n"
