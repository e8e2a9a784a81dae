"""Which recipe model each job validates against, and the built-in defaults."""

from __future__ import annotations

from pathlib import Path

from megacli.recipe import base


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
    if job == "reshard":
        from megacli.recipe.reshard import ReshardRecipe

        return ReshardRecipe
    raise ValueError(f"unknown job {job!r}")


def default_recipe_path(job: str) -> Path | None:
    """`megacli pretrain` with no recipe runs the tiny GPT recipe (the embedded default)."""
    from megacli.cli.common import repo_recipes_dir

    return {"pretrain": repo_recipes_dir() / "gpt_tiny.yaml"}.get(job)


def load_job_recipe(job: str, path: str | Path | None, overrides=()):
    if path is None:
        path = default_recipe_path(job)
    return base.load(recipe_model(job), path, overrides)
