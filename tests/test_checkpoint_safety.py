"""No code runs from a checkpoint: every pickle megacli reads is restricted to an allow-list unless
the user says --trust-pickle / checkpoint.trust_pickle; corrupt, truncated and escaping files are
clear errors. Single process: a small torch_dist checkpoint written directly (no model is built but
for one tiny Hugging Face model's conversion)."""

from __future__ import annotations

import importlib.util
import io
import json
import pickle
from pathlib import Path

import pytest
import torch

from megacli.checkpoint.source import Source

from tests.conftest import cli

ITER = "iter_0000002"
TINY_MODEL = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 16, "seq_length": 8,
              "make_vocab_size_divisible_by": 8}


def write_checkpoint(root: Path, arch: str = "gpt") -> Path:
    """A weights-only torch_dist checkpoint (CKPT/latest + iter dir) holding one tensor."""
    from megacli.checkpoint.torch_dist import TensorEntry, write_torch_dist
    from megacli.recipe.base import dump, validate
    from megacli.recipe.pretrain import TrainingRecipe

    it = root / ITER
    it.mkdir(parents=True)
    data = {"mock": True} if arch == "gpt" else {"path": "corpus_text_sentence"}  # BERT has no mock data
    raw = {"data": data, "tokenizer": {"type": "byte", "path": None}, "model": {**TINY_MODEL, "arch": arch},
           "train": {"precision": "fp32", "micro_batch_size": 1, "global_batch_size": 1, "iters": 4}}
    shape = (264, 8)
    write_torch_dist(it, [TensorEntry("embedding.word_embeddings.weight", shape, torch.float32, [((0, 0), shape)],
                                      lambda offsets, sizes: torch.ones(sizes))], [], {"scheduler": {"num_steps": 2}})
    (it / "recipe.yaml").write_text(dump(validate(TrainingRecipe, raw, "test")))
    (it / "megacli.json").write_text(json.dumps({"iteration": 2, "consumed_samples": 2, "format": "torch_dist",
                                                 "layout": {"tensor": 1, "pipeline": 1, "virtual_pipeline": None,
                                                            "data": 1, "context": 1}}))
    (root / "latest").write_text(ITER + "\n")
    return it


class _Payload:
    """Unpickles by running code: creates ``marker``, then returns the object pickled in ``inner``."""

    def __init__(self, marker: Path, inner: bytes):
        self.marker, self.inner = marker, inner

    def __reduce__(self):
        return eval, (f"open({str(self.marker)!r}, 'w').close() or __import__('pickle').loads({self.inner!r})",)


def poison(it: Path, which: str, marker: Path) -> None:
    """Replace ``.metadata`` or ``common.pt`` with a pickle that runs code and then gives back the
    real content (so everything would still work)."""
    if which == ".metadata":
        real = (it / which).read_bytes()
        (it / which).write_bytes(pickle.dumps(_Payload(marker, real)))
    else:
        real = torch.load(it / which, weights_only=True)
        torch.save({"scheduler": real["scheduler"], "extra": _Payload(marker, pickle.dumps(1))}, it / which)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clean") / "ck"
    write_checkpoint(root)
    return root


@pytest.fixture(params=[".metadata", "common.pt"])
def poisoned(request, clean, tmp_path):
    import shutil

    root = tmp_path / "ck"
    shutil.copytree(clean, root)
    marker = tmp_path / "code-ran"
    poison(root / ITER, request.param, marker)
    return root, marker, request.param


def assert_refused(res, marker: Path, which: str) -> None:
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "refused to unpickle builtins.eval" in text and which in text and "--trust-pickle" in text, text
    assert "Traceback" not in res.output
    assert not marker.exists()


def test_inspect_refuses_code_and_runs_it_only_when_trusted(poisoned):
    root, marker, which = poisoned
    assert_refused(cli("reshard", "inspect", root), marker, which)
    res = cli("reshard", "inspect", root, "--json", "--trust-pickle")
    assert res.exit_code == 0, res.output
    assert marker.exists()


