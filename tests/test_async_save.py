"""Asynchronous checkpoint saves (checkpoint.async_save): Megatron-Core's writer in a forked
process while training goes on; `latest` moves only once the write is complete; a failed or killed
write keeps the previous checkpoint; a stop signal waits for the save in flight."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import pretrain_losses

TINY = [
    "data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null",
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
    "model.seq_length=32", "train.iters=6", "train.micro_batch_size=2", "train.global_batch_size=4",
    "train.log_interval=1", "train.eval_interval=null", "optim.warmup_iters=0", "optim.lr=1e-2",
    "train.precision=fp32", "parallel.tensor=1", "parallel.pipeline=1", "parallel.sequence_parallel=false",
    "parallel.virtual_pipeline=null", "launch.nproc=1", "checkpoint.save_interval=2",
]


def args(*sets: str) -> list[str]:
    return [x for s in [*TINY, *sets] for x in ("--set", s)]


def assert_same(a: dict[int, float], b: dict[int, float], steps) -> None:
    for i in steps:
        assert abs(a[i] - b[i]) <= 1e-6 * abs(b[i]), f"step {i}: {a[i]} vs {b[i]}"


@pytest.mark.slow
def test_async_saves_train_and_resume_as_synchronous_ones(tmp_path):
    """Saving in the background changes no loss; a run resumed from a checkpoint written in the
    background continues exactly as the uninterrupted synchronous run (fp32, 1e-6)."""
    from megacli.checkpoint import manifest

    out, sync = pretrain_losses(args(f"checkpoint.dir={tmp_path / 'sync'}", "checkpoint.async_save=false"),
                                tmp_path / "sync_run", in_process=True)
    assert out.returncode == 0, out.stderr[-3000:]
    ck = tmp_path / "async"
    out, background = pretrain_losses(args(f"checkpoint.dir={ck}"), tmp_path / "async_run", in_process=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same(background, sync, range(1, 7))
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]
    for it in ("iter_0000002", "iter_0000004", "iter_0000006"):
        assert manifest.verify(ck / it).startswith("manifest: OK"), it
    out, resumed = pretrain_losses(args(f"checkpoint.resume={ck / 'iter_0000002'}", "checkpoint.dir=null"),
                                   tmp_path / "resumed_run", in_process=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert min(resumed) == 3
    assert_same(resumed, sync, range(3, 7))


class Weights:
    """A model chunk's stand-in: checkpoint.save asks it for its sharded state dict."""

    def __init__(self, value: float):
        import torch

        # Large enough for torch's parallel kernels, which the parent then uses before forking its writer
        # (torch's OpenMP threads do not survive a fork: the writer must not run such a kernel).
        self.weight = torch.full((256, 256), float(value)) * torch.ones(256, 256)

    def sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        return {"weight": ShardedTensor.from_rank_offsets("weight", self.weight, replica_id=0)}


