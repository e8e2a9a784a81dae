"""Training's kernel choices without Transformer Engine: torch.compile of the transformer layers
(train.compile) and SDPA's attention kernel (train.attention_backend), which is logged once at
start as torch picks it for a training micro-batch of the model."""

from __future__ import annotations

import torch

from megacli.errors import UserError

# train.attention_backend -> the torch.backends.cuda switch of that kernel (they also steer CPU SDPA).
_SWITCHES = {"flash": "enable_flash_sdp", "efficient": "enable_mem_efficient_sdp", "cudnn": "enable_cudnn_sdp"}
_NAMES = {"MATH": "math", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cuDNN"}


def choose_attention(choice: str, device: torch.device) -> None:
    """train.attention_backend: auto leaves torch's switches alone; a kernel turns the other fused
    kernels off (the math kernel stays on for the calls the chosen one cannot take); math turns
    every fused kernel off."""
    if choice == "auto":
        return
    if device.type != "cuda" and choice in ("cudnn", "efficient"):
        raise UserError(f"train.attention_backend = {choice!r} is a CUDA kernel; this run is on {device.type} "
                        f"(use auto, flash or math)")
    for name, switch in _SWITCHES.items():
        getattr(torch.backends.cuda, switch)(name == choice)
    torch.backends.cuda.enable_math_sdp(True)


def attention_kernel(recipe, device: torch.device) -> str:
    """The SDPA kernel torch picks (under the switches now set) for the attention of one training
    micro-batch of this model: its shape, dtype, dropout and mask; "ring" with context parallelism."""
    from torch.nn.attention import SDPBackend

    m, t, p = recipe.model, recipe.train, recipe.parallel
    if p.context > 1:
        return "ring (context parallelism: flash-style blocks in torch)"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]
    heads, groups = m.num_attention_heads // p.tensor, m.query_groups // p.tensor
    s = m.seq_length
    q = torch.zeros(t.micro_batch_size, heads, s, m.head_dim, dtype=dtype, device=device)
    packed = getattr(recipe.sft, "packing", False)
    masked = m.arch != "gpt" or m.position_embedding == "alibi" or packed  # as CoreAttention calls SDPA then
    kv = q if masked else q[:, :groups]
    mask = torch.ones(s, s, dtype=torch.bool, device=device).tril() if masked else None
    choice = torch._fused_sdp_choice(q, kv, kv, attn_mask=mask, dropout_p=m.attention_dropout, is_causal=not masked,
                                     enable_gqa=not masked and groups != heads)
    return _NAMES.get(SDPBackend(choice).name, SDPBackend(choice).name.lower())


def describe_attention(recipe, device: torch.device) -> str:
    """The start-of-run line: the kernel, the device and what chose it."""
    how = "torch's choice" if recipe.train.attention_backend == "auto" else f"train.attention_backend = {recipe.train.attention_backend}"
    return f"attention: SDPA {attention_kernel(recipe, device)} kernel on {device.type.upper()} ({how})"


def compile_layers(chunks) -> list:
    """train.compile: torch.compile each transformer layer's forward in place (their parameters
    stay where they are, so wrappers, optimizer and checkpoints see the same tensors). The forward,
    not the module call: the layer's own hooks run outside the graph (see lift_param_sync_hooks).
    Every layer shares one compiled graph: they run the same code on tensors of the same shapes.
    Returns the compiled layers."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    _quiet_group_defaults()
    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.forward = torch.compile(layer.forward)
    return layers


def lift_param_sync_hooks(ddp, layers) -> None:
    """With parallel.overlap_param_gather, Megatron's DDP puts a forward pre-hook on every module
    that waits for its parameters' all-gather. Traced inside a compiled layer, each hook guards on
    the identity of that layer's parameters, so every layer recompiles the graph (and past torch's
    recompile limit runs eager). The same waits, for all the modules of a layer at once, in one
    hook on the layer itself, which runs before the compiled forward. ``layers`` may hold other
    model chunks' layers."""
    handles = ddp.remove_forward_pre_hook_handles
    if not handles:
        return
    wait = ddp._make_forward_pre_hook()
    for layer in layers:
        inner = [m for m in layer.modules() if m in handles]  # none for another model chunk's layers
        if not inner:
            continue
        for m in inner:
            handles[m].remove()

        def wait_for_layer(_layer, _args, inner=inner):
            for m in inner:
                wait(m)

        lifted = layer.register_forward_pre_hook(wait_for_layer)
        for m in inner:  # DDP's disable_forward_pre_hook removes the lifted hook (removing twice is a no-op)
            handles[m] = lifted


def _quiet_group_defaults() -> None:
    """Megatron-Core 0.16.1's RowParallelLinear calls its linear function without a tensor-parallel
    group, and the group default warns (DeprecationWarning, rank 0) on every call. Dynamo cannot
    trace that warning: the graph breaks inside an active context manager, and the rest of each
    layer runs eager. The same default, without the warning, for the modules the layers call."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers, mappings

    def group_if_none(tp_group, is_expert=False, check_initialized=True):
        if tp_group is not None or not torch.distributed.is_initialized() or not parallel_state.is_initialized():
            return tp_group if torch.distributed.is_initialized() else None
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    for module in (layers, mappings):
        module.get_tensor_model_parallel_group_if_none = group_if_none