def test_reshard_convert_generate_and_resume_refuse_code(poisoned, tmp_path):
    root, marker, which = poisoned
    assert_refused(cli("reshard", root, tmp_path / "out", "--tensor", "2"), marker, which)
    assert_refused(cli("convert", root, tmp_path / "hf"), marker, which)
    assert_refused(cli("generate", "-c", root, "--prompt", "x"), marker, which)
    data = ["data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null", f"run.dir={tmp_path / 'run'}"]
    for job, load in (("pretrain", f"checkpoint.resume={root}"), ("finetune", f"checkpoint.pretrained={root}")):
        assert_refused(cli(job, *[x for s in (load, *data) for x in ("--set", s)]), marker, which)
    assert not any(p.name not in ("ck",) for p in tmp_path.iterdir()), sorted(p.name for p in tmp_path.iterdir())


def self_trusting(clean: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of ``clean`` whose recipe.yaml sets every trust field to true and whose .metadata runs
    code (creating the returned marker) when unpickled without the allow-list."""
    import shutil

    import yaml

    from megacli.recipe import trust
    from megacli.recipe.pretrain import TrainingRecipe

    root, marker = tmp_path / "ck", tmp_path / "code-ran"
    shutil.copytree(clean, root)
    saved = root / ITER / "recipe.yaml"
    raw = yaml.safe_load(saved.read_text())
    for section, field in trust.FIELDS:
        if section in TrainingRecipe.model_fields:  # checkpoint and eval: a training recipe's trust fields
            raw[section] = {**(raw.get(section) or {}), field: True}
    raw["eval"]["tasks"] = ["x"]
    saved.write_text(yaml.safe_dump(raw))
    poison(root / ITER, ".metadata", marker)
    return root, marker


def _granted(raw: dict) -> list[str]:
    from megacli.recipe import trust

    return [f"{s}.{f}" for s, f in trust.FIELDS if (raw.get(s) or {}).get(f) is True]


def test_a_checkpoint_cannot_grant_itself_trust(clean, tmp_path):
    """Every trust field set to true in a checkpoint's own recipe.yaml lifts nothing, whatever reads
    it: the readers of a checkpoint's recipe (layout.read_recipe, Source.recipe, base.read_yaml on
    it), `recipe from` (what it prints and writes), `recipe show` and training runs given the
    checkpoint's recipe.yaml, finetune/resume from it, convert, reshard, generate, eval."""
    import yaml

    from megacli.checkpoint.layout import read_recipe
    from megacli.recipe.base import read_yaml

    root, marker = self_trusting(clean, tmp_path)
    saved = root / ITER / "recipe.yaml"
    assert _granted(yaml.safe_load(saved.read_text())) == ["checkpoint.trust_pickle", "eval.trust_task_code"]
    assert _granted(read_recipe(root / ITER)) == [] and _granted(read_yaml(saved)) == []
    assert _granted(Source(root).recipe.model_dump()) == []
    res = cli("recipe", "from", root, "-o", tmp_path / "from.yaml")
    assert res.exit_code == 0, res.output
    assert _granted(yaml.safe_load((tmp_path / "from.yaml").read_text())) == []
    for args in (("recipe", "from", root), ("recipe", "show", saved)):
        res = cli(*args)
        assert res.exit_code == 0 and _granted(yaml.safe_load(res.output)) == [], res.output
    run = ["--set", f"run.dir={tmp_path / 'run'}"]
    assert_refused(cli("pretrain", saved, "--set", f"checkpoint.resume={root}", *run), marker, ".metadata")
    assert_refused(cli("finetune", saved, "--set", f"checkpoint.pretrained={root}", *run), marker, ".metadata")
    assert_refused(cli("convert", root, tmp_path / "hf"), marker, ".metadata")
    assert_refused(cli("reshard", root, tmp_path / "out", "--tensor", "2"), marker, ".metadata")
    assert_refused(cli("generate", "-c", root, "--prompt", "x"), marker, ".metadata")
    assert_refused(cli("eval", root, "--tasks", "x"), marker, ".metadata")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "from.yaml"]


