"""`megacli recipe explain FIELD`: a field's type, default, allowed values and docstring (from the
models, megacli.recipe.fields) and the cross-field rules that involve it (from the checks' code,
megacli.recipe.rules)."""

from __future__ import annotations

import difflib
import textwrap

from megacli.errors import UserError


def explain(path: str, kind: str = "pretrain") -> str:
    from megacli.recipe.fields import field_paths
    from megacli.recipe.jobs import recipe_model
    from megacli.recipe.rules import rules_for

    model = recipe_model(kind)
    fields = field_paths(model)
    f = fields.get(path) or fields.get(path.replace("[]", "")) or _list_item(fields, path)
    if f is None:
        close = difflib.get_close_matches(path, list(fields), n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise UserError(f"{path}: no such field in {kind} recipes{hint}; `megacli recipe schema {kind}` lists them all")
    out = [f"{f.path}  ({kind} recipe)", f"  type:     {f.type}", f"  default:  {f.default}"]
    if f.allowed:
        out.append(f"  allowed:  {', '.join(f.allowed)}")
    if f.doc:
        out += ["", _wrap(f.doc, "  ", "  ")]
    if f.section is not None:
        prefix = f.path + ("[]." if f.type.startswith("list") else ".")
        children = [c for c in fields.values() if c.path.startswith(prefix) and "." not in c.path[len(prefix):]]
        out += ["", "fields:"] + [f"  {c.path[len(prefix):]}: {c.type} = {c.default}" for c in children]
    rules = rules_for(model, f.path)
    out += ["", f"rules that involve it ({len(rules)}, read from the recipe checks):" if rules
            else "rules that involve it: none besides its type"]
    for rule in rules:
        field = " or ".join(rule.field_choices) or rule.field
        out.append(_wrap(f"{field}: {rule.says}" if field else rule.says, "  - ", "    "))
        if rule.when:
            out.append(_wrap(f"when {rule.when}", "    ", "      "))
        out.append(f"    ({rule.where})")
    return "\n".join(out)


def _wrap(text: str, first: str, rest: str) -> str:
    return textwrap.fill(text, 100, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)


def _list_item(fields: dict, path: str):
    """``data.sources.0.files`` (how validation errors name list items) -> ``data.sources[].files``."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit() and i:
            return fields.get(".".join(parts[:i - 1] + [parts[i - 1] + "[]"] + parts[i + 1:]))
    return None
