"""Export a megacli checkpoint as a Megatron-LM legacy (``--ckpt-format torch``) checkpoint: the
files of the target layout, with the key names of Megatron-Core's model for the layer spec (te:
Transformer Engine's, local: Megatron-Core's own modules) in its parameter order (see
megacli.checkpoint.megatron_lm.legacy_staging for what each part becomes). A legacy file holds one
rank's whole state, so writing one needs that rank's share of the model in memory."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch

from megacli.checkpoint.layout import FILE, TRACKER, iter_name
from megacli.checkpoint.megatron_lm.dist_writer import SPECS, TRANSFORMER_IMPL, rng_for_megatron_lm
from megacli.checkpoint.sharding import shard
from megacli.errors import UserError
from megacli.checkpoint.megatron_lm.args_to_recipe import scale_scheduler
from megacli.checkpoint.megatron_lm.keys import LOCAL_NAMES
from megacli.checkpoint.megatron_lm.legacy_staging import EXTRA_STATE_MODULES
from megacli.checkpoint.source import Source

# Parameter order of a Megatron-Core GPT layer, per layer spec, in megacli's (Transformer Engine)
# names: the order of the layer's state_dict() and so of the standard optimizer's indices. TE spec:
# Attention builds linear_proj before SelfAttention builds linear_qkv; TE's LayerNormLinear
# registers its norm before its weight. Local spec (get_gpt_layer_local_spec): TransformerLayer
# builds input_layernorm, self_attention, pre_mlp_layernorm, mlp, the norms being modules of their own.
_LAYER_ORDER = {
    "te": (
        "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
        "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
        "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
        "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
        "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
        "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
    ),
    "local": (
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
        "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
        "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
        "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
        "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
        "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
        "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
    ),
}
_TOP_FIRST = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_TOP_LAST = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight", "output_layer.bias")


def check_exportable(recipe, where: Path) -> None:
    """Refuse, before anything is written, a model the legacy export cannot write: what Megatron-LM's
    arguments cannot describe (as for torch_dist), and mixture-of-experts models."""
    from megacli.checkpoint.megatron_lm.dist_export import check_exportable as check_arguments

    check_arguments(recipe, where)
    if recipe.model.arch != "gpt":
        raise UserError(f"{where}: a {recipe.model.arch.upper()} model; the legacy (--ckpt-format torch) export writes "
                        f"GPT checkpoints. Write a torch_dist one: `megacli reshard {where} DST --format megatron`")
    if recipe.model.moe is not None:
        raise UserError(f"{where}: a mixture-of-experts model; the legacy (--ckpt-format torch) export does not write "
                        f"MoE checkpoints. Write a torch_dist one: `megacli reshard {where} DST --format megatron`")


def export(source: Source, out: Path, *, spec: str = "te", progress=None) -> list[str]:
    """Write the megacli checkpoint ``source`` (an iteration directory) (standard optimizer, any layout) as a Megatron-LM
    legacy checkpoint for the ``spec`` layer spec (te or local) in its layout under ``out``
    (created). Returns notes for the user."""
    from megacli.recipe.base import validate
    from megacli.recipe.pretrain import TrainingRecipe
    from megacli.checkpoint.megacli_checkpoint import OPT_PREFIX, Checkpoint, split_optimizer_key

    if spec not in SPECS:
        raise UserError(f"--spec {spec!r}: expected one of {', '.join(SPECS)}")
    it_dir = source.path
    ck = Checkpoint(source)
    if ck.optimizer_kind == "distributed":
        raise UserError("internal error: export needs the standard optimizer's format")
    recipe = validate(TrainingRecipe, ck.recipe_raw, str(it_dir / "recipe.yaml"))
    lay = ck.layout
    m = recipe.model
    L, T, P, V = m.num_layers, lay.tensor, lay.pipeline, lay.vp
    swiglu = m.gated
    reader = ck.reader
    model_keys = set(ck.model_keys)
    states = sorted({split_optimizer_key(k)[0] for k in reader.tensors if k.startswith(OPT_PREFIX)})
    common = ck.common
    mixed = recipe.train.precision != "fp32"
    opt_common = common.get("optimizer")
    groups, step = _groups_and_step(opt_common, mixed=mixed)
    notes = [f"Megatron-LM legacy checkpoint for the {spec} layer spec (--transformer-impl {TRANSFORMER_IMPL[spec]})"]
    rng = ck.rng_objects
    if rng and reader.read_object(next(iter(rng.values())))[0].get("cuda") is None:
        notes.append("RNG state is the CPU backend's (CPU generator states): in Megatron-LM on CUDA, load with --no-load-rng")
    gbs = recipe.train.global_batch_size
    args = _args_from_recipe(recipe, ck, reader, transformer_impl=TRANSFORMER_IMPL[spec])
    it_name = iter_name(ck.iteration)
    chunks = recipe.parallel.chunk_layers(L)  # [stage][virtual chunk] -> its global layers
    total = T * P
    done = progress("exporting", total) if progress else (lambda key: None)

    def global_piece(key: str, layer: Optional[int]) -> torch.Tensor:
        info = reader.tensors[key]
        if layer is None:
            return reader.read(key)
        return reader.read_region(key, (layer,) + (0,) * (len(info.shape) - 1), (1,) + tuple(info.shape[1:]))[0]

    unknown = {k for k in model_keys if k not in _TOP_FIRST + _TOP_LAST
               and not any(k == f"decoder.layers.{s}" for s in _LAYER_ORDER[spec])}
    if unknown:
        raise UserError(f"{it_dir}: no Megatron-LM name/order for {sorted(unknown)}")
    layer_items = _layer_items(spec, model_keys)
    for p in range(P):
        for r in range(T):
            model_chunks = {}
            params: list[tuple[str, str]] = []  # (file key, megacli base key) in parameter order
            for v in range(V):
                state: dict = {}
                entries = _chunk_entries(chunks[p][v], first=p == 0 and v == 0, last=p == P - 1 and v == V - 1,
                                         layer_items=layer_items, model_keys=model_keys, spec=spec,
                                         output_from_embedding=P > 1 and not m.untie_embeddings)
                for base, layer, file_key in entries:
                    if base is None:  # extra state: none, as Megatron-Core's own linear layers save (no FP8 metadata)
                        state[file_key] = None
                        continue
                    state[file_key] = shard(base, global_piece(base, layer), tp=T, rank=r, gated=swiglu)
                    params.append((file_key, base, layer))
                model_chunks["model" if V == 1 else f"model{v}"] = state
            payload = {"args": args, "checkpoint_version": 3.0, "iteration": ck.iteration, **model_chunks,
                       "num_floating_point_operations_so_far": 0}
            if opt_common:
                payload["optimizer"] = _legacy_optimizer(reader, params, groups, step, states, T, r, swiglu, mixed, opt_common)
            if "scheduler" in common:
                payload["opt_param_scheduler"] = scale_scheduler(common["scheduler"], gbs, str(it_dir))
            if rng:
                payload["rng_state"] = [rng_for_megatron_lm(reader.read_object(rng[(p, r)])[0])]
            name = f"mp_rank_{r:02d}" if P == 1 else f"mp_rank_{r:02d}_{p:03d}"
            (out / it_name / name).mkdir(parents=True, exist_ok=True)
            torch.save(payload, out / it_name / name / FILE)
            done(name)
    (out / TRACKER).write_text(str(ck.iteration))
    return notes


def _groups_and_step(opt_common, *, mixed: bool) -> tuple[list[dict], object]:
    """The optimizer's param groups and common step from megacli's common state (none without one)."""
    if opt_common is None:
        return [], None
    inner = opt_common["optimizer"] if mixed else opt_common
    return [dict(g) for g in inner["param_groups"]], inner.get("state", {}).get("common_step")


def _layer_items(spec: str, model_keys: set[str]) -> list[tuple[Optional[str], str]]:
    """One layer's entries (megacli suffix or None, file suffix) in Megatron-Core's parameter
    order, the extra state after each linear module's parameters."""
    rename = LOCAL_NAMES if spec == "local" else {}  # a plain state_dict() keeps the local spec's names
    layer_items: list[tuple[Optional[str], str]] = []
    present = [x for x in _LAYER_ORDER[spec] if f"decoder.layers.{x}" in model_keys]
    for i, suffix in enumerate(present):
        file_suffix = rename.get(suffix, suffix)
        layer_items.append((suffix, file_suffix))
        module = file_suffix.rsplit(".", 1)[0]
        nxt = rename.get(present[i + 1], present[i + 1]).rsplit(".", 1)[0] if i + 1 < len(present) else None
        if module in EXTRA_STATE_MODULES and nxt != module:
            layer_items.append((None, module + "._extra_state"))
    return layer_items


