"""Mixture of experts: the recipe section and its cross-field checks, expert parameters in the
dry-run plan, and pretraining end to end on the CPU backend: expert parallelism over 2 gloo
processes (all-to-all) gives the single-process losses, the loss falls with the experts' load
balanced, and the load-balancing loss and tokens per expert reach metrics.jsonl and the console."""

from __future__ import annotations

from pathlib import Path

import pytest

from megacli.recipe import base
from megacli.recipe.base import RecipeErrors
from megacli.recipe.pretrain import TrainingRecipe
from tests.conftest import MOCK_GPT, assert_close, losses, pretrain, records

RECIPES = Path(__file__).parent.parent / "recipes"

# 4 layers, MoE in layers 1 and 3 (layer_freq 2): 4 experts of width 64, top-2, plus a gated shared
# expert (Qwen2-MoE style); SwiGLU without biases as in Mixtral.
MOE = ["model.activation=swiglu", "model.add_bias_linear=false", "model.moe.num_experts=4", "model.moe.router_topk=2",
       "model.moe.ffn_hidden_size=64", "model.moe.layer_freq=2", "model.moe.shared_expert_ffn_hidden_size=32",
       "model.moe.shared_expert_gate=true", "model.moe.aux_loss_coeff=1e-2"]
SINGLE = ["parallel.tensor=1", "parallel.pipeline=1", "parallel.sequence_parallel=false", "launch.nproc=1"]


def load(overrides: list[str]) -> TrainingRecipe:
    return base.load(TrainingRecipe, None, overrides, default={"data": {"mock": True}})


def problem(overrides: list[str]) -> str:
    with pytest.raises(RecipeErrors) as info:
        load(overrides)
    return info.value.render()


@pytest.mark.parametrize("overrides, field, words", [
    (["parallel.expert=2", "launch.nproc=2"], "parallel.expert = 2", "set model.moe"),
    (["model.moe.num_experts=6", "parallel.expert=4", "launch.nproc=4"], "parallel.expert = 4", "(6 % 4 = 2); try 3"),
    (["model.moe.num_experts=8", "parallel.expert=4", "launch.nproc=2"], "parallel.expert = 4",
     "1 × 4 = 4 must divide the ranks of a pipeline stage, tensor × context × data-parallel = 1 × 1 × 2 = 2"),
    (["model.moe.num_experts=8", "parallel.expert=2", "parallel.pipeline=2", "launch.nproc=2"], "parallel.expert = 2",
     "(world 2 / pipeline 2)"),
    (["model.moe.num_experts=4", "parallel.tensor=2", "launch.nproc=2", "model.add_bias_linear=false",
      "parallel.sequence_parallel=false"], "parallel.sequence_parallel = False",
     "need sequence parallelism"),
    (["model.moe.num_experts=4", "model.moe.router_topk=5"], "model.moe.router_topk = 5", "num_experts = 4"),
    (["model.moe.num_experts=4", "model.moe.pad_to_capacity=true"], "model.moe.pad_to_capacity = True", "capacity_factor"),
    (["model.moe.num_experts=4", "model.moe.layer_freq=[1, 0]"], "model.moe.layer_freq = [1, 0]",
     "2 entries for model.num_layers = 12"),
    (["model.moe.num_experts=4", "model.moe.shared_expert_ffn_hidden_size=64"], "model.add_bias_linear = True",
     "a shared expert"),
    (["model.moe.num_experts=4", "model.moe.ffn_hidden_size=30", "parallel.tensor=4", "parallel.sequence_parallel=true",
      "launch.nproc=4", "model.add_bias_linear=false"], "model.moe.ffn_hidden_size = 30", "expert tensor-parallel size 4"),
    (["model.moe.num_experts=4", "model.arch=bert"], "model.moe", "for gpt, not bert"),
    (["model.moe.router_topk=2"], "model.moe.num_experts", "required"),
    (["model.moe.num_experts=4", "model.moe.dispatcher=flex"], "model.moe.dispatcher", "alltoall"),
])
def test_bad_moe_recipes_name_field_value_and_reason(overrides, field, words):
    msg = problem(overrides)
    assert field in msg and words in msg, msg


