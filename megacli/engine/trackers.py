"""Experiment trackers: TensorBoard, Weights & Biases and MLflow. Each gets every metrics.jsonl
record; W&B and MLflow also get the resolved recipe as the run config, the versions and the run's
name. Only the reporting rank makes them (see engine.metrics).

A tracker that cannot start (package missing, no credentials, a bad URI) or fails while logging
is turned off with one line saying why; the run goes on with the others. The W&B and MLflow run
ids are kept in <run.dir>/trackers.json, so a resumed run continues the same tracker run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from megacli.rundir import RECIPE_FILE

IDS_FILE = "trackers.json"
INSTALL_HINT = {"tensorboard": "pip install tensorboard", "wandb": "pip install 'megacli[wandb]'",
                "mlflow": "pip install 'megacli[mlflow]'"}


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers (booleans as 0/1), without the iteration and missing values."""
    return {k: float(v) for k, v in record.items() if k != "iteration" and isinstance(v, (int, float))}


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"train": {"iters": 10}} -> {"train.iters": "10"}: MLflow params are flat strings."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, type(None))) else str(value)
    return out


class TensorBoard:
    name = "tensorboard"

    def __init__(self, *, run_dir: Path, **_):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.id = None

    def log(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["iteration"])

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run in <run.dir>/wandb (WANDB_MODE=offline: synced later with `wandb sync`); the
    project is WANDB_PROJECT (default megacli), the entity WANDB_ENTITY. Without WANDB_MODE, a run
    that cannot start online (no API key, no network) is kept offline, and ``note`` says how to sync it."""

    name = "wandb"

    def __init__(self, *, run_dir: Path, run_name: str, config: dict, run_id: str | None, **_):
        import wandb

        options = dict(project=os.environ.get("WANDB_PROJECT", "megacli"), name=run_name, dir=str(run_dir), id=run_id,
                       resume="allow" if run_id else None, config=config, allow_val_change=True, reinit="create_new",
                       settings=wandb.Settings(console="off"))
        self.note = None
        try:
            self.run = wandb.init(**options)
        except Exception as exc:
            if os.environ.get("WANDB_MODE"):  # the mode the user chose failed
                raise
            self.run = wandb.init(mode="offline", **options)
            synced = self.run.settings.sync_dir
            self.note = (f"wandb: could not start online ({_why(exc)}); the run is kept offline in {synced}: "
                         f"upload it with `wandb sync {synced}`")
        self.id = self.run.id

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["iteration"])

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run in experiment MLFLOW_EXPERIMENT_NAME (default megacli) at MLFLOW_TRACKING_URI,
    by default the file store <run.dir>/mlruns (no server needed). Params: the recipe's fields,
    dotted; the run directory's recipe.yaml as an artifact; tags: the versions and the run dir."""

    name = "mlflow"

    def __init__(self, *, run_dir: Path, run_name: str, config: dict, run_id: str | None, **_):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 refuses the file store unless asked; it is the one store that needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=uri)
        params = flatten(config["recipe"])
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            # MLflow never changes a logged param: a resumed run adds only the new ones.
            params = {k: v for k, v in params.items() if k not in self.client.get_run(run_id).data.params}
        else:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "megacli")
            experiment = self.client.get_experiment_by_name(experiment_name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
            tags = {"run_dir": config["run_dir"], **{f"version.{k}": str(v) for k, v in config["versions"].items()}}
            run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run_id, params=items[start:start + 100])
        if (run_dir / RECIPE_FILE).is_file():
            self.client.log_artifact(run_id, str(run_dir / RECIPE_FILE))
        self.id = run_id

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(k, v, now, record["iteration"]) for k, v in scalars(record).items()])

    def close(self) -> None:
        self.client.set_terminated(self.id)


KINDS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def _why(exc: BaseException) -> str:
    """One line: the exception's first line, cut at 200 characters."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= 200 else text[:197] + "..."


def saved_ids(path: Path, warn: Callable[[str], None]) -> dict[str, str]:
    """The tracker run ids a run directory keeps ({tracker: id}); an unreadable file is one warning
    and no ids (the trackers start new runs)."""
    try:
        ids = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        warn(f"{path}: unreadable ({_why(exc)}); the trackers start new runs")
        return {}
    if not isinstance(ids, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ids.items()):
        warn(f"{path}: expected {{tracker: run id}} strings; the trackers start new runs")
        return {}
    return ids


class Trackers:
    """The trackers that started; one that fails while logging is closed and dropped."""

    def __init__(self, *, names: list[str], run_dir: str, run_name: str | None, recipe: dict, versions: dict, resumed: bool, warn: Callable[[str], None]):
        self.warn = warn
        self.active = []
        run_dir = Path(run_dir)
        ids_path = run_dir / IDS_FILE
        ids = saved_ids(ids_path, warn) if resumed and ids_path.is_file() else {}
        config = {"recipe": recipe, "versions": versions, "run_dir": str(run_dir.resolve())}
        for name in names:
            try:
                tracker = KINDS[name](run_dir=run_dir, run_name=run_name or run_dir.resolve().name,
                                      config=config, run_id=ids.get(name))
            except ImportError as exc:
                warn(f"{name} logger off: {_why(exc)} ({INSTALL_HINT[name]})")
                continue
            except Exception as exc:  # any reason a tracker cannot start must not stop the run
                warn(f"{name} logger off: could not start: {_why(exc)}")
                continue
            self.active.append(tracker)
            if getattr(tracker, "note", None):
                warn(tracker.note)
            if tracker.id is not None:
                ids[name] = tracker.id
        if ids:
            try:
                ids_path.write_text(json.dumps(ids, indent=2) + "\n")
            except OSError as exc:
                warn(f"{ids_path}: not written ({_why(exc)}); a resumed run will start new tracker runs")

    def log(self, record: dict) -> None:
        for tracker in list(self.active):
            try:
                tracker.log(record)
            except Exception as exc:  # a tracker's failure must not stop the run
                self.warn(f"{tracker.name} logger off: logging failed: {_why(exc)}")
                self.active.remove(tracker)
                self._close(tracker)

    def close(self) -> None:
        for tracker in self.active:
            self._close(tracker)
        self.active = []

    def _close(self, tracker) -> None:
        try:
            tracker.close()
        except Exception as exc:  # closing is best effort: the metrics are already logged
            self.warn(f"{tracker.name} logger: closing failed: {_why(exc)}")
