"""The tensor-parallel RNG tracker's states as a checkpoint holds them: each generator's state
tensor. With train.cuda_graphs the tracker is Megatron-Core's graph-safe one, which holds
torch.Generator objects (registered with the captured graphs): they pickle, but weights-only
loading refuses them, so they are saved as their state tensors and set back into the tracker's
own generators at a load."""

from __future__ import annotations

import torch


def tracker_states(tracker) -> dict:
    """The tracker's states by name, each a state tensor."""
    from megatron.core import tensor_parallel

    return {name: tensor_parallel.convert_cuda_rng_state(state, to_graphable=False)
            for name, state in tracker.get_states().items()}


def restore_tracker(tracker, states: dict) -> None:
    """Set saved states into ``tracker``: tensors, or generators (a Megatron-LM checkpoint of a run
    with CUDA graphs, read with the user's pickle trust). A graph-safe tracker keeps its generators, each set
    to its saved state."""
    from megatron.core import tensor_parallel

    states = {name: tensor_parallel.convert_cuda_rng_state(state, to_graphable=False) for name, state in states.items()}
    if tensor_parallel.is_graph_safe_cuda_rng_tracker(tracker):
        live = tracker.get_states()
        states = {name: _set_generator(live.get(name), state) for name, state in states.items()}
    tracker.set_states(states)


def _set_generator(generator, state: torch.Tensor):
    """``generator`` set to ``state``; a new graph-safe generator for a name the tracker lacks."""
    from megatron.core import tensor_parallel

    if not isinstance(generator, torch.Generator):
        return tensor_parallel.convert_cuda_rng_state(state, to_graphable=True)
    generator.set_state(state)
    return generator
