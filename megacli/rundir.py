"""The run directory: the resolved recipe, the versions in use, metrics.jsonl, logs, errors."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from megacli.recipe.base import dump

RECIPE_FILE = "recipe.yaml"
VERSIONS_FILE = "versions.json"
METRICS_FILE = "metrics.jsonl"


def versions() -> dict[str, str | None]:
    """megacli, megatron-core, torch and CUDA versions (CUDA None on a CPU build)."""
    from importlib.metadata import PackageNotFoundError, version

    import megacli

    def pkg(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    import torch

    return {
        "megacli": megacli.__version__,
        "megatron-core": pkg("megatron-core"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def prepare(recipe, run_dir: str | Path) -> Path:
    """Create the run directory and write the resolved recipe and versions; return the recipe path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe_file = run_dir / RECIPE_FILE
    recipe_file.write_text(dump(recipe))
    (run_dir / VERSIONS_FILE).write_text(json.dumps(versions(), indent=2) + "\n")
    return recipe_file
