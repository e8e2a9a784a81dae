"""Layers the engine plugs into Megatron-Core layer specs.

Imported only by workers (it imports torch and Megatron); it does no work at import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


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
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.normalization == "LayerNorm":
            return F.layer_norm(x, (self.hidden_size,), weight, self.bias, self.eps)
        return F.rms_norm(x, (self.hidden_size,), weight, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalization}, {self.hidden_size}, eps={self.eps}"
                + (", zero_centered_gamma" if self.zero_centered_gamma else ""))
