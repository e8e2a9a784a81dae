"""Megatron-LM's own torch_dist checkpoints (``--ckpt-format torch_dist``, its default), read.

    CKPT/latest_checkpointed_iteration.txt     "1000" (or "release")
    CKPT/iter_0001000/.metadata, __R_F.distcp  the sharded state: model (global shapes, layers stacked),
                                               optimizer, RNG state (sharded objects)
    CKPT/iter_0001000/common.pt                the state every rank shares: args (the run's argparse
                                               Namespace), checkpoint_version, iteration,
                                               opt_param_scheduler, ...; from Megatron-Core 0.19 on
                                               it is the shards' common_state object instead
    CKPT/iter_0001000/metadata.json            {"sharded_backend": "torch_dist", ...}

The model's sharded keys are megacli's canonical ones: Megatron-Core's Transformer Engine spec
fuses the layer norms into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``
and its local spec maps its norms to those names on save. A local-spec model saved without that
map (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``) is renamed on read; Transformer
Engine's ``_extra_state`` entries are not weights and are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

from megacli.checkpoint.layout import BACKEND_META, tracked_iteration
from megacli.checkpoint.megatron_lm.keys import FUSED_INTO, MOE_NORM, fused_prefix
from megacli.checkpoint.megatron_lm.args_to_recipe import ArgsDescribed
from megacli.checkpoint.megatron_lm.args import arg, model_section_from_args, moe_refusals, t5_refusals
from megacli.checkpoint.safe_pickle import COMMON, DCP_METADATA
from megacli.checkpoint.source import MEGATRON_LM, Source
from megacli.checkpoint.torch_dist import COMMON_STATE_OBJECT, NOT_MODEL, STACKED, TorchDistReader, is_extra_state
from megacli.errors import UserError

__all__ = ["FORMAT", "MegatronLMCheckpoint", "canonical_key", "recipe_for_weights", "weights_dir"]

FORMAT = "megatron-lm torch_dist"

# Arguments that change the model in ways megacli's model section does not express (name: why).
_UNMAPPED_ARGS = {
    "multi_latent_attention": "multi-latent attention is not supported (its local-spec latent norm names and the "
                              "yarn parameters its arguments leave to defaults are not mapped to model.mla)",
    "mtp_num_layers": "multi-token prediction layers are not supported (megacli's GPT has no MTP block)",
    "quick_geglu": "the quick-GELU gated activation (quick_geglu) is not one of megacli's activations",
    "qk_l2_norm": "L2-normalised queries and keys (qk_l2_norm) are not expressed by megacli's model",
    "attention_output_gate": "gated attention outputs (attention_output_gate) are not expressed by megacli's model",
    "no_rope_freq": "layers without RoPE (no_rope_freq) are not expressed by megacli's model",
}
_NORMALIZATIONS = ("LayerNorm", "RMSNorm")

_LOCAL_NORM = re.compile(r"(?:^|\.)layers\.(?P<norm>" + "|".join(FUSED_INTO) + r")\.(?P<kind>weight|bias)\Z")
_MOE_LOCAL_NORM = re.compile(r"(?:^|\.)layers\.(?:\d+\.)?(?P<fused>" + re.escape(fused_prefix(MOE_NORM))
                             + r")(?P<kind>weight|bias)\Z")


def canonical_key(key: str, stored: set[str]) -> str | None:
    """The megacli (canonical) name of a stored model key; None for entries that are not weights.
    A local-spec norm is renamed to the fused spelling only where the layer has that fused linear
    (a MoE layer's pre-MLP norm stays separate). Megatron-Core's local spec maps
    ``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_`` on save in every layer, so a MoE
    layer's norm (its MLP has no linear_fc1) is stored under that name: renamed back."""
    if is_extra_state(key):
        return None
    moe = _MOE_LOCAL_NORM.search(key)
    if moe is not None:
        stem = key[: moe.start("fused")]
        return key if f"{stem}{FUSED_INTO[MOE_NORM]}.weight" in stored else f"{stem}{MOE_NORM}.{moe.group('kind')}"
    m = _LOCAL_NORM.search(key)
    if m is None:
        return key
    stem = key[: m.start("norm")]
    norm = m.group("norm")
    if f"{stem}{FUSED_INTO[norm]}.weight" not in stored:
        return key
    return f"{stem}{fused_prefix(norm)}{m.group('kind')}"


class MegatronLMCheckpoint(ArgsDescribed):
    """A Megatron-LM torch_dist checkpoint: its run's args, iteration, stored entries (``reader``)
    and the canonical names of its model weights (``model_keys``)."""

    def __init__(self, source: Source):
        self.root = source.path
        self.it_dir = tracked_iteration(self.root) or self.root
        if source.at(self.it_dir).kind != MEGATRON_LM:
            raise UserError(f"{self.it_dir}: not a Megatron-LM torch_dist iteration directory (needs {DCP_METADATA} "
                            f"and {COMMON} or {BACKEND_META})")
        self.reader = TorchDistReader(source.at(self.it_dir))
        where = self.common_where = self.reader.common_where
        if where is None:
            raise UserError(f"{self.it_dir}: no common state (the run's args): neither {COMMON} nor the "
                            f"{COMMON_STATE_OBJECT} object Megatron-Core 0.19 and newer save in the shards")
        self.common = self.reader.common()
        if not isinstance(self.common, dict):
            raise UserError(f"{where}: holds a {type(self.common).__name__}, not Megatron-LM's common state dict")
        version = self.common.get("checkpoint_version", 0) or 0
        if version < 3.0:
            raise UserError(f"{where}: checkpoint_version {version}; only version 3.0 is supported")
        self.args = self.common.get("args")
        if self.args is None:
            raise UserError(f"{where} has no 'args' (needed to know the model)")
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            if getattr(self.args, name, None) is None:
                raise UserError(f"{where}: args has no {name}")
        self.iteration = int(self.common.get("iteration", 0) or 0)
        self.tp = int(arg(self.args, "tensor_model_parallel_size", 1))
        self.pp = int(arg(self.args, "pipeline_model_parallel_size", 1))
        self.vp = int(arg(self.args, "virtual_pipeline_model_parallel_size", 1))
        self.first_stage_layers = arg(self.args, "decoder_first_pipeline_num_layers") or None  # uneven stages
        self.last_stage_layers = arg(self.args, "decoder_last_pipeline_num_layers") or None
        model = {k: v for k, v in self.reader.tensors.items() if k.split(".")[0] not in NOT_MODEL}
        names = set(model)
        # canonical name -> stored key, for every model weight
        self.model_keys = {name: k for k in model if (name := canonical_key(k, names)) is not None}

    # --- what the model is

    @property
    def arch(self) -> str:
        keys = self.model_keys
        if any(k.startswith("encoder.") for k in keys) and any(k.startswith("decoder.") for k in keys):
            return "t5"
        return "bert" if any(k.startswith("lm_head.") for k in keys) else "gpt"

    def unmapped(self) -> list[str]:
        """Why this run's model cannot be expressed as a megacli model section (empty when it can)."""
        out = [why for name, why in _UNMAPPED_ARGS.items() if arg(self.args, name)]
        out += moe_refusals(self.args)
        softmax = arg(self.args, "softmax_type", "vanilla")
        if softmax != "vanilla":
            out.append(f"softmax_type {softmax!r} is not supported (the standard softmax is)")
        out += t5_refusals(self.args)
        norm = arg(self.args, "normalization", "LayerNorm")
        if norm not in _NORMALIZATIONS:
            out.append(f"normalization {norm!r} is not supported (LayerNorm and RMSNorm are)")
        return out

    @property
    def moe_layers_stacked(self) -> bool:
        """A MoE model whose layers are stacked under one key (``decoder.layers.mlp.router.weight``
        with a leading layer axis): Megatron-Core stacks them when every layer is alike
        (--moe-layer-freq an integer giving all MoE layers, e.g. the default 1), while megacli's MoE
        models key each layer on its own (``decoder.layers.N.``, Megatron-Core's layout for a
        --moe-layer-freq list). The engine loads such a checkpoint with the layers stacked
        (checkpoint/megatron_lm/resume.py); reshard stages it per layer (checkpoint/megatron_lm/dist_staging.py)."""
        return bool(arg(self.args, "num_experts")) and any(STACKED.search(k) for k in self.model_keys)

    def padded_vocab_rows(self) -> int:
        info = self.reader.tensors.get(self.model_keys.get("embedding.word_embeddings.weight", ""))
        if info is None:
            raise UserError(f"{self.it_dir}: no embedding.word_embeddings.weight")
        return info.shape[0]

    def model_section(self) -> dict:
        problems = self.unmapped()
        if problems:
            raise UserError(f"{self.it_dir}: " + "; ".join(problems))
        section = model_section_from_args(self.args, self.vocab_size(), arch=self.arch)
        if section["arch"] == "t5":
            # pretrain_t5.py builds the decoder with args.num_layers layers (--decoder-num-layers is
            # not passed on): the stored weights say how many there are.
            qkv = self.reader.tensors.get(self.model_keys.get("decoder.layers.self_attention.linear_qkv.weight", ""))
            if qkv is not None and qkv.shape[0] != section["num_layers"]:
                section["decoder_num_layers"] = qkv.shape[0]
        return section

    # --- what inspect shows

    def recipe(self) -> dict | None:
        """The megacli training recipe the run's args describe (None when its model cannot be mapped:
        ``unmapped()`` says why)."""
        from megacli.checkpoint.megatron_lm.args_to_recipe import recipe_from_args

        if self.unmapped():
            return None
        raw = recipe_from_args(self)
        raw["parallel"]["distributed_optimizer"] = bool(arg(self.args, "use_distributed_optimizer", False))
        return raw

    def not_mapped(self) -> list[str]:
        """What of the run the recipe leaves out (the tokenizer when its files are not on this machine)."""
        return self.unmapped() + self.tokenizer_not_found()


def weights_dir(source: Source) -> Path:
    """The iteration directory of a Megatron-LM torch_dist checkpoint that megacli's engine loads
    weights from directly (local-spec norm names are renamed, stacked MoE layers read, as it loads)."""
    return MegatronLMCheckpoint(source).it_dir


def recipe_for_weights(source: Source) -> tuple[Path, dict]:
    """(iteration directory, raw recipe) for running a Megatron-LM checkpoint's weights in megacli
    (generate): the recipe its args map to; what cannot be mapped is refused, named."""
    src = MegatronLMCheckpoint(source)
    raw = src.recipe()
    if raw is None:
        raise UserError(f"{source.path}: " + "; ".join(src.unmapped()))
    return src.it_dir, raw
