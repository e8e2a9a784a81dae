"""The one table of layer-norm spellings: Megatron-Core's local layer spec keeps a layer's norms as
modules of their own (``input_layernorm.weight``), its Transformer Engine spec fuses each into the
linear layer after it (``self_attention.linear_qkv.layer_norm_weight``). megacli's (canonical) names
are the Transformer Engine spec's."""

from __future__ import annotations

# local-spec norm -> the linear layer the Transformer Engine spec fuses it into
FUSED_INTO = {"input_layernorm": "self_attention.linear_qkv", "pre_mlp_layernorm": "mlp.linear_fc1"}


def fused_prefix(norm: str) -> str:
    """Where the Transformer Engine spec keeps a norm's parameters: ``input_layernorm`` ->
    ``self_attention.linear_qkv.layer_norm_`` (then ``weight`` / ``bias``)."""
    return f"{FUSED_INTO[norm]}.layer_norm_"


# Megatron-Core's sharded_state_dict_keys_map for a local-spec layer: its norms saved under the
# Transformer Engine spec's names.
LOCAL_KEYS_MAP = {f"{norm}.": fused_prefix(norm) for norm in FUSED_INTO}
# Within a layer, the Transformer Engine spec's name -> the local spec's.
LOCAL_NAMES = {f"{fused_prefix(norm)}{kind}": f"{norm}.{kind}" for norm in FUSED_INTO for kind in ("weight", "bias")}
# A MoE layer's pre-MLP norm: its MLP has no linear_fc1 to fuse into, so the Transformer Engine spec
# keeps it under its own name (the local spec saves it under the fused name all the same).
MOE_NORM = "pre_mlp_layernorm"
