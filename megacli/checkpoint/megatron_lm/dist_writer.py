"""Megatron-LM torch_dist checkpoints, written: what Megatron-LM core_v0.16.1 ``--load``s with
``--ckpt-format torch_dist`` (see megacli.checkpoint.megatron_lm.dist_reader for the layout).

A megacli torch_dist checkpoint is already Megatron-Core's sharded layout: the model's and the
optimizer's sharded keys are the ones Megatron-LM's GPT model and optimizer ask for (both layer
specs name the norms ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` in
their sharded state dict). What differs is around it:

* ``common.pt`` - Megatron-LM's common state: ``args`` (megacli.checkpoint.megatron_lm.args),
  ``checkpoint_version`` 3.0, ``iteration``, ``opt_param_scheduler`` (steps counted in samples),
  ``num_floating_point_operations_so_far``, the optimizer's non-tensor state and the
  ``content_metadata`` Megatron-LM's loader builds its sharded state dict from;
* RNG state - the same ``rng_state`` object per (pipeline, tensor) rank, holding a list of
  states (megacli's holds the state) with Megatron-LM's field names (``random_rng_state``, ``np_rng_state``, ``torch_rng_state``, ``cuda_rng_state``,
  ``rng_tracker_states``);
* ``_extra_state`` - one object per linear module and layer, which Megatron-LM's strict load
  requires: Transformer Engine's "no FP8 metadata" value (an empty uint8 tensor) for the TE spec,
  plus its norms'; ``None`` for the local spec, as Megatron-Core's own linear layers save;
* ``latest_checkpointed_iteration.txt`` beside ``iter_NNNNNNN/``.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Iterable

import torch

from megacli.checkpoint.layout import TRACKER, iter_name
from megacli.checkpoint.megacli_checkpoint import RNG_KEY
from megacli.checkpoint.megatron_lm.keys import MOE_NORM, fused_prefix
from megacli.checkpoint.safe_pickle import torch_load
from megacli.checkpoint.source import Source
from megacli.checkpoint.torch_dist import ObjectEntry, write_torch_dist
from megacli.errors import UserError

SPECS = ("te", "local")
TRANSFORMER_IMPL = {"te": "transformer_engine", "local": "local"}
CHECKPOINT_VERSION = 3.0
# megacli RNG field -> Megatron-LM's (megatron/training/checkpointing.py get_rng_state).
RNG_FIELDS = {"random": "random_rng_state", "numpy": "np_rng_state", "torch": "torch_rng_state",
              "cuda": "cuda_rng_state", "tracker": "rng_tracker_states"}
_EXTRA_STATE = re.compile(r"^(?P<module>.+)\._extra_state/shard_(?P<offset>[\d.]+)_(?P<shape>[\d.]+)$")
# Transformer Engine norms (TENorm) that carry extra state under the TE spec: final norm, and per layer.
_TE_NORMS = ("decoder.final_layernorm",)
_TE_LAYER_NORMS = ("self_attention.q_layernorm", "self_attention.k_layernorm")
_TE_T5_NORMS = ("encoder.final_layernorm",)
_TE_T5_LAYER_NORM = "pre_cross_attn_layernorm"  # decoder layers'


_MOE_NORM = re.compile(r"(?P<stem>(?:^|\.)layers\.(?:\d+\.)?)" + MOE_NORM + r"\.(?P<kind>weight|bias)\Z")


def stored_key(key: str, spec: str) -> str:
    """The key a tensor of megacli's (model or optimizer state) is stored under for ``spec``.
    Megatron-Core's local spec maps ``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_`` on
    save in every layer, a MoE layer's too (megacli, like the TE spec, keeps that norm's own name)."""
    if spec != "local":
        return key
    return _MOE_NORM.sub(lambda m: f"{m.group('stem')}{fused_prefix(MOE_NORM)}{m.group('kind')}", key)


def _saved(obj) -> bytes:
    """A sharded object's stored bytes: Megatron-Core saves the list of the rank's objects."""
    buf = io.BytesIO()
    torch.save([obj], buf)
    return buf.getvalue()


def extra_state_value(spec: str):
    """What a module's ``_extra_state`` holds when no FP8 metadata was recorded, per spec."""
    return torch.empty(0, dtype=torch.uint8) if spec == "te" else None


def rng_for_megatron_lm(state: dict) -> dict:
    """One rank's RNG state (megacli's field names) with Megatron-LM's names, values as saved (a
    run on the CPU backend has no CUDA generator state: Megatron-LM loads such a checkpoint with
    --no-load-rng, and megacli reads it back exactly)."""
    missing = [k for k in RNG_FIELDS if k not in state]
    if missing:
        raise UserError(f"RNG state without {missing} (not a megacli RNG state)")
    return {RNG_FIELDS[k]: state[k] for k in RNG_FIELDS}