def test_trust_is_not_written_into_a_checkpoint(clean, tmp_path):
    """A recipe written with a checkpoint (here a reshard's) leaves the trust fields out, so a user resuming
    with it (as reshard suggests) does not inherit the source's trust."""
    import yaml

    it, _ = _copy(clean, tmp_path)
    raw = yaml.safe_load((it / "recipe.yaml").read_text())
    raw["checkpoint"]["trust_pickle"] = True
    (it / "recipe.yaml").write_text(yaml.safe_dump(raw))
    assert cli("reshard", tmp_path / "ck", tmp_path / "out", "--tensor", "2").exit_code == 0
    written = yaml.safe_load((tmp_path / "out" / ITER / "recipe.yaml").read_text())
    assert "trust_pickle" not in written["checkpoint"] and written["model"]["hidden_size"] == TINY_MODEL["hidden_size"]


def test_convert_runs_code_only_when_trusted(poisoned, tmp_path):
    root, marker, which = poisoned
    res = cli("convert", root, tmp_path / "hf", "--trust-pickle")
    assert res.exit_code == 0, res.output
    assert marker.exists() == (which == ".metadata")  # a conversion never reads the common state


def _copy(clean: Path, tmp_path: Path) -> tuple[Path, Path]:
    import shutil

    shutil.copytree(clean, tmp_path / "ck")
    it = tmp_path / "ck" / ITER
    return it, sorted(it.glob("*.distcp"))[0]


@pytest.mark.parametrize("relative", ["/etc/passwd", "../outside.distcp", "a/../../outside.distcp"])
def test_metadata_may_not_name_files_outside_the_checkpoint(clean, tmp_path, relative):
    from megacli.checkpoint.safe_pickle import check_torch_dist
    from megacli.errors import UserError

    it, shard = _copy(clean, tmp_path)
    (tmp_path / "outside.distcp").write_bytes(shard.read_bytes())
    metadata = pickle.loads((it / ".metadata").read_bytes())
    for storage in metadata.storage_data.values():
        storage.relative_path = relative
    (it / ".metadata").write_bytes(pickle.dumps(metadata))
    res = cli("reshard", "inspect", tmp_path / "ck")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"names the file '{relative}', which is outside {it}" in text, res.output
    with pytest.raises(UserError, match="outside"):
        check_torch_dist(it, trust=True)  # trusting pickles does not lift it


def test_a_symlinked_shard_leaving_the_checkpoint_is_refused(clean, tmp_path):
    it, shard = _copy(clean, tmp_path)
    elsewhere = tmp_path / "elsewhere.distcp"
    shard.rename(elsewhere)
    shard.symlink_to(elsewhere)
    res = cli("reshard", "inspect", tmp_path / "ck", "--trust-pickle")
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"{shard}: a symbolic link to {elsewhere}, outside the checkpoint" in text, res.output
    shard.unlink()
    (it / "moved").mkdir()
    elsewhere.rename(it / "moved" / shard.name)
    shard.symlink_to(Path("moved") / shard.name)  # a link that stays inside is read
    assert cli("reshard", "inspect", tmp_path / "ck").exit_code == 0


def test_a_fifo_in_place_of_a_shard_is_refused_not_waited_on(clean, tmp_path):
    """Nothing ever writes to the FIFO: opening it would block forever (the alarm stops the test)."""
    import os
    import signal

    it, shard = _copy(clean, tmp_path)
    shard.unlink()
    os.mkfifo(shard)

    def hung(signum, frame):
        raise TimeoutError("megacli waited on the FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        for args in (("generate", "-c", tmp_path / "ck", "--prompt", "x", "--trust-pickle"),
                     ("reshard", "inspect", tmp_path / "ck")):
            res = cli(*args)
            text = " ".join(res.output.split())
            assert res.exit_code == 2 and f"{shard}: a FIFO (named pipe), not a regular file" in text, (args, res.output)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_rng_objects_are_restricted_too(tmp_path):
    """Sharded objects (RNG state) are unpickled by torch's reader without restriction: checked first."""
    from megacli.checkpoint.safe_pickle import check_torch_dist
    from megacli.checkpoint.torch_dist import ObjectEntry, write_torch_dist
    from megacli.errors import UserError

    marker = tmp_path / "code-ran"
    good, bad = tmp_path / "good", tmp_path / "bad"
    for path, obj in ((good, [{"random": (3, (1, 2), None), "torch": torch.zeros(4, dtype=torch.uint8)}]),
                      (bad, [_Payload(marker, pickle.dumps(1))])):
        path.mkdir()
        buf = io.BytesIO()
        torch.save(obj, buf)
        write_torch_dist(path, [], [ObjectEntry("rng_state/shard_0.0_1.1", lambda data=buf.getvalue(): data)], {})
    check_torch_dist(good, trust=False)
    with pytest.raises(UserError, match="builtins.eval"):
        check_torch_dist(bad, trust=False)
    assert not marker.exists()


