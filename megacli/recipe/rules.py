"""The cross-field rules of the recipes, read from the validators' own code: every ``raise
RecipeError(field, value, reason)`` / ``raise ValueError(reason)`` in a recipe module (and every
``(field, value, reason)`` a problem-finding function such as stages.split_problem returns), with
the condition it sits under and the fields its message names. ``megacli recipe explain`` lists the
rules that involve a field; there is no second list of rules to keep in step with the checks."""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from pathlib import Path

RECIPE_DIR = Path(__file__).resolve().parent
DOTTED = re.compile(r"\b[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+\b")


@dataclasses.dataclass(frozen=True)
class Rule:
    where: str
    """module.Class.method (or module.function) holding the check."""
    owner: str | None
    """The class holding the check (None for a module-level function)."""
    field: str | None
    """The field the error names first: a dotted path, a pattern with {…} for a computed one, or
    None (a ValueError, reported at the validated field or section)."""
    field_choices: tuple[str, ...]
    """The values a computed field takes (from the literal tuple its loop runs over); () = any."""
    validated: tuple[str, ...]
    """field_validator("x", ...) fields of the check (relative to its section)."""
    when: str
    """The condition the raise sits under, as written (empty: unconditional in its function)."""
    says: str
    """The message, as written (placeholders in braces)."""
    mentions: tuple[str, ...]
    """Dotted names in the message and condition (recipe fields among them)."""


def _text(node: ast.AST) -> str:
    """A message expression as a person reads it: an f-string without its quotes."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    return "{" + ast.unparse(node) + "}"


def _dict_keys(node: ast.AST, fn: ast.FunctionDef | None) -> list[ast.AST] | None:
    """The keys of ``name.items()`` / ``name.keys()`` / ``name`` when ``name`` is a dict literal
    assigned in ``fn``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("items", "keys"):
        node = node.func.value
    if not isinstance(node, ast.Name) or fn is None:
        return None
    for stmt in ast.walk(fn):
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict) \
                and any(isinstance(t, ast.Name) and t.id == node.id for t in stmt.targets):
            return list(stmt.value.keys)
    return None


def _loop_values(placeholder: str, loops: list[ast.For], fn: ast.FunctionDef | None) -> tuple[str, ...]:
    """The strings ``placeholder`` takes in an enclosing ``for`` over a literal tuple or a dict
    literal's keys, or () when they cannot be read from the code."""
    for loop in reversed(loops):
        names = [loop.target] if isinstance(loop.target, ast.Name) else list(getattr(loop.target, "elts", []))
        index = next((i for i, n in enumerate(names) if isinstance(n, ast.Name) and n.id == placeholder), None)
        if index is None:
            continue
        keys = _dict_keys(loop.iter, fn)
        if keys is not None and index == 0:
            items = keys
        elif isinstance(loop.iter, (ast.Tuple, ast.List)):
            items = [item if len(names) == 1 and isinstance(loop.target, ast.Name) else
                     (item.elts[index] if isinstance(item, (ast.Tuple, ast.List)) else None) for item in loop.iter.elts]
        else:
            return ()
        return tuple(i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str))
    return ()


def _assigned(name: str, fn: ast.FunctionDef | None) -> tuple[str, ...]:
    """The dotted names among the string constants ``fn`` assigns to ``name`` (``field, value =
    ("parallel.first_stage_layers", first) if ... else ("parallel.last_stage_layers", last)``)."""
    found: list[str] = []
    for stmt in ast.walk(fn) if fn is not None else ():
        if not isinstance(stmt, ast.Assign):
            continue
        targets = [n for t in stmt.targets for n in ([t] if isinstance(t, ast.Name) else getattr(t, "elts", []))]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            found += [c.value for c in ast.walk(stmt.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                      and DOTTED.fullmatch(c.value)]
    return tuple(dict.fromkeys(found))


def _field(node: ast.AST, loops: list[ast.For], fn) -> tuple[str | None, tuple[str, ...]]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, ()
    if isinstance(node, ast.Name):
        choices = _loop_values(node.id, loops, fn) or _assigned(node.id, fn)
        return ("{" + node.id + "}", choices) if choices else (None, ())
    if isinstance(node, ast.JoinedStr):
        pattern = _text(node)
        holes = [v.value.id for v in node.values if isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name)]
        if len(holes) == 1:
            values = _loop_values(holes[0], loops, fn)
            return pattern, tuple(pattern.replace("{" + holes[0] + "}", v) for v in values)
        return pattern, ()
    return None, ()