def slowed_writer(monkeypatch, seconds: float) -> None:
    """Megatron-Core's background writer starts ``seconds`` late (in the forked process only)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    real = FileSystemWriterAsync.write_preloaded_data_multiproc
    trainer = os.getpid()

    def slow(*a, **kw):
        if os.getpid() != trainer:
            time.sleep(seconds)
        return real(*a, **kw)

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data_multiproc", staticmethod(slow))


@pytest.mark.slow
def test_latest_moves_only_once_the_write_is_complete_and_a_failed_or_killed_write_keeps_it(tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from megacli.checkpoint import manifest
    from megacli.checkpoint.layout import find_checkpoint
    from megacli.convert.megatron_io import megatron_process
    from megacli.engine import checkpoint

    ck = tmp_path / "ck"

    def save(iteration: int, queue=None) -> Path:
        return checkpoint.save(ckpt_dir=ck, iteration=iteration, consumed_samples=0, chunks=[Weights(iteration)],
                               optimizer=None, scheduler=None, recipe_yaml="{}\n", queue=queue)

    with megatron_process():
        save(1)
        slowed_writer(monkeypatch, 3.0)
        queue = AsyncCallsQueue()
        final = save(2, queue)
        assert queue.maybe_finalize_async_calls(blocking=False) == []  # still being written
        assert (ck / "latest").read_text().strip() == "iter_0000001" and not final.exists()
        assert (ck / "iter_0000002.tmp").is_dir() and find_checkpoint(ck) == ck / "iter_0000001"
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        assert (ck / "latest").read_text().strip() == "iter_0000002"
        assert manifest.verify(ck).startswith("manifest: OK")

        monkeypatch.setenv("MEGACLI_TEST_CRASH_IN_SAVE", "3")  # fails in the finalize step, before publishing
        save(3, queue)
        with pytest.raises(RuntimeError, match="injected crash while saving iteration 3"):
            queue.maybe_finalize_async_calls(blocking=True)
        assert find_checkpoint(ck) == ck / "iter_0000002" and not (ck / "iter_0000003").exists()

        save(4, queue)  # the writer killed mid-write (its process is gone, as with a crashed node)
        (call,) = queue.async_calls
        call.async_caller.close(abort=True)
        queue.async_calls.clear()
        assert find_checkpoint(ck) == ck / "iter_0000002" and not (ck / "iter_0000004").exists()
        assert manifest.verify(ck).startswith("manifest: OK")


def test_a_run_reuses_its_save_plan_in_each_new_directory(tmp_path):
    """One strategy for a run's saves (engine.saves): from the third save on Megatron-Core's plan is
    reused, not made again; each save, asynchronous or not, holds its own values in its own directory."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from megacli.checkpoint import manifest
    from megacli.convert.megatron_io import megatron_process
    from megacli.engine import checkpoint

    ck = tmp_path / "ck"
    with megatron_process():
        strategy, queue = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True), AsyncCallsQueue()
        for iteration in (1, 2, 3, 4):
            checkpoint.save(ckpt_dir=ck, iteration=iteration, consumed_samples=0, chunks=[Weights(iteration)],
                            optimizer=None, scheduler=None, recipe_yaml="{}\n", strategy=strategy,
                            queue=queue if iteration % 2 else None)
            assert queue.maybe_finalize_async_calls(blocking=True) == ([iteration // 2] if iteration % 2 else [])
            assert strategy.validated_cache_reuse == (iteration > 1)  # the plan made at 1 and 2 is the same
        for iteration in (1, 2, 3, 4):
            saved = ck / f"iter_{iteration:07d}"
            assert manifest.verify(saved).startswith("manifest: OK")
            named = set(re.findall(rb"iter_\d+", (saved / ".metadata").read_bytes()))
            assert named <= {saved.name.encode()}  # the torch_dist metadata names no other save's directory
            empty = {"weight": ShardedTensor.from_rank_offsets("weight", torch.zeros(256, 256), replica_id=0)}
            loaded = dist_checkpointing.load(empty, str(saved))["weight"]
            assert torch.equal(loaded, torch.full((256, 256), float(iteration)))


SIGNAL_IN_FLIGHT = """
import os, signal, sys, time
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

real = FileSystemWriterAsync.write_preloaded_data_multiproc
trainer, flag = os.getpid(), sys.argv[1]

def signal_then_write(*args, **kwargs):
    if os.getpid() != trainer and not os.path.exists(flag):  # the first background write
        open(flag, "w").close()
        os.kill(trainer, signal.SIGTERM)
        time.sleep(4)
    return real(*args, **kwargs)

FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(signal_then_write)
from megacli.cli import main
sys.argv[0:2] = ["megacli"]
main()
"""


@pytest.mark.slow
def test_a_stop_signal_waits_for_the_save_in_flight(tmp_path):
    """SIGTERM arrives while iteration 2 is written in the background: the run stops at the next
    step boundary, publishes iteration 2 once written, saves where it stopped and exits 0."""
    from megacli.checkpoint import manifest

    ck = tmp_path / "ck"
    out = subprocess.run([sys.executable, "-c", SIGNAL_IN_FLIGHT, str(tmp_path / "signalled"), "pretrain",
                          *args(f"checkpoint.dir={ck}", "train.iters=50", f"run.dir={tmp_path / 'run'}")],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, MEGACLI_IN_PROCESS="1", COLUMNS="400"))
    text = " ".join(out.stdout.split())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stopped = int((ck / "latest").read_text().strip().split("_")[1])
    assert stopped < 50 and f"stopped on SIGTERM at iteration {stopped}: saved checkpoint" in text, text[-2000:]
    assert text.index(f"saved checkpoint {ck / 'iter_0000002'}") < text.index("stopped on SIGTERM")
    assert not list(ck.glob("*.tmp"))
    for it in {2, stopped}:
        assert manifest.verify(ck / f"iter_{it:07d}").startswith("manifest: OK")