def test_expert_layout_arithmetic():
    r = load(["launch.nproc=8", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=4",
              "parallel.expert_tensor=1", "model.moe.num_experts=8", "model.add_bias_linear=false",
              "model.moe.layer_freq=[1, 0, 1, 0]", "model.num_layers=4"])
    assert (r.data_parallel_size, r.expert_tensor_size, r.expert_data_parallel_size) == (4, 1, 2)
    assert r.model.moe_layers() == [1, 0, 1, 0]
    assert load(["model.num_layers=5", "model.moe.num_experts=2", "model.moe.layer_freq=2"]).model.moe_layers() == [1, 0, 1, 0, 1]


def test_dry_run_plan_counts_expert_parameters():
    """The Mixtral-8x7B recipe: 46.7B parameters, 12.9B active per token (Mistral AI's figures)."""
    from megacli import plan

    r = base.load(TrainingRecipe, RECIPES / "mixtral_8x7b.yaml")
    counts, mem = plan.estimate(r, 32000)
    assert round(counts.total / 1e9, 1) == 46.7 and round(counts.active / 1e9, 1) == 12.9
    # First of 4 stages: 8 layers, each rank holds 1 of the 8 experts of each of them, plus the embedding.
    expert = 3 * 4096 * 14336
    assert mem.params == 8 * (counts.moe_layer - 8 * expert) + 8 * expert + 32000 * 4096


def test_a_run_leaves_no_expert_losses_to_the_next_in_its_process():
    """Megatron-Core's aux-loss tracker sizes its per-layer tensor by the first run's layer count: a
    later run in the same process (the in-process path) with more layers must not index past it."""
    import torch
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, save_to_aux_losses_tracker

    from megacli.engine import distributed

    try:
        save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.0), layer_number=2, num_layers=2)
        distributed.teardown()
        save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(3.0), layer_number=4, num_layers=4)
        assert get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].tolist() == [0.0, 0.0, 0.0, 3.0]
    finally:
        distributed.teardown()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_single")
    pretrain(tmp / "run", MOCK_GPT + MOE + SINGLE)
    return tmp / "run"


@pytest.mark.slow
def test_moe_loss_falls_with_balanced_experts_and_is_reported(single):
    steps = [r for r in records(single) if "loss" in r]
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3, [r["loss"] for r in steps]
    even = 8 * 32 * 2 / 4  # tokens per step × top-2 / 4 experts
    for r in steps:
        # Only the MoE layers (1 and 3 of 4) report; every expert gets 50%..150% of the even share.
        assert sorted(r["expert_tokens"]) == ["1", "3"]
        for counts in r["expert_tokens"].values():
            assert sum(counts) == 8 * 32 * 2 and all(0.5 * even <= c <= 1.5 * even for c in counts), counts
        assert r["expert_tokens_min"] == min(min(c) for c in r["expert_tokens"].values())
        # E · Σ f_i P_i is 1 when routing is uniform; near it when balanced.
        assert 1.0 <= r["load_balancing_loss"] < 1.2, r["load_balancing_loss"]


@pytest.mark.slow
def test_expert_parallel_matches_single_process(single, tmp_path):
    """EP=2 (DP=2, each process holds 2 experts, tokens exchanged by all-to-all on gloo) gives the
    single-process losses, load-balancing losses and expert loads."""
    out = pretrain(tmp_path / "ep2", MOCK_GPT + MOE + SINGLE + ["launch.nproc=2", "parallel.expert=2"])
    assert "4 experts, top-2, EP 2" in out.stdout and "load balancing" in out.stdout, out.stdout[-2000:]
    ep2 = records(tmp_path / "ep2")
    ref = records(single)
    assert_close(losses(tmp_path / "ep2"), losses(single), range(1, 7), 1e-4)
    for a, b in zip(ep2, ref):
        assert abs(a["load_balancing_loss"] - b["load_balancing_loss"]) <= 1e-4 * b["load_balancing_loss"]
        assert a["expert_tokens"] == b["expert_tokens"]


@pytest.mark.slow
def test_allgather_dispatcher_matches_single_process(single, tmp_path):
    """The all-gather token dispatcher (every rank sees all tokens, keeps those for its experts)
    under EP=2 on gloo gives the same losses and expert loads as one process."""
    pretrain(tmp_path / "ag", MOCK_GPT + MOE + SINGLE + ["launch.nproc=2", "parallel.expert=2", "model.moe.dispatcher=allgather"])
    assert_close(losses(tmp_path / "ag"), losses(single), range(1, 7), 1e-4)
    assert [r["expert_tokens"] for r in records(tmp_path / "ag")] == [r["expert_tokens"] for r in records(single)]
