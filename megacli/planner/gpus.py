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
    calibration: tuple[tuple[int, float], ...] = ()
    """Measured (hidden size, MFU) of single-GPU training runs on this GPU (docs/gpu.md); () = none,
    the H100's curve is used at this GPU's peak."""


# Single-GPU bf16 training, sequence 1024-2048, the GPU benchmark's settings (docs/gpu.md):
# GPT-2 124M (h 768), 350M (h 1024) and 1.3B (h 2048) at megacli's default settings.
H100_MEASURED = ((768, 0.210), (1024, 0.324), (2048, 0.436))
H200_MEASURED = ((768, 0.241), (2048, 0.502))
CALIBRATION_TOKENS = 8192
"""Tokens of a micro-batch in the calibration runs (micro-batch 4-8 × sequence 1024-2048)."""

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
    half_fill_tokens: float = 512.0
    """Tokens of a micro-batch on one rank at which its matrices reach half the rate of long ones
    (short micro-batches, e.g. a long sequence split by context parallelism, fill the GPU less)."""
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


def fitted_mfu_curve(points: tuple[tuple[int, float], ...]) -> tuple[float, float]:
    """(ceiling, half) of MFU(h) = ceiling · h / (h + half), fitted through the measurements of the two
    largest hidden sizes (the small models are bound by kernel launches, which a large model's
    per-GPU matrices are not)."""
    (h1, m1), (h2, m2) = sorted(points)[-2:]
    # m1 (h1 + k) / h1 = m2 (h2 + k) / h2  ->  k = (m2 - m1) h1 h2 / (m1 h2 - m2 h1)
    half = (m2 - m1) * h1 * h2 / (m1 * h2 - m2 * h1)
    return m2 * (h2 + half) / h2, half


def achievable_mfu(gpu: GPU, matrix_width: float, constants: Constants) -> float:
    """Share of the peak a transformer layer's matrix multiplications reach when each GPU's share of
    the hidden dimension is ``matrix_width`` (hidden / tensor-parallel size)."""
    ceiling, half = fitted_mfu_curve(gpu.calibration or H100_MEASURED)
    if constants.mfu_ceiling:
        ceiling = constants.mfu_ceiling
    return ceiling * matrix_width / (matrix_width + half)
