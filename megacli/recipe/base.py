"""Recipe plumbing shared by every subcommand: the Section base class, YAML + ``--set`` loading,
and turning validation failures into one message a person can act on.

Validation never mutates a recipe: sections are frozen, and numbers derived from several fields
(data-parallel size, micro-batches per step, ...) are properties computed on demand.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Iterable, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from megacli.recipe import trust
from megacli.recipe.yaml_text import AliasBomb, DuplicateKey, load_yaml_text, yaml_problem


def _admits(annotation: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a field annotation (through Optional, Union, Annotated, list[...]) admits any of ``kinds``."""
    if annotation in kinds:
        return True
    return any(_admits(arg, kinds) for arg in getattr(annotation, "__args__", ()) if arg is not Ellipsis)


def _holds_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_bool(v) for v in value)
    return False


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, every field documents itself
    (the attribute docstring becomes the field description), and values never change after
    validation. Numbers are numbers: true/false is not read as 1/0, and inf/NaN are refused."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
        protected_namespaces=(),
        allow_inf_nan=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if _holds_bool(value):
            annotation = cls.model_fields[info.field_name].annotation
            if _admits(annotation, (int, float)) and not _admits(annotation, (bool,)):
                raise ValueError("expected a number, not true/false")
        return value


class RecipeError(Exception):
    """A recipe value that cannot work: names the dotted field, the value and why.

    Raised from cross-field checks (pydantic passes non-ValueError exceptions through untouched,
    so the field we name is the field the user sees)."""

    def __init__(self, field: str, value: Any, reason: str, source: str | None = None):
        self.field = field
        self.value = value
        self.reason = reason
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        where = f"{self.source}: " if self.source else ""
        return f"{where}{self.field} = {self.value!r}: {self.reason}"


class RecipeErrors(Exception):
    """One or more problems with a recipe, rendered together, one per line."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        head = f"invalid recipe {self.source}"
        if len(self.problems) == 1:
            return f"{head}: {self.problems[0]}"
        return head + ":\n" + "\n".join(f"  - {p}" for p in self.problems)


R = TypeVar("R", bound=BaseModel)

# A seed every generator megacli seeds takes: numpy's legacy seeding (and Megatron's datasets, which
# use it) refuses anything outside 0 .. 2**32 - 1.
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], parsed value). The value is read as YAML, so
    ``3`` is an int, ``true`` a bool, ``[1, 2]`` a list and ``null`` clears a field."""
    if "=" not in text:
        raise RecipeErrors("--set", [f"{text!r}: expected dotted.key=value"])
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeErrors("--set", [f"{text!r}: expected dotted.key=value"])
    try:
        value = load_yaml_text(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        # A bare word with YAML punctuation inside (a: b) is meant as text; a value that opens a list,
        # a mapping or a quoted string and does not close it is a typo.
        if isinstance(exc, (DuplicateKey, AliasBomb)):
            raise RecipeErrors("--set", [f"{text!r}: {yaml_problem(exc)}"]) from None
        if raw.strip()[:1] in "[{\"'":
            raise RecipeErrors("--set", [f"{text!r}: {yaml_problem(exc)}; close it, or quote the whole value "
                                         f"to pass it as text"]) from None
        value = raw
    return key.split("."), value


def apply_overrides(raw: dict, overrides: Iterable[str]) -> dict:
    """Return a copy of ``raw`` with each ``--set`` applied (creating sections as needed)."""
    import copy

    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeErrors("--set", [f"{text!r}: {part} is not a section"])
            node = child
        node[path[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict:
    """A recipe file's raw mapping; a checkpoint's without the trust it claims (megacli.recipe.trust)."""
    path = Path(path)
    if path.is_dir():
        raise RecipeErrors(str(path), ["a directory, not a YAML recipe file"])
    if not path.is_file():
        raise RecipeErrors(str(path), ["file not found"])
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise RecipeErrors(str(path), [f"line {line}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                                       f"{exc.start}); save the recipe as UTF-8"]) from None
    try:
        data = load_yaml_text(text) or {}
    except yaml.YAMLError as exc:
        raise RecipeErrors(str(path), [yaml_problem(exc)]) from None
    if not isinstance(data, dict):
        raise RecipeErrors(str(path), ["the top level must be a mapping of sections"])
    from megacli.paths import with_carried_tokenizer

    return with_carried_tokenizer(Path(path).parent, trust.carried(data)) if trust.from_checkpoint(path) else data


def _known_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names valid at ``loc`` (for 'did you mean' hints)."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int) or current is None:
            return []
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        current = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if current is None:
            for arg in getattr(ann, "__args__", ()):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    current = arg
    return list(getattr(current, "model_fields", {}) or [])


def _describe(error: dict, model: type[BaseModel], raw: dict) -> str:
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-union"))))
    dotted = ".".join(str(p) for p in loc) or "(recipe)"
    if error["type"] == "extra_forbidden":
        hint = difflib.get_close_matches(str(loc[-1]), _known_fields(model, loc), n=1)
        tip = f" (did you mean {'.'.join(map(str, loc[:-1] + (hint[0],)))}?)" if hint else ""
        return f"{dotted}: unknown field{tip}"
    if error["type"] == "missing":
        return f"{dotted}: required field is missing"
    value = error.get("input")
    msg = error["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{dotted} = {value!r}: {msg}"


def validate(model: type[R], raw: dict, source: str) -> R:
    """Validate ``raw`` against ``model``; every failure becomes a RecipeErrors naming ``source``."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise RecipeErrors(source, [_describe(e, model, raw) for e in exc.errors()]) from None
    except RecipeError as exc:
        raise RecipeErrors(source, [exc.render()]) from None


def load(model: type[R], path: str | Path | None, overrides: Iterable[str] = (), default: dict | None = None) -> R:
    """Read a YAML recipe (or ``default`` when no path), apply ``--set`` overrides, validate."""
    overrides = list(overrides)
    raw = read_yaml(path) if path is not None else dict(default or {})
    raw = apply_overrides(raw, overrides)
    source = str(path) if path is not None else "(default recipe)"
    if overrides:
        source += " with --set " + " ".join(overrides)
    return validate(model, raw, source)


def dump(recipe: BaseModel, *, carried: bool = False, tokenizer: dict | None = None) -> str:
    """The resolved recipe as block YAML (every field, defaults included) in declaration order,
    one field per line and no line folded, however long its value. ``carried``: for a recipe a
    checkpoint carries, without the trust fields (megacli.recipe.trust: trust is never passed on).
    ``tokenizer``: the tokenizer section to write instead of the recipe's (the checkpoint's copy)."""
    raw = recipe.model_dump(mode="json")
    if tokenizer is not None:
        raw["tokenizer"] = tokenizer
    return yaml.safe_dump(trust.carried(raw) if carried else raw, sort_keys=False, default_flow_style=False,
                          width=float("inf"), allow_unicode=True)
