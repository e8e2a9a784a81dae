"""train.fp8: FP8 matrix products in Megatron-Core's column- and row-parallel linears, through
torchao's float8 training (``torchao.float8``), without Transformer Engine.

Each linear that takes FP8 keeps its module, weight and state dict; only the matrix product of its
``_forward_impl`` (the hook through which Megatron's ColumnParallelLinear and RowParallelLinear
run their autograd function) changes. The tensor-parallel communication around it is Megatron's
own: the sequence-parallel all-gather (reduce-scatter of the gradient) or the copy whose gradient
is all-reduced, then torchao's FP8 autograd function (input and weight cast to float8 with dynamic
scales; in the backward pass the output gradient too). Under sequence parallelism the backward
pass gathers this rank's part of the input again, as Megatron's does, rather than keeping it
whole. The weight gradient reaches the parameter's main_grad through Megatron DDP's hook, as on
Megatron's path without gradient-accumulation fusion.
The master weights, the optimizer and checkpoints are those of a bf16 run, so FP8 can be turned on
or off at a resume.

Left in bf16 by rule (``KEPT``): the output layer, MoE experts (their token counts vary per step
and FP8 matrix units need multiples of 16), the MoE router (a linear of its own, not a parallel
one), linears whose weight shape on this rank is not a multiple of 16 in both dimensions, and
frozen weights (LoRA's base: Megatron's frozen-weight path).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from megacli.errors import UserError

ALIGN = 16  # what FP8 matrix units (torch._scaled_mm) need of every dimension
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores
# How far (relative) an FP8 run's loss may stray from the bf16 run's at the same step: 2.8x the
# largest gap of 8 emulated 50-step curves on CPU (docs/gpu.md derives it); tests/test_fp8.py and
# benchmarks/gpu_bench.py hold runs to it.
LOSS_TOLERANCE = 5e-3
KEPT = {
    "output": "the output layer (its logits feed the softmax over the vocabulary)",
    "expert": "MoE experts (tokens per expert vary; FP8 matrix units need multiples of 16)",
    "router": "the MoE router (not a parallel linear)",
    "shape": f"weight shape on this rank not a multiple of {ALIGN}",
    "frozen": "frozen weights (Megatron's frozen-weight path)",
}


def check_device(choice: str, *, emulate: bool, device: torch.device) -> None:
    """Refuse train.fp8 where no FP8 matrix unit runs it (a CPU, a GPU before Ada/Hopper) unless
    it is emulated, and refuse it without torchao."""
    if choice == "none":
        return
    torchao_config(choice, emulate=emulate)  # torchao importable
    if emulate:
        return
    if device.type != "cuda":
        raise UserError(f"train.fp8 = {choice!r} needs a GPU with FP8 matrix units (compute capability "
                        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: Ada, Hopper or newer); this run is on "
                        f"{device.type} (train.fp8_emulate: true emulates FP8 in higher precision, for testing)")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise UserError(f"train.fp8 = {choice!r} needs a GPU with FP8 matrix units (compute capability "
                        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: Ada, Hopper or newer); "
                        f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}")


def tokens_aligned(recipe) -> bool:
    """Whether every micro-batch's token count on a rank (the inner dimension of the weight
    gradient's product) is a multiple of ALIGN: fixed-length batches whose micro-batch size times
    each sequence length (t5: the decoder's too), over the context-parallel ranks, is. Instruction
    and preference batches vary in length."""
    m, t, p = recipe.model, recipe.train, recipe.parallel
    if getattr(recipe, "sft", None) is not None or getattr(recipe, "preference", None) is not None:
        return False
    lengths = [m.seq_length, *([m.dec_seq_length] if m.arch == "t5" else [])]
    return all(t.micro_batch_size * length // p.context % ALIGN == 0 for length in lengths)


def torchao_config(choice: str, *, emulate: bool, pad_tokens: bool = False):
    """torchao's Float8LinearConfig of a train.fp8 recipe (tensorwise or rowwise), emulated or not;
    ``pad_tokens``: torchao pads each product's inner dimension to a multiple of ALIGN (for token
    counts that are not; a copy per product)."""
    import dataclasses

    try:
        with _quiet_loggers("torchao", "torch.utils._pytree"):  # its extensions' load failures on CPU builds, enum notes
            from torchao.float8 import Float8LinearConfig
    except ImportError as exc:
        raise UserError(f"train.fp8 needs torchao ({exc}): pip install 'megacli[fp8]'") from None
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(choice), emulate=emulate, pad_inner_dim=pad_tokens)


@contextlib.contextmanager
def _quiet_loggers(*names: str):
    """These loggers' warnings dropped while the block runs (torchao's import)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _mm_config(config):
    """torchao's per-product settings (forward, input gradient, weight gradient) as its Float8Linear
    builds them."""
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    def one(gemm):
        return ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)

    return LinearMMConfig(one(config.gemm_config_output), one(config.gemm_config_grad_input),
                          one(config.gemm_config_grad_weight))


