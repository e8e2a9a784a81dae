"""The model state of one given rank, in bytes: its weights, gradient buffers and optimizer state
(the fp32 main copy and Adam's two moments), by megacli.plan's arithmetic (the numbers the planner
and `--dry-run` use for the fullest rank)."""

from __future__ import annotations

from megacli import plan


def rank_coordinates(recipe, rank: int) -> tuple[int, int, int]:
    """(pipeline stage, data-parallel rank, expert data-parallel rank) of global ``rank`` in
    Megatron-Core's default order (tensor fastest, then context, data, pipeline; expert layers
    re-slice a stage's ranks as expert-tensor, expert, expert-data)."""
    p = recipe.parallel
    per_stage = recipe.world_size // p.pipeline
    stage, in_stage = divmod(rank, per_stage)
    dp_rank = in_stage // (p.tensor * p.context)
    expert_dp_rank = in_stage // (recipe.expert_tensor_size * p.expert)
    return stage, dp_rank, expert_dp_rank


def rank_state_bytes(recipe, vocab_size: int, rank: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes global rank ``rank`` holds."""
    stage, dp_rank, expert_dp_rank = rank_coordinates(recipe, rank)
    counts = plan.count_params(recipe, vocab_size)
    dense, experts = plan.rank_params_of_stage(recipe, counts, vocab_size, stage)
    w, g, o = plan.bytes_per_param(recipe.train.precision, bf16_grads=recipe.train.grad_reduce_in_bf16)
    grads, state = plan.state_numels(recipe, dense, experts, dp_rank=dp_rank, expert_dp_rank=expert_dp_rank)
    return (dense + experts) * w, grads * g, state * o
