"""`megacli plan --measure K`: run the top K layouts for a few steps each with `megacli pretrain` (the
local launcher, on whatever device the recipe names) and read back their step time and peak
memory from metrics.jsonl, to re-rank the layouts by what was measured."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MEASURE_STEPS = 3
"""Steps per measured layout; the first is left out of the step time (warm-up)."""


@dataclass(frozen=True)
class Measured:
    row: object
    """The planner's row (its prediction)."""
    step_time_s: float | None
    peak_memory_gib: float | None
    """Largest memory_gib of the logged steps (CUDA: max_memory_allocated; CPU: resident memory)."""
    error: str = ""

    @property
    def tokens_per_second_per_gpu(self) -> float | None:
        if self.step_time_s is None:
            return None
        recipe = self.row.recipe
        return recipe.tokens_per_step / self.step_time_s / recipe.world_size


def short_run(recipe, run_dir: Path, steps: int):
    """``recipe`` for a few logged steps into ``run_dir``: no evaluation, checkpoints or plot."""
    from megacli.recipe.sections import CheckpointSection, RunSection, TrainSection

    train = TrainSection.model_validate({**recipe.train.model_dump(), "iters": steps, "log_interval": 1,
                                         "eval_interval": 0, "plot": False})
    checkpoint = CheckpointSection.model_validate({**recipe.checkpoint.model_dump(), "dir": None, "save_interval": None})
    return recipe.with_sections(train=train, checkpoint=checkpoint, run=RunSection(dir=str(run_dir)))


def measure(rows, workdir: Path, *, steps: int = MEASURE_STEPS) -> list[Measured]:
    """Each row's layout run for ``steps`` steps, in order, one after the other."""
    from megacli.recipe.base import dump

    out = []
    for i, row in enumerate(rows):
        run_dir = workdir / f"layout{i + 1}"
        run_dir.mkdir(parents=True, exist_ok=True)
        recipe_path = run_dir / "plan_recipe.yaml"
        recipe_path.write_text(dump(short_run(row.recipe, run_dir, steps)), encoding="utf-8")
        done = subprocess.run([sys.executable, "-m", "megacli", "pretrain", str(recipe_path)],
                              capture_output=True, text=True)
        records = _step_records(run_dir / "metrics.jsonl")
        if done.returncode != 0 or not records:
            last = (done.stderr.strip() or done.stdout.strip() or "no steps logged").splitlines()[-1]
            out.append(Measured(row, None, None, error=f"exit {done.returncode}: {last}"))
            continue
        timed = [r["step_time_s"] for r in records[1:]] or [records[0]["step_time_s"]]
        out.append(Measured(row, statistics.median(timed), max(r["memory_gib"] for r in records)))
    return out


def _step_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in lines if "step_time_s" in r]


def reranked(measured: list[Measured]) -> list[Measured]:
    """Fastest measured first; layouts that failed last."""
    return sorted(measured, key=lambda m: (m.step_time_s is None, -(m.tokens_per_second_per_gpu or 0)))
