"""Initialisation by name: every weight drawn from its layout-free name, the same model under any
TP/PP/EP/DP/virtual-pipeline layout."""

from __future__ import annotations

import zlib

import torch

from megacli.checkpoint.sharding import GATED_SPLIT, part_of
from megacli.engine.models.common import unwrap
from megacli.engine.models.moe import global_expert_name


def _global_names(chunk) -> dict[int, str]:
    """param id -> layout-free name: global layer numbers, global expert numbers, shared output
    weight named as the embedding."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = getattr(chunk, "config", None)
    experts = getattr(config, "num_moe_experts", None)
    ep_rank = ps.get_expert_model_parallel_rank() if experts else 0
    local_experts = experts // ps.get_expert_model_parallel_world_size() if experts else 0

    names: dict[int, str] = {}
    layer_prefix: dict[str, str] = {}
    for mod_name, mod in chunk.named_modules():
        if isinstance(mod, TransformerLayer):
            parent = mod_name.rsplit(".", 1)[0]
            layer_prefix[mod_name + "."] = f"{parent}.{mod.layer_number - 1}."
    for name, p in chunk.named_parameters():
        glob = name
        for local, global_ in layer_prefix.items():
            if name.startswith(local):
                glob = global_ + name[len(local):]
                break
        if getattr(p, "shared_embedding", False) or (name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False)):
            glob = "embedding.word_embeddings.weight"
        if experts:
            glob = global_expert_name(glob, ep_rank=ep_rank, local_experts=local_experts)
        names[id(p)] = glob
    return names


def _init_kind(name: str, param) -> str:
    if name.endswith(("bias", "lora_b")):  # a LoRA adapter starts as a no-op: B = 0
        return "zeros"
    if param.dim() == 1:
        return "ones"  # norm gains
    return "normal"


def init_weights(chunks, *, seed: int, std: float, num_layers: int, gated: bool, zero_centered_gamma: bool = False) -> None:
    """Draw every parameter from a generator seeded by (seed, its layout-free name), in its full
    unsharded shape, then keep this rank's shard. The same seed gives the same model under any
    TP/PP/DP/virtual-pipeline layout (Megatron's own CPU init depends on construction order).

    Output projections use Megatron's scaled init std/sqrt(2·num_layers); biases 0; norm gains 1."""
    from megatron.core import parallel_state as ps

    dense_tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    expert_tp = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    scaled_std = std / (2.0 * num_layers) ** 0.5
    for chunk in chunks:
        names = _global_names(unwrap(chunk))
        for p in unwrap(chunk).parameters():
            name = names[id(p)]
            kind = _init_kind(name, p)
            with torch.no_grad():
                if kind == "zeros":
                    p.zero_()
                    continue
                if kind == "ones":
                    p.fill_(0.0 if zero_centered_gamma else 1.0)
                    continue
                # Megatron marks routed-expert weights allreduce=False; they are split over the expert TP group.
                tp_rank, tp = dense_tp if getattr(p, "allreduce", True) else expert_tp
                full = _full_shape(p, tp)
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                sigma = scaled_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
                if name.endswith("lora_a"):
                    sigma = (3.0 * full[1]) ** -0.5  # the spread of PEFT's kaiming-uniform A
                master = torch.empty(full, dtype=torch.float32).normal_(0.0, sigma, generator=gen)
                p.copy_(_shard(master, p, tp_rank, tp, gated and name.endswith("linear_fc1.weight")).to(p.dtype))


def _full_shape(p, tp: int) -> tuple[int, ...]:
    shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False) and tp > 1:
        shape[p.partition_dim] *= tp
    return tuple(shape)


def _shard(master, p, tp_rank: int, tp: int, gated_fc1: bool):
    """This rank's slice of the unsharded tensor, split as the live parameter says (Megatron marks
    each tensor-parallel parameter with its partition dim); the gated MLP input keeps [gate; up]."""
    if not getattr(p, "tensor_model_parallel", False):
        return master
    return part_of(master, GATED_SPLIT if gated_fc1 else p.partition_dim, tp=tp, rank=tp_rank)
