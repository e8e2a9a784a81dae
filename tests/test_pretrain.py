"""GPT pretraining end to end on the CPU backend: multi-process layouts through the real launcher,
layout invariance against a single process, resume reproducibility, atomic checkpoints, loading
a checkpoint under another layout.

The model is tiny and the data mock (Megatron's MockGPTDataset); a few steps each. Losses are read
back from metrics.jsonl (log_interval 1: one record per step)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import MOCK_GPT as TINY, assert_close, layout, losses, megacli, pretrain, sets_args

REL = 1e-4  # another layout: another order of floating-point sums

@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    pretrain(tmp / "run", [*TINY, *layout()])
    return losses(tmp / "run")


@pytest.mark.slow
def test_single_process_loss_falls(single):
    assert single[6] < single[1] - 0.3, single


@pytest.mark.slow
def test_tp2_pp2_sp_matches_single_process_and_checkpoint_loads_in_tp1(single, tmp_path):
    """TP=2 × PP=2 with SP under 1F1B gives the single-process losses; its checkpoint at step 4
    loads into TP=1 × PP=1 and step 5 there equals step 5 of the TP2×PP2 run."""
    ck = tmp_path / "ck"
    pretrain(tmp_path / "tp2pp2", TINY + layout(tp=2, pp=2, sp=True) + [f"checkpoint.dir={ck}", "checkpoint.save_interval=4"])
    tp2pp2 = losses(tmp_path / "tp2pp2")
    assert_close(tp2pp2, single, range(1, 4), REL)
    assert (ck / "latest").read_text().strip() == "iter_0000006"
    pretrain(tmp_path / "resumed_tp1", TINY + layout() + [f"checkpoint.resume={ck / 'iter_0000004'}"])
    resumed = losses(tmp_path / "resumed_tp1")
    assert min(resumed) == 5, "training continues after the loaded iteration"
    assert_close(resumed, tp2pp2, [5, 6], REL)


@pytest.mark.slow
def test_tp2_dp2_sp_distributed_optimizer_matches_single_process(single, tmp_path):
    pretrain(tmp_path / "tp2dp2", TINY + layout(tp=2, dp=2, sp=True, dist_opt=True))
    assert_close(losses(tmp_path / "tp2dp2"), single, range(1, 4), REL)


@pytest.mark.slow
def test_interleaved_pipeline_matches_single_process(single, tmp_path):
    # 4 layers over PP=2 × 2 virtual stages: one layer per chunk; 4 micro-batches (a multiple of PP).
    pretrain(tmp_path / "vpp", TINY + layout(pp=2, vp=2))
    assert_close(losses(tmp_path / "vpp"), single, range(1, 4), REL)


@pytest.mark.slow
def test_resume_reproduces_uninterrupted_run(single, tmp_path):
    ck = tmp_path / "ck"
    pretrain(tmp_path / "part", TINY + layout() + [f"checkpoint.dir={ck}", "train.exit_after_iters=3"])
    assert (ck / "latest").read_text().strip() == "iter_0000003"
    pretrain(tmp_path / "part", TINY + layout() + [f"checkpoint.dir={ck}"])
    resumed = losses(tmp_path / "part")
    # Same loss curve, steps 1-3 from the first process and 4-6 from the resumed one.
    assert_close(resumed, single, range(1, 7), 1e-6)


@pytest.mark.slow
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    """A worker killed while writing iteration 4 leaves iter_0000002 and `latest` intact; the next
    run resumes from it."""
    ck = tmp_path / "ck"
    sets = [*TINY, *layout(), f"checkpoint.dir={ck}", "checkpoint.save_interval=2", f"run.dir={tmp_path / 'run'}"]
    out = megacli("pretrain", *sets_args(sets), env={"MEGACLI_TEST_CRASH_IN_SAVE": "4"})  # a worker the launcher starts
    assert out.returncode != 0
    # The launcher shows the failing worker's error once, not a wall of tracebacks.
    assert "rank 0 failed with RuntimeError: injected crash while saving iteration 4" in out.stderr, out.stderr
    assert out.stderr.count("Traceback") <= 1, out.stderr
    assert (ck / "latest").read_text().strip() == "iter_0000002"
    assert (ck / "iter_0000004.tmp").exists() and not (ck / "iter_0000004").exists()
    pretrain(tmp_path / "run", TINY + layout() + [f"checkpoint.dir={ck}", "checkpoint.save_interval=2"])
    logged = [json.loads(line)["iteration"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # The first run logged 1-4 and died saving 4; the second resumed from 2 and replaced the records of 3 and 4.
    assert logged == [1, 2, 3, 4, 5, 6]
    assert (ck / "latest").read_text().strip() == "iter_0000006"
    assert not (ck / "iter_0000004.tmp").exists()


@pytest.mark.slow
def test_context_parallel_matches_single_process(single, tmp_path):
    """CP=2 (ring attention over load-balanced chunks, sequence split per rank) gives the same losses."""
    pretrain(tmp_path / "cp2", TINY + layout(cp=2))
    assert_close(losses(tmp_path / "cp2"), single, range(1, 4), REL)


def double_loss(losses, *, labels, loss_mask, factor):
    """A custom loss for the test below: every token's loss times `factor`."""
    return losses * factor


@pytest.mark.slow
def test_custom_loss_and_tensorboard(single, tmp_path):
    pretrain(tmp_path / "custom", TINY + layout() + ["train.loss=tests.test_pretrain:double_loss", "train.loss_kwargs={factor: 2.0}",
                                             "train.iters=2", "train.tensorboard=true"])
    assert abs(losses(tmp_path / "custom")[1] - 2 * single[1]) <= 1e-6 * single[1]
    assert any((tmp_path / "custom" / "tensorboard").glob("events.out.tfevents.*"))


def test_slurm_environment_maps_to_torch_env():
    from megacli.launch import first_slurm_host, slurm_to_torch_env

    assert first_slurm_host("gpu[003-010,012],cpu1") == "gpu003"
    assert first_slurm_host("node7") == "node7"
    env = slurm_to_torch_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_LOCALID": "1",
                              "SLURM_JOB_NODELIST": "dgx[01-02]", "SLURM_JOB_ID": "1234"})
    assert env == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
                   "MASTER_ADDR": "dgx01", "MASTER_PORT": str(20000 + 1234)}