def test_graph_safe_rng_tracker_state_is_saved_as_tensors_and_restored_into_its_generators(tmp_path):
    """With train.cuda_graphs the tensor-parallel RNG tracker holds torch.Generator objects, which
    the restricted unpickling refuses: a checkpoint holds their state tensors, and a load sets them
    back into the tracker's own generators (the ones its CUDA graphs register). CPU generators
    stand in for CUDA ones (the graph-safe tracker's constructor asks for CUDA graph support)."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    from megacli.checkpoint.rng import restore_tracker, tracker_states
    from megacli.checkpoint.safe_pickle import check_torch_dist, torch_load
    from megacli.checkpoint.torch_dist import ObjectEntry, write_torch_dist
    from megacli.errors import UserError

    tracker = CudaRNGStatesTracker()
    tracker.use_cudagraphable_rng = True
    generators = {"model-parallel-rng": torch.Generator().manual_seed(1), "expert-parallel-rng": torch.Generator().manual_seed(2)}
    tracker.set_states(dict(generators))

    def checkpoint_of(path, tracker_state):
        path.mkdir()
        buf = io.BytesIO()
        torch.save([{"torch": torch.get_rng_state(), "tracker": tracker_state}], buf)
        write_torch_dist(path, [], [ObjectEntry("rng_state/shard_0.0_1.1", lambda data=buf.getvalue(): data)], {})
        return buf.getvalue()

    checkpoint_of(tmp_path / "generators", tracker.get_states())
    with pytest.raises(UserError, match="Generator"):
        check_torch_dist(tmp_path / "generators", trust=False)

    saved = tracker_states(tracker)
    assert all(isinstance(state, torch.Tensor) for state in saved.values())
    data = checkpoint_of(tmp_path / "tensors", saved)
    check_torch_dist(tmp_path / "tensors", trust=False)
    loaded = torch_load(io.BytesIO(data), trust=False, name="rng_state")[0]["tracker"]
    after_save = {name: torch.rand(4, generator=g) for name, g in generators.items()}
    for g in generators.values():
        torch.rand(7, generator=g)  # the run goes on past the save
    restore_tracker(tracker, loaded)
    restored = tracker.get_states()
    assert restored.keys() == generators.keys() and all(restored[n] is g for n, g in generators.items())
    for name, g in generators.items():
        assert torch.equal(torch.rand(4, generator=g), after_save[name]), name

    plain = CudaRNGStatesTracker()
    restore_tracker(plain, loaded)
    assert all(torch.equal(plain.get_states()[n], loaded[n]) for n in loaded)


def test_corrupt_metadata_and_truncated_files_are_clear_errors(clean, tmp_path):
    import shutil

    root = tmp_path / "ck"
    shutil.copytree(clean, root)
    (root / ITER / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
    res = cli("reshard", "inspect", root)
    assert res.exit_code == 2 and ".metadata" in res.output and "Traceback" not in res.output, res.output

    shutil.rmtree(root)
    shutil.copytree(clean, root)
    common = root / ITER / "common.pt"
    common.write_bytes(common.read_bytes()[:200])
    res = cli("reshard", "inspect", root)
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "common.pt" in text and "truncated or corrupt" in text, res.output


def test_truncated_legacy_file_is_a_clear_error(tmp_path):
    import argparse

    from megacli.checkpoint.megatron_lm.legacy_reader import LegacyCheckpoint
    from megacli.errors import UserError

    rank = tmp_path / "legacy" / ITER / "mp_rank_00"
    rank.mkdir(parents=True)
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("2")
    f = rank / "model_optim_rng.pt"
    torch.save({"args": argparse.Namespace(num_layers=1), "checkpoint_version": 3.0, "model": {"w": torch.ones(64)}}, f)
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(UserError, match=r"model_optim_rng.pt: cannot read .*truncated or corrupt"):
        LegacyCheckpoint(Source(tmp_path / "legacy"))


@pytest.mark.parametrize("shard", ["../other/model.safetensors", "../../etc/passwd", "/etc/passwd", "a/../../x"])
def test_safetensors_index_may_not_leave_the_model_directory(tmp_path, shard):
    from safetensors.torch import save_file

    from megacli.convert.hf_io import HFWeights
    from megacli.errors import UserError

    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    save_file({"w": torch.ones(2)}, other / "model.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(UserError, match="outside"):
        HFWeights(Source(model))


def test_pickled_pytorch_model_bin_needing_code_is_a_clear_error(tmp_path):
    from megacli.convert.hf_io import HFWeights
    from megacli.errors import UserError

    marker = tmp_path / "code-ran"
    torch.save({"w": torch.ones(2), "x": _Payload(marker, pickle.dumps(1))}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"pytorch_model.bin: refused to unpickle builtins.eval"):
        HFWeights(Source(tmp_path))
    assert not marker.exists()
    assert "w" in HFWeights(Source(tmp_path, True)).keys() and marker.exists()


def test_an_hf_directory_given_to_generate_or_serve_is_read_as_convert_reads_it(tmp_path):
    """Its pytorch_model.bin passes the allow-list (refused: nothing converted) unless --trust-pickle."""
    from safetensors.torch import load_file

    from megacli.cli.generate import build_recipe
    from tests import _convert_models as cm

    hf, run = tmp_path / "hf", tmp_path / "run"
    cm.build_hf("gpt2", hf)
    marker = tmp_path / "code-ran"
    state = load_file(hf / "model.safetensors")
    name = next(iter(state))
    torch.save({**state, name: _Payload(marker, pickle.dumps(state[name]))}, hf / "pytorch_model.bin")
    (hf / "model.safetensors").unlink()
    commands = [("generate", "-c", hf, "--prompt", "x")]
    if importlib.util.find_spec("fastapi") and importlib.util.find_spec("sse_starlette"):
        commands.append(("serve", hf))
    for command in commands:
        assert_refused(cli(*command, "--set", f"run.dir={run}"), marker, "pytorch_model.bin")
        assert not run.exists(), "nothing is left of the refused conversion"
    recipe = build_recipe(None, {"checkpoint": str(hf)}, tensor=None, pipeline=None, overrides=[f"run.dir={run}"],
                          trusted=True)
    assert marker.exists() and recipe.generate.checkpoint == str(run / "converted" / "hf")


def test_bert_legacy_export_is_refused_before_writing(tmp_path):
    root = tmp_path / "bert"
    write_checkpoint(root, arch="bert")
    res = cli("reshard", root, tmp_path / "out", "--format", "legacy")
    assert res.exit_code == 2 and "the Megatron-LM export writes GPT models" in " ".join(res.output.split()), res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]


def test_a_failed_legacy_export_leaves_nothing(clean, tmp_path, monkeypatch):
    from megacli.recipe.reshard import ReshardSection
    from megacli.checkpoint.megatron_lm import legacy_writer as legacy_export
    from megacli.reshard import reshard

    def fail(it_dir, out, **kwargs):
        out.mkdir(parents=True)
        (out / "half-written").write_text("x")
        raise RuntimeError("injected failure while exporting")

    monkeypatch.setattr(legacy_export, "export", fail)
    with pytest.raises(RuntimeError, match="injected"):
        reshard(ReshardSection(source=str(clean), output=str(tmp_path / "out"), format="legacy"))
    assert list(tmp_path.iterdir()) == []
