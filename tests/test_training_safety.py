"""What a training run does when things go wrong: non-finite steps, checkpoint directories
holding other runs' checkpoints, resume pointers gone missing, a changed model shape, a full disk.
Single-process runs (in the launcher's process), a tiny GPT on mock data, a few steps each."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import MOCK_GPT, layout, ok, pretrain, records, sets_args

# 2 layers, 4 steps of 2 samples, no warmup, the default vocabulary padding; one process.
TINY = [*MOCK_GPT, "model.num_layers=2", "model.make_vocab_size_divisible_by=128", "train.iters=4",
        "train.global_batch_size=2", "optim.warmup_iters=0", *layout()]


def run(run_dir: Path, overrides: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`megacli pretrain` of TINY with the overrides (in the CLI's process), finished however it finished."""
    return pretrain(run_dir, [*TINY, *overrides], env=env, check=False)


def refused(out: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2 with one message (no traceback) holding every needle; returns the message."""
    text = " ".join(out.stderr.split())
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in text, text
    return text


_CALLS: dict[str, int] = {}  # nan_at_step's calls, by run (one process may train several)


def nan_at_step(losses, *, labels, loss_mask, step, run):
    """A custom loss that is NaN at the given (1-based) call of the run named ``run`` - one call per
    step with one micro-batch."""
    _CALLS[run] = _CALLS.get(run, 0) + 1
    return losses * float("nan") if _CALLS[run] == step else losses


def nan_at_3(run_dir: Path) -> list[str]:
    """The overrides of a run into ``run_dir`` whose loss is NaN at step 3."""
    return ["train.loss=tests.test_training_safety:nan_at_step", f"train.loss_kwargs={{step: 3, run: '{run_dir}'}}"]


# ---------------------------------------------------------------- non-finite training


def test_nonfinite_loss_stops_naming_iteration_and_last_good_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    out = run(tmp_path / "run", nan_at_3(tmp_path / "run") + [f"checkpoint.dir={ck}", "checkpoint.save_interval=2"])
    refused(out, "non-finite loss at iteration 3", f"last good checkpoint is {ck / 'iter_0000002'}")
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "latest"]


OVERFLOWING_STEP = """
import sys, torch
from megacli.engine import loop

real = loop.train_step

def overflowing(trainer, iterators):
    out = real(trainer, iterators)
    with torch.no_grad():
        next(trainer.chunks[0].parameters()).fill_(float("inf"))
    return out

loop.train_step = overflowing
from megacli.cli import main
sys.argv[0] = "megacli"
main()
"""


@pytest.mark.parametrize("on_nonfinite", ["stop", "skip"])
def test_nonfinite_weights_are_never_saved(tmp_path, on_nonfinite):
    ck = tmp_path / "ck"
    sets = [*TINY, f"train.on_nonfinite={on_nonfinite}", f"checkpoint.dir={ck}", "checkpoint.save_interval=1",
            f"run.dir={tmp_path / 'run'}"]
    out = subprocess.run([sys.executable, "-c", OVERFLOWING_STEP, "pretrain", *sets_args(sets)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, MEGACLI_IN_PROCESS="1"))
    message = refused(out, "weights are not finite after iteration 1", "no good checkpoint")
    # with skip already set, the message does not suggest setting it
    assert ("train.on_nonfinite = skip drops such steps instead" in message) == (on_nonfinite == "stop"), message
    assert not (ck / "iter_0000001").exists() and not (ck / "latest").exists()


def test_an_infinite_lr_is_refused_before_anything_runs(tmp_path):
    ck = tmp_path / "ck"
    out = run(tmp_path / "run", ["optim.lr=.inf", f"checkpoint.dir={ck}", "checkpoint.save_interval=1"])
    refused(out, "optim.lr = inf: Input should be a finite number")
    assert not ck.exists() and not (tmp_path / "run").exists()


def test_nonfinite_skip_drops_the_step_and_counts_it(tmp_path):
    ck = tmp_path / "ck"
    out = ok(run(tmp_path / "run", nan_at_3(tmp_path / "run") + ["train.on_nonfinite=skip", f"checkpoint.dir={ck}"]))
    assert "iteration 3: non-finite loss, step skipped" in " ".join(out.stdout.split())
    logged = {r["iteration"]: r for r in records(tmp_path / "run") if "loss" in r}
    assert sorted(logged) == [1, 2, 4] and logged[4]["nonfinite_skipped"] == 1
    assert all(r["loss"] == r["loss"] for r in logged.values())  # no NaN recorded
    assert (ck / "latest").read_text().strip() == "iter_0000004"


# ---------------------------------------------------------------- checkpoint directories of earlier runs


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A checkpoint directory an earlier run left: iter_1 ... iter_4, latest = iter_4."""
    tmp = tmp_path_factory.mktemp("earlier")
    ok(run(tmp / "run", [f"checkpoint.dir={tmp / 'ck'}", "checkpoint.save_interval=1"]))
    return tmp / "ck"


def copy_of(ck: Path, tmp: Path) -> Path:
    import shutil

    return Path(shutil.copytree(ck, tmp / "ck"))


def test_fresh_run_in_a_directory_with_checkpoints_is_refused(earlier_run, tmp_path):
    ck = copy_of(earlier_run, tmp_path)
    out = run(tmp_path / "run", [f"checkpoint.dir={ck}", "checkpoint.resume=none", "checkpoint.keep_last=2"])
    refused(out, f"checkpoint.dir {ck} already holds checkpoints", "checkpoint.overwrite: true")
    assert sorted(p.name for p in ck.iterdir()) == [f"iter_000000{i}" for i in range(1, 5)] + ["latest"]


def test_keep_last_prunes_only_this_runs_checkpoints(earlier_run, tmp_path):
    """Pruning by name would keep the earlier run's iter_3 and iter_4 and delete the iter_2 just saved."""
    ck = copy_of(earlier_run, tmp_path)
    ok(run(tmp_path / "run", [f"checkpoint.dir={ck}", "checkpoint.resume=none", "checkpoint.overwrite=true",
                                   "checkpoint.keep_last=1", "checkpoint.save_interval=1", "train.iters=2"]))
    assert (ck / "latest").read_text().strip() == "iter_0000002"
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "iter_0000003", "iter_0000004", "latest"]
    assert (ck / "iter_0000002" / "megacli.json").is_file()


