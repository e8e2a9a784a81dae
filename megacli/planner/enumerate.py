"""Every layout of a recipe's model on N GPUs that the recipe's own checks accept.

A candidate is the recipe with another ``parallel`` section, micro-batch size and process count,
put through TrainingRecipe.with_sections: the same validators a loaded recipe goes through, so
there is one definition of each rule (heads and query groups divisible by TP, layers by PP × VP,
the batch by micro-batch × DP, CP's sequence split, EP dividing the experts, ...). The values tried
per axis are only the search space; what is allowed is decided by the checks."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from megacli.recipe.base import RecipeError
from megacli.recipe.stages import pick_split

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
"""Micro-batch sizes tried (those dividing the global batch per data-parallel rank are kept)."""
CONTEXT_SIZES = (1, 2, 4, 8, 16)
"""Context-parallel sizes tried (a long sequence splits over up to 16 ranks)."""
MAX_VIRTUAL_STAGES = 8
"""Most model chunks per pipeline stage tried for the interleaved schedule."""
RECOMPUTE = ("none", "selective", "full")


@dataclass
class Enumeration:
    layouts: list = field(default_factory=list)
    """The accepted recipes, one per layout."""
    rejected: Counter = field(default_factory=Counter)
    """Why candidates were refused: (field, reason) -> how many."""
    tried: int = 0


def _divisors(n: int, most: int | None = None) -> list[int]:
    return [d for d in range(1, (most or n) + 1) if n % d == 0]


def _launch(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(processes per node, nodes) for ``gpus`` GPUs: whole nodes, or part of one."""
    return (gpus, 1) if gpus <= gpus_per_node else (gpus_per_node, gpus // gpus_per_node)


def _pipeline_splits(num_layers: int, pipeline: int, vp: int | None) -> tuple[int | None, int | None] | None:
    """(first_stage_layers, last_stage_layers) for an even split, else Megatron-Core's uneven one."""
    return pick_split(num_layers, pipeline, vp) if pipeline > 1 else (None, None)


def _structures(recipe, gpus: int, gpus_per_node: int):
    """(tensor, pipeline, virtual, context, expert) combinations worth validating."""
    m = recipe.model
    tensors = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= gpus_per_node and gpus % t == 0]
    experts = _divisors(m.moe.num_experts) if m.moe is not None else [1]
    arch_layers = m.num_layers
    for tp, cp in itertools.product(tensors, CONTEXT_SIZES):
        if gpus % (tp * cp):
            continue
        for pp in _divisors(gpus // (tp * cp), arch_layers):
            virtuals = [None] + [v for v in range(2, MAX_VIRTUAL_STAGES + 1) if pp > 1 and arch_layers % (pp * v) == 0]
            for vp, ep in itertools.product(virtuals, experts):
                yield tp, pp, vp, cp, ep


def enumerate_layouts(recipe, gpus: int, gpus_per_node: int) -> Enumeration:
    """Every accepted layout of ``recipe``'s model on ``gpus`` GPUs (``gpus_per_node`` per node)."""
    from megacli.recipe.sections import LaunchSection, ParallelSection, TrainSection

    out = Enumeration()
    nproc, nnodes = _launch(gpus, gpus_per_node)
    if nproc * nnodes != gpus:
        out.rejected[("launch.nnodes", f"{gpus} GPUs are not whole nodes of {gpus_per_node}")] += 1
        return out
    launch = LaunchSection.model_validate({**recipe.launch.model_dump(), "nproc": nproc, "nnodes": nnodes})
    base_parallel, base_train = recipe.parallel.model_dump(), recipe.train.model_dump()
    trains = {b: TrainSection.model_validate({**base_train, "micro_batch_size": b}) for b in MICRO_BATCH_SIZES}
    splits: dict = {}
    for tp, pp, vp, cp, ep in _structures(recipe, gpus, gpus_per_node):
        if (pp, vp) not in splits:
            splits[pp, vp] = _pipeline_splits(recipe.model.num_layers, pp, vp)
        split = splits[pp, vp]
        if split is None:
            out.rejected[("parallel.pipeline", f"{recipe.model.num_layers} layers cannot split over {pp} stages")] += 1
            continue
        for recompute, dist_opt, sp in itertools.product(RECOMPUTE, (True, False), (True, False)):
            if sp and tp == 1:
                continue
            parallel = ParallelSection.model_validate({
                **base_parallel, "tensor": tp, "pipeline": pp, "virtual_pipeline": vp, "context": cp, "expert": ep,
                "first_stage_layers": split[0], "last_stage_layers": split[1], "recompute": recompute,
                "distributed_optimizer": dist_opt, "sequence_parallel": sp, "expert_tensor": None,
                "overlap_param_gather": base_parallel["overlap_param_gather"] and dist_opt})
            for train in trains.values():
                out.tried += 1
                try:
                    out.layouts.append(recipe.with_sections(parallel=parallel, train=train, launch=launch))
                except RecipeError as exc:
                    out.rejected[(exc.field, exc.reason)] += 1
    return out
