"""Checkpoints cross Megatron-Core releases: a run stopped under one (0.16.1 on Python 3.11, 0.19.x on
3.12) resumes under the other, optimizer state included, and its losses after the resume are those of
an uninterrupted run. The other release's interpreter is MEGACLI_OTHER_PYTHON (.ci/run_py312 names
the machine's Python 3.11 from the 3.12 leg); without it the test is skipped."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import MOCK_GPT, ROOT, assert_close, layout, losses, ok, pretrain, sets_args, without_plot

OTHER_PYTHON = os.environ.get("MEGACLI_OTHER_PYTHON")
REL = 1e-5  # another torch build between the halves


def _core_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('megatron-core'))"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _pretrain_other(run_dir, sets: list[str]) -> None:
    """`megacli pretrain` under the other interpreter, on this checkout's megacli."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400", "MEGACLI_IN_PROCESS": "1"}
    env.pop("VIRTUAL_ENV", None)
    args = without_plot(["pretrain", *sets_args([*sets, f"run.dir={run_dir}"])])
    ok(subprocess.run([OTHER_PYTHON, "-m", "megacli", *args], capture_output=True, text=True, env=env, timeout=900))


@pytest.mark.skipif(not OTHER_PYTHON, reason="MEGACLI_OTHER_PYTHON names no interpreter with the other Megatron-Core")
def test_checkpoint_resumes_across_core_versions(tmp_path):
    from megacli.engine.core_compat import core_version

    assert _core_version(OTHER_PYTHON) != str(core_version()), "the other interpreter has this Megatron-Core"
    sets = [*MOCK_GPT, *layout()]
    pretrain(tmp_path / "whole", sets)
    whole = losses(tmp_path / "whole")
    for first, then in (("other", "here"), ("here", "other")):
        ck, run = tmp_path / f"ck_{first}", tmp_path / f"{first}_then_{then}"
        half = [*sets, f"checkpoint.dir={ck}", "train.exit_after_iters=3"]
        _pretrain_other(run, half) if first == "other" else pretrain(run, half)
        rest = [*sets, f"checkpoint.dir={ck}"]
        _pretrain_other(run, rest) if then == "other" else pretrain(run, rest)
        resumed = losses(run)
        assert sorted(resumed) == [1, 2, 3, 4, 5, 6], f"{first} then {then}: {resumed}"
        assert_close(resumed, whole, range(1, 7), REL)
