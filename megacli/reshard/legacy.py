"""Megatron-LM legacy (``--ckpt-format torch``) checkpoints <-> megacli torch_dist, for reshard.

    CKPT/latest_checkpointed_iteration.txt
    CKPT/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt     one file per (tensor, pipeline) rank

Each file holds that rank's model state dict(s) (``model``, or ``model0``, ``model1``... with
virtual pipeline stages; layers numbered within the chunk), its optimizer's state dict, the LR
scheduler, its RNG state and the run's ``args``. megacli.checkpoint.legacy reads the weights
and the optimizer state (Megatron-Core or legacy-model key names, tensor-parallel shards merged);
here they are carried over with the rest, so a run moves between Megatron-LM and megacli with its
optimizer:

* optimizer - Adam moments and fp32 main weights, merged and split like the weights they belong
  to. (The distributed optimizer's legacy ``distrib_optim.pt`` shards are not supported: resume
  such a run once in Megatron-LM with torch_dist.)
* scheduler - Megatron-LM counts scheduler steps in samples, megacli in iterations: the step
  fields are divided (import) or multiplied (export) by the global batch size;
* RNG state - one per (tensor, pipeline) rank in both formats, carried over as stored (a CPU
  run's generator states are CPU states: load such a checkpoint in Megatron-LM on CUDA with
  ``--no-load-rng``);
* args <-> recipe.yaml.

Import writes a megacli checkpoint in the legacy layout to a staging directory (which the
reshard then reads like any other); export writes the files of the target layout from a megacli
checkpoint, with Megatron-Core's Transformer-Engine key names in Megatron-Core's parameter order.
One pipeline stage's files are open (memory-mapped) at a time when reading; a legacy file holds
one rank's whole state, so writing one needs that rank's share of the model in memory.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from megacli.checkpoint.layout import FILE, TRACKER, iter_name
from megacli.checkpoint.legacy import LAYER, LegacyCheckpoint
from megacli.checkpoint.legacy_args import arg, recipe_from_args
from megacli.checkpoint.sharding import GATED_SPLIT, shard, split_of
from megacli.errors import UserError
from megacli.precision import params_dtype

STAGING_PREFIX = ".megacli-legacy-"
_SCHED_STEPS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "wsd_decay_steps")
# The linear modules with Transformer Engine extra state (fp8 metadata), as megacli's torch_dist keeps them.
_EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
# Parameter order of a Megatron-Core GPT layer with the Transformer Engine spec (module creation
# order: Attention builds linear_proj before SelfAttention builds linear_qkv; TE's LayerNormLinear
# registers its norm before its weight).
_LAYER_ORDER = (
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
)
_TOP_FIRST = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_TOP_LAST = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight", "output_layer.bias")


# ---------------------------------------------------------------- reading


def open_source(path: Path, *, trust_pickle: bool = False) -> LegacyCheckpoint:
    """A legacy GPT checkpoint to import with its optimizer state."""
    src = LegacyCheckpoint(Path(path), trust_pickle=trust_pickle, optimizer=True)
    if src.arch != "gpt":
        raise UserError(f"{src.it_dir}: a Megatron-LM {src.arch.upper()} checkpoint; reshard imports legacy GPT "
                        f"checkpoints with their optimizer state. For the weights, use `megacli convert "
                        f"{path} DST` (then pretrain/finetune from DST)")
    if (src.it_dir / "distrib_optim.pt").exists() or any(src.it_dir.glob("mp_rank_*/distrib_optim.pt")):
        raise UserError(f"{src.it_dir}: distributed-optimizer state (distrib_optim.pt) is not supported; resume the "
                        f"run in Megatron-LM once with --ckpt-format torch_dist, or without --use-distributed-optimizer")
    return src


def import_to_staging(path: Path, *, where: Path, trust_pickle: bool = False, progress=None) -> Path:
    """Write the legacy checkpoint at ``path`` as a megacli torch_dist checkpoint in its own
    layout, in a new staging directory under ``where``; returns the iteration directory."""
    from megacli.checkpoint.torch_dist import ObjectEntry, TensorEntry, write_torch_dist
    from megacli.recipe.base import dump, validate
    from megacli.recipe.pretrain import TrainingRecipe
    from megacli.reshard.plan import OPT_PREFIX, target_chunks

    src = open_source(path, trust_pickle=trust_pickle)
    raw = recipe_from_args(src)
    recipe = validate(TrainingRecipe, raw, f"the recipe made from {src.it_dir}'s args")
    gbs = recipe.train.global_batch_size
    where.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=where))
    it_dir = staging / iter_name(src.iteration)
    it_dir.mkdir()

    keys = src.canonical_keys()
    stacked: dict[str, list[tuple[int, str]]] = {}  # megacli key -> [(layer, canonical key)]
    for k in keys:
        m = LAYER.match(k)
        base = f"decoder.layers.{m.group(2)}" if m else k
        stacked.setdefault(base, []).append((int(m.group(1)) if m else -1, k))
    L = src.num_layers
    for base, members in stacked.items():
        if base.startswith("decoder.layers.") and sorted(l for l, _ in members) != list(range(L)):
            raise UserError(f"{src.it_dir}: {base} is not in all {L} layers")

    first_stage = src.stage(0)
    kinds = [k for k in ("fp32_param", "exp_avg", "exp_avg_sq") if any(k in v for n, v in first_stage.items() if not n.startswith("_"))]
    swiglu = src.swiglu

    def probe(base: str, kind: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Global shape (one layer) and dtype, from the shards' shapes."""
        name = stacked[base][0][1]
        shards = src.stage(src.stage_of(name))[name][kind]
        shape = list(shards[0].shape)
        dim = split_of(name, gated=swiglu)
        if len(shards) > 1 and dim is not None:
            shape[0 if dim == GATED_SPLIT else dim] *= len(shards)
        return tuple(shape), shards[0].dtype

    cache: dict = {}

    def region_for(base: str, kind: str):
        layered = base.startswith("decoder.layers.")

        def region(offsets, sizes):
            if layered:
                name = f"decoder.layers.{offsets[0]}.{base[len('decoder.layers.'):]}"
                rest_off, rest_size = offsets[1:], sizes[1:]
            else:
                name, rest_off, rest_size = base, offsets, sizes
            if cache.get("key") != (name, kind):
                cache.clear()
                cache["key"] = (name, kind)
                cache["t"] = src.get(name, kind)
            t = cache["t"]
            for d, (o, s) in enumerate(zip(rest_off, rest_size)):
                t = t.narrow(d, o, s)
            return (t.unsqueeze(0) if layered else t).clone()

        return region

    def stage_key(base: str):
        layered = base.startswith("decoder.layers.")
        return lambda offsets: (src.stage_of(f"decoder.layers.{offsets[0]}.x") if layered else src.stage_of(base),)

    tensors: list[TensorEntry] = []
    for kind in ["weight"] + kinds:
        for base in stacked:
            one, dtype = probe(base, kind)
            shape = ((L,) if base.startswith("decoder.layers.") else ()) + one
            key = base if kind == "weight" else f"{OPT_PREFIX}{kind}.{base}"
            tensors.append(TensorEntry(key=key, shape=shape, dtype=dtype, region=region_for(base, kind),
                                       chunks=target_chunks(key, shape, tp=src.tp, gated=swiglu), sort_key=stage_key(base)))
    src.forget_stage()

    # Sharded objects: TE extra state per layer and linear module (empty here), the RNG state per rank.
    objects = []
    none_bytes = _saved([None])
    for module in _EXTRA_STATE_MODULES:
        for layer in range(L):
            objects.append(ObjectEntry(f"decoder.layers.{module}._extra_state/shard_{layer}_{L}", (lambda b=none_bytes: b)))
    for p in range(src.pp):
        for r in range(src.tp):
            objects.append(ObjectEntry(f"rng_state/shard_{p}.{r}_{src.pp}.{src.tp}", (lambda p=p, r=r: _rng_from_legacy(src, p, r))))

    common: dict = {}
    step = first_stage["_step"]
    groups = first_stage["_groups"]
    if src.has_optimizer and groups is not None:
        groups = sorted(groups, key=lambda g: float(g.get("wd_mult", 1.0)) == 0.0)  # Megatron-Core 0.16: weights first
        state = {"common_step": torch.tensor(float(step))} if step else {}
        body = {"state": state, "param_groups": groups}
        mixed = recipe.train.precision != "fp32"
        opt = src.first["optimizer"]
        if mixed:
            common["optimizer"] = {"optimizer": body, **({"grad_scaler": opt["grad_scaler"]} if opt.get("grad_scaler") else {})}
        else:
            common["optimizer"] = body
    sched = src.first.get("opt_param_scheduler") or src.first.get("lr_scheduler")
    if sched:
        common["scheduler"] = _scale_scheduler(sched, 1 / gbs, f"{src.files[(0, 0)]}")

    done = progress("importing", len(tensors) + len(objects)) if progress else (lambda key: None)
    write_torch_dist(it_dir, tensors, objects, common, on_done=done)
    consumed = int(arg(src.args, "consumed_train_samples", src.iteration * gbs) or 0)
    meta = {"iteration": src.iteration, "consumed_samples": consumed,
            "layout": {"tensor": src.tp, "pipeline": src.pp, "virtual_pipeline": src.vp if src.vp > 1 else None,
                       "data": recipe.data_parallel_size, "context": recipe.parallel.context},
            "format": "torch_dist", "imported_from": {"path": str(Path(path).resolve()), "format": "megatron-lm torch"}}
    if not src.has_optimizer:
        meta["has_optimizer"] = False
    (it_dir / "recipe.yaml").write_text(dump(recipe))
    (it_dir / "megacli.json").write_text(json.dumps(meta, indent=2) + "\n")
    return it_dir


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rng_from_legacy(src: LegacyCheckpoint, p: int, r: int) -> bytes:
    state = src.first if (r, p) == (0, 0) else src.read(src.files[(r, p)])
    rng = state.get("rng_state")
    if isinstance(rng, list) and rng:
        rng = rng[0]
    if not isinstance(rng, dict):
        raise UserError(f"{src.files[(r, p)]}: no RNG state")
    return _saved([{"random": rng.get("random_rng_state"), "numpy": rng.get("np_rng_state"),
                    "torch": rng.get("torch_rng_state"), "cuda": rng.get("cuda_rng_state"),
                    "tracker": rng.get("rng_tracker_states") or {}}])


