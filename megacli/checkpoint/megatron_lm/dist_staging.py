"""Megatron-LM torch_dist checkpoints as the source of `megacli reshard` (and `reshard verify`).

The checkpoint is staged as a megacli checkpoint in its own layout without copying its data: the
staging directory links to its ``.distcp`` files and holds a rewritten DCP ``.metadata`` (model
keys under megacli's canonical names, the layout-free optimizer state kept), a megacli
``common.pt`` (optimizer param groups; the scheduler in iterations), ``recipe.yaml`` (from the run's
args) and ``megacli.json``. The reshard then reads it like any other. A MoE model whose layers are
stacked under one key (--moe-layer-freq 1) is staged with each layer under its own key, as megacli
keys its MoE models. The modules' ``_extra_state`` objects (Megatron-Core's model asks for them
when it loads, both layer specs) are kept, under the per-layer keys in that case.

The RNG state is carried (megacli's field names; data-parallel rank 0's where Megatron-LM kept one
per data-parallel rank) and remapped like a megacli checkpoint's. Not carried: distributed-optimizer
state in Megatron-LM's default ``dp_reshardable`` format (laid out by the saving run's gradient
buckets, readable only under its own tensor/pipeline layout: resume it in place with
checkpoint.resume, or reshard its weights).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import torch

from megacli.checkpoint.files import staged
from megacli.checkpoint.layout import META, RECIPE, iter_name
from megacli.checkpoint.megatron_lm.args import arg
from megacli.checkpoint.megatron_lm.args_to_recipe import scale_scheduler
from megacli.checkpoint.megacli_checkpoint import OPT_PREFIX, split_optimizer_key
from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint, canonical_key
from megacli.checkpoint.megatron_lm.dist_writer import RNG_FIELDS
from megacli.checkpoint.safe_pickle import DCP_METADATA
from megacli.checkpoint.torch_dist import BACKEND_META, STACKED, is_extra_state
from megacli.errors import UserError
from megacli.checkpoint.megatron_lm.legacy_staging import STAGING_PREFIX
from megacli.checkpoint.source import Source

_STACKED_OBJECT = re.compile(r"^(?P<head>(?:.+\.)?layers\.)(?P<module>(?!\d)[^/]+)/shard_(?P<offsets>[\d.]+)_(?P<shape>[\d.]+)$")


def _object_per_layer(key: str) -> str:
    """A layer-stacked sharded object's key under its own layer, as a model keyed per layer names
    it: ``decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.3_2.4`` (layer 1,
    expert 3) -> ``decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state/shard_3_4``."""
    m = _STACKED_OBJECT.match(key)
    if m is None:
        return key
    layer, *offsets = m["offsets"].split(".")
    _, *shape = m["shape"].split(".")
    return f"{m['head']}{layer}.{m['module']}/shard_{'.'.join(offsets) or '0'}_{'.'.join(shape) or '1'}"


_RNG_FILE = "rng.distcp"  # the staged RNG objects, in megacli's format (the only file not linked)
_MLM_RNG_KEY = re.compile(r"^rng_state/shard_(\d+)\.(\d+)(?:\.(\d+))?_(\d+)\.(\d+)(?:\.\d+)?$")


def _rng_objects(src: MegatronLMCheckpoint, notes: list[str]) -> dict[str, bytes]:
    """megacli's RNG objects (``rng_state/shard_{pp}.{tp}_{PP}.{TP}``: [state], megacli's field names)
    from Megatron-LM's (the same keys, or with a data-parallel rank under expert parallelism: [[state
    per data-parallel rank]], Megatron-LM's field names). megacli keeps one state per (pipeline,
    tensor) rank: data-parallel rank 0's."""
    found: dict[tuple[int, int], str] = {}
    for key in src.reader.objects:
        m = _MLM_RNG_KEY.match(key)
        if m and int(m.group(3) or 0) == 0:
            found[int(m.group(1)), int(m.group(2))] = key
    if not found:
        return {}
    if set(found) != {(p, t) for p in range(src.pp) for t in range(src.tp)}:
        notes.append(f"RNG state not carried: it is stored for ranks {sorted(found)}, not the saved layout's "
                     f"{src.pp}×{src.tp} (PP×TP) grid; the resharded run re-seeds")
        return {}
    names = {v: k for k, v in RNG_FIELDS.items()}
    out, per_dp = {}, False
    for (p, t), key in sorted(found.items()):
        stored = src.reader.read_object(key)
        states = stored[0] if isinstance(stored, list) and len(stored) == 1 else None
        if not (isinstance(states, list) and states and isinstance(states[0], dict)
                and set(names) <= set(states[0])):
            notes.append(f"RNG state not carried: {key} is not in Megatron-LM's layout; the resharded run re-seeds")
            return {}
        per_dp |= len(states) > 1
        buf = io.BytesIO()
        torch.save([{names[k]: v for k, v in states[0].items() if k in names}], buf)
        out[f"rng_state/shard_{p}.{t}_{src.pp}.{src.tp}"] = buf.getvalue()
    if per_dp:
        notes.append("RNG state: Megatron-LM saved one per data-parallel rank (--data-parallel-random-init); "
                     "megacli keeps data-parallel rank 0's for every rank")
    return out


