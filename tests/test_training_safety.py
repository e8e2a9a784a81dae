"""What a training run does when things go wrong: non-finite steps, checkpoint directories
holding other runs' checkpoints, resume pointers gone missing, a changed model shape, a full disk.
Single-process runs (in the launcher's process), a tiny GPT on mock data, a few steps each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = [
    "data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null",
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
    "model.seq_length=32", "train.iters=4", "train.micro_batch_size=2", "train.global_batch_size=2",
    "train.log_interval=1", "train.eval_interval=null", "optim.warmup_iters=0", "optim.lr=1e-2",
    "train.precision=fp32", "checkpoint.dir=null", "parallel.tensor=1", "parallel.pipeline=1",
    "parallel.sequence_parallel=false", "parallel.virtual_pipeline=null", "launch.nproc=1",
]


def pretrain(run_dir: Path, overrides: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    sets = [*TINY, *overrides, f"run.dir={run_dir}"]
    env = dict(os.environ, MEGACLI_IN_PROCESS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "megacli", "pretrain", *[x for s in sets for x in ("--set", s)]],
                          capture_output=True, text=True, timeout=600, env=env)


def ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def refused(out: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2 with one message (no traceback) holding every needle; returns the message."""
    text = " ".join(out.stderr.split())
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in text, text
    return text


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def nan_at_step(losses, *, labels, loss_mask, step):
    """A custom loss that is NaN at the given (1-based) call - one call per step with one micro-batch."""
    nan_at_step.calls = getattr(nan_at_step, "calls", 0) + 1
    return losses * float("nan") if nan_at_step.calls == step else losses


NAN_AT_3 = ["train.loss=tests.test_training_safety:nan_at_step", "train.loss_kwargs={step: 3}"]


# ---------------------------------------------------------------- non-finite training


def test_nonfinite_loss_stops_naming_iteration_and_last_good_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    out = pretrain(tmp_path / "run", NAN_AT_3 + [f"checkpoint.dir={ck}", "checkpoint.save_interval=2"])
    refused(out, "non-finite loss at iteration 3", f"last good checkpoint is {ck / 'iter_0000002'}")
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "latest"]


def test_infinite_lr_never_saves_nonfinite_weights(tmp_path):
    ck = tmp_path / "ck"
    out = pretrain(tmp_path / "run", ["optim.lr=.inf", f"checkpoint.dir={ck}", "checkpoint.save_interval=1"])
    refused(out, "weights are not finite after iteration 1", "no good checkpoint")
    assert not (ck / "iter_0000001").exists() and not (ck / "latest").exists()


def test_nonfinite_skip_drops_the_step_and_counts_it(tmp_path):
    ck = tmp_path / "ck"
    out = ok(pretrain(tmp_path / "run", NAN_AT_3 + ["train.on_nonfinite=skip", f"checkpoint.dir={ck}"]))
    assert "iteration 3: non-finite loss, step skipped" in " ".join(out.stdout.split())
    logged = {r["iteration"]: r for r in records(tmp_path / "run") if "loss" in r}
    assert sorted(logged) == [1, 2, 4] and logged[4]["nonfinite_skipped"] == 1
    assert all(r["loss"] == r["loss"] for r in logged.values())  # no NaN recorded
    assert (ck / "latest").read_text().strip() == "iter_0000004"
