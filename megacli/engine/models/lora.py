"""LoRA adapters on Megatron's tensor-parallel linear layers (the layer spec builds these in place
of ColumnParallelLinear / RowParallelLinear for the recipe's lora.targets).

A layer computes W·x + s·B·A·dropout(x), s = alpha / rank, with W frozen. Under tensor
parallelism the adapter is split the way the base layer is:

* column-parallel W (rows split): A [r, in] replicated, B [out/tp, r] split like W's rows. The
  product A·x is copied into the tensor-parallel region (its gradient is summed over ranks), or,
  with sequence parallelism, computed on this rank's tokens and gathered (A's gradient is then
  summed over ranks by Megatron's finalize_model_grads, as for sequence-parallel norms);
* row-parallel W (columns split): A [r, in/tp] split like W's columns, B [out, r] replicated. The
  partial products A_i·x_i are all-reduced (reduce-scattered with sequence parallelism) exactly as
  the base layer's output is.

Adapters are saved under the base layer's key plus `lora_a` / `lora_b`, in the same layout-free
global form as the weights (SwiGLU's B like fc1's weight: [gate; up]), so a LoRA checkpoint loads
under any TP/PP and merges with pure tensor arithmetic: W + s·B·A.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

ADAPTER_SUFFIXES = ("lora_a", "lora_b")


def is_adapter_key(key: str) -> bool:
    """A state-dict or checkpoint key of an adapter tensor."""
    return key.rsplit(".", 1)[-1] in ADAPTER_SUFFIXES


def _adapter_params(module, lora, a_shape, b_shape):
    device, dtype = module.weight.device, module.weight.dtype
    module.lora_a = torch.nn.Parameter(torch.zeros(a_shape, device=device, dtype=dtype))
    module.lora_b = torch.nn.Parameter(torch.zeros(b_shape, device=device, dtype=dtype))
    module.lora_dropout = torch.nn.Dropout(lora.dropout)
    module.lora_scale = lora.alpha / lora.rank


class LoRAColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear plus an adapter: A replicated, B split along the output like W."""

    def __init__(self, input_size, output_size, *, lora, swiglu: bool = False, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        if self.gather_output:
            raise ValueError("LoRA on a column-parallel layer that gathers its output is not supported")
        _adapter_params(self, lora, (lora.rank, self.input_size), (self.output_size_per_partition, lora.rank))
        set_tensor_model_parallel_attributes(self.lora_b, is_parallel=True, dim=0, stride=1)
        if self.sequence_parallel:
            self.lora_a.sequence_parallel = True  # its gradient covers this rank's tokens only
        self.swiglu = swiglu

    def forward(self, input_, weight=None, runtime_gather_output=None):
        output, bias = super().forward(input_, weight, runtime_gather_output)
        if self.sequence_parallel:  # this rank's tokens (the TP ranks' dropout masks differ, as their tokens do)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                h = F.linear(self.lora_dropout(input_), self.lora_a)
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
        else:  # the same input on every TP rank, and the same dropout mask (the default generator)
            h = copy_to_tensor_model_parallel_region(F.linear(self.lora_dropout(input_), self.lora_a), group=self.tp_group)
        return output + self.lora_scale * F.linear(h, self.lora_b), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        state = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                    {"weight": 0, "bias": 0, "lora_b": 0}, sharded_offsets,
                                                    tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        if self.swiglu:  # [gate; up] per rank, saved as fc1's weight is (MLP applies it to the weight and bias)
            key = f"{prefix}lora_b"
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets,
                                                      (metadata or {}).get("singleton_local_shards", False))
        return state


class LoRARowParallelLinear(RowParallelLinear):
    """RowParallelLinear plus an adapter: A split along the input like W, B replicated."""

    def __init__(self, input_size, output_size, *, lora, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        if not self.input_is_parallel:
            raise ValueError("LoRA on a row-parallel layer with an unsplit input is not supported")
        _adapter_params(self, lora, (lora.rank, self.input_size_per_partition), (self.output_size, lora.rank))
        set_tensor_model_parallel_attributes(self.lora_a, is_parallel=True, dim=1, stride=1)
        if self.sequence_parallel:
            self.lora_b.sequence_parallel = True  # applied to this rank's tokens only

    def forward(self, input_):
        output, bias = super().forward(input_)
        with tensor_parallel.get_cuda_rng_tracker().fork():  # each rank holds different input features
            h = F.linear(self.lora_dropout(input_), self.lora_a)
        if self.sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return output + self.lora_scale * F.linear(h, self.lora_b), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"weight": 1, "lora_a": 1}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


def linear_spec(base, name: str, lora, *, swiglu: bool = False):
    """The layer spec entry for the linear layer `name`: the base class, or its LoRA version when
    the recipe targets it."""
    if lora is None or name not in lora.targets:
        return base
    from megatron.core.transformer.spec_utils import ModuleSpec

    if base is ColumnParallelLinear:
        return ModuleSpec(module=LoRAColumnParallelLinear, params={"lora": lora, "swiglu": swiglu})
    return ModuleSpec(module=LoRARowParallelLinear, params={"lora": lora})


def freeze_base(chunks) -> None:
    """Only adapters train: call before the DDP wrappers and the optimizer are built (both take
    the parameters that require gradients)."""
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            p.requires_grad_(is_adapter_key(name))


def adapter_params(model, lora) -> int:
    """Adapter parameters of the whole model: rank × (in + out) per targeted layer."""
    heads = model.num_attention_heads * model.head_dim
    shapes = {
        "linear_qkv": (model.hidden_size, heads + 2 * model.query_groups * model.head_dim),
        "linear_proj": (heads, model.hidden_size),
        "linear_fc1": (model.hidden_size, model.ffn_size * (2 if model.gated else 1)),
        "linear_fc2": (model.ffn_size, model.hidden_size),
    }
    return model.num_layers * sum(lora.rank * sum(shapes[t]) for t in lora.targets)


def merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale·B·A in W's dtype (computed in fp32): the adapted layer as one weight."""
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)


@contextmanager
def adapters_off(chunks):
    """The model computes with its base weights only (each adapter's scale set to 0) inside the block."""
    layers = [m for c in chunks for m in c.modules() if hasattr(m, "lora_scale")]
    scales = [m.lora_scale for m in layers]
    for m in layers:
        m.lora_scale = 0.0
    try:
        yield
    finally:
        for m, s in zip(layers, scales):
            m.lora_scale = s