def megatron_objects(objects: Iterable[ObjectEntry], *, spec: str, num_layers: int, qk_layernorm: bool,
                     moe_layers: list[int] | None = None, t5: bool = False,
                     source: Source | None) -> list[ObjectEntry]:
    """The sharded objects of the Megatron-LM checkpoint from megacli's: extra state per spec, RNG
    state renamed, anything else as stored. ``t5``: an encoder-decoder (its encoder's final norm and
    the decoder layers' pre-cross-attention norms are TENorms too). ``moe_layers`` (a MoE model: 1 per MoE layer): the
    layers are keyed one by one (``decoder.layers.N.``), not stacked. ``source``: the checkpoint the
    objects come from (None: a conversion's, made in this process)."""
    if spec not in SPECS:
        raise UserError(f"--spec {spec!r}: expected one of {', '.join(SPECS)}")
    extra = _saved(extra_state_value(spec))
    out: list[ObjectEntry] = []
    for o in objects:
        if _EXTRA_STATE.match(o.key):
            out.append(ObjectEntry(o.key, (lambda: extra), how=f"{spec} extra state"))
        elif RNG_KEY.match(o.key):
            def produce(o=o):
                stored = torch_load(io.BytesIO(o.produce()), trust=source is not None and source.trust, name=o.key)
                if not (isinstance(stored, list) and stored and all(isinstance(s, dict) for s in stored)):
                    raise UserError(f"{o.key}: unexpected RNG state layout ({type(stored).__name__})")
                # Megatron-LM's object is a list of states (one per data-parallel rank with
                # --data-parallel-random-init, else one); megacli's is the state itself.
                return _saved([rng_for_megatron_lm(s) for s in stored])

            out.append(ObjectEntry(o.key, produce, how="RNG state, Megatron-LM field names"))
        else:
            out.append(o)
    if spec == "te":
        have = {o.key for o in out}
        wanted = [f"{m}._extra_state/shard_0_1" for m in _TE_NORMS]
        if moe_layers is not None:
            norms = _TE_LAYER_NORMS if qk_layernorm else ()
            wanted += [f"decoder.layers.{i}.{m}._extra_state/shard_0_1" for i in range(num_layers) for m in norms]
            wanted += [f"decoder.layers.{i}.{MOE_NORM}._extra_state/shard_0_1" for i, moe in enumerate(moe_layers) if moe]
        elif qk_layernorm:
            wanted += [f"decoder.layers.{m}._extra_state/shard_{i}_{num_layers}" for m in _TE_LAYER_NORMS
                       for i in range(num_layers)]
        if t5:
            wanted += [f"{m}._extra_state/shard_0_1" for m in _TE_T5_NORMS]
            wanted += [f"decoder.layers.{_TE_T5_LAYER_NORM}._extra_state/shard_{i}_{num_layers}" for i in range(num_layers)]
        out += [ObjectEntry(k, (lambda: extra), how="te extra state") for k in wanted if k not in have]
    return out


def content_metadata(distributed_optimizer: bool) -> dict:
    """The ``content_metadata`` Megatron-LM saves (its sharded-state-dict flags, no process group)."""
    meta: dict = {}
    if distributed_optimizer:
        meta.update(distrib_optim_sharding_type="fully_reshardable", distrib_optim_fully_reshardable_mem_efficient=False)
    meta.update(singleton_local_shards=False, chained_optim_avoid_prefix=True)
    return meta


def common_state(*, args, iteration: int, optimizer: dict | None, opt_param_scheduler: dict | None,
                 distributed_optimizer: bool, flops: int = 0) -> dict:
    """Megatron-LM's ``common.pt``: what every rank shares."""
    common: dict = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                    "num_floating_point_operations_so_far": flops,
                    "content_metadata": content_metadata(distributed_optimizer)}
    if optimizer is not None:
        common["optimizer"] = optimizer
    if opt_param_scheduler is not None:
        common["opt_param_scheduler"] = opt_param_scheduler
    return common


def write(root: Path, *, iteration: int, tensors, objects, common: dict, progress=None) -> Path:
    """Write ``root/iter_NNNNNNN/`` (torch_dist shards, common.pt, metadata.json) and, last, the
    tracker file. ``root`` must exist; returns the iteration directory."""
    it_dir = root / iter_name(iteration)
    it_dir.mkdir(parents=True)
    done = progress("writing", len(tensors) + len(objects)) if progress else (lambda key: None)
    write_torch_dist(it_dir, tensors, objects, common, on_done=done)
    (root / TRACKER).write_text(str(iteration))
    return it_dir
