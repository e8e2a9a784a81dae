"""Megatron-LM legacy (``--ckpt-format torch``) checkpoints <-> megacli torch_dist, for reshard.

    CKPT/latest_checkpointed_iteration.txt
    CKPT/iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt     one file per (tensor, pipeline) rank

Each file holds that rank's model state dict(s) (``model``, or ``model0``, ``model1``... with
virtual pipeline stages; layers numbered within the chunk), its optimizer's state dict, the LR
scheduler, its RNG state and the run's ``args``. megacli.checkpoint.megatron_lm.legacy_reader reads the weights
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

import io
import json
import shutil
import tempfile
from pathlib import Path

import torch

from megacli.checkpoint.layout import iter_name
from megacli.checkpoint.megatron_lm.legacy_reader import LAYER, LegacyCheckpoint
from megacli.checkpoint.megatron_lm.args import arg
from megacli.checkpoint.megatron_lm.args_to_recipe import recipe_from_args, scale_scheduler
from megacli.checkpoint.sharding import GATED_SPLIT, split_of
from megacli.checkpoint.source import Source
from megacli.errors import UserError

STAGING_PREFIX = ".megacli-legacy-"
# The linear modules with Transformer Engine extra state (fp8 metadata), as megacli's torch_dist keeps them.
EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")


# ---------------------------------------------------------------- reading


def open_source(source: Source) -> LegacyCheckpoint:
    """A legacy GPT checkpoint to import with its optimizer state."""
    src = LegacyCheckpoint(source, optimizer=True)
    if src.arch != "gpt":
        raise UserError(f"{src.it_dir}: a Megatron-LM {src.arch.upper()} checkpoint; reshard imports legacy GPT "
                        f"checkpoints with their optimizer state. For the weights, use `megacli convert "
                        f"{source.path} DST` (then pretrain/finetune from DST)")
    if (src.it_dir / "distrib_optim.pt").exists() or any(src.it_dir.glob("mp_rank_*/distrib_optim.pt")):
        raise UserError(f"{src.it_dir}: distributed-optimizer state (distrib_optim.pt) is not supported; resume the "
                        f"run in Megatron-LM once with --ckpt-format torch_dist, or without --use-distributed-optimizer")
    return src


def import_to_staging(source: Source, *, where: Path, progress=None) -> Path:
    """Write the legacy checkpoint ``source`` as a megacli torch_dist checkpoint in its own
    layout, in a new staging directory under ``where``; returns the iteration directory."""
    from megacli.checkpoint.torch_dist import write_torch_dist
    from megacli.recipe.base import dump, validate
    from megacli.recipe.pretrain import TrainingRecipe

    src = open_source(source)
    raw = recipe_from_args(src)
    recipe = validate(TrainingRecipe, raw, f"the recipe made from {src.it_dir}'s args")
    where.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=where))
    it_dir = staging / iter_name(src.iteration)
    it_dir.mkdir()

    first_stage = src.stage(0)
    kinds = [k for k in ("fp32_param", "exp_avg", "exp_avg_sq") if any(k in v for n, v in first_stage.items() if not n.startswith("_"))]
    step, groups = first_stage["_step"], first_stage["_groups"]
    tensors = _tensor_entries(src, kinds)  # drops the shards it read, stage 0's included
    objects = _object_entries(src)
    common = _common_state(src, recipe, step=step, groups=groups)
    done = progress("importing", len(tensors) + len(objects)) if progress else (lambda key: None)
    write_torch_dist(it_dir, tensors, objects, common, on_done=done)
    (it_dir / "recipe.yaml").write_text(dump(recipe, carried=True))
    (it_dir / "megacli.json").write_text(json.dumps(_meta(src, recipe, source), indent=2) + "\n")
    return it_dir


def _layer_stacks(src) -> dict[str, list[tuple[int, str]]]:
    """megacli key -> [(layer, canonical key)]: a layer's tensors stacked into one key (layer -1:
    not per layer); each stacked key must be in every layer."""
    stacked: dict[str, list[tuple[int, str]]] = {}
    for k in src.canonical_keys():
        m = LAYER.match(k)
        base = f"decoder.layers.{m.group(2)}" if m else k
        stacked.setdefault(base, []).append((int(m.group(1)) if m else -1, k))
    L = src.num_layers
    for base, members in stacked.items():
        if base.startswith("decoder.layers.") and sorted(l for l, _ in members) != list(range(L)):
            raise UserError(f"{src.it_dir}: {base} is not in all {L} layers")
    return stacked


def _tensor_entries(src, kinds: list[str]) -> list:
    """The weights and the optimizer's ``kinds`` (fp32 copies, moments), one entry per megacli
    key, each read region by region from the legacy shards (one source tensor held at a time)."""
    from megacli.checkpoint.megacli_checkpoint import OPT_PREFIX, target_chunks
    from megacli.checkpoint.torch_dist import TensorEntry

    stacked = _layer_stacks(src)
    L, swiglu = src.num_layers, src.swiglu

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

    tensors = []
    for kind in ["weight"] + kinds:
        for base in stacked:
            one, dtype = probe(base, kind)
            shape = ((L,) if base.startswith("decoder.layers.") else ()) + one
            key = base if kind == "weight" else f"{OPT_PREFIX}{kind}.{base}"
            tensors.append(TensorEntry(key=key, shape=shape, dtype=dtype, region=region_for(base, kind),
                                       chunks=target_chunks(key, shape, tp=src.tp, gated=swiglu), sort_key=stage_key(base)))
    src.forget_stage()
    return tensors


def _object_entries(src) -> list:
    """Sharded objects: TE extra state per layer and linear module (empty here), the RNG state per rank."""
    from megacli.checkpoint.torch_dist import ObjectEntry

    L = src.num_layers
    objects = []
    none_bytes = _saved([None])
    for module in EXTRA_STATE_MODULES:
        for layer in range(L):
            objects.append(ObjectEntry(f"decoder.layers.{module}._extra_state/shard_{layer}_{L}", (lambda b=none_bytes: b)))
    for p in range(src.pp):
        for r in range(src.tp):
            objects.append(ObjectEntry(f"rng_state/shard_{p}.{r}_{src.pp}.{src.tp}", (lambda p=p, r=r: _rng_from_legacy(src, p, r))))
    return objects


def _common_state(src, recipe, *, step, groups) -> dict:
    """The optimizer's step and param groups (and grad scaler) and the scheduler, in samples."""
    common: dict = {}
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
        common["scheduler"] = scale_scheduler(sched, 1 / recipe.train.global_batch_size, f"{src.files[(0, 0)]}")
    return common


def _meta(src, recipe, source: Source) -> dict:
    """megacli.json of the staged checkpoint: iteration, consumed samples, the legacy layout."""
    from megacli.checkpoint.megacli_checkpoint import Layout

    gbs = recipe.train.global_batch_size
    consumed = int(arg(src.args, "consumed_train_samples", src.iteration * gbs) or 0)
    meta = {"iteration": src.iteration, "consumed_samples": consumed,
            "layout": Layout(tensor=src.tp, pipeline=src.pp, virtual_pipeline=src.vp if src.vp > 1 else None,
                             data=recipe.data_parallel_size, context=recipe.parallel.context,
                             first_stage_layers=src.first_stage_layers, last_stage_layers=src.last_stage_layers).as_meta(),
            "format": "torch_dist", "imported_from": {"path": str(source.path.resolve()), "format": "megatron-lm torch"}}
    if not src.has_optimizer:
        meta["has_optimizer"] = False
    return meta


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


def cleanup_staging(path: Path) -> None:
    """Remove an import staging directory (``path`` is its iteration directory); others are left alone."""
    path = Path(path)
    root = path.parent
    if root.name.startswith(STAGING_PREFIX):
        shutil.rmtree(root, ignore_errors=True)
