"""`megacli reshard inspect`: what a checkpoint holds, from its metadata (no tensor data is read)."""

from __future__ import annotations

import math
from pathlib import Path

from megacli.checkpoint.legacy import LAYER
from megacli.checkpoint.legacy_args import arg, recipe_from_args
from megacli.checkpoint.sharding import GATED_SPLIT, split_of
from megacli.errors import UserError


def inspect_checkpoint(path: str | Path, *, trust_pickle: bool = False) -> dict:
    """Format, layout, iteration, recipe and a row per tensor (global shape, dtype, split)."""
    from megacli.checkpoint.layout import locate
    from megacli.reshard.plan import (
        RNG_KEY,
        Checkpoint,
        describe_split,
        split_optimizer_key,
    )

    src, kind = locate(path)
    if kind == "legacy":
        return _inspect_legacy(src, trust_pickle=trust_pickle)
    ck = Checkpoint(src, trust_pickle=trust_pickle)
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


def render(info: dict, console) -> None:
    from rich.table import Table

    from megacli.reshard.core import _size
    from megacli.reshard.plan import split_optimizer_key

    m = (info.get("recipe") or {}).get("model") or {}
    t = (info.get("recipe") or {}).get("train") or {}
    p = (info.get("recipe") or {}).get("parallel") or {}
    head = Table(title=f"checkpoint {info['path']}", show_header=False, title_justify="left")
    head.add_row("format", info["format"])
    head.add_row("layout", f"{info['layout_text']}  (world size {info['world_size']})")
    head.add_row("iteration", f"{info['iteration']}  ({info['consumed_samples']} samples consumed)")
    opt = {"distributed": "distributed optimizer (fully_reshardable)", "standard": "standard optimizer",
           None: "none (weights only)"}[info["optimizer"]]
    head.add_row("optimizer state", opt + (f", scheduler at step {info['scheduler_steps']}" if info.get("scheduler_steps") is not None else ""))
    rng = info["objects"]["rng_state"]
    head.add_row("RNG state", f"{len(rng)} rank(s)" if rng else "none")
    if m:
        head.add_row("model", f"{m.get('arch', 'gpt')}: {m.get('num_layers')} layers, hidden {m.get('hidden_size')}, "
                     f"{m.get('num_attention_heads')} heads, ffn {m.get('ffn_hidden_size')}, {m.get('activation')}, "
                     f"seq {m.get('seq_length')}")
    if t:
        head.add_row("training", f"precision {t.get('precision')}, global batch {t.get('global_batch_size')}, "
                     f"micro batch {t.get('micro_batch_size')}, {t.get('iters')} iters"
                     + (", sequence parallel" if p.get("sequence_parallel") else ""))
    if info.get("resharded_from"):
        rf = info["resharded_from"]
        head.add_row("resharded from", f"{rf.get('path')} ({_layout_text(rf.get('layout') or {})})")
    head.add_row("files", f"{len(info['files'])} shard file(s), {_size(info['total_bytes'])} of tensors")
    console.print(head)

    # One row per model tensor; its optimizer state (same global shape and split) in a column.
    rows = [r for r in info["tensors"] if r["kind"] == "model"]
    by_name = {r["name"]: r for r in rows}
    states: dict[str, list[str]] = {}
    extra = []
    for r in info["tensors"]:
        if r["kind"] != "optimizer":
            continue
        state, base = split_optimizer_key(r["name"])
        model = by_name.get(base)
        if model is None or model["shape"] != r["shape"] or model["split"] != r["split"]:
            extra.append(r)
            continue
        states.setdefault(base, []).append(state if r["dtype"] == model["dtype"] else f"{state} ({r['dtype']})")
    order = {"param": 0, "fp32_param": 1, "exp_avg": 2, "exp_avg_sq": 3}
    for names in states.values():
        names.sort(key=lambda n: (order.get(n.split(" ")[0], 9), n))
    n_opt = sum(1 for r in info["tensors"] if r["kind"] == "optimizer")
    table = Table(title=f"{len(rows)} model tensors, {n_opt} optimizer-state tensors (global shapes)", title_justify="left")
    table.add_column("tensor", overflow="fold", ratio=3)
    table.add_column("shape", justify="right", no_wrap=True)
    table.add_column("dtype", no_wrap=True)
    table.add_column("stored as", ratio=1)
    table.add_column("optimizer state", ratio=1)
    table.add_column("size", justify="right", no_wrap=True)
    for r in rows + extra:
        opt_size = sum(x["bytes"] for x in info["tensors"] if x["kind"] == "optimizer" and split_optimizer_key(x["name"])[1] == r["name"]
                       and x not in extra) if r["kind"] == "model" else 0
        table.add_row(r["name"], "×".join(map(str, r["shape"])) or "()", r["dtype"],
                      f"{r['chunks']} chunk{'s' if r['chunks'] != 1 else ''}: {r['split']}",
                      ", ".join(states.get(r["name"], [])) or ("-" if r["kind"] == "model" else "(optimizer)"),
                      _size(r["bytes"] + opt_size))
    console.print(table)
    other = info["objects"]["other"]
    if other:
        console.print(f"{len(other)} other sharded object(s) (per-layer extra state), copied as stored", highlight=False)


def _layout_text(layout: dict) -> str:
    from megacli.reshard.plan import Layout

    try:
        return str(Layout.from_meta(layout))
    except (TypeError, ValueError):
        raise UserError(f"unreadable layout {layout!r}") from None


def _inspect_legacy(path: Path, *, trust_pickle: bool = False) -> dict:
    from megacli.reshard.legacy import open_source

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