def _scale_scheduler(sched: dict, factor: float, where: str) -> dict:
    out = dict(sched)
    for k in _SCHED_STEPS:
        v = out.get(k)
        if v is None:
            continue
        scaled = v * factor
        if abs(scaled - round(scaled)) > 1e-6:
            raise UserError(f"{where}: scheduler {k} = {v} is not a whole number of global batches")
        out[k] = int(round(scaled))
    return out


def cleanup_staging(path: Path) -> None:
    """Remove an import staging directory (``path`` is its iteration directory); others are left alone."""
    path = Path(path)
    root = path.parent
    if root.name.startswith(STAGING_PREFIX):
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- writing


def check_exportable(recipe_raw: dict, where: Path) -> None:
    """Refuse, before anything is written, a model the legacy export cannot name."""
    arch = ((recipe_raw.get("model") or {}).get("arch")) or "gpt"
    if arch != "gpt":
        raise UserError(f"{where}: a {arch.upper()} checkpoint; the legacy export writes GPT checkpoints only. For the "
                        f"weights in another format, use `megacli convert {where} DST --to hf`")


def export(it_dir: Path, out: Path, *, trust_pickle: bool = False, progress=None) -> list[str]:
    """Write the megacli checkpoint ``it_dir`` (standard optimizer, any layout) as a Megatron-LM
    legacy checkpoint in its layout under ``out`` (created). Returns notes for the user."""
    from megacli.recipe.base import validate
    from megacli.recipe.pretrain import TrainingRecipe
    from megacli.reshard.plan import OPT_PREFIX, Checkpoint, split_optimizer_key

    ck = Checkpoint(it_dir, trust_pickle=trust_pickle)
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
    if opt_common is not None:
        inner = opt_common["optimizer"] if mixed else opt_common
        groups = [dict(g) for g in inner["param_groups"]]
        step = inner.get("state", {}).get("common_step")
    else:
        groups, step = [], None
    notes = []
    rng = ck.rng_objects
    if rng:
        sample = reader.read_object(next(iter(rng.values())))[0]
        cpu_states = sample.get("cuda") is None
        if cpu_states:
            notes.append("RNG state is the CPU backend's (CPU generator states): in Megatron-LM on CUDA, load with --no-load-rng")
    gbs = recipe.train.global_batch_size
    args = _args_from_recipe(recipe, ck, reader)
    it_name = iter_name(ck.iteration)
    per_chunk = L // (P * V)
    total = T * P
    done = progress("exporting", total) if progress else (lambda key: None)

    def local(base: str, layer: Optional[int]) -> str:
        return base if layer is None else f"decoder.layers.{layer}.{base[len('decoder.layers.'):]}"

    def global_piece(key: str, layer: Optional[int]) -> torch.Tensor:
        info = reader.tensors[key]
        if layer is None:
            return reader.read(key)
        return reader.read_region(key, (layer,) + (0,) * (len(info.shape) - 1), (1,) + tuple(info.shape[1:]))[0]

    # One layer's entries in Megatron-Core's parameter order, TE extra state after each linear module.
    layer_items: list[str] = []
    present = [x for x in _LAYER_ORDER if f"decoder.layers.{x}" in model_keys]
    for i, suffix in enumerate(present):
        layer_items.append(suffix)
        module = suffix.rsplit(".", 1)[0]
        nxt = present[i + 1].rsplit(".", 1)[0] if i + 1 < len(present) else None
        if module in _EXTRA_STATE_MODULES and nxt != module:
            layer_items.append(module + "._extra_state")
    for p in range(P):
        for r in range(T):
            model_chunks = {}
            params: list[tuple[str, str]] = []  # (file key, megacli base key) in parameter order
            for v in range(V):
                state: dict = {}
                first_layer = v * (L // V) + p * per_chunk
                entries: list[tuple[str, Optional[int], str]] = []  # (megacli key, global layer, file key)
                if p == 0 and v == 0:
                    entries += [(k, None, k) for k in _TOP_FIRST if k in model_keys]
                for i in range(per_chunk):
                    for suffix in layer_items:
                        if suffix.endswith("._extra_state"):
                            entries.append((None, first_layer + i, f"decoder.layers.{i}.{suffix}"))
                        else:
                            entries.append((f"decoder.layers.{suffix}", first_layer + i, f"decoder.layers.{i}.{suffix}"))
                if p == P - 1 and v == V - 1:
                    entries += [(k, None, k) for k in _TOP_LAST if k in model_keys]
                    if P > 1 and not m.untie_embeddings:
                        entries.append(("embedding.word_embeddings.weight", None, "output_layer.weight"))
                unknown = {k for k in model_keys if k not in _TOP_FIRST + _TOP_LAST
                           and not any(k == f"decoder.layers.{s}" for s in _LAYER_ORDER)}
                if unknown:
                    raise UserError(f"{it_dir}: no Megatron-LM name/order for {sorted(unknown)}")
                for base, layer, file_key in entries:
                    if base is None:  # TE extra state after the module's parameters: none, as Megatron-LM's local layers
                        state[file_key] = None
                        continue
                    state[file_key] = shard(base, global_piece(base, layer), tp=T, rank=r, gated=swiglu)
                    params.append((file_key, base, layer))
                model_chunks["model" if V == 1 else f"model{v}"] = state
            optimizer = _legacy_optimizer(reader, params, groups, step, states, T, r, swiglu, mixed, opt_common) if opt_common else None
            rank_rng = None
            if rng:
                s = reader.read_object(rng[(p, r)])[0]
                rank_rng = [{"random_rng_state": s["random"], "np_rng_state": s["numpy"], "torch_rng_state": s["torch"],
                             "cuda_rng_state": s["cuda"], "rng_tracker_states": s["tracker"]}]
            payload = {"args": args, "checkpoint_version": 3.0, "iteration": ck.iteration, **model_chunks,
                       "num_floating_point_operations_so_far": 0}
            if optimizer is not None:
                payload["optimizer"] = optimizer
            if "scheduler" in common:
                payload["opt_param_scheduler"] = _scale_scheduler(common["scheduler"], gbs, str(it_dir))
            if rank_rng is not None:
                payload["rng_state"] = rank_rng
            name = f"mp_rank_{r:02d}" if P == 1 else f"mp_rank_{r:02d}_{p:03d}"
            (out / it_name / name).mkdir(parents=True, exist_ok=True)
            torch.save(payload, out / it_name / name / FILE)
            done(name)
    (out / TRACKER).write_text(str(ck.iteration))
    return notes


def _legacy_optimizer(reader, params, groups, step, states, T, r, swiglu, mixed, opt_common) -> dict:
    """The standard optimizer's state dict for one rank: parameters indexed group by group
    (weights, then biases and 1-D parameters), each group in parameter order."""
    from megacli.reshard.plan import OPT_PREFIX

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


def _args_from_recipe(recipe, ck, reader) -> argparse.Namespace:
    """The Megatron-LM arguments a legacy checkpoint carries (what Megatron-LM checks on load, and
    what megacli.convert reads back)."""
    m, p, t, o = recipe.model, recipe.parallel, recipe.train, recipe.optim
    emb = reader.tensors.get("embedding.word_embeddings.weight")
    padded = emb.shape[0] if emb is not None else None
    tok = recipe.tokenizer
    gbs = t.global_batch_size
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        group_query_attention=m.query_groups != m.num_attention_heads, num_query_groups=m.query_groups,
        kv_channels=m.head_dim, ffn_hidden_size=m.ffn_size, seq_length=m.seq_length,
        max_position_embeddings=m.max_positions,
        position_embedding_type={"learned": "learned_absolute", "rope": "rope"}.get(m.position_embedding, "none"),
        add_position_embedding=m.position_embedding == "learned",
        rotary_base=int(m.rotary_base), rotary_percent=m.rotary_percent,
        normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm", norm_epsilon=m.norm_epsilon,
        swiglu=m.activation == "swiglu", squared_relu=m.activation == "squared_relu", openai_gelu=m.activation == "gelu_tanh",
        add_bias_linear=m.add_bias_linear, add_qkv_bias=m.add_qkv_bias, qk_layernorm=m.qk_layernorm,
        untie_embeddings_and_output_weights=m.untie_embeddings, hidden_dropout=m.dropout,
        attention_dropout=m.attention_dropout, init_method_std=m.init_method_std,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by, padded_vocab_size=padded,
        vocab_size=m.vocab_size,
        tokenizer_type="HuggingFaceTokenizer" if tok.type == "huggingface" else "NullTokenizer",
        tokenizer_model=tok.path,
        tensor_model_parallel_size=p.tensor, pipeline_model_parallel_size=p.pipeline,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline, sequence_parallel=p.sequence_parallel,
        context_parallel_size=p.context, data_parallel_size=recipe.data_parallel_size, world_size=recipe.world_size,
        use_distributed_optimizer=False, ckpt_format="torch", data_parallel_random_init=False,
        global_batch_size=gbs, micro_batch_size=t.micro_batch_size, train_iters=t.iters, seed=t.seed,
        bf16=t.precision == "bf16", fp16=t.precision == "fp16",
        params_dtype=params_dtype(t.precision),
        optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, lr_decay_style={"wsd": "WSD"}.get(o.decay_style, o.decay_style),
        lr_decay_iters=o.decay_iters or t.iters, lr_warmup_iters=o.warmup_iters, weight_decay=o.weight_decay,
        clip_grad=o.clip_grad, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        iteration=ck.iteration, consumed_train_samples=int(ck.meta.get("consumed_samples", ck.iteration * gbs)),
        consumed_valid_samples=0, skipped_train_samples=0,
        data_path=[recipe.data.path] if recipe.data.path else None,
    )


