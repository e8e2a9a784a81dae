"""`megacli convert` for mixture-of-experts models: Mixtral and Qwen2-MoE (shared expert with a
gate, QKV biases, a dense layer, top-k probabilities not renormalised), tiny random models built
from config dicts. Checked: HF -> megacli -> HF is bitwise with the same config; a checkpoint
without the carried HF config exports from its recipe alone; the converted model's logits equal
Hugging Face's at TP=1, at TP=2 (with the sequence parallelism Megatron's MoE layers need) and
at EP=2 (experts split over two processes, tokens exchanged by all-to-all)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megacli.checkpoint.source import Source

from tests import _convert_models as cm

TOL = 1e-4


def _convert_both_ways(rank, world, root: str) -> dict:
    from megacli.convert import convert
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    root, toks, out = Path(root), cm.tokens(), {}
    for name in cm.MOE_MODELS:
        d = root / name
        ref = cm.hf_logits(cm.build_hf(name, d / "hf"), toks)
        torch.save(ref, d / "hf_logits.pt")
        out[name] = cm.round_trip(d, parallel=ParallelSection(tensor=2, sequence_parallel=True))
        bare = d / "mc_bare"  # as a MoE trained from scratch: no Hugging Face config to carry
        shutil.copytree(d / "mc", bare)
        shutil.rmtree(bare / "hf")
        convert(Source(bare), d / "hf3", say=lambda *_: None)
        out[name]["bare_export_logits"] = cm.max_diff(cm.hf_logits(cm.load_hf(d / "hf3"), toks), ref)
    distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu"), seed=0)
    for name in cm.MOE_MODELS:
        out[name]["tp1_logits"] = cm.max_diff(cm.megacli_logits(root / name / "mc", toks), torch.load(root / name / "hf_logits.pt"))
    distributed.teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("convert_moe")
    return root, spawn(_convert_both_ways, 1, str(root), timeout=900)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(cm.MOE_MODELS))
def test_round_trip_is_bitwise_and_logits_match_at_tp1(converted, name):
    _, out = converted
    r = out[name]
    assert r["same_keys"] and r["bitwise"]
    src, back = r["config"]
    assert src == back
    assert r["tp1_logits"] < TOL, r
    assert r["bare_export_logits"] < TOL, r


def _logits_tp2_and_ep2(rank, world, root: str) -> dict:
    from megatron.core import parallel_state as ps

    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    toks, out = cm.tokens(), {}
    distributed.setup(parallel=ParallelSection(tensor=2, sequence_parallel=True), launch=LaunchSection(device="cpu", nproc=2),
                      seed=0)
    for name in cm.MOE_MODELS:
        out[(name, "tp2")] = cm.megacli_logits(Path(root) / name / "mc", toks, ("parallel.sequence_parallel=true",))
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
    for name in cm.MOE_MODELS:
        out[(name, "ep2")] = cm.megacli_logits(Path(root) / name / "mc", toks, ("parallel.expert=2", "launch.nproc=2"))
    distributed.teardown()
    return out


@pytest.mark.slow
def test_logits_match_hf_at_tp2_and_at_ep2(converted):
    from tests._dist import spawn

    root, _ = converted
    first, second = spawn(_logits_tp2_and_ep2, 2, str(root))
    for name in cm.MOE_MODELS:
        ref = torch.load(root / name / "hf_logits.pt")
        assert second[(name, "tp2")] is None  # TP rank 1 reports nothing
        assert cm.max_diff(first[(name, "tp2")], ref) < TOL, name
        for r in (first, second):  # EP=2 × DP=2: both ranks hold the whole output
            assert cm.max_diff(r[(name, "ep2")], ref) < TOL, name
