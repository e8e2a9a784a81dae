"""Layers the engine plugs into Megatron-Core layer specs, and the layer spec BERT and T5 share.

Where Megatron's local specs use torch's LayerNorm (which refuses sequence parallelism) and
``DotProductAttention``, these use ``Norm`` and ``attention.CoreAttention``. Imported only by
workers (it imports torch and Megatron); it does no work at import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules, SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megacli.checkpoint.megatron_lm.keys import LOCAL_KEYS_MAP
from megacli.engine.models.attention import CoreAttention


class Norm(torch.nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``), usable wherever a Megatron layer spec takes
    a norm (``input_layernorm``, ``pre_mlp_layernorm``, the block's final ``layer_norm``).

    Unlike the local spec's ``WrappedTorchNorm`` it works under sequence parallelism: every
    parameter carries ``sequence_parallel = config.sequence_parallel``, which is what Megatron's
    ``finalize_model_grads`` looks for to all-reduce a replicated parameter's gradient over the
    tensor-parallel group (each rank saw only its slice of the sequence).
    ``config.layernorm_zero_centered_gamma`` stores ``gamma - 1`` (initialised to zero) and applies
    ``1 + weight``, as Megatron's fused norms do.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.config = config
        self.normalization = config.normalization
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"Norm supports LayerNorm and RMSNorm, not {self.normalization!r}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        kw = {"dtype": config.params_dtype}
        if not config.use_cpu_initialization and torch.cuda.is_available():
            kw["device"] = torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, **kw))
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(hidden_size, **kw))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        for p in self.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered_gamma and self.normalization == "RMSNorm":
            # in fp32, 1 + weight included, then cast (Gemma's RMSNorm: 1 + w in bf16 would round)
            return F.rms_norm(x.float(), (self.hidden_size,), self.weight.float() + 1, self.eps).to(x.dtype)
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.normalization == "LayerNorm":
            return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)
        return F.rms_norm(x, (self.hidden_size,), weight, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalization}, {self.hidden_size}, eps={self.eps}"
                + (", zero_centered_gamma" if self.zero_centered_gamma else ""))


class PostNormAdd(torch.nn.Module):
    """The residual step of a post-LN layer, norm(residual + dropout(output + bias)), in the
    bias-dropout-add slot of Megatron's TransformerLayer (which calls ``bda(training, fused)`` and
    then the function it returns). Its norm is stored as ``<layer>.self_attn_bda.norm.*`` /
    ``<layer>.mlp_bda.norm.*``."""

    def __init__(self, config):
        super().__init__()
        self.norm = Norm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, training: bool, fused: bool):
        add = get_bias_dropout_add(training, fused)
        return lambda output_with_bias, residual, prob: self.norm(add(output_with_bias, residual, prob))


class OutputNormAdd(torch.nn.Module):
    """The residual step of a layer that normalises each sublayer's output before adding it,
    residual + dropout(norm(output + bias)) (``model.norm_placement``: output, OLMo 2; sandwich, Gemma 2/3), in the
    bias-dropout-add slot of Megatron's TransformerLayer. Its norm is stored as
    ``<layer>.self_attn_bda.norm.*`` / ``<layer>.mlp_bda.norm.*``. Under sequence parallelism the
    output is this rank's tokens, and Norm's gain carries ``sequence_parallel``."""

    def __init__(self, config):
        super().__init__()
        self.norm = Norm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def normed(self, output_with_bias):
        out, bias = output_with_bias
        return self.norm(out if bias is None else out + bias)

    def forward(self, training: bool, fused: bool):
        add = get_bias_dropout_add(training, fused)
        return lambda output_with_bias, residual, prob: add((self.normed(output_with_bias), None), residual, prob)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose gradient is the all-reduced gradient: each rank's copy of the sum
    feeds different heads, so the sum's gradient is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class ProjectionNorm(torch.nn.Module):
    """RMSNorm over all heads of a query or key projection at once (OLMo 2's q_norm / k_norm,
    ``model.qk_norm_scope: projection``), as ``q_layernorm`` / ``k_layernorm`` of Megatron's
    SelfAttention, which passes [sq, b, local heads, head_dim]. The gain covers ``heads`` ×
    head_dim features and is split over the tensor-parallel ranks like the heads (contiguous, rank
    order); the sum of squares of a token is all-reduced over the tensor-parallel group, so every
    rank divides by the whole projection's width. Computed in fp32, cast back after the gain."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *, heads: int):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        if config.normalization != "RMSNorm":
            raise ValueError(f"ProjectionNorm is an RMSNorm, not {config.normalization!r}")
        tp = config.tensor_model_parallel_size
        if heads % tp:
            raise ValueError(f"{heads} heads do not split over {tp} tensor-parallel ranks")
        self.config, self.eps = config, eps
        self.width = heads * hidden_size
        self.group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        kw = {"dtype": config.params_dtype}
        if not config.use_cpu_initialization and torch.cuda.is_available():
            kw["device"] = torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(heads // tp * hidden_size, **kw))
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:-2], -1).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.group is not None:
            squares = _SumOverGroup.apply(squares, self.group)
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        out = weight.float() * (flat * torch.rsqrt(squares / self.width + self.eps))
        return out.to(x.dtype).reshape(x.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        dp_cp = (metadata or {}).get("dp_cp_group") or ps.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets, tp_group=ps.get_tensor_model_parallel_group(),
                                                   dp_cp_group=dp_cp)

    def extra_repr(self) -> str:
        return f"RMSNorm over {self.width} features (this rank: {self.weight.numel()}), eps={self.eps}"


def layer_spec(*, model, self_attn_mask: AttnMaskType, cross_attention: bool, config=None) -> ModuleSpec:
    """A transformer layer: self-attention, optionally cross-attention (T5 decoder), MLP. Pre-LN,
    or post-LN for ``model.norm_position: post`` (then ``config``, the TransformerConfig, builds
    the norms in the residual steps). Checkpoint keys are those of Megatron's local BERT/T5 specs."""
    qk_norm = Norm if model.qk_layernorm else IdentityOp
    post = model.norm_position == "post"
    residual = ModuleSpec(module=PostNormAdd, params={"config": config}) if post else get_bias_dropout_add
    cross = {}
    if cross_attention:
        cross = dict(
            pre_cross_attn_layernorm=Norm,
            cross_attention=ModuleSpec(
                module=CrossAttention,
                params={"attn_mask_type": AttnMaskType.padding},
                submodules=CrossAttentionSubmodules(linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear,
                                                    core_attention=CoreAttention, linear_proj=RowParallelLinear),
            ),
            cross_attn_bda=get_bias_dropout_add,
        )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if post else Norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": self_attn_mask},
                submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=CoreAttention,
                                                   linear_proj=RowParallelLinear, q_layernorm=qk_norm, k_layernorm=qk_norm),
            ),
            self_attn_bda=residual,
            **cross,
            pre_mlp_layernorm=IdentityOp if post else Norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=residual,
            sharded_state_dict_keys_map=dict(LOCAL_KEYS_MAP),
        ),
    )


def block_spec(layer: ModuleSpec, num_layers: int, *, final_norm: bool = True) -> ModuleSpec:
    """``num_layers`` copies of ``layer`` and (unless post-LN) our final norm (Megatron's default
    one refuses SP)."""
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=Norm if final_norm else None))
