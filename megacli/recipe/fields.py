"""Every field of a recipe, read from its pydantic model: dotted path, type, default, allowed values
and the field's docstring. The recipe reference, `megacli recipe explain` and the rule index read
the models through this module only."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

REQUIRED = "(required)"
SECTION_DEFAULTS = "(its fields' defaults)"


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    path: str
    """Dotted path from the recipe's top level (items of a list of sections: ``name[].field``)."""
    type: str
    """The type as a person reads it: ``int > 0 | null``, ``gpt | bert | t5``, ``section``."""
    default: str
    """The default as YAML, or REQUIRED."""
    allowed: tuple[str, ...]
    """The values a Literal allows (empty when any value of the type goes)."""
    doc: str
    """The field's docstring, lines joined."""
    section: type[BaseModel] | None
    """The section class when the field holds a section (or a list of them)."""
    owner: type[BaseModel]
    """The class that declares the field."""

    @property
    def required(self) -> bool:
        return self.default == REQUIRED


def section_of(annotation) -> type[BaseModel] | None:
    """The BaseModel a field holds, directly, optionally or as list items."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = section_of(arg)
        if found is not None:
            return found
    return None


def _is_list_of_sections(annotation) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(_is_list_of_sections(a) for a in typing.get_args(annotation))
    return origin is list and section_of(annotation) is not None


_SIGNS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="), (annotated_types.Lt, "lt", "<"),
          (annotated_types.Le, "le", "<="))


def _bounds(metadata) -> str:
    marks = [f"{sign} {getattr(m, attr)}" for m in metadata for kind, attr, sign in _SIGNS if isinstance(m, kind)]
    marks += [f"at least {m.min_length} items" for m in metadata if isinstance(m, annotated_types.MinLen) and m.min_length]
    return " ".join(marks)


_NAMES = {int: "int", float: "float", str: "string", bool: "bool", Path: "path", type(None): "null", Any: "any"}


def type_text(annotation, metadata=()) -> str:
    """``annotation`` as a person reads it."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0], annotation.__metadata__)
    bounds = _bounds(metadata)
    if origin in (Union, types.UnionType):  # Field(ge=...) bounds the non-null members
        return " | ".join(dict.fromkeys(type_text(a, () if a is type(None) else metadata) for a in args))
    if origin is Literal:
        text = " | ".join(_yaml(a) for a in args)
    elif origin in (list, tuple, set):
        inner = ", ".join(_grouped(type_text(a)) for a in args if a is not Ellipsis) or "any"
        text = f"list of {inner}" if origin is not tuple else f"[{inner}]"
    elif origin is dict:
        text = f"mapping of {type_text(args[0])} to {type_text(args[1])}" if args else "mapping"
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        text = "section"
    else:
        text = _NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))
    return f"{text} {bounds}" if bounds else text


def _grouped(text: str) -> str:
    return f"({text})" if " | " in text else text


def allowed_values(annotation) -> tuple[str, ...]:
    """The values a field may take when its type is a Literal (optionally null); () otherwise."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return tuple(_yaml(a) for a in args)
    if origin is typing.Annotated:
        return allowed_values(args[0])
    if origin in (Union, types.UnionType):
        parts = [() if a is type(None) else allowed_values(a) for a in args]
        if all(p or a is type(None) for p, a in zip(parts, args)):
            return tuple(dict.fromkeys(v for p in parts for v in p)) + (("null",) if type(None) in args else ())
    return ()


def _yaml(value) -> str:
    import yaml

    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif isinstance(value, Path):
        value = str(value)
    return yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip().removesuffix("\n...").strip()


def default_text(info) -> str:
    if isinstance(info.default, BaseModel):
        return SECTION_DEFAULTS
    if info.default_factory is not None:
        return _yaml(info.default_factory())
    if info.default is PydanticUndefined:
        return REQUIRED
    return _yaml(info.default)


def walk(model: type[BaseModel], prefix: str = "") -> Iterator[FieldDoc]:
    """Every field of ``model`` and of the sections it holds, depth first, in declaration order."""
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        section = section_of(info.annotation)
        owner = next(c for c in model.__mro__ if name in getattr(c, "__annotations__", {}))
        yield FieldDoc(path=path, type=type_text(info.annotation, info.metadata), default=default_text(info),
                       allowed=allowed_values(info.annotation), doc=" ".join((info.description or "").split()),
                       section=section, owner=owner)
        if section is not None:
            yield from walk(section, f"{path}[]." if _is_list_of_sections(info.annotation) else f"{path}.")


def field_paths(model: type[BaseModel]) -> dict[str, FieldDoc]:
    return {f.path: f for f in walk(model)}


def section_paths(model: type[BaseModel]) -> dict[type[BaseModel], list[str]]:
    """Each section class under ``model`` -> the dotted paths it sits at ("" for ``model`` itself)."""
    out: dict[type[BaseModel], list[str]] = {model: [""]}
    for f in walk(model):
        if f.section is not None:
            out.setdefault(f.section, []).append(f.path + ("[]" if f.type.startswith("list") else ""))
    return out
