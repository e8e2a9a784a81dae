"""train.cuda_graphs: Megatron-Core's own CUDA graphs (cuda_graph_impl "local", no Transformer
Engine). layers: each transformer layer's forward and backward are captured after the first step
and replayed; full: the whole forward-backward of a step (every micro-batch, the loss and the
gradient reduction; not the optimizer) is one graph, its inputs copied into static buffers first.
The loss, gradient-norm and non-finite checks read the graph's outputs after it has run. Which
layouts can be captured is the recipe's rule (recipe.pretrain); this module refuses the device."""

from __future__ import annotations

from megacli.errors import UserError

# full: steps run eagerly before the capture (the allocator and any compilation settle first);
# layers: each layer's warm-up passes before its capture, at the end of the first step.
WARMUP_STEPS = 2
_WRAPPED: dict = {}  # Megatron's forward-backward function -> its full-iteration wrapper


def config_kwargs(choice: str) -> dict:
    """The TransformerConfig fields of train.cuda_graphs (none: Megatron's defaults)."""
    if choice == "none":
        return {}
    # "full" is Megatron's name for a whole layer; "full_iteration" for the whole forward-backward
    scope = "full_iteration" if choice == "full" else "full"
    return {"cuda_graph_impl": "local", "cuda_graph_scope": scope, "cuda_graph_warmup_steps": WARMUP_STEPS}


def prepare(choice: str, *, device, seed: int) -> None:
    """Before the model is built: refuse a run that is not on CUDA, put Megatron's tensor-parallel
    RNG tracker in its graph-safe form (what Megatron's graph manager asserts: dropout inside a
    captured layer draws from a generator state registered with the graph) and clear any graph a
    previous run in this process captured."""
    if choice == "none":
        return
    if device.type != "cuda":
        raise UserError(f"train.cuda_graphs = {choice!r} captures CUDA graphs; this run is on {device.type} "
                        f"(use train.cuda_graphs: none)")
    from megatron.core import tensor_parallel
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, force_reset_rng=True)
    delete_cuda_graphs()
    FullCudaGraphWrapper.curr_iteration = {"training": 0, "validation": 0}
    FullCudaGraphWrapper.cuda_graph = {"training": None, "validation": None}
    FullCudaGraphWrapper.result = {"training": None, "validation": None}
    StaticBufferLoader.static_buffers = {"training": [], "validation": []}
    _WRAPPED.clear()


def schedule(choice: str, forward_backward):
    """Megatron's forward-backward function, wrapped in its full-iteration graph for full."""
    if choice != "full":
        return forward_backward
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    if forward_backward not in _WRAPPED:
        _WRAPPED[forward_backward] = FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=WARMUP_STEPS)
    return _WRAPPED[forward_backward]
