"""What a checkpoint holds, in every format megacli reads (a megacli torch_dist checkpoint, a
Megatron-LM legacy one), from its metadata and headers: `megacli reshard inspect` (global tensors,
layout, recipe) and `megacli convert --print-structure` (keys, shapes and dtypes as stored)."""

from __future__ import annotations

import math
import re
from typing import Iterator

import torch

from megacli.checkpoint.layout import read_meta
from megacli.checkpoint.megatron_lm.legacy_reader import LAYER, LegacyCheckpoint, flatten
from megacli.checkpoint.megatron_lm.args import arg
from megacli.checkpoint.megatron_lm.args_to_recipe import recipe_from_args
from megacli.checkpoint.megacli_checkpoint import RNG_KEY, Checkpoint, describe_split, split_optimizer_key
from megacli.checkpoint.sharding import GATED_SPLIT, split_of
from megacli.checkpoint.source import Source, locate
from megacli.checkpoint.torch_dist import TorchDistReader


def inspect(source: Source) -> dict:
    """Format, layout, iteration, recipe and a row per tensor (global shape, dtype, split)."""
    src, kind = locate(source.path)
    if kind == "legacy":
        return _inspect_legacy(source.at(src))
    if kind == "megatron-lm":
        from megacli.checkpoint.megatron_lm.dist_contents import inspect_megatron_lm

        return inspect_megatron_lm(source.at(src))
    ck = Checkpoint(source.at(src))
    meta = ck.meta
    tensors = []
    total = 0
    for key, info in ck.reader.tensors.items():
        state, base = split_optimizer_key(key)
        tensors.append({
            "name": key,
            "kind": "optimizer" if state else "model",
            "shape": list(info.shape),
            "dtype": str(info.dtype).replace("torch.", ""),
            "bytes": info.nbytes,
            "chunks": len(info.chunks),
            "split": describe_split(info),
        })
        total += info.nbytes
    rng = sorted(k for k in ck.reader.objects if RNG_KEY.match(k))
    other = sorted(k for k in ck.reader.objects if not RNG_KEY.match(k))
    common = ck.common
    sched = common.get("scheduler") or {}
    recipe = ck.recipe_raw
    return {
        "path": str(src),
        "format": meta.get("format", "torch_dist"),
        "iteration": meta.get("iteration"),
        "consumed_samples": meta.get("consumed_samples"),
        "layout": ck.layout.as_meta(),
        "layout_text": str(ck.layout),
        "world_size": ck.layout.world_size,
        "optimizer": ck.optimizer_kind,
        "has_rng_state": bool(rng),
        "scheduler_steps": sched.get("num_steps"),
        "resharded_from": meta.get("resharded_from"),
        "recipe": recipe,
        "tensors": tensors,
        "total_bytes": total,
        "objects": {"rng_state": rng, "other": other},
        "files": [p.name for p in ck.reader.files()],
    }


def _inspect_legacy(source: Source) -> dict:
    """inspect's answer for a legacy checkpoint (global shapes from the shards' shapes; nothing merged)."""
    src = LegacyCheckpoint(source, optimizer=True)
    rows: dict[str, dict] = {}
    total = 0
    for p in range(src.pp):
        stage = src.stage(p)
        for name, kinds in stage.items():
            if name.startswith("_"):
                continue
            m = LAYER.match(name)
            base = f"{name.split('.layers.', 1)[0]}.layers.{m.group(2)}" if m else name
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
        "path": str(source.path), "format": "megatron-lm legacy (torch)", "iteration": src.iteration,
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


def structure(source: Source) -> Iterator[str]:
    """Lines for `--print-structure`: a header, then each stored tensor's key, shape and dtype (a
    megacli checkpoint's global shapes, layers stacked; a legacy checkpoint's per rank file)."""
    src, kind = locate(source.path)
    if kind == "megatron-lm":
        from megacli.checkpoint.megatron_lm.dist_contents import structure_megatron_lm

        header, rows = structure_megatron_lm(source.at(src))
        yield header
        for key, shape, dtype in rows:
            yield row(key, shape, dtype)
        return
    if kind == "megacli":
        meta = read_meta(src)
        reader = TorchDistReader(source.at(src))
        yield (f"megacli checkpoint {src}: iteration {meta.get('iteration')}, saved under {meta.get('layout')}, "
               f"optimizer state: {'yes' if meta.get('has_optimizer', True) else 'no'}; global shapes "
               f"(layers stacked along the first axis)")
        for key, info in sorted(reader.tensors.items()):
            yield row(key, info.shape, info.dtype)
        return
    legacy = LegacyCheckpoint(source.at(src))
    a = legacy.args
    yield (f"Megatron-LM legacy checkpoint {legacy.it_dir}: iteration {legacy.iteration}, TP={legacy.tp} PP={legacy.pp} "
           f"VPP={legacy.vp}; {a.num_layers} layers, hidden {a.hidden_size}, {a.num_attention_heads} heads; "
           f"per-rank shapes")
    for (_, _), f in sorted(legacy.files.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        state = legacy.first if f == legacy.files[(0, 0)] else legacy.read(f)
        yield f"{f.relative_to(legacy.root)}:"
        for chunk_key in [k for k in state if k == "model" or re.fullmatch(r"model\d+", k)]:
            for key, t in flatten(state[chunk_key]).items():
                if isinstance(t, torch.Tensor):
                    yield row(f"{chunk_key}.{key}", t.shape, t.dtype)


def row(key: str, shape, dtype) -> str:
    return f"  {key}  {list(shape)}  {str(dtype).replace('torch.', '')}"
