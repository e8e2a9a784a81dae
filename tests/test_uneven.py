"""Uneven pipeline stages end to end on the CPU backend: a 3-layer GPT at PP=2 with one layer on
the first stage trains as one process does, its checkpoint resumes at PP=1 and reshards to PP=3
and back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megacli.checkpoint.source import Source

from tests.conftest import assert_close, cli, losses, pretrain

TINY = [
    "data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null",
    "model.num_layers=3", "model.hidden_size=32", "model.num_attention_heads=2", "model.ffn_hidden_size=64",
    "model.seq_length=16", "model.make_vocab_size_divisible_by=256",
    "train.iters=4", "train.micro_batch_size=2", "train.global_batch_size=4", "train.log_interval=1",
    "train.eval_interval=null", "optim.warmup_iters=1", "optim.lr=1e-2", "train.precision=fp32",
    "checkpoint.dir=null", "parallel.tensor=1", "parallel.sequence_parallel=false", "parallel.virtual_pipeline=null",
]
UNEVEN = ["parallel.pipeline=2", "parallel.first_stage_layers=1", "launch.nproc=2"]
SINGLE = ["parallel.pipeline=1", "launch.nproc=1"]
PROMPT = "the quick brown fox"


def run(run_dir: Path, overrides: list[str]) -> dict[int, float]:
    """The losses of `megacli pretrain` of TINY with the overrides."""
    pretrain(run_dir, [*TINY, *overrides])
    return losses(run_dir)


REL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uneven")
    single = run(tmp / "single", SINGLE)
    ck = tmp / "ck"
    uneven = run(tmp / "uneven", UNEVEN + [f"checkpoint.dir={ck}", "checkpoint.save_interval=2"])
    return tmp, single, uneven, ck / "iter_0000002"


@pytest.mark.slow
def test_pp2_with_one_layer_on_the_first_stage_matches_one_process(runs):
    _, single, uneven, ckpt = runs
    assert_close(uneven, single, range(1, 5), REL)
    meta = json.loads((ckpt / "megacli.json").read_text())
    assert meta["layout"]["pipeline"] == 2 and meta["layout"]["first_stage_layers"] == 1


@pytest.mark.slow
def test_uneven_checkpoint_resumes_at_pp1(runs):
    tmp, _, uneven, ckpt = runs
    resumed = run(tmp / "resumed", SINGLE + [f"checkpoint.resume={ckpt}"])
    assert min(resumed) == 3
    assert_close(resumed, uneven, [3, 4], REL)


@pytest.mark.slow
def test_reshard_to_pp3_and_back_to_the_uneven_split(runs):
    from megacli.checkpoint.torch_dist import TorchDistReader

    tmp, _, _, ckpt = runs
    out = cli("reshard", ckpt, tmp / "pp3", "--pipeline", 3)
    assert out.exit_code == 0, out.output
    meta = json.loads((tmp / "pp3" / "iter_0000002" / "megacli.json").read_text())
    assert meta["layout"]["pipeline"] == 3 and "first_stage_layers" not in meta["layout"]  # 3 layers split evenly
    assert sorted(k for k in TorchDistReader(Source(tmp / "pp3" / "iter_0000002")).objects if k.startswith("rng_state")) == \
        [f"rng_state/shard_{p}.0_3.1" for p in range(3)]
    out = cli("reshard", tmp / "pp3", tmp / "back", "--pipeline", 2)
    assert out.exit_code == 0, out.output
    back = tmp / "back" / "iter_0000002"
    meta = json.loads((back / "megacli.json").read_text())
    assert meta["layout"]["first_stage_layers"] == 1 and "last_stage_layers" not in meta["layout"], meta["layout"]
    import yaml

    assert yaml.safe_load((back / "recipe.yaml").read_text())["parallel"]["first_stage_layers"] == 1
    a, b = TorchDistReader(Source(ckpt)), TorchDistReader(Source(back))
    assert set(a.tensors) == set(b.tensors)
    for key, info in a.tensors.items():
        full = (0,) * len(info.shape)
        assert a.read_region(key, full, tuple(info.shape)).equal(b.read_region(key, full, tuple(info.shape))), key


# ---------------------------------------------------------------- convert: HF -> megacli at PP=2


def _convert_3_layers(rank, world, root: str):
    """A 3-layer Llama: HF logits, HF -> megacli prepared for PP=2 (what convert says), and back."""
    import torch

    from megacli.convert import convert
    from megacli.recipe.sections import ParallelSection
    from tests import _convert_models as cm

    d = Path(root)
    model = cm.build_hf("llama_3_layers", d / "hf", with_tokenizer=True)
    torch.save(cm.hf_logits(model, cm.tokens()), d / "hf_logits.pt")
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(d / "hf").encode(PROMPT)
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    said: list[str] = []
    out = cm.round_trip(d, parallel=ParallelSection(pipeline=2), say=said.append)
    return {**out, "said": said, "greedy": greedy[0, len(ids):].tolist()}


def _logits_pp2(rank, world, root: str):
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection
    from tests import _convert_models as cm

    distributed.setup(parallel=ParallelSection(pipeline=2, first_stage_layers=1), launch=LaunchSection(nproc=2, device="cpu"),
                      seed=0)
    logits = cm.megacli_logits(Path(root) / "mc", cm.tokens())
    distributed.teardown()
    return logits


@pytest.mark.slow
def test_convert_at_pp2_picks_a_split_and_the_logits_match_hf(tmp_path):
    import torch
    import yaml

    from tests import _convert_models as cm
    from tests._dist import spawn

    result = spawn(_convert_3_layers, 1, str(tmp_path), timeout=900)[0]
    assert any("layers per pipeline stage: [1, 2] (3 layers do not split evenly over PP=2; chose "
               "parallel.first_stage_layers = 1" in line for line in result["said"]), result["said"]
    recipe = yaml.safe_load(next((tmp_path / "mc").glob("iter_*/recipe.yaml")).read_text())
    assert (recipe["parallel"]["pipeline"], recipe["parallel"]["first_stage_layers"]) == (2, 1)
    assert result["same_keys"] and result["bitwise"], result  # megacli -> HF reads the uneven checkpoint
    assert result["config"][0] == result["config"][1]
    logits = [x for x in spawn(_logits_pp2, 2, str(tmp_path), timeout=900) if x is not None]
    assert len(logits) == 1
    assert cm.max_diff(logits[0], torch.load(tmp_path / "hf_logits.pt")) < 1e-4

    # generate at PP=2 (the recipe's split) decodes as HF; at PP=1 and PP=3 the split is refitted
    out = tmp_path / "gen.jsonl"
    res = subprocess.run([sys.executable, "-m", "megacli", "generate", "--checkpoint", str(tmp_path / "mc"), "--pipeline", "2",
                          "--prompt", PROMPT, "-n", "8", "--output", str(out), "--set", "generate.stop_at_eod=false",
                          "--set", f"run.dir={tmp_path / 'gen'}"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads(out.read_text())["tokens"] == result["greedy"]
    from megacli.cli.generate import build_recipe

    for pp, split in ((1, [3]), (3, [1, 1, 1])):
        recipe = build_recipe(None, {"checkpoint": str(tmp_path / "mc")}, tensor=1, pipeline=pp, overrides=[])
        assert recipe.layers_per_stage == split


@pytest.mark.slow
def test_megatron_lm_legacy_export_and_import_keep_the_uneven_split(runs):
    import torch

    from megacli.checkpoint.torch_dist import TorchDistReader

    tmp, _, _, ckpt = runs
    mlm = tmp / "megatron_lm"
    out = cli("reshard", ckpt, mlm, "--format", "legacy")
    assert out.exit_code == 0, out.output
    stages = [torch.load(mlm / "iter_0000002" / f"mp_rank_00_{p:03d}" / "model_optim_rng.pt", weights_only=False) for p in range(2)]
    assert stages[0]["args"].decoder_first_pipeline_num_layers == 1
    assert [len({k.split(".")[2] for k in s["model"] if k.startswith("decoder.layers.")}) for s in stages] == [1, 2]
    out = cli("reshard", mlm, tmp / "imported")
    assert out.exit_code == 0, out.output
    back = tmp / "imported" / "iter_0000002"
    assert json.loads((back / "megacli.json").read_text())["layout"]["first_stage_layers"] == 1
    a, b = TorchDistReader(Source(ckpt)), TorchDistReader(Source(back))
    for key, info in a.tensors.items():
        if not key.startswith("optimizer."):
            full = (0,) * len(info.shape)
            assert a.read_region(key, full, tuple(info.shape)).equal(b.read_region(key, full, tuple(info.shape))), key
