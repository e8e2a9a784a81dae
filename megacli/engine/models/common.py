"""What every model builder shares: the position-embedding names, the virtual-pipeline chunk loop,
the padded-vocabulary mask, and the bare model under its wrappers."""

from __future__ import annotations

import torch

# recipe model.position_embedding -> Megatron's position_embedding_type (alibi is a core-attention bias)
POSITION_TYPES = {"learned": "learned_absolute", "rope": "rope", "relative": "relative"}


def build_chunks(build_chunk, *, virtual_pipeline: int | None) -> list:
    """Model chunks for this rank: one per virtual pipeline stage it holds (one without
    interleaving), as Megatron's schedules expect. ``build_chunk(vp_stage=, pre_process=,
    post_process=)`` builds one."""
    from megatron.core import parallel_state as ps

    chunks = []
    for stage in range(virtual_pipeline or 1):
        vp_stage = stage if virtual_pipeline else None
        chunks.append(build_chunk(vp_stage=vp_stage,
                                  pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                                  post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)))
    return chunks


def mask_padded_vocab(output_layer, *, vocab_size: int) -> None:
    """Keep the padded vocabulary rows out of the softmax: their logits become the dtype's lowest
    value. The rows exist only so the vocabulary splits evenly over TP ranks; counted as tokens,
    they would make the loss depend on the TP size (the padding grows with it) and differ from
    a converted model's Hugging Face loss."""
    def hook(module, _inputs, output):
        logits, bias = output
        width = logits.shape[-1]
        first = 0 if width == module.output_size else module.output_size_per_partition * module.tp_group.rank()
        if first + width <= vocab_size:
            return output
        ids = torch.arange(first, first + width, device=logits.device)
        return logits.masked_fill(ids >= vocab_size, torch.finfo(logits.dtype).min), bias

    output_layer.register_forward_hook(hook)


def unwrap(module):
    """The bare Megatron model under DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module