# ---------------------------------------------------------------- inspect


def inspect(path: Path, *, trust_pickle: bool = False) -> dict:
    """inspect_checkpoint's answer for a legacy checkpoint (shapes from the files; no merging)."""
    src = open_source(path, trust_pickle=trust_pickle)
    rows: dict[str, dict] = {}
    total = 0
    for p in range(src.pp):
        stage = src.stage(p)
        for name, kinds in stage.items():
            if name.startswith("_"):
                continue
            m = LAYER.match(name)
            base = f"decoder.layers.{m.group(2)}" if m else name
            for kind, shards in kinds.items():
                shape = list(shards[0].shape)
                dim = split_of(name, gated=src.swiglu)
                if len(shards) > 1 and dim is not None:
                    shape[0 if dim == GATED_SPLIT else dim] *= len(shards)
                key = base if kind == "weight" else f"optimizer.state.{kind}.{base}"
                row = rows.get(key)
                nbytes = math.prod(shape) * shards[0].element_size()
                total += nbytes
                if row is None:
                    if len(shards) == 1:
                        split = "whole"
                    elif dim is None:
                        split = f"replicated on {len(shards)} ranks"
                    else:
                        split = f"{len(shards)} on dim {(0 if dim == GATED_SPLIT else dim) + (1 if m else 0)}"
                    rows[key] = {"name": key, "kind": "model" if kind == "weight" else "optimizer",
                                 "shape": ([1] if m else []) + shape, "dtype": str(shards[0].dtype).replace("torch.", ""),
                                 "bytes": nbytes, "chunks": len(shards),
                                 "split": ("per layer" + ("" if split == "whole" else " · " + split)) if m else split}
                elif m:
                    row["shape"][0] += 1
                    row["bytes"] += nbytes
                    row["chunks"] += len(shards)
    src.forget_stage()
    args = src.args
    return {
        "path": str(path), "format": "megatron-lm legacy (torch)", "iteration": src.iteration,
        "consumed_samples": arg(args, "consumed_train_samples"),
        "layout": {"tensor": src.tp, "pipeline": src.pp, "virtual_pipeline": src.vp if src.vp > 1 else None,
                   "data": arg(args, "data_parallel_size", 1), "context": arg(args, "context_parallel_size", 1)},
        "layout_text": f"TP {src.tp} × PP {src.pp}" + (f" (VP {src.vp})" if src.vp > 1 else "") + f" × DP {arg(args, 'data_parallel_size', 1)}",
        "world_size": src.tp * src.pp * int(arg(args, "data_parallel_size", 1) or 1),
        "optimizer": "standard" if src.has_optimizer else None,
        "has_rng_state": "rng_state" in src.first, "scheduler_steps": (src.first.get("opt_param_scheduler") or {}).get("num_steps"),
        "resharded_from": None, "recipe": recipe_from_args(src), "tensors": list(rows.values()), "total_bytes": total,
        "objects": {"rng_state": [f"mp_rank_{r:02d}" + (f"_{p:03d}" if src.pp > 1 else "") for p in range(src.pp) for r in range(src.tp)]
                    if "rng_state" in src.first else [], "other": []},
        "files": [str(f.relative_to(src.root)) for f in sorted(src.files.values())],
    }