def _add_objects(meta, objects: dict[str, bytes], path: Path) -> None:
    """Write ``objects`` (key: stored bytes) into the one file ``path`` and list them in ``meta``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    if not objects:
        return
    offset = 0
    with open(path, "wb") as f:
        for key, data in objects.items():
            f.write(data)
            meta.state_dict_metadata[key] = BytesStorageMetadata()
            meta.storage_data[MetadataIndex(key)] = _StorageInfo(path.name, offset, len(data))
            offset += len(data)
    if getattr(meta, "planner_data", None):
        meta.planner_data.update({key: (key,) for key in objects})


def _layers_apart(meta, where: Path) -> None:
    """Key each layer of the layer-stacked tensors on its own (``decoder.layers.mlp.router.weight``
    [L, ...] -> ``decoder.layers.N.mlp.router.weight``), as megacli's MoE models are keyed. Megatron-Core
    saves each layer of a stacked tensor as its own chunks (size 1 along the layer axis), so each chunk
    is relabelled, not copied; the reader drops the stored chunk's leading axis of 1."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    stacked = {k: md for k, md in meta.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata) and STACKED.search(split_optimizer_key(k)[1])}
    per_layer: dict[str, TensorStorageMetadata] = {}
    names: dict[tuple[str, int], str] = {}
    for key, md in stacked.items():
        _, base = split_optimizer_key(key)
        at = len(key) - len(base) + STACKED.search(base).end()  # just after "layers."
        for chunk in md.chunks:
            if chunk.sizes[0] != 1:
                raise UserError(f"{where}: {key} has a chunk spanning layers {chunk.offsets[0]}-"
                                f"{chunk.offsets[0] + chunk.sizes[0] - 1}; Megatron-Core stores one chunk per layer")
            name = names[key, chunk.offsets[0]] = f"{key[:at]}{chunk.offsets[0]}.{key[at:]}"
            layer = per_layer.setdefault(name, TensorStorageMetadata(md.properties, torch.Size(md.size[1:]), []))
            layer.chunks.append(ChunkStorageMetadata(torch.Size(chunk.offsets[1:]), torch.Size(chunk.sizes[1:])))
    meta.state_dict_metadata = {**{k: v for k, v in meta.state_dict_metadata.items() if k not in stacked}, **per_layer}
    storage = {}
    for idx, info in meta.storage_data.items():
        if idx.fqn in stacked:
            idx = MetadataIndex(names[idx.fqn, idx.offset[0]], idx.offset[1:])
        storage[idx] = info
    meta.storage_data = storage
    if getattr(meta, "planner_data", None):
        meta.planner_data = {k: v for k, v in meta.planner_data.items() if k not in stacked}
        meta.planner_data.update({name: (name,) for name in per_layer})


