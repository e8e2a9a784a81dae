"""Qwen3 (per-head q/k RMSNorm before RoPE, explicit head_dim != hidden / heads, no biases) against
Hugging Face: HF -> megacli -> HF bitwise with the same config.json, logits at TP=1 and TP=2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import _convert_models as cm

TOL = 1e-4


def _prepare(rank, world, root: str):
    import torch

    from megacli.recipe.sections import ParallelSection

    d = Path(root) / "qwen3"
    model = cm.build_hf("qwen3", d / "hf")
    torch.save(cm.hf_logits(model, cm.tokens()), d / "hf_logits.pt")
    return cm.round_trip(d, parallel=ParallelSection(tensor=2), say=lambda *_: None)


def _logits(rank, world, root: str):
    import torch

    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    d = Path(root) / "qwen3"
    distributed.setup(parallel=ParallelSection(tensor=world), launch=LaunchSection(nproc=world, device="cpu"), seed=0)
    got = cm.megacli_logits(d / "mc", cm.tokens())
    distributed.teardown()
    return None if got is None else cm.max_diff(got, torch.load(d / "hf_logits.pt"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("qwen3")
    return root, spawn(_prepare, 1, str(root), timeout=900)[0]


@pytest.mark.slow
def test_round_trip_is_bitwise_with_the_same_config(converted):
    r = converted[1]
    assert r["same_keys"] and r["bitwise"]
    src, back = r["config"]
    assert src == back and src["architectures"] == ["Qwen3ForCausalLM"]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_equal_hugging_face(converted, tp):
    from tests._dist import spawn

    diffs = [d for d in spawn(_logits, tp, str(converted[0])) if d is not None]
    assert len(diffs) == 1 and diffs[0] < TOL, diffs