def kept_reason(name: str, module) -> str | None:
    """The KEPT key of a column- or row-parallel linear that stays in bf16, None for one in FP8."""
    if name.split(".")[-1] == "output_layer":
        return "output"
    if getattr(module, "is_expert", False):
        return "expert"
    if module.weight is None or any(d % ALIGN for d in module.weight.shape):
        return "shape"
    if not module.weight.requires_grad:
        return "frozen"
    return None


def install(chunks, choice: str, *, emulate: bool, pad_tokens: bool) -> None:
    """Route the matrix product of every column- and row-parallel linear of ``chunks`` that FP8
    can take through torchao's float8 (before the model is wrapped; its parameters stay as they
    are). Each linear records its choice in ``fp8_kept`` (a KEPT key, or None)."""
    if choice == "none":
        return
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from torchao.float8._inductor_patch import _patch_inductor_min_max_codegen

    _patch_inductor_min_max_codegen()  # what torchao's own conversion applies before any FP8 kernel compiles
    config = torchao_config(choice, emulate=emulate, pad_tokens=pad_tokens)
    mm_config = _mm_config(config)
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            module.fp8_kept = kept_reason(name, module)
            if module.fp8_kept is None:
                module._forward_impl = functools.partial(fp8_linear, config=config, mm_config=mm_config,
                                                         plain=module._forward_impl)


def fp8_linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
               grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, *, config, mm_config, plain):
    """Megatron's ``linear_with_grad_accumulation_and_async_allreduce`` (same arguments) with the
    matrix products in FP8: the communication of Megatron's mappings, then torchao's FP8 function.
    A frozen weight or a deferred weight gradient takes Megatron's own path (``plain``)."""
    if not weight.requires_grad or grad_output_buffer is not None:
        return plain(input=input, weight=weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                     allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                     grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group)
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    kept = contextlib.nullcontext()
    if sequence_parallel:  # all-gather the sequence; the input gradient is reduce-scattered
        local = input
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        kept = _kept_as_local(input, local, tp_group)
    elif allreduce_dgrad:  # the input gradient is all-reduced over the tensor-parallel group
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    with kept:
        output = matmul_with_hp_or_float8_args.apply(input, weight.t(), mm_config, config)
    return output + bias if bias is not None else output


class _Local:
    """What autograd keeps of a gathered sequence: this rank's part."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _kept_as_local(gathered: torch.Tensor, local: torch.Tensor, group):
    """Inside the block, autograd keeps ``local`` (this rank's part of the sequence) where it would
    keep ``gathered`` (the whole sequence) for the backward pass, which gathers it again: activation
    memory divided by the tensor-parallel size, as in Megatron's own sequence-parallel linear."""
    import weakref

    from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

    gathered = weakref.ref(gathered)  # autograd keeps the hooks with what they saved

    def pack(tensor):
        return _Local(local) if tensor is gathered() else tensor

    def unpack(saved):
        return _gather_along_first_dim(saved.tensor, group) if isinstance(saved, _Local) else saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def describe(chunks, choice: str, *, emulate: bool, pad_tokens: bool) -> str | None:
    """The start-of-run line: which linears of this rank's chunks run FP8 and which stay bf16, by rule."""
    if choice == "none":
        return None
    from importlib.metadata import version

    linears = [(name, m) for chunk in chunks for name, m in chunk.named_modules() if hasattr(m, "fp8_kept")]
    fp8 = sorted({name.split(".")[-1] for name, m in linears if m.fp8_kept is None})
    kept: dict[str, set] = {}
    for name, m in linears:
        if m.fp8_kept is not None:
            kept.setdefault(m.fp8_kept, set()).add(name.split(".")[-1])
    kept.setdefault("output", {"output_layer"})  # whichever pipeline stage holds it
    if any(name.split(".")[-1] == "router" for chunk in chunks for name, _ in chunk.named_modules()):
        kept["router"] = {"router"}
    count = sum(m.fp8_kept is None for _, m in linears)
    how = "emulated in higher precision" if emulate else "FP8 matrix units"
    if pad_tokens:
        how += f", token dimension padded to a multiple of {ALIGN}"
    bf16 = "; ".join(f"{', '.join(sorted(names))}: {KEPT[key]}" for key, names in sorted(kept.items()))
    return (f"train.fp8 = {choice}: torchao {version('torchao')} float8 ({how}) in {count} of {len(linears)} "
            f"parallel linears on this rank ({', '.join(fp8) or 'none'}); bf16 by rule: {bf16 or 'none'}")