def test_a_tensor_shard_that_would_run_code_is_refused_by_megacli_on_resume(earlier_run, tmp_path):
    """check_torch_dist reads the pickled objects; tensor shards are read by torch's weights-only
    loader inside Megatron's load, whose refusal megacli reports in its own words."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(tmp_path / 'ran')!r}, 'w').close()",)

    ck = copy_of(earlier_run, tmp_path)
    it = ck / "iter_0000004"
    torch.save(Payload(), it / "evil.distcp")
    metadata = pickle.loads((it / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data
                 if isinstance(metadata.state_dict_metadata[i.fqn], TensorStorageMetadata))
    metadata.storage_data[index] = _StorageInfo("evil.distcp", 0, (it / "evil.distcp").stat().st_size)
    (it / ".metadata").write_bytes(pickle.dumps(metadata))
    out = run(tmp_path / "run", [f"checkpoint.dir={ck}", "checkpoint.verify=false", "train.iters=5"])
    refused(out, f"{it}: refused to unpickle builtins.exec: loading it could run code")
    assert "Weights only load failed" not in out.stderr and not (tmp_path / "ran").exists()


def test_resume_auto_without_latest_takes_the_newest_complete_checkpoint(earlier_run, tmp_path):
    ck = copy_of(earlier_run, tmp_path)
    (ck / "latest").unlink()
    (ck / "iter_0000004" / "megacli.json").unlink()  # as if the save of iteration 4 never finished
    out = ok(run(tmp_path / "run", [f"checkpoint.dir={ck}", "train.iters=5"]))
    assert "resuming from the newest complete checkpoint, iter_0000003" in " ".join(out.stdout.split())
    assert min(r["iteration"] for r in records(tmp_path / "run") if "loss" in r) == 4


def test_resume_auto_with_no_complete_checkpoint_is_refused(earlier_run, tmp_path):
    ck = copy_of(earlier_run, tmp_path)
    (ck / "latest").unlink()
    for meta in ck.glob("iter_*/megacli.json"):
        meta.unlink()
    refused(run(tmp_path / "run", [f"checkpoint.dir={ck}"]), "none of its iterations", "is complete")
    assert len(list(ck.glob("iter_*"))) == 4


# ---------------------------------------------------------------- resuming under a changed recipe


def recipe_with(*overrides: str):
    """The recipe `megacli pretrain` runs with TINY and these overrides."""
    from megacli.recipe.jobs import load_job_recipe

    return load_job_recipe("pretrain", None, [*TINY, *overrides])


def test_resume_with_more_heads_is_refused_naming_old_and_new(earlier_run, tmp_path):
    ck = copy_of(earlier_run, tmp_path)
    out = run(tmp_path / "run", [f"checkpoint.dir={ck}", "train.iters=5", "model.num_attention_heads=8"])
    refused(out, f"cannot resume {ck / 'iter_0000004'}", "model.num_attention_heads = 8 (checkpoint: 4)")
    assert (ck / "latest").read_text().strip() == "iter_0000004"


@pytest.mark.parametrize("override,named", [
    ("model.hidden_size=128", "model.hidden_size = 128 (checkpoint: 64)"),
    ("model.num_layers=3", "model.num_layers = 3 (checkpoint: 2)"),
    ("model.num_query_groups=2", "model.num_query_groups = 2 (checkpoint: None)"),
    ("model.activation=gelu", "model.activation = 'gelu' (checkpoint: 'swiglu')"),
    ("model.normalization=layernorm", "model.normalization = 'layernorm' (checkpoint: 'rmsnorm')"),
    ("model.position_embedding=learned", "model.position_embedding = 'learned' (checkpoint: 'rope')"),
    ("model.vocab_size=1000", "model.vocab_size = 1000 (checkpoint: None)"),
    ("model.moe={num_experts: 4}", "model.moe set (checkpoint: null)"),
    ("model.sliding_window=8", "model.sliding_window = 8 (checkpoint: None)"),
    ("model.norm_placement=sandwich", "model.norm_placement = 'sandwich' (checkpoint: 'pre')"),
    ("model.mla={kv_lora_rank: 16, qk_head_dim: 8, qk_pos_emb_head_dim: 8, v_head_dim: 8}", "model.mla set (checkpoint: null)"),
])
def test_weight_changing_fields_are_refused(override, named):
    from megacli.engine.compat import check_resumable
    from megacli.errors import UserError

    with pytest.raises(UserError, match="changes what its weights mean") as err:
        check_resumable(_saved(recipe_with()), recipe_with(override))
    assert named in str(err.value)


def test_learned_positions_tie_the_sequence_length():
    from megacli.engine.compat import check_resumable
    from megacli.errors import UserError

    learned = ["model.position_embedding=learned"]
    with pytest.raises(UserError, match=r"learned position embeddings for 64 positions \(checkpoint: 32"):
        check_resumable(_saved(recipe_with(*learned)), recipe_with(*learned, "model.seq_length=64"))
    fixed = [*learned, "model.max_position_embeddings=64"]
    assert "model.seq_length = 64" in check_resumable(_saved(recipe_with(*fixed)), recipe_with(*fixed, "model.seq_length=64"))


def test_sequence_length_and_batch_changes_are_noted():
    """With rotary positions nothing in the weights depends on the sequence length."""
    from megacli.engine.compat import check_resumable

    assert check_resumable(_saved(recipe_with()), recipe_with()) is None
    note = check_resumable(_saved(recipe_with()), recipe_with("model.seq_length=64", "train.global_batch_size=4"))
    assert note == ("resuming with changed settings: model.seq_length = 64 (checkpoint: 32); "
                    "train.global_batch_size = 4 (checkpoint: 2)")


def _saved(recipe) -> Path:
    """A directory holding only a checkpoint's recipe.yaml."""
    import tempfile

    from megacli.recipe.base import dump

    path = Path(tempfile.mkdtemp())
    (path / "recipe.yaml").write_text(dump(recipe))
    return path


