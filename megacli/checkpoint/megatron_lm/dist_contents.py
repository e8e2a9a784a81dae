"""What a Megatron-LM torch_dist checkpoint holds, for `megacli reshard inspect` and
`megacli convert --print-structure`: its tensors as stored and the megacli recipe its args map to."""

from __future__ import annotations


from megacli.checkpoint.megatron_lm.args import arg
from megacli.checkpoint.megacli_checkpoint import describe_split
from megacli.checkpoint.megatron_lm.dist_reader import FORMAT, MegatronLMCheckpoint
from megacli.checkpoint.source import Source


def inspect_megatron_lm(source: Source) -> dict:
    """inspect's answer (see megacli.checkpoint.contents.inspect) plus ``not_mapped``: what of the
    run's args the recipe does not carry."""
    src = MegatronLMCheckpoint(source)
    reader = src.reader
    tensors, total = [], 0
    for key, info in reader.tensors.items():
        tensors.append({"name": key, "kind": "optimizer" if key.startswith("optimizer") else "model",
                        "shape": list(info.shape), "dtype": str(info.dtype).replace("torch.", ""), "bytes": info.nbytes,
                        "chunks": len(info.chunks), "split": describe_split(info)})
        total += info.nbytes
    rng = sorted(k for k in reader.objects if k.startswith("rng_state"))
    other = sorted(k for k in reader.objects if not k.startswith("rng_state"))
    args = src.args
    dp = int(arg(args, "data_parallel_size", 1))
    has_optimizer = any(t["kind"] == "optimizer" for t in tensors) or any(k.startswith("optimizer") for k in other)
    return {
        "path": str(source.path), "format": FORMAT, "iteration": src.iteration,
        "consumed_samples": arg(args, "consumed_train_samples"),
        "layout": {"tensor": src.tp, "pipeline": src.pp, "virtual_pipeline": src.vp if src.vp > 1 else None,
                   "data": dp, "context": int(arg(args, "context_parallel_size", 1))},
        "layout_text": f"TP {src.tp} × PP {src.pp}" + (f" (VP {src.vp})" if src.vp > 1 else "") + f" × DP {dp}",
        "world_size": int(arg(args, "world_size", src.tp * src.pp * dp)),
        "optimizer": ("distributed" if arg(args, "use_distributed_optimizer", False) else "standard") if has_optimizer else None,
        "optimizer_format": ((src.common.get("optimizer") or {}).get("param_state_sharding_type")
                             if isinstance(src.common.get("optimizer"), dict) else None),
        "has_rng_state": bool(rng), "scheduler_steps": _scheduler_iterations(src),
        "resharded_from": None, "recipe": src.recipe(), "not_mapped": src.not_mapped(),
        "tensors": tensors, "total_bytes": total, "objects": {"rng_state": rng, "other": other},
        "files": [p.name for p in reader.files()],
    }


def structure_megatron_lm(source: Source) -> tuple[str, list[tuple]]:
    """`--print-structure`: a header, and each stored tensor's (key, global shape, dtype), layers stacked."""
    src = MegatronLMCheckpoint(source)
    a = src.args
    header = (f"Megatron-LM torch_dist checkpoint {src.it_dir}: iteration {src.iteration}, saved under TP={src.tp} "
              f"PP={src.pp}; {a.num_layers} layers, hidden {a.hidden_size}, {a.num_attention_heads} heads; global shapes "
              f"(layers stacked along the first axis)")
    return header, [(key, info.shape, info.dtype) for key, info in sorted(src.reader.tensors.items())]


def _scheduler_iterations(src: MegatronLMCheckpoint) -> int | None:
    """The scheduler's step in iterations (Megatron-LM counts samples)."""
    steps = (src.common.get("opt_param_scheduler") or {}).get("num_steps")
    gbs = int(arg(src.args, "global_batch_size", 0) or 0)
    return None if steps is None else steps // gbs if gbs else steps
