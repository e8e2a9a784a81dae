"""Which recipe model each job validates against, and the built-in defaults."""

from __future__ import annotations

from pathlib import Path

from megacli.recipe import base


# The recipe kinds, each with its model (finetune recipes are pretrain recipes: one model, one schema).
KINDS = ("pretrain", "finetune", "preprocess", "generate", "eval", "serve", "reshard", "convert")
SCHEMA_KINDS = ("pretrain", "preprocess", "generate", "eval", "serve", "reshard", "convert")


def schema_kind(kind: str) -> str:
    """The kind whose schema file describes ``kind``'s recipes."""
    return "pretrain" if kind == "finetune" else kind


def kind_of_recipe(path: str | Path) -> str:
    """The kind a recipe file declares by its schema line (``# yaml-language-server:
    $schema=.../<kind>.json``), else pretrain."""
    import re

    try:
        with open(path, encoding="utf-8") as f:
            head = [f.readline() for _ in range(3)]
    except (OSError, UnicodeDecodeError):
        return "pretrain"  # loading the recipe reports what is wrong with the file
    for line in head:
        found = re.match(r"#\s*yaml-language-server:\s*\$schema=\S*?(\w+)\.json\s*$", line)
        if found and found.group(1) in KINDS:
            return found.group(1)
    return "pretrain"


def recipe_model(job: str):
    if job in ("pretrain", "finetune"):
        from megacli.recipe.pretrain import TrainingRecipe

        return TrainingRecipe
    if job == "preprocess":
        from megacli.recipe.preprocess import PreprocessRecipe

        return PreprocessRecipe
    if job == "generate":
        from megacli.recipe.generate import GenerateRecipe

        return GenerateRecipe
    if job == "eval":
        from megacli.recipe.eval import EvalRecipe

        return EvalRecipe
    if job == "serve":
        from megacli.recipe.serve import ServeRecipe

        return ServeRecipe
    if job == "reshard":
        from megacli.recipe.reshard import ReshardRecipe

        return ReshardRecipe
    if job == "convert":
        from megacli.recipe.convert import ConvertRecipe

        return ConvertRecipe
    raise ValueError(f"unknown job {job!r}")


def repo_recipes_dir() -> Path:
    """Shipped recipes: inside the wheel (megacli/recipes) or beside the package in a checkout."""
    here = Path(__file__).resolve().parent.parent  # megacli/
    for candidate in (here / "recipes", here.parent / "recipes"):
        if candidate.is_dir():
            return candidate
    return here.parent / "recipes"


def default_recipe_path(job: str) -> Path | None:
    """`megacli pretrain` with no recipe runs the tiny GPT recipe (the embedded default)."""
    return {"pretrain": repo_recipes_dir() / "gpt_tiny.yaml"}.get(job)


def load_job_recipe(job: str, path: str | Path | None, overrides=()):
    if path is None:
        path = default_recipe_path(job)
    return base.load(recipe_model(job), path, overrides)