# ---------------------------------------------------------------- disk full


ENOSPC_WRITER = """
import errno, functools, os, sys
from pathlib import Path
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megacli.checkpoint import manifest

real, real_write_text = filesystem_async._write_item, Path.write_text

@functools.wraps(real)
def full_disk(*args, **kwargs):
    if os.path.basename(os.path.dirname(args[1].name)) == "iter_0000004.tmp":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(*args, **kwargs)

def full_disk_text(path, text, *args, **kwargs):  # the writer's description of its files: the disk is still full
    if path.parent.name == "iter_0000004.tmp" and path.name == manifest.part_name(0):
        real_write_text(path, text[:1])  # what a short write leaves
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_write_text(path, text, *args, **kwargs)

filesystem_async._write_item = full_disk
Path.write_text = full_disk_text
from megacli.cli import main
sys.argv[0] = "megacli"
main()
"""


@pytest.mark.parametrize("iters", [4, 5])  # the save at 4 is the run's last (written at once), or asynchronous
def test_disk_full_while_saving_is_named_and_leaves_no_partial_save(tmp_path, iters):
    """One message, no traceback (also none from the background writer process), nothing half-saved."""
    ck = tmp_path / "ck"
    sets = [*TINY, f"checkpoint.dir={ck}", "checkpoint.save_interval=2", f"run.dir={tmp_path / 'run'}",
            f"train.iters={iters}"]
    out = subprocess.run([sys.executable, "-c", ENOSPC_WRITER, "pretrain", *sets_args(sets)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, MEGACLI_IN_PROCESS="1"))
    message = refused(out, f"no space left on device in {ck} (needed ~", "iter_0000004.tmp was removed")
    assert re.search(r"needed ~\d+\.\d (KiB|MiB), free \d+\.\d [KMGT]iB", message), message
    assert "encountered an error" not in out.stderr, out.stderr
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "latest"]
    assert (ck / "latest").read_text().strip() == "iter_0000002"


