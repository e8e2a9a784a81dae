"""Measured peak memory beside the dry run's estimate, for the first logged step."""

from __future__ import annotations

import resource

import torch

GIB = 1024**3


def peak_memory_line(recipe, *, tokenizer, device: torch.device) -> str:
    """One line: this rank's measured peak memory so far and plan.estimate's total for the run's
    device and attention kernel. CUDA measures tensors (torch.cuda.max_memory_allocated); on CPU
    only the process's peak RSS is there, which also holds the Python and torch runtime."""
    from megacli import plan

    _, mem = plan.estimate(recipe, plan.model_vocab_size(recipe, tokenizer), device=device.type)
    kernel = plan.attention_kernel(recipe, device=device.type)
    if device.type == "cuda":
        measured = f"peak {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB allocated (measured)"
    else:  # ru_maxrss is in KiB on Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        measured = f"peak RSS {rss / GIB:.2f} GiB (measured; the whole process, runtime included)"
    return (f"memory: {measured} | estimate {mem.total_gib:.2f} GiB "
            f"(first pipeline stage, {kernel} attention, as --dry-run)")
