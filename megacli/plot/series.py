"""The curves of a run, read from its metrics.jsonl. A resumed run appends to the same file and
logs again from its checkpoint on, so a training record whose iteration is not past the previous
one starts a new segment: what the earlier segment logged from that iteration on is dropped."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from megacli.errors import UserError
from megacli.rundir import METRICS_FILE

DEFAULT_METRICS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu")
DRAWABLE = 1e300
"""Values beyond ±DRAWABLE are left out: an axis spanning them overflows a float."""
MAX_ITERATION = 2**63 - 1


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
    skipped: dict[str, list[int]] = field(default_factory=dict)
    """Per metric, the iterations whose value could not be drawn (inf, NaN, beyond ±DRAWABLE)."""


def is_number(value) -> bool:
    """A JSON number (true/false are not numbers)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def drawable(value) -> float | None:
    """``value`` as a float when it can be drawn, else None."""
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float's range
        return None
    return number if math.isfinite(number) and abs(number) <= DRAWABLE else None


def read_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records in order. A last line without its newline (a write cut off by a
    crash) is ignored."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        what = "is not a directory" if not run_dir.is_dir() else f"has no {METRICS_FILE}"
        raise UserError(f"{run_dir}: {what} (give a run directory of `megacli pretrain` or `megacli finetune`)")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise UserError(f"{path}, line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None
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
        iteration = record.get("iteration") if isinstance(record, dict) else None
        if not (is_number(iteration) and isinstance(iteration, int) and 0 <= iteration <= MAX_ITERATION):
            raise UserError(f"{path}, line {number}: not a metrics record (no integer 'iteration' >= 0)")
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


def curves(records: list[dict]) -> tuple[dict[str, Curve], dict[str, list[int]]]:
    """One curve per numeric field (missing values, such as grad_norm null, are left out), and per
    field the iterations whose number cannot be drawn (inf, NaN, beyond ±DRAWABLE)."""
    points: dict[str, tuple[list, list, bool]] = {}
    skipped: dict[str, list[int]] = {}
    for record in records:
        evaluation = "loss" not in record
        for key, value in record.items():
            if key == "iteration" or not is_number(value):
                continue
            y = drawable(value)
            if y is None:
                skipped.setdefault(key, []).append(record["iteration"])
                continue
            xs, ys, _ = points.setdefault(key, ([], [], evaluation))
            xs.append(record["iteration"])
            ys.append(y)
    return {k: Curve(iterations=xs, values=ys, evaluation=ev) for k, (xs, ys, ev) in points.items()}, skipped


def read_runs(run_dirs: list[Path]) -> list[Run]:
    names = [Path(d).resolve().name for d in run_dirs]
    labels = names if len(set(names)) == len(names) else [str(d) for d in run_dirs]
    runs = []
    for run_dir, label in zip(run_dirs, labels):
        records = read_records(Path(run_dir))
        if not records:
            raise UserError(f"{Path(run_dir) / METRICS_FILE}: no records yet")
        drawn, skipped = curves(join_segments(records))
        runs.append(Run(label=label, curves=drawn, skipped=skipped))
    return runs


def skipped_note(run: Run, metrics: list[str]) -> str | None:
    """One line naming the values of ``metrics`` that were left out of the plot, None when none were."""
    parts = []
    for metric in metrics:
        its = run.skipped.get(metric)
        if its:
            shown = ", ".join(map(str, its[:5])) + (f", ... ({len(its)} in all)" if len(its) > 5 else "")
            parts.append(f"{metric} at iteration {shown}")
    if not parts:
        return None
    return f"{run.label}: left out values that cannot be drawn (inf, NaN or beyond ±{DRAWABLE:g}): {'; '.join(parts)}"


def choose_metrics(runs: list[Run], requested: list[str] | None) -> list[str]:
    """The panels: the requested metrics (each must be in some run), or those of DEFAULT_METRICS
    the runs have."""
    present = {name for run in runs for name in (*run.curves, *run.skipped)}
    if requested is None:
        return [m for m in DEFAULT_METRICS if m in present]
    unknown = [m for m in requested if m not in present]
    if unknown:
        raise UserError(f"--metrics: {', '.join(unknown)} not in metrics.jsonl (it has: {', '.join(sorted(present))})")
    return requested
