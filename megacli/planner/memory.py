"""Memory of a layout's fullest rank: megacli.plan's per-stage model (the one `--dry-run` prints),
over the stages that can be fullest, plus a stated allowance for what is not a tensor of the model."""

from __future__ import annotations

from dataclasses import dataclass

from megacli import plan
from megacli.planner.gpus import Constants

GIB = plan.GIB


@dataclass(frozen=True)
class LayoutMemory:
    stage: int
    """The pipeline stage of the fullest rank."""
    weights: float
    gradients: float
    optimizer: float
    activations: float
    """Activations of the micro-batches in flight, with the logits at the loss on the last stage."""
    other: float
    """The allowance: CUDA context, NCCL buffers, the caching allocator's fragmentation."""
    params: int
    """Parameters held by the fullest rank."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.other

    def as_gib(self) -> dict[str, float]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "other": self.other, "total": self.total}


def candidate_stages(pipeline: int) -> list[int]:
    """The stages that can be fullest: the first (most micro-batches in flight, the embedding), the
    second (the busiest of the middle stages, which all hold the same layers), the last (the output
    layer and the logits)."""
    return sorted({0, min(1, pipeline - 1), pipeline - 1})


def process_groups(recipe) -> int:
    """Process groups with more than one rank that a rank belongs to (each holds NCCL buffers)."""
    p = recipe.parallel
    sizes = (p.tensor, p.pipeline, p.context, p.expert, recipe.data_parallel_size, p.tensor * p.context)
    return sum(size > 1 for size in sizes)


def layout_memory(recipe, counts: plan.ParamCounts, vocab_size: int, constants: Constants, *,
                  device: str = "cuda") -> LayoutMemory:
    """The fullest rank of ``recipe``'s layout, in GiB."""
    stages = [plan.stage_memory(recipe, counts, vocab_size, stage, device=device)
              for stage in candidate_stages(recipe.parallel.pipeline)]
    fullest = max(stages, key=lambda mem: mem.total_gib)
    tensors = fullest.total_gib
    other = (constants.cuda_context_gib + constants.nccl_buffers_gib * process_groups(recipe)
             + constants.fragmentation * tensors)
    return LayoutMemory(stage=fullest.stage, weights=fullest.weights_gib + fullest.reference_gib,
                        gradients=fullest.grads_gib, optimizer=fullest.optimizer_gib,
                        activations=fullest.activations_gib + fullest.logits_gib, other=other, params=fullest.params)
