"""Mixture-of-experts pieces for the GPT layer spec, and what a run reports about the experts.

The MoE layer is Megatron-Core's ``MoELayer`` (top-k router, all-to-all or all-gather token
dispatcher, experts split over the expert-parallel group). The experts are Megatron's
``GroupedMLP`` (one grouped GEMM for all local experts; needs CUDA and the ``grouped_gemm``
package) where available, else ``SequentialMLP`` (one MLP per expert, any device).

Reporting: Megatron-Core records each MoE layer's load-balancing loss in its aux-loss tracker
(``moe_utils.get_moe_layer_wise_logging_tracker``); the tokens each expert received are counted
here by a forward hook on each router. ``ExpertStats`` reads and clears both once per log interval.
"""

from __future__ import annotations

import re

import torch

_LOCAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)\.")


def grouped_gemm_available(*, on_cuda: bool) -> bool:
    from megacli.engine.core_compat import has_grouped_mlp

    if not on_cuda or not has_grouped_mlp():
        return False
    from megatron.core.transformer.moe import grouped_gemm_util

    return grouped_gemm_util.grouped_gemm_is_available()


def config_kwargs(*, model, parallel, on_cuda: bool) -> dict:
    """TransformerConfig arguments for ``model.moe`` (empty for a dense model)."""
    from megacli.engine.core_compat import legacy_grouped_gemm_flag

    moe = model.moe
    if moe is None:
        return {}
    grouped = moe.grouped_gemm and grouped_gemm_available(on_cuda=on_cuda)
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=model.expert_ffn_size,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_pad_expert_input_to_capacity=moe.pad_to_capacity,
        moe_token_drop_policy=moe.drop_policy,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_layer_freq=model.moe_layers(),
        moe_router_dtype=moe.router_dtype,
        moe_router_pre_softmax=moe.router_pre_softmax,
        moe_token_dispatcher_type=moe.dispatcher,
        moe_grouped_gemm=grouped,
        **legacy_grouped_gemm_flag(grouped),  # GroupedMLP (grouped_gemm package), not TE's
        expert_tensor_parallel_size=parallel.expert_tensor or parallel.tensor,
        moe_router_score_function=moe.router_score_function,
        moe_router_enable_expert_bias=moe.router_expert_bias,
        moe_router_bias_update_rate=moe.router_bias_update_rate,
        moe_router_num_groups=moe.router_num_groups,
        moe_router_group_topk=moe.router_group_topk,
        moe_router_topk_scaling_factor=moe.router_topk_scaling_factor,
    )


def _define_absent_te_gemm() -> None:
    """Megatron-Core 0.16.1's moe_utils imports ``te_general_gemm`` inside a try block and, without
    Transformer Engine, never defines the name, so the router's GEMM raises NameError on any
    device. Megatron's own fallback value is None (then the router uses torch.mm); set it."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def moe_mlp_spec(*, config):
    """ModuleSpec of the MoE block that replaces a layer's MLP."""
    _define_absent_te_gemm()
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if config.moe_grouped_gemm:  # only where grouped_gemm_available(): Megatron-Core before 0.19
        from megatron.core.transformer.moe.experts import GroupedMLP

        experts = ModuleSpec(module=GroupedMLP)
    else:
        experts = ModuleSpec(module=SequentialMLP, submodules=linears)
    return ModuleSpec(module=MoELayer,
                      submodules=MoESubmodules(experts=experts, shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=linears)))


def global_expert_name(name: str, *, ep_rank: int, local_experts: int) -> str:
    """``...experts.local_experts.<local>.`` -> ``...experts.local_experts.<global>.``: the same name
    for an expert whichever expert-parallel rank holds it."""
    return _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}.", name)


# ---------------------------------------------------------------- reporting


def _routers(chunks) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]


def _count_tokens(router, _inputs, outputs) -> None:
    """Forward hook: add the tokens each expert received (after capacity dropping). Counted only
    with grad enabled: once per training micro-batch, also under full recompute (whose first
    forward runs without grad), never in evaluation."""
    if not torch.is_grad_enabled():
        return
    _probs, routing_map = outputs
    counts = routing_map.sum(dim=0).to(torch.float64)
    before = getattr(router, "megacli_tokens_per_expert", None)
    router.megacli_tokens_per_expert = counts.detach() if before is None else before + counts.detach()


class ExpertStats:
    """Load-balancing loss and tokens per expert of every MoE layer, summed over the steps since the
    last ``collect()``. Every rank must call ``collect()`` at the same steps (one all-reduce)."""

    def __init__(self, chunks, *, num_layers: int, num_experts: int, aux_loss: bool, data_parallel: int,
                 microbatches: int, device: torch.device):
        self.num_layers, self.num_experts, self.aux_loss = num_layers, num_experts, aux_loss
        self.data_parallel, self.microbatches = data_parallel, microbatches
        self.device = device
        self.routers = _routers(chunks)
        for r in self.routers:
            r.register_forward_hook(_count_tokens)

    def collect(self, steps: int) -> dict:
        """Per-step means over the last ``steps`` steps: ``load_balancing_loss`` (the mean over MoE
        layers of E · Σ_i f_i · P_i without its coefficient; 1.0 when perfectly balanced),
        ``expert_tokens`` (layer number -> tokens per expert) and their overall min and max."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        table = torch.zeros(self.num_layers, self.num_experts + 1, dtype=torch.float64, device=self.device)
        aux = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        if aux is not None:
            table[:, 0] = aux["values"].to(table)
        for r in self.routers:
            counts = getattr(r, "megacli_tokens_per_expert", None)
            if counts is not None:
                table[r.layer_number - 1, 1:] += counts.to(table)
                r.megacli_tokens_per_expert = None
        clear_aux_losses_tracker()
        # Each layer's numbers live on its pipeline stage; the aux loss is partial over TP × CP
        # (sequence shards) and per data-parallel rank, the counts are per rank: sum everything.
        torch.distributed.all_reduce(table)
        table /= max(steps, 1)
        moe_layers = [i for i in range(self.num_layers) if table[i, 1:].sum() > 0]
        if not moe_layers:
            return {}
        tokens = {i + 1: [round(float(x), 2) for x in table[i, 1:]] for i in moe_layers}
        every = table[moe_layers, 1:]
        out = {"expert_tokens_min": float(every.min()), "expert_tokens_max": float(every.max()), "expert_tokens": tokens}
        if self.aux_loss:
            per_layer = table[moe_layers, 0] / (self.data_parallel * self.microbatches)
            out = {"load_balancing_loss": float(per_layer.mean()), **out}
        return out
