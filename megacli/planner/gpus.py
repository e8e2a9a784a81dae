"""The GPUs `megacli plan` knows, and the constants its time and memory predictions use: each one
named, documented, and overridable from the command line (``--gpu-memory``, ``--gpu-tflops``,
``--intra-node-bandwidth``, ``--inter-node-bandwidth``, ``--set-constant NAME=VALUE``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    """Memory torch can allocate on it (what ``torch.cuda.mem_get_info`` reports free on an idle GPU)."""
    peak_tflops: float
    """Dense bf16 tensor-core peak, the denominator of MFU."""
    intra_node_gbps: float
    """NVLink bandwidth per GPU, one direction, GB/s (what a ring collective inside a node moves)."""
    inter_node_gbps: float
    """Network bandwidth per GPU between nodes, one direction, GB/s (one 400 Gb/s NIC per GPU = 50)."""
    calibration: tuple[tuple[int, int, float], ...] = ()
    """Measured (hidden size, tokens per micro-batch, MFU) of single-GPU training runs on this GPU
    (docs/gpu.md); () = none, the H100's curve is used at this GPU's peak."""


# Single-GPU bf16 training at the GPU benchmark's settings (docs/gpu.md, benchmarks/gpu_bench.py):
# sequence 2048, GPT-2 124M (h 768) and 350M (h 1024) at micro-batch 8, 1.3B (h 2048) at 4, megacli's
# default settings; MFU of benchmarks/results/*.json.
H100_MEASURED = ((768, 16384, 0.210), (1024, 16384, 0.324), (2048, 8192, 0.436))
H200_MEASURED = ((768, 16384, 0.241), (2048, 8192, 0.502))

GPUS = {
    "h100-80gb": GPU("h100-80gb", 79.2, 989.4, 450.0, 50.0, H100_MEASURED),
    "h200": GPU("h200", 139.8, 989.4, 450.0, 50.0, H200_MEASURED),
    "a100-80gb": GPU("a100-80gb", 79.2, 312.0, 300.0, 25.0),
    "b200": GPU("b200", 178.4, 2250.0, 900.0, 50.0),
}


@dataclass(frozen=True)
class Constants:
    """What the predictions assume beyond the recipe and the GPU. Override with
    ``--set-constant NAME=VALUE``."""

    bus_efficiency: float = 0.80
    """Share of the link bandwidth a large NCCL ring collective reaches (nccl-tests bus bandwidth)."""
    grad_overlap_efficiency: float = 0.90
    """With overlap_grad_reduce/overlap_param_gather: share of the data-parallel traffic hidden
    behind the backward/forward of the last/first micro-batch (the rest is exposed)."""
    cp_overlap_efficiency: float = 0.50
    """Share of the context-parallel ring exchanges hidden behind the attention blocks they feed."""
    p2p_latency_us: float = 20.0
    """Fixed cost of one pipeline point-to-point send/receive."""
    collective_latency_us: float = 15.0
    """Fixed cost of one tensor-parallel collective (launch and synchronisation)."""
    mfu_ceiling: float = 0.0
    """Override of the fitted achievable MFU at large matrices (0 = fitted from the GPU's measurements)."""
    cuda_context_gib: float = 0.5
    """Memory of the CUDA context and the kernels' workspaces (cuBLAS, cuDNN) per process."""
    nccl_buffers_gib: float = 0.25
    """NCCL's buffers per process group a rank belongs to (tensor, pipeline, data, context, expert)."""
    fragmentation: float = 0.05
    """Share of the allocated tensors the caching allocator holds on top (fragmentation)."""

    def with_overrides(self, pairs: dict[str, float]) -> "Constants":
        return dataclasses.replace(self, **pairs)


def constant_names() -> list[str]:
    return [f.name for f in dataclasses.fields(Constants)]


def matmul_work(hidden: int, tokens: int, tensor: int) -> float:
    """The size of a layer's matrix multiplications on one GPU: tokens of a micro-batch × hidden ×
    hidden / TP (the multiply-adds of one h × h/TP projection). Small ones are bound by kernel
    launches and memory traffic; large ones approach the GPU's matrix rate."""
    return tokens * hidden * hidden / tensor


def fitted_mfu_curve(points: tuple[tuple[int, int, float], ...]) -> tuple[float, float]:
    """(ceiling, half) of MFU(w) = ceiling · w / (w + half), w = matmul_work, fitted through the two
    measurements with the largest work (the smallest model is bound by kernel launches more than
    the curve says)."""
    (w1, m1), (w2, m2) = sorted((matmul_work(h, t, 1), m) for h, t, m in points)[-2:]
    # m1 (w1 + k) / w1 = m2 (w2 + k) / w2  ->  k = (m2 - m1) w1 w2 / (m1 w2 - m2 w1)
    half = (m2 - m1) * w1 * w2 / (m1 * w2 - m2 * w1)
    return m2 * (w2 + half) / w2, half


def achievable_mfu(gpu: GPU, work: float, constants: Constants) -> float:
    """Share of the peak a transformer layer's matrix multiplications reach at ``work`` (matmul_work)."""
    ceiling, half = fitted_mfu_curve(gpu.calibration or H100_MEASURED)
    if constants.mfu_ceiling:
        ceiling = constants.mfu_ceiling
    return ceiling * work / (work + half)
