"""The curves of a run, read from its metrics.jsonl. A resumed run appends to the same file and
logs again from its checkpoint on, so a training record whose iteration is not past the previous
one starts a new segment: what the earlier segment logged from that iteration on is dropped."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megacli.errors import UserError
from megacli.rundir import METRICS_FILE

DEFAULT_METRICS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu")


@dataclass(frozen=True)
class Curve:
    iterations: list[int]
    values: list[float]
    evaluation: bool
    """From evaluation records (drawn as marked points) rather than training steps."""


@dataclass(frozen=True)
class Run:
    label: str
    curves: dict[str, Curve]


def read_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records in order. A last line without its newline (a write cut off by a
    crash) is ignored."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        what = "is not a directory" if not run_dir.is_dir() else f"has no {METRICS_FILE}"
        raise UserError(f"{run_dir}: {what} (give a run directory of `megacli pretrain` or `megacli finetune`)")
    text = path.read_text()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}, line {number}: not a JSON record ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
            raise UserError(f"{path}, line {number}: not a metrics record (no integer 'iteration')")
        records.append(record)
    return records


def join_segments(records: list[dict]) -> list[dict]:
    """The records of the run as it stands: where a resumed segment logs an iteration again, the
    earlier segment's records from that iteration on are replaced by the later segment's."""
    kept, last = [], 0
    for record in records:
        if "loss" in record:  # a training step (evaluation records carry val_loss)
            if record["iteration"] <= last:
                kept = [k for k in kept if k["iteration"] < record["iteration"]]
            last = record["iteration"]
        kept.append(record)
    return kept


def curves(records: list[dict]) -> dict[str, Curve]:
    """One curve per numeric field (missing values, such as grad_norm null, are left out)."""
    points: dict[str, tuple[list, list, bool]] = {}
    for record in records:
        evaluation = "loss" not in record
        for key, value in record.items():
            if key == "iteration" or not isinstance(value, (int, float)):
                continue
            xs, ys, _ = points.setdefault(key, ([], [], evaluation))
            xs.append(record["iteration"])
            ys.append(float(value))
    return {k: Curve(iterations=xs, values=ys, evaluation=ev) for k, (xs, ys, ev) in points.items()}


def read_runs(run_dirs: list[Path]) -> list[Run]:
    names = [Path(d).resolve().name for d in run_dirs]
    labels = names if len(set(names)) == len(names) else [str(d) for d in run_dirs]
    runs = []
    for run_dir, label in zip(run_dirs, labels):
        records = read_records(Path(run_dir))
        if not records:
            raise UserError(f"{Path(run_dir) / METRICS_FILE}: no records yet")
        runs.append(Run(label=label, curves=curves(join_segments(records))))
    return runs


def choose_metrics(runs: list[Run], requested: list[str] | None) -> list[str]:
    """The panels: the requested metrics (each must be in some run), or those of DEFAULT_METRICS
    the runs have."""
    present = {name for run in runs for name in run.curves}
    if requested is None:
        return [m for m in DEFAULT_METRICS if m in present]
    unknown = [m for m in requested if m not in present]
    if unknown:
        raise UserError(f"--metrics: {', '.join(unknown)} not in metrics.jsonl (it has: {', '.join(sorted(present))})")
    return requested
