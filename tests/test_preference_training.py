"""Preference tuning trained end to end: TP=2 x PP=2 against one process, held-out reward accuracy
rising on a learnable rule, and resuming exactly (DP=1 and DP=2). The pair data and the objectives
against TRL: tests/test_preference.py, whose converted tiny Llama these runs start from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from megacli.checkpoint.source import Source

from tests.test_preference import tiny_llama  # noqa: F401  (the module-scoped fixture)

# ---------------------------------------------------------------- parallel layout


def _steps_at(rank, world, root: str, layouts: list[tuple[int, int]]):
    """Three DPO steps (reference: copy) at each (tensor, pipeline) layout in turn, in the same
    processes (ranks beyond a layout's size sit it out as data-parallel replicas); the losses and
    rewards as the reporting rank sees them."""
    from megatron.core import parallel_state as ps

    from megacli.engine import checkpoint, distributed
    from megacli.engine.loop import build_trainer, data_iterators, train_step
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    base = Path(root) / "base"
    out, runtime = {}, None
    for tp, pp in layouts:
        recipe = load(TrainingRecipe, base / "iter_0000000" / "recipe.yaml", [
            f"preference.train={Path(root) / 'pairs.jsonl'}", "preference.valid_fraction=0",
            f"checkpoint.pretrained={base}", "checkpoint.resume=none", "launch.device=cpu", f"launch.nproc={world}",
            f"parallel.tensor={tp}", f"parallel.pipeline={pp}", "train.micro_batch_size=1",
            "train.global_batch_size=4", "train.precision=fp32",
            f"run.dir={Path(root) / f'run_tp{tp}pp{pp}'}", "optim.lr=2e-2", "optim.decay_style=constant",
            "optim.min_lr=0", "optim.warmup_iters=0"])
        if runtime is None:
            runtime = distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=recipe.train.seed)
        else:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        trainer, _ = build_trainer(recipe, runtime)
        checkpoint.load(source=Source(checkpoint.find_checkpoint(base)), chunks=trainer.chunks, optimizer=trainer.optimizer,
                        scheduler=trainer.scheduler, load_optimizer=False)
        iterators = data_iterators(trainer, trainer.train_data, start_sample=0)
        steps = [train_step(trainer, iterators)[0] for _ in range(3)]
        out[(tp, pp)] = steps if distributed.is_reporting_rank() else None
    distributed.teardown()
    return out


@pytest.mark.slow
def test_tp2_pp2_gives_the_tp1_losses(tiny_llama):
    """TP=2 × PP=2 (sequence parallel, 1F1B over four micro-batches, the reference copy pipelined the
    same way) against TP=1 × DP=4 with the same global batch of four pairs: the same losses and rewards."""
    from tests._dist import spawn

    results = spawn(_steps_at, 4, str(tiny_llama), [(2, 2), (1, 1)])
    parallel = next(r[(2, 2)] for r in results if r[(2, 2)] is not None)
    single = next(r[(1, 1)] for r in results if r[(1, 1)] is not None)
    assert parallel[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        np.testing.assert_allclose([m[key] for m in parallel], [m[key] for m in single], rtol=0, atol=1e-5, err_msg=key)
    assert parallel[-1]["loss"] < parallel[0]["loss"]


# ---------------------------------------------------------------- end to end: learning, resume


def _finetune(root: Path, run: Path, *sets: str) -> tuple[list[dict], str]:
    """`megacli finetune` from the converted checkpoint (conftest's pretrain: one worker in this
    process), resuming from its own checkpoint.dir when that holds one: metrics.jsonl's records and
    the console output."""
    from tests.conftest import pretrain

    base = root / "base"
    args = [f"checkpoint.pretrained={base}", f"checkpoint.dir={run / 'ck'}", "checkpoint.resume=auto",
            "checkpoint.load_optimizer=true", "launch.device=cpu",
            "model.seq_length=48", "preference.template=chatml", "train.precision=fp32", "train.log_interval=1", *sets]
    out = pretrain(run, args, recipe=base / "iter_0000000" / "recipe.yaml", command="finetune")
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()], out.stdout


# data_tools/build_preference_data.py's pairs_from_texts(n=300, seed=0) over the docstrings of argparse,
# collections, pathlib, shutil, textwrap and json (each module and its public names) under Python 3.11,
# kept as files: the docstrings differ between Python releases, and the tests run under 3.11 and 3.12.
PAIRS = Path(__file__).parent / "data" / "preference_pairs"


@pytest.mark.slow
def test_held_out_reward_accuracy_rises_on_a_learnable_rule(tiny_llama, tmp_path):
    """data_tools/build_preference_data.py's rule (the continuation in the case the prompt asks for is
    chosen): the held-out
    set's reward accuracy, reported per name, goes from chance to at least 0.9 in a few steps."""
    data = PAIRS
    records, _ = _finetune(tiny_llama, tmp_path / "run", f"preference.train={data / 'train.jsonl'}",
                        f"preference.valid.heldout={data / 'valid.jsonl'}", "train.iters=24",
                        "train.micro_batch_size=8", "train.global_batch_size=8", "train.eval_interval=2",
                        "train.eval_iters=4", "optim.lr=3e-3", "optim.warmup_iters=0")
    accuracy = [r["val_rewards/accuracy/heldout"] for r in records if "val_rewards/accuracy/heldout" in r]
    print("held-out reward accuracy every 2 steps:", accuracy)
    assert len(accuracy) == 12
    assert accuracy[0] <= 0.75, accuracy  # after two steps: not yet learned
    assert accuracy[-1] >= 0.9, accuracy
    steps = [r for r in records if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert {"rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
            "logps/rejected"} <= set(steps[0])


@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 2])
def test_resume_is_exact(tiny_llama, tmp_path, dp):
    """Four steps in one go, and two steps, stop, resume for two more: the same losses and rewards,
    at DP=1 (one in-process worker) and DP=2 (two workers through the launcher)."""
    data = PAIRS
    sets = [f"preference.train={data / 'train.jsonl'}", "train.iters=4", "train.micro_batch_size=2",
            "train.global_batch_size=4", "optim.lr=3e-3", "train.eval_interval=0", f"launch.nproc={dp}"]
    whole, _ = _finetune(tiny_llama, tmp_path / "whole", *sets)
    _finetune(tiny_llama, tmp_path / "parts", *sets, "train.exit_after_iters=2")
    parts, console = _finetune(tiny_llama, tmp_path / "parts", *sets)
    resumed = f"resumed from {tmp_path / 'parts' / 'ck' / 'iter_0000002'} at iteration 2"
    assert "".join(resumed.split()) in "".join(console.split()), console  # the console wraps long lines
    by_iter = {r["iteration"]: r for r in parts if "loss" in r}
    assert sorted(by_iter) == [1, 2, 3, 4]
    for r in (r for r in whole if "loss" in r):
        for key in ("loss", "rewards/chosen", "rewards/rejected"):
            assert by_iter[r["iteration"]][key] == pytest.approx(r[key], abs=1e-6), (r["iteration"], key)