# ---------------------------------------------------------------- manifest


def flip_bytes(path: Path, count: int = 256) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_of_a_save(earlier_run):
    it = earlier_run / "iter_0000004"
    files = json.loads((it / "manifest.json").read_text())["files"]
    on_disk = sorted(str(p.relative_to(it)) for p in it.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(files) == on_disk
    assert {"recipe.yaml", "megacli.json", ".metadata"} <= set(files) and any(f.endswith(".distcp") for f in files)
    assert all(files[f]["size"] == (it / f).stat().st_size for f in files)


def test_corrupt_shard_is_refused_naming_the_file(earlier_run, tmp_path):
    ck = copy_of(earlier_run, tmp_path)
    shard = sorted((ck / "iter_0000004").glob("*.distcp"))[0]
    flip_bytes(shard)
    out = run(tmp_path / "run", [f"checkpoint.dir={ck}", "train.iters=5"])
    refused(out, f"{shard}: checksum differs from the manifest", "checkpoint.verify: false")
    assert (ck / "latest").read_text().strip() == "iter_0000004"  # nothing saved from the corrupt state
    # verify: false loads it (nothing left to train at iteration 4 of 4)
    ok(run(tmp_path / "run2", [f"checkpoint.dir={ck}", "checkpoint.verify=false"]))


def test_truncated_file_is_named_with_its_size(earlier_run, tmp_path):
    from megacli.checkpoint import manifest
    from megacli.errors import UserError

    ck = copy_of(earlier_run, tmp_path)
    common = ck / "iter_0000004" / "common.pt"
    size = common.stat().st_size
    common.write_bytes(common.read_bytes()[:100])
    with pytest.raises(UserError, match=f"{common}: 100 bytes, the manifest says {size}"):
        manifest.verify(ck)


def test_reshard_verify_checks_the_manifests(earlier_run, tmp_path):
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    ck = copy_of(earlier_run, tmp_path)
    out = CliRunner().invoke(app, ["reshard", "verify", str(ck), str(ck / "iter_0000004"), "--no-progress"],
                             env={"COLUMNS": "300"})
    assert out.exit_code == 0, out.output
    assert "manifest: OK" in out.output and "verify: OK" in out.output
    shard = sorted((ck / "iter_0000004").glob("*.distcp"))[0]
    flip_bytes(shard)
    out = CliRunner().invoke(app, ["reshard", "verify", str(ck), str(ck / "iter_0000004"), "--no-progress"],
                             env={"COLUMNS": "300"})
    assert out.exit_code == 1 and f"{shard}: checksum differs" in " ".join(out.output.split()), out.output


def test_keep_last_prunes_the_checkpoints_of_the_run_it_resumed(earlier_run, tmp_path):
    """A resumed run is the same run: its older checkpoints are pruned like its own."""
    ck = copy_of(earlier_run, tmp_path)
    ok(run(tmp_path / "run", [f"checkpoint.dir={ck}", "checkpoint.keep_last=2", "train.iters=5"]))
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000004", "iter_0000005", "latest"]
