"""`megacli plan`: every layout of a recipe's model on N GPUs, its predicted memory per GPU and
speed, ranked. Pure arithmetic on the recipe (no torch): enumerate (the recipe's own checks),
memory (megacli.plan's per-stage model, the one `--dry-run` prints), speed (named parts of a step),
gpus (GPU specs and every constant)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megacli import plan
from megacli.planner.enumerate import enumerate_layouts
from megacli.planner.gpus import GPU, Constants
from megacli.planner.memory import LayoutMemory, layout_memory
from megacli.planner.speed import PARTS, ModelWork, Network, StepTime, step_time

LAYOUT_FIELDS = ("tensor", "pipeline", "virtual_pipeline", "context", "expert", "data", "micro_batch_size",
                 "recompute", "distributed_optimizer", "sequence_parallel")


def layout_of(recipe) -> dict:
    """A recipe's layout under its own field names (data: the data-parallel size it implies)."""
    p = recipe.parallel
    return {"tensor": p.tensor, "pipeline": p.pipeline, "virtual_pipeline": p.virtual_pipeline,
            "context": p.context, "expert": p.expert, "data": recipe.data_parallel_size,
            "micro_batch_size": recipe.train.micro_batch_size, "recompute": p.recompute,
            "distributed_optimizer": p.distributed_optimizer, "sequence_parallel": p.sp_enabled}


@dataclass(frozen=True)
class Row:
    recipe: object
    memory: LayoutMemory
    time: StepTime
    fits: bool
    gpu: GPU

    @property
    def layout(self) -> dict:
        return layout_of(self.recipe)

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.recipe.tokens_per_step / self.time.seconds / self.recipe.world_size

    @property
    def mfu(self) -> float:
        return self.time.model_flops / self.time.seconds / self.recipe.world_size / (self.gpu.peak_tflops * 1e12)

    @property
    def headroom_gib(self) -> float:
        return self.gpu.memory_gib - self.memory.total

    def train_hours(self) -> float:
        return self.time.seconds * self.recipe.train.iters / 3600


@dataclass
class Plan:
    rows: list[Row]
    """Fitting layouts fastest first, then those that do not fit, least over first."""
    tried: int
    rejected: dict = field(default_factory=dict)

    @property
    def fitting(self) -> list[Row]:
        return [r for r in self.rows if r.fits]


def predict(recipe, counts: plan.ParamCounts, vocab_size: int, gpu: GPU, net: Network,
            work: ModelWork | None = None) -> Row:
    """Memory and step time of one layout (a validated recipe)."""
    memory = layout_memory(recipe, counts, vocab_size, net.constants)
    time = step_time(recipe, work or ModelWork.of(recipe, counts.active), memory.params, gpu, net)
    return Row(recipe=recipe, memory=memory, time=time, fits=memory.total <= gpu.memory_gib, gpu=gpu)


def plan_layouts(recipe, vocab_size: int, *, gpus: int, gpu: GPU, gpus_per_node: int,
                 constants: Constants = Constants()) -> Plan:
    """Every accepted layout of ``recipe``'s model on ``gpus`` GPUs, predicted and ranked."""
    found = enumerate_layouts(recipe, gpus, gpus_per_node)
    net = Network(gpus_per_node=gpus_per_node, intra_gbps=gpu.intra_node_gbps, inter_gbps=gpu.inter_node_gbps,
                  constants=constants)
    counts_by_tp: dict[int, plan.ParamCounts] = {}
    work = None
    rows = []
    for candidate in found.layouts:
        tp = candidate.parallel.tensor
        if tp not in counts_by_tp:  # the padded vocabulary depends on TP
            counts_by_tp[tp] = plan.count_params(candidate, vocab_size)
        work = work or ModelWork.of(candidate, counts_by_tp[tp].active)
        rows.append(predict(candidate, counts_by_tp[tp], vocab_size, gpu, net, work))
    # Fastest first; at equal speed the one with the most headroom.
    rows.sort(key=lambda r: (not r.fits, -r.tokens_per_second_per_gpu if r.fits else 0, -r.headroom_gib))
    return Plan(rows=rows, tried=found.tried, rejected=dict(found.rejected))


def why_slower(row: Row, best: Row) -> str:
    """What costs ``row`` most against the top layout: the step-time part that grew most."""
    if not row.fits:
        return f"does not fit: {row.memory.total:.1f} GiB of {row.gpu.memory_gib:.1f} ({-row.headroom_gib:.1f} over)"
    if row is best:
        return "fastest that fits"
    if row.time.seconds <= best.time.seconds * 1.005:
        return "as fast as the top (within 0.5%)"
    grown = {part: row.time.parts[part] - best.time.parts[part] for part in PARTS}
    part = max(grown, key=grown.get)
    share = grown[part] / best.time.seconds
    names = {"compute": "more compute (recompute or narrower matrices)", "bubble": "pipeline bubble",
             "tensor": "tensor-parallel collectives", "pipeline": "pipeline sends", "data": "data-parallel traffic",
             "context": "context-parallel ring", "expert": "expert all-to-all"}
    return f"{names[part]} +{share:.0%} of the top step"
