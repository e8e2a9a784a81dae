"""Megatron optimizer (mixed precision, distributed optimizer, clipping) and LR/WD schedule."""

from __future__ import annotations

import torch

from megacli.precision import params_dtype


def build_optimizer(chunks, *, optim, precision: str, distributed_optimizer: bool, on_cuda: bool):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megacli.engine.kernels import use_foreach_grad_kernels

    use_foreach_grad_kernels()
    config = OptimizerConfig(
        optimizer=optim.optimizer,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=params_dtype(precision) if precision != "fp32" else torch.float32,
        initial_loss_scale=optim.initial_loss_scale,
        use_distributed_optimizer=grads_sharded(optim, distributed_optimizer),
        **(muon_settings(optim, distributed_optimizer, on_cuda) if optim.optimizer == "muon" else {}),
    )
    if optim.optimizer == "muon":
        mark_embeddings(chunks)
    optimizer = get_megatron_optimizer(config, chunks)
    if optim.fused_on(on_cuda):
        for inner in torch_optimizers(optimizer):
            use_fused_kernels(inner)
    return optimizer


def grads_sharded(optim, distributed_optimizer: bool) -> bool:
    """Whether Megatron's DistributedOptimizer shards the gradient buffers and optimizer state. Muon
    orthogonalizes whole matrices: its distributed form is the layer-wise one (each data-parallel
    rank updates whole parameters, then they are all-gathered), over unsharded DDP buffers."""
    return distributed_optimizer and optim.optimizer != "muon"


# Muon as published (Keller Jordan's and torch.optim.Muon's): Nesterov momentum, five Newton-Schulz
# steps with the fixed coefficients (3.4445, -4.7750, 2.0315), the update scaled by 0.2·sqrt(max(rows,
# cols)) so that its RMS matches AdamW's and optim.lr serves both (Moonlight, arXiv:2502.16982).
# Q, K and V are orthogonalized apart; a tensor-parallel shard is orthogonalized whole (gathered), so
# every layout takes the same step.
MUON_UPDATE_RMS = 0.2


def muon_settings(optim, distributed_optimizer: bool, on_cuda: bool) -> dict:
    """Megatron-Core 0.19's OptimizerConfig fields for optim.optimizer = muon (AdamW, with the
    recipe's adam_* settings, on embeddings, output layer, norms and biases)."""
    return dict(muon_momentum=optim.muon_momentum, muon_nesterov=True, muon_coefficient_type="simple",
                muon_num_ns_steps=5, muon_scale_mode="spectral", muon_extra_scale_factor=MUON_UPDATE_RMS,
                muon_split_qkv=True, muon_tp_mode="duplicated", muon_scalar_optimizer="adam",
                # TF32 on CUDA; exact fp32 on CPU ("medium" would round every Newton-Schulz step to bf16)
                muon_fp32_matmul_prec="high" if on_cuda else "highest",
                use_layer_wise_distributed_optimizer=distributed_optimizer)


def mark_embeddings(chunks) -> None:
    """Every embedding table (word, position, token type, relative position) goes to AdamW under
    muon: Megatron marks only the word embedding and the output layer, and sends any other 2-D
    weight to Muon."""
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (torch.nn.Embedding, VocabParallelEmbedding)):
                module.weight.is_embedding_or_output_parameter = True


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside Megatron's wrapper (one per parameter set of a chained optimizer)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part.optimizer for part in parts if getattr(part, "optimizer", None) is not None]


def use_fused_kernels(optimizer) -> None:
    """optim.fused for a torch AdamW/SGD built by Megatron (which passes no such flag). Re-applied
    after every load_state_dict: a checkpoint's param_groups replace the optimizer's, flags
    included, and the fused kernel wants each Adam step count as a float32 tensor on its parameter's device."""

    def fuse(opt) -> None:
        opt.defaults.update(foreach=False, fused=True)
        for group in opt.param_groups:
            group.update(foreach=False, fused=True)
            for p in group["params"]:
                state = opt.state.get(p, {})
                if "step" in state:
                    state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)

    fuse(optimizer)
    optimizer.register_load_state_dict_post_hook(fuse)


def build_scheduler(optimizer, *, optim, train_iters: int):
    """Steps are optimizer iterations (Megatron-LM counts samples; same curve, simpler numbers)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = optim.decay_horizon(train_iters)
    warmup = optim.warmup_steps(train_iters)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=optim.decay_style if optim.decay_style != "wsd" else "WSD",
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        wsd_decay_steps=(optim.wsd_decay_iters or max(1, decay // 10)) if optim.decay_style == "wsd" else None,
        lr_wsd_decay_style="linear" if optim.decay_style == "wsd" else None,
    )
