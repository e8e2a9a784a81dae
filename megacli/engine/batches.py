"""Micro-batches onto the training device."""

from __future__ import annotations

import torch


def to_device(batch: dict, device) -> dict:
    """A micro-batch's tensors on ``device``. To a GPU through pinned memory: a copy from pageable
    memory waits for every kernel queued before it, so the CPU would lose its lead over the GPU at
    each micro-batch (launch-bound small models pay for that); a pinned copy is queued like a kernel."""
    if torch.device(device).type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
