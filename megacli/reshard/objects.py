"""A reshard's sharded objects: the RNG state per (pipeline, tensor) rank, remapped to the new
layout, and every other object copied as stored."""

from __future__ import annotations

import io

import torch

from megacli.checkpoint.megacli_checkpoint import RNG_KEY
from megacli.checkpoint.torch_dist import ObjectEntry, TorchDistReader
from megacli.errors import UserError

# Megatron's RNG tracker streams that are seeded per tensor-parallel rank (tensor_parallel/random.py).
_PER_TP_STREAMS = {"model-parallel-rng": 2718, "expert-parallel-rng": 1024}


def plan_objects(src, target, recipe, notes: list[str]) -> list[ObjectEntry]:
    """The sharded objects of ``target`` (a plan.Target) from ``src`` (a Checkpoint): the RNG
    state per (pipeline, tensor) rank, the rest copied."""
    reader = src.reader
    rng = src.rng_objects
    out = [ObjectEntry(k, (lambda k=k: reader.read_object_bytes(k))) for k in reader.objects if not RNG_KEY.match(k)]
    if not rng:
        return out
    s, t = src.layout, target.layout
    grid_src = {(p, r) for p in range(s.pipeline) for r in range(s.tensor)}
    if set(rng) != grid_src:
        raise UserError(f"{src.path}: RNG state for ranks {sorted(rng)} does not match the recorded layout {s}")
    if (s.pipeline, s.tensor) == (t.pipeline, t.tensor) and s.vp == t.vp:
        out += [ObjectEntry(k, (lambda k=k: reader.read_object_bytes(k))) for k in rng.values()]
        return out
    num_layers = recipe.model.num_layers
    seed = recipe.train.seed
    notes.append(f"RNG state: {s.pipeline}×{s.tensor} → {t.pipeline}×{t.tensor} (PP×TP) ranks; each stage takes the "
                 f"generators of the source stage that held its first layer, tensor-parallel streams by TP rank "
                 f"(seeded afresh for new TP ranks)")
    for p in range(t.pipeline):
        sp = s.stage_of_layer(t.first_layer_of_stage(p, num_layers), num_layers)
        for r in range(t.tensor):
            key = f"rng_state/shard_{p}.{r}_{t.pipeline}.{t.tensor}"
            out.append(ObjectEntry(key, (lambda sp=sp, r=r: _rng_bytes(reader, rng, sp, r, s.tensor, seed)),
                                   how=f"from PP {sp} · TP {r if r < s.tensor else 'new'}"))
    return out


def _rng_bytes(reader: TorchDistReader, rng: dict, src_stage: int, tp_rank: int, src_tp: int, seed: int) -> bytes:
    base = reader.read_object(rng[(src_stage, 0)])
    if not (isinstance(base, list) and len(base) == 1 and isinstance(base[0], dict)):
        raise UserError(f"{reader.path}: unexpected RNG state object layout ({type(base).__name__})")
    state = dict(base[0])
    tracker = dict(state.get("tracker") or {})
    if tp_rank < src_tp:
        same = reader.read_object(rng[(src_stage, tp_rank)])[0].get("tracker") or {}
        for name in _PER_TP_STREAMS:
            if name in same:
                tracker[name] = same[name]
    else:
        for name, offset in _PER_TP_STREAMS.items():
            if name in tracker:
                tracker[name] = _seeded_state(tracker[name], seed + offset + tp_rank)
    state["tracker"] = tracker
    buf = io.BytesIO()
    torch.save([state], buf)
    return buf.getvalue()


def _seeded_state(like: torch.Tensor, seed: int) -> torch.Tensor:
    """A generator state for ``seed`` in the format of ``like`` (CPU Mersenne Twister, or CUDA Philox
    seed + offset), as Megatron's model_parallel_cuda_manual_seed would set it."""
    cpu = torch.Generator().get_state()
    if like.numel() == cpu.numel():
        return torch.Generator().manual_seed(seed).get_state()
    if like.numel() == 16:
        return torch.tensor([seed, 0], dtype=torch.int64).view(torch.uint8).clone()
    raise UserError(f"unknown RNG state format ({like.numel()} bytes); cannot seed a new tensor-parallel rank")
