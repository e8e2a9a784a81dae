"""Helpers and settings several test files share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLURM_CLUSTER_SCRIPT = ROOT / ".ci" / "slurm_cluster.sh"


def pretrain_losses(args: list[str], run_dir: Path, *, in_process: bool) -> tuple[subprocess.CompletedProcess, dict[int, float]]:
    """`megacli pretrain ARGS --set run.dir=RUN_DIR` in a fresh interpreter (its one worker in the CLI's
    process with ``in_process``): the finished process and the loss of each logged step."""
    env = {**os.environ, "COLUMNS": "400"}  # long tmp paths must not wrap a message
    if in_process:
        env["MEGACLI_IN_PROCESS"] = "1"
    out = subprocess.run([sys.executable, "-m", "megacli", "pretrain", *args, "--set", f"run.dir={run_dir}"],
                         capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0:
        return out, {}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return out, {r["iteration"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A two-node Slurm cluster on this host (.ci/slurm_cluster.sh: nodes n1 and n2), started once
    for the tests that ask for it and stopped after them; SLURM_CONF names its configuration
    meanwhile. Yields its directory (pids/, log/). Skipped, with the reason, where it cannot start
    (not root, no apt-get, no network for the packages)."""
    directory = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(SLURM_CLUSTER_SCRIPT), "start", str(directory)], capture_output=True, text=True,
                             timeout=600)
    if started.returncode != 0:
        pytest.skip(f"no Slurm cluster here: {(started.stderr.strip() or started.stdout.strip())[-500:]}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(directory / "slurm.conf")
    try:
        yield directory
    finally:
        subprocess.run(["bash", str(SLURM_CLUSTER_SCRIPT), "stop", str(directory)], capture_output=True, timeout=300)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous


try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the [test] extra brings it; without it the property tests are skipped
    pass
else:
    # Deterministic property tests: the same examples on every run, nothing stored between runs.
    settings.register_profile("megacli", derandomize=True, database=None, deadline=None, max_examples=60,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    settings.load_profile("megacli")