def _validated(fn: ast.FunctionDef) -> tuple[str, ...]:
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "field_validator":
            return tuple(a.value for a in deco.args if isinstance(a, ast.Constant))
    return ()


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str):
        self.module = module
        self.rules: list[Rule] = []
        self.cls: str | None = None
        self.fn: ast.FunctionDef | None = None
        self.conditions: list[str] = []
        self.loops: list[ast.For] = []

    def visit_ClassDef(self, node):
        outer, self.cls = self.cls, node.name
        self.generic_visit(node)
        self.cls = outer

    def visit_FunctionDef(self, node):
        outer = (self.fn, self.conditions, self.loops)
        self.fn, self.conditions, self.loops = node, [], []
        self.generic_visit(node)
        self.fn, self.conditions, self.loops = outer

    def visit_If(self, node):
        test = ast.unparse(node.test)
        self.visit(node.test)
        self.conditions.append(test)
        for stmt in node.body:
            self.visit(stmt)
        self.conditions[-1] = f"not ({test})"
        for stmt in node.orelse:
            self.visit(stmt)
        self.conditions.pop()

    def visit_For(self, node):
        self.loops.append(node)
        self.generic_visit(node)
        self.loops.pop()

    def visit_Raise(self, node):
        call = node.exc
        name = getattr(getattr(call, "func", None), "id", None)
        if isinstance(call, ast.Call) and name == "RecipeError" and len(call.args) >= 3:
            self._add(call.args[0], call.args[2])
        elif isinstance(call, ast.Call) and name == "ValueError" and call.args:
            self._add(None, call.args[0])

    def visit_Return(self, node):
        value = node.value
        if isinstance(value, ast.Tuple) and len(value.elts) == 3 and self.cls is None \
                and isinstance(value.elts[2], (ast.Constant, ast.JoinedStr, ast.BinOp)):
            self._add(value.elts[0], value.elts[2])

    def _add(self, field_node, message):
        field, choices = _field(field_node, self.loops, self.fn) if field_node is not None else (None, ())
        says = _text(message)
        when = " and ".join(self.conditions)
        self.rules.append(Rule(
            where=".".join(p for p in (self.module, self.cls, self.fn.name if self.fn else None) if p),
            owner=self.cls, field=field, field_choices=choices,
            validated=_validated(self.fn) if self.fn else (), when=when, says=says,
            mentions=tuple(dict.fromkeys(DOTTED.findall(says + " " + when)))))


@functools.cache
def all_rules() -> tuple[Rule, ...]:
    """Every check in the recipe modules."""
    rules: list[Rule] = []
    for path in sorted(RECIPE_DIR.glob("*.py")):
        collector = _Collector(path.stem)
        collector.visit(ast.parse(path.read_text(encoding="utf-8")))
        rules.extend(collector.rules)
    return tuple(rules)


def _matches(pattern: str, path: str) -> bool:
    regex = re.sub(r"\\\{[^}]*\\\}", r"[a-z0-9_]+", re.escape(pattern))
    return re.fullmatch(regex, path) is not None


def rules_for(model, path: str) -> list[Rule]:
    """The rules of ``model``'s recipe kind that involve the field at ``path``."""
    from megacli.recipe.fields import section_paths

    sections = section_paths(model)
    classes = {cls.__name__ for cls in sections} | {c.__name__ for c in model.__mro__}
    plain = path.replace("[]", "")
    out = []
    for rule in all_rules():
        if rule.owner is not None and rule.owner not in classes:
            continue
        involved = {m.replace("[]", "") for m in rule.mentions}
        if rule.field is not None:
            involved |= set(rule.field_choices) or ({plain} if _matches(rule.field, plain) else {rule.field})
        if rule.validated:
            cls = next((c for c in sections if c.__name__ == rule.owner), None)
            for where in sections.get(cls, []):
                involved |= {f"{where}.{name}".lstrip(".").replace("[]", "") for name in rule.validated}
        if plain in involved:
            out.append(rule)
    return out
