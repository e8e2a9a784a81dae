"""JSON Schema of each recipe kind, generated from its pydantic model (field docstrings become
descriptions, so editors using the YAML language server complete and explain fields). The
shipped copies live in recipes/schemas/ (packaged as megacli/recipes/schemas/)."""

from __future__ import annotations

import json
from pathlib import Path

from megacli.recipe.jobs import recipe_model, repo_recipes_dir, schema_kind

DIALECT = "https://json-schema.org/draft/2020-12/schema"


def recipe_schema(kind: str) -> dict:
    """The JSON Schema a ``kind`` recipe (pretrain, finetune, preprocess, ...) validates against."""
    schema = recipe_model(kind).model_json_schema(mode="validation")
    return {"$schema": DIALECT, **schema, "title": f"megacli {schema_kind(kind)} recipe"}


def schema_text(kind: str) -> str:
    return json.dumps(recipe_schema(kind), indent=2, ensure_ascii=False) + "\n"


def schemas_dir() -> Path:
    return repo_recipes_dir() / "schemas"


def schema_path(kind: str) -> Path:
    """Where the shipped schema of ``kind`` recipes lives."""
    return schemas_dir() / f"{schema_kind(kind)}.json"


def modeline(kind: str) -> str:
    """The first line of a shipped recipe: its schema, relative to the recipe (recipes/ in a checkout,
    megacli/recipes/ in the wheel, the same relative path in both)."""
    return f"# yaml-language-server: $schema=schemas/{schema_kind(kind)}.json"
