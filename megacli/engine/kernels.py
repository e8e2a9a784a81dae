"""Training's kernel choices without Transformer Engine: torch.compile of the model's step
(train.compile), SDPA's attention kernel (train.attention_backend), which is logged once at
start as torch picks it for a training micro-batch of the model, and the gradient norm and
scaling on torch's multi-tensor kernels where Megatron-Core has no Apex kernels."""

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


def compile_model(chunks) -> list:
    """train.compile: torch.compile each transformer layer's forward in place (their parameters
    stay where they are, so wrappers, optimizer and checkpoints see the same tensors), and for a
    GPT the rest of the step: the embedding, the final norm, and the output layer with the loss
    as one graph (the padded-vocabulary mask and the soft-cap, hooks of the output layer, fused
    into the cross-entropy's passes over the logits). The forward, not the module call: each
    compiled module's own hooks run outside its graph (see lift_param_sync_hooks). Every layer
    shares one compiled graph: they run the same code on tensors of the same shapes. Returns
    the compiled modules."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_layer import TransformerLayer

    _quiet_group_defaults()
    compiled = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]
    for chunk in chunks:
        if isinstance(chunk, GPTModel) and not chunk.config.mtp_num_layers:
            if chunk.pre_process:
                compiled.append(chunk.embedding)
            if chunk.post_process:
                compiled.append(chunk.decoder.final_layernorm)
                compiled.append(_compile_loss_head(chunk))
    for module in compiled:
        module.forward = torch.compile(module.forward)
    return compiled


class LossHead(torch.nn.Module):
    """A GPT's output layer and loss for training batches, as one function to compile. It holds
    the model without registering it (the model's state dict and module tree stay as they are);
    ``covers`` names the modules whose parameter-sync hooks run before it."""

    def __init__(self, model):
        super().__init__()
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "covers", [model.output_layer])

    def forward(self, hidden_states, labels, weight):
        logits, _ = self.model.output_layer(hidden_states, weight=weight)
        return self.model.compute_language_model_loss(labels, logits)


def _compile_loss_head(chunk) -> LossHead:
    """Route the chunk's training forward (labels given, no inference context) through a LossHead;
    logits for generation and evaluation without labels take Megatron's own path."""
    head = LossHead(chunk)
    original = chunk._postprocess

    def postprocess(**kwargs):
        if kwargs.get("labels") is None or kwargs.get("inference_context") is not None:
            return original(**kwargs)
        weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
        return head(kwargs["hidden_states"], kwargs["labels"], weight)

    chunk._postprocess = postprocess
    return head


def lift_param_sync_hooks(ddp, compiled) -> None:
    """With parallel.overlap_param_gather, Megatron's DDP puts a forward pre-hook on every module
    that waits for its parameters' all-gather. Traced inside a compiled layer, each hook guards on
    the identity of that layer's parameters, so every layer recompiles the graph (and past torch's
    recompile limit runs eager). The same waits, for all the modules a compiled module runs, in
    one hook on that module, which runs before its compiled forward. ``compiled`` may hold other
    model chunks' modules."""
    handles = ddp.remove_forward_pre_hook_handles
    if not handles:
        return
    wait = ddp._make_forward_pre_hook()
    for module in compiled:
        inner = [m for m in getattr(module, "covers", module.modules()) if m in handles]  # none for another chunk's
        if not inner:
            continue
        for m in inner:
            handles[m].remove()

        def wait_for_module(_module, _args, inner=inner):
            for m in inner:
                wait(m)

        lifted = module.register_forward_pre_hook(wait_for_module)
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


def use_foreach_grad_kernels() -> None:
    """Without Apex or Transformer Engine, Megatron-Core's gradient norm (clip_grads) copies every
    parameter tensor's norm to the host, each step, and its gradient scaling (clipping, the mixed
    precision optimizer's main-to-model copies) runs a multiply and a copy per tensor. The same
    maths on torch's multi-tensor kernels, on the device, in place of Megatron's local fallbacks
    only: a real amp_C kernel stays. Idempotent."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's call: the L2 norm of all tensors of ``tensor_lists`` as a
    1-element float32 tensor on their device, and with ``per_tensor`` each tensor's norm (float32).
    Each tensor's norm is taken in its own dtype, as Megatron-Core's local fallback takes it."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        device = noop_flag.device if noop_flag is not None else None
        return torch.zeros(1, dtype=torch.float32, device=device), (torch.zeros(0, device=device) if per_tensor else None)
    norms = torch.stack(torch._foreach_norm(tensors)).to(torch.float32)
    return torch.linalg.vector_norm(norms).reshape(1), (norms if per_tensor else None)


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale) -> None:
    """amp_C.multi_tensor_scale's call: each tensor of ``tensor_lists[1]`` = the same one of
    ``tensor_lists[0]`` times ``scale``, in place when they are the same tensors."""
    sources, targets = tensor_lists[0], tensor_lists[1]
    if not sources:
        return
    # A host 0-d tensor, not a number: both devices then multiply bf16/fp16 tensors in float32 by
    # the unrounded scale, as src * scale does (CPU's in-place kernel rounds a number to their dtype).
    factor = torch.tensor(scale, dtype=torch.float64)
    if all(s is t for s, t in zip(sources, targets)):
        torch._foreach_mul_(targets, factor)
    else:
        torch._foreach_copy_(targets, sources if scale == 1.0 else torch._foreach_mul(sources, factor))