def _chunk_entries(layers: range, *, first: bool, last: bool, layer_items, model_keys: set[str], spec: str,
                   output_from_embedding: bool) -> list[tuple[Optional[str], Optional[int], str]]:
    """One model chunk's entries (megacli key or None for extra state, global layer, file key):
    the embedding in the ``first`` chunk, the ``layers``, the final norm and output layer in the
    ``last``."""
    entries: list[tuple[Optional[str], Optional[int], str]] = []
    if first:
        entries += [(k, None, k) for k in _TOP_FIRST if k in model_keys]
    for i in range(len(layers)):
        for suffix, file_suffix in layer_items:
            base = None if suffix is None else f"decoder.layers.{suffix}"
            entries.append((base, layers.start + i, f"decoder.layers.{i}.{file_suffix}"))
    if last:
        entries += [(k, None, k) for k in _TOP_LAST if k in model_keys]
        if output_from_embedding:
            entries.append(("embedding.word_embeddings.weight", None, "output_layer.weight"))
        if spec == "local":  # Megatron-Core's ColumnParallelLinear, there with or without its weight
            entries.append((None, None, "output_layer._extra_state"))
    return entries


def _legacy_optimizer(reader, params, groups, step, states, T, r, swiglu, mixed, opt_common) -> dict:
    """The standard optimizer's state dict for one rank: parameters indexed group by group
    (weights, then biases and 1-D parameters), each group in parameter order."""
    from megacli.checkpoint.megacli_checkpoint import OPT_PREFIX

    wd_groups = [i for i, g in enumerate(groups) if float(g.get("wd_mult", 1.0)) != 0.0]
    nowd_groups = [i for i, g in enumerate(groups) if float(g.get("wd_mult", 1.0)) == 0.0]
    if len(wd_groups) != 1 or len(nowd_groups) > 1:
        raise UserError(f"optimizer param groups {groups}: expected one weight group and at most one no-decay group")
    members: dict[int, list] = {i: [] for i in range(len(groups))}
    cache: dict = {}
    for file_key, base, layer in params:
        info = reader.tensors[base]
        shape = info.shape[1:] if layer is not None else info.shape
        no_wd = file_key.endswith(".bias") or len(shape) == 1
        gi = (nowd_groups or [None])[0] if no_wd else wd_groups[0]
        if gi is None:
            raise UserError(f"{file_key}: a no-weight-decay parameter but the optimizer has no such group")
        members[gi].append((file_key, base, layer))
    state, out_groups, fp32 = {}, [], []
    idx = 0
    for gi, g in enumerate(groups):
        ids, fp32_group = [], []
        for file_key, base, layer in members[gi]:
            entry = {}
            if step is not None:
                entry["step"] = step.clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step))
            for s in states:
                if s == "fp32_param":
                    continue
                key = f"{OPT_PREFIX}{s}.{base}"
                t = _piece(reader, key, layer, cache)
                entry[s] = shard(base, t, tp=T, rank=r, gated=swiglu)
            if mixed:
                fp32_group.append(shard(base, _piece(reader, f"{OPT_PREFIX}fp32_param.{base}", layer, cache), tp=T, rank=r, gated=swiglu))
            state[idx] = entry
            ids.append(idx)
            idx += 1
        out_groups.append({**g, "params": ids})
        fp32.append(fp32_group)
    body = {"state": state, "param_groups": out_groups}
    if not mixed:
        return body
    out = {"optimizer": body, "fp32_from_fp16_params": fp32}
    if opt_common.get("grad_scaler") is not None:
        out["grad_scaler"] = opt_common["grad_scaler"]
    return out


def _piece(reader, key: str, layer: Optional[int], cache: dict) -> torch.Tensor:
    info = reader.tensors.get(key)
    if info is None:
        raise UserError(f"{reader.path}: no {key}")
    if layer is None:
        return reader.read(key)
    return reader.read_region(key, (layer,) + (0,) * (len(info.shape) - 1), (1,) + tuple(info.shape[1:]))[0]


def _args_from_recipe(recipe, ck, reader, *, transformer_impl: str) -> argparse.Namespace:
    """The Megatron-LM arguments a legacy checkpoint carries: the full set parse_args defines, with
    this recipe's values (megacli.checkpoint.megatron_lm.args)."""
    from megacli.checkpoint.megatron_lm.args_namespace import megatron_args

    emb = reader.tensors.get("embedding.word_embeddings.weight")
    gbs = recipe.train.global_batch_size
    return megatron_args(recipe, ckpt_format="torch", iteration=ck.iteration,
                         consumed_samples=int(ck.meta.get("consumed_samples", ck.iteration * gbs)),
                         padded_vocab_size=emb.shape[0] if emb is not None else None,
                         transformer_impl=transformer_impl)
