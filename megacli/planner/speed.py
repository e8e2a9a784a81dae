"""Step time of a layout on a GPU, as the sum of named parts (seconds per step, one rank):

- compute: the step's FLOPs (megacli.plan.flops_per_token, plus what recompute replays) over the
  GPUs at an achievable share of the peak for the size of each GPU's matrix multiplications
  (gpus.achievable_mfu, calibrated from the project's single-GPU benchmark runs);
- bubble: (PP - 1) / (micro-batches × virtual stages) of the compute;
- tensor: the TP/SP collectives of every layer (2 forward, 2 backward; full recompute 2 more) at
  intra-node bandwidth;
- pipeline: the point-to-point sends between stages;
- data: the data-parallel gradient reduce-scatter / all-reduce and the distributed optimizer's
  parameter all-gather, the part not hidden behind the first/last micro-batch when overlapped;
- context: the ring exchanges of keys and values, partly hidden behind attention;
- expert: the MoE token all-to-alls (dispatch and combine, forward and backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from megacli import plan
from megacli.planner.gpus import GPU, Constants, achievable_mfu, matmul_work

PARTS = ("compute", "bubble", "tensor", "pipeline", "data", "context", "expert")


@dataclass(frozen=True)
class Network:
    gpus_per_node: int
    intra_gbps: float
    inter_gbps: float
    constants: Constants

    def bandwidth(self, group_span: int) -> float:
        """Bytes/s a ring collective reaches over a group whose ranks span ``group_span`` consecutive ranks."""
        gbps = self.intra_gbps if group_span <= self.gpus_per_node else self.inter_gbps
        return gbps * 1e9 * self.constants.bus_efficiency


@dataclass(frozen=True)
class StepTime:
    parts: dict
    """Seconds per step of each of PARTS."""
    model_flops: float
    """FLOPs of a step without recompute (the numerator of MFU)."""

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())


def _ring(size: int, nbytes: float, bandwidth: float, *, all_reduce: bool) -> float:
    """A ring all-reduce (2(n-1)/n of the bytes) or reduce-scatter / all-gather ((n-1)/n)."""
    if size <= 1:
        return 0.0
    return (2 if all_reduce else 1) * (size - 1) / size * nbytes / bandwidth


@dataclass(frozen=True)
class ModelWork:
    """What a layout does not change: FLOPs per token (megacli.plan.flops_per_token) and the share of
    MoE layers."""

    per_token: float
    attention_per_token: float
    """The attention scores' and their use's part of per_token (what selective recompute replays)."""
    moe_share: float

    @classmethod
    def of(cls, recipe, active_params: int) -> "ModelWork":
        m = recipe.model
        return cls(per_token=plan.flops_per_token(recipe, active_params),
                   attention_per_token=plan.flops_per_token(recipe, 0),
                   moe_share=sum(m.moe_layers()) / m.num_layers if m.moe is not None else 0.0)


def compute_seconds(recipe, work: ModelWork, gpu: GPU, constants: Constants) -> tuple[float, float]:
    """(seconds of this rank's matrix work per step, the step's model FLOPs). The achievable rate
    follows the size of each GPU's matrix multiplications (gpus.matmul_work: tokens of a
    micro-batch on one rank, hidden size, TP)."""
    p, m = recipe.parallel, recipe.model
    model = work.per_token * recipe.tokens_per_step
    replayed = {"none": 0.0, "full": work.per_token / 3, "selective": work.attention_per_token / 3}[p.recompute]
    hardware = (work.per_token + replayed) * recipe.tokens_per_step
    tokens = m.seq_length // p.context * plan.rows_per_microbatch(recipe)
    rate = achievable_mfu(gpu, matmul_work(m.hidden_size, tokens, p.tensor), constants) * gpu.peak_tflops * 1e12
    return hardware / recipe.world_size / rate, model


def _activation_bytes(recipe) -> int:
    return 4 if recipe.train.precision == "fp32" else 2


def step_time(recipe, work: ModelWork, rank_params: int, gpu: GPU, net: Network) -> StepTime:
    """The predicted step of ``recipe``'s layout; ``rank_params``: parameters on the fullest rank."""
    p, m, c = recipe.parallel, recipe.model, net.constants
    tp, pp, cp, ep = p.tensor, p.pipeline, p.context, p.expert
    dp, micro, vp = recipe.data_parallel_size, recipe.num_microbatches, p.virtual_pipeline or 1
    compute, model_flops = compute_seconds(recipe, work, gpu, c)
    tokens = m.seq_length // cp * plan.rows_per_microbatch(recipe)  # per micro-batch on one rank
    hidden_bytes = tokens * m.hidden_size * _activation_bytes(recipe)
    stage_layers = max(recipe.layers_per_stage)
    layer_passes = stage_layers * micro
    parts = dict.fromkeys(PARTS, 0.0)
    parts["compute"] = compute
    parts["bubble"] = compute * (pp - 1) / (micro * vp)
    collectives = 4 + (2 if p.recompute == "full" else 0)
    per_collective = _ring(tp, hidden_bytes, net.bandwidth(tp), all_reduce=True) + (c.collective_latency_us * 1e-6 if tp > 1 else 0)
    parts["tensor"] = layer_passes * collectives * per_collective
    if pp > 1:
        sent = hidden_bytes / (tp if p.sp_enabled else 1)
        parts["pipeline"] = 2 * micro * vp * (sent / net.bandwidth(recipe.world_size // pp + 1) + c.p2p_latency_us * 1e-6)
    parts["data"] = _data_parallel_seconds(recipe, rank_params, compute, net)
    if cp > 1:
        kv_bytes = 2 * tokens * m.query_groups * m.head_dim // tp * _activation_bytes(recipe)
        ring = (cp - 1) * kv_bytes / net.bandwidth(tp * cp)
        parts["context"] = layer_passes * 3 * ring * (1 - c.cp_overlap_efficiency)  # forward K,V; backward K,V and dK,dV
    if m.moe is not None and ep > 1:
        routed = hidden_bytes * m.moe.router_topk * (ep - 1) / ep
        parts["expert"] = layer_passes * work.moe_share * 4 * routed / net.bandwidth(tp * ep)
    return StepTime(parts=parts, model_flops=model_flops)


def _data_parallel_seconds(recipe, rank_params: int, compute: float, net: Network) -> float:
    """Gradient reduction and the distributed optimizer's parameter all-gather, the exposed part."""
    p, c = recipe.parallel, net.constants
    dp = recipe.data_parallel_size
    if dp <= 1:
        return 0.0
    bandwidth = net.bandwidth(p.tensor * p.context * dp)
    grad_bytes = rank_params * (2 if recipe.train.grad_reduce_in_bf16 else 4)
    weight_bytes = rank_params * plan.bytes_per_param(recipe.train.precision)[0]
    reduce = _ring(dp, grad_bytes, bandwidth, all_reduce=not p.distributed_optimizer)
    gather = _ring(dp, weight_bytes, bandwidth, all_reduce=False) if p.distributed_optimizer else 0.0
    per_micro = compute / recipe.num_microbatches
    if p.overlap_grad_reduce:  # behind the last micro-batch's backward (2/3 of its work)
        reduce = max(reduce * (1 - c.grad_overlap_efficiency), reduce - 2 / 3 * per_micro)
    if p.overlap_param_gather:  # behind the first micro-batch's forward (1/3 of its work)
        gather = max(gather * (1 - c.grad_overlap_efficiency), gather - 1 / 3 * per_micro)
    return reduce + gather
