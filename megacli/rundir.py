"""The run directory: the resolved recipe, the versions in use, metrics.jsonl, logs, errors, and the
lock a job holds on it (and on its checkpoint directory) while it runs."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from megacli.recipe.base import dump

RECIPE_FILE = "recipe.yaml"
VERSIONS_FILE = "versions.json"
METRICS_FILE = "metrics.jsonl"
# Written by rank 0 when the workers stopped at a step boundary on a signal (see engine.stop).
STOPPED_FILE = "stopped.json"
LOCK_FILE = "megacli.lock"


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
    recipe_file = run_dir / RECIPE_FILE
    draft = run_dir / f".{RECIPE_FILE}.{os.getpid()}"  # workers on other nodes may be reading it
    with unwritable_names(run_dir, "run.dir", draft):
        run_dir.mkdir(parents=True, exist_ok=True)
        draft.write_text(dump(recipe))
        draft.replace(recipe_file)
        (run_dir / VERSIONS_FILE).write_text(json.dumps(versions(), indent=2) + "\n")
    return recipe_file


@contextmanager
def unwritable_names(directory: Path, field: str, *drafts: Path):
    """An OSError while writing in ``directory`` (read-only or full filesystem, no permission) as one
    error naming it; the block's ``drafts``, and ``directory`` when the block created it, are removed then."""
    from megacli.errors import UserError

    existed = directory.exists()
    try:
        yield
    except OSError as exc:
        for leftover in drafts:
            try:
                leftover.unlink(missing_ok=True)
            except OSError:
                pass
        if not existed:
            try:
                directory.rmdir()
            except OSError:
                pass
        cause = exc.strerror or type(exc).__name__
        raise UserError(f"{field} {directory}: cannot write there ({cause}); give a writable directory with free space") from None


@contextmanager
def locked(directories: dict[str, str], *, job_id: str):
    """Hold the job's lock on each directory ({field: path}) while the block runs. Every rank and node
    of one job (the same job id) shares it; another job is refused. The process that created a lock
    removes it."""
    created = []
    try:
        seen = {}
        for field, directory in directories.items():
            seen.setdefault(Path(directory).resolve(), field)
        for directory, field in seen.items():
            if _acquire(directory, job_id, field):
                created.append(directory)
        yield
    finally:
        for directory in created:
            holder = _holder(directory / LOCK_FILE)
            if holder and holder.get("job_id") == job_id:
                (directory / LOCK_FILE).unlink(missing_ok=True)


def _acquire(directory: Path, job_id: str, field: str) -> bool:
    """Take the lock; True when this process created it, False when the job already holds it."""
    path = directory / LOCK_FILE
    mine = {"job_id": job_id, "host": socket.gethostname(), "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    draft = directory / f".{LOCK_FILE}.{os.getpid()}"
    with unwritable_names(directory, field, draft):
        directory.mkdir(parents=True, exist_ok=True)
        draft.write_text(json.dumps(mine) + "\n")
        return _link(draft, path, mine, job_id)


def _link(draft: Path, path: Path, mine: dict, job_id: str) -> bool:
    """Make ``draft`` the lock at ``path`` unless another live job holds it."""
    from megacli.errors import UserError

    directory = path.parent
    try:
        for _ in range(3):
            try:
                os.link(draft, path)  # atomic: fails when a lock exists, never leaves a half-written one
                return True
            except FileExistsError:
                pass
            holder = _holder(path)
            if holder is None:
                continue  # removed meanwhile
            if holder.get("job_id") == job_id:
                return False
            if holder.get("host") == mine["host"] and not _alive(int(holder.get("pid", 0))):
                print(f"note: {path}: job {holder.get('job_id')!r} (pid {holder.get('pid')}) is gone; taking over its lock",
                      file=sys.stderr)
                path.unlink(missing_ok=True)
                continue
            raise UserError(f"{directory} is in use by job {holder.get('job_id')!r} (pid {holder.get('pid')} on "
                            f"{holder.get('host')}, since {holder.get('since')}): wait for it to finish or give another "
                            f"run.dir / checkpoint.dir (if that job is gone, delete {path})")
        raise UserError(f"{path}: could not take the run-directory lock (another job keeps replacing it)")
    finally:
        draft.unlink(missing_ok=True)


def _holder(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"job_id": None, "host": None, "pid": 0, "since": "?"}  # unreadable: refused, named


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def error_dir(run_dir: str | Path) -> Path:
    """Where each rank records the error that ended it, for the launcher."""
    return Path(run_dir) / "errors"


def record_worker_error(run_dir: str | Path, exc: BaseException, tb: str) -> int:
    """Write this rank's error for the launcher; return the exit code to use."""
    from megacli.errors import UserError

    user_error = isinstance(exc, UserError)
    exit_code = getattr(exc, "exit_code", 2) if user_error else 1
    path = error_dir(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    payload = {"rank": rank, "time": time.time(), "type": type(exc).__name__, "message": str(exc),
               "traceback": "" if user_error else tb, "user_error": user_error, "exit_code": exit_code}
    (path / f"rank{rank}.json").write_text(json.dumps(payload))
    return exit_code