def import_to_staging(source: Source, *, where: Path) -> tuple[Path, list[str]]:
    """Stage the Megatron-LM checkpoint ``source`` under ``where``; returns (the staged iteration
    directory, notes on what was left out)."""
    from megacli.recipe.base import dump, validate
    from megacli.recipe.pretrain import TrainingRecipe

    src = MegatronLMCheckpoint(source)
    raw = src.recipe()
    if raw is None:
        raise UserError(f"{source.path}: " + "; ".join(src.unmapped()))
    notes = []
    opt_common = src.common.get("optimizer")
    sharding = (opt_common or {}).get("param_state_sharding_type") if isinstance(opt_common, dict) else None
    keep_optimizer = isinstance(opt_common, dict) and sharding in (None, "fully_reshardable")
    if isinstance(opt_common, dict) and not keep_optimizer:
        notes.append(f"optimizer state not carried: Megatron-LM's {sharding!r} distributed-optimizer format loads only "
                     f"under the layout that saved it (resume it there with checkpoint.resume, or save it with "
                     f"--dist-ckpt-optim-fully-reshardable); the output holds the weights")
    raw["parallel"]["distributed_optimizer"] = keep_optimizer and sharding is not None
    recipe = validate(TrainingRecipe, raw, f"the recipe made from {src.it_dir}'s args")

    stored = set(src.reader.tensors)
    renames = {stored_key: name for name, stored_key in src.model_keys.items()}
    if keep_optimizer:
        for key in stored:
            state, base = split_optimizer_key(key)
            if state is not None and key.startswith(OPT_PREFIX):
                name = canonical_key(base, stored)
                if name is not None:
                    renames[key] = f"{OPT_PREFIX}{state}.{name}"
    for key in src.reader.objects:
        if is_extra_state(key):
            renames[key] = _object_per_layer(key) if src.moe_layers_stacked else key
    rng = _rng_objects(src, notes)

    where.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=where))
    it_dir = staged(staging / iter_name(src.iteration))
    it_dir.mkdir()
    meta = copy.copy(src.reader.metadata)  # read with the checked unpickler
    meta.state_dict_metadata = {renames[k]: v for k, v in meta.state_dict_metadata.items() if k in renames}
    meta.storage_data = {dataclasses.replace(idx, fqn=renames[idx.fqn]): v
                         for idx, v in meta.storage_data.items() if idx.fqn in renames}
    if getattr(meta, "planner_data", None):
        meta.planner_data = {renames[k]: v for k, v in meta.planner_data.items() if k in renames}
    if src.moe_layers_stacked:
        _layers_apart(meta, src.it_dir)
    _add_objects(meta, rng, it_dir / _RNG_FILE)
    with open(it_dir / DCP_METADATA, "wb") as f:
        pickle.dump(meta, f)
    for file in {v.relative_path for v in meta.storage_data.values()} - {_RNG_FILE}:
        os.symlink((src.it_dir / file).resolve(), it_dir / file)

    common = {}
    if keep_optimizer:
        common["optimizer"] = opt_common
        sched = src.common.get("opt_param_scheduler")
        if isinstance(sched, dict):
            common["scheduler"] = scale_scheduler(sched, 1 / int(arg(src.args, "global_batch_size", 1) or 1),
                                                  src.common_where)
    torch.save(common, it_dir / "common.pt")
    shutil.copyfile(src.it_dir / BACKEND_META, it_dir / BACKEND_META)
    (it_dir / RECIPE).write_text(dump(recipe, carried=True))
    dp = int(arg(src.args, "data_parallel_size", 1) or 1)
    layout = {"tensor": src.tp, "pipeline": src.pp, "virtual_pipeline": src.vp if src.vp > 1 else None, "data": dp,
              "context": int(arg(src.args, "context_parallel_size", 1) or 1)}
    for key, given in (("first_stage_layers", src.first_stage_layers), ("last_stage_layers", src.last_stage_layers)):
        if given is not None:
            layout[key] = given
    consumed = arg(src.args, "consumed_train_samples")
    (it_dir / META).write_text(json.dumps({
        "iteration": src.iteration, "format": "torch_dist", "layout": layout,
        "consumed_samples": int(consumed if consumed is not None else src.iteration * recipe.train.global_batch_size),
        "has_optimizer": keep_optimizer, "has_rng_state": bool(rng)}, indent=2) + "\n")
    return it_dir, notes
