"""Continuing a Megatron-LM torch_dist checkpoint (checkpoint.resume, or its weights for
checkpoint.pretrained) in the built model chunks, optimizer and scheduler.

What Megatron-LM core_v0.16.1's megatron/training/checkpointing.py saves, and where it goes:

    model / model0..     the chunks' sharded state dict (local-spec norm names renamed on read;
                         a MoE model's layers stacked under one key where it stored them so)
    optimizer            Megatron-Core's optimizer sharded state dict, built with the checkpoint's
                         content metadata (``distrib_optim_sharding_type``: dp_reshardable, its
                         default, or fully_reshardable / fully_sharded_model_space; none for the
                         plain optimizer), as its load_checkpoint does
    opt_param_scheduler  counted in samples: the step fields divided by args.global_batch_size
    iteration, args.consumed_train_samples
    rng_state            [ {random_rng_state, np_rng_state, torch_rng_state, cuda_rng_state,
                         rng_tracker_states} ] per (pipeline, tensor) rank (and data rank with
                         expert parallelism): restored when the layout is the saved one
"""

from __future__ import annotations

from contextlib import contextmanager

from megacli.checkpoint.megatron_lm.args import arg
from megacli.checkpoint.megatron_lm.args_to_recipe import scale_scheduler
from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint
from megacli.checkpoint.source import Source
from megacli.errors import UserError

# Megatron-LM's sharding types that a different tensor/pipeline layout can read.
_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space", "fully_sharded_bucket_space")
# scheduler field -> the recipe field that sets it (for the mismatch message).
_SCHED_FIELDS = {"max_lr": "optim.lr", "min_lr": "optim.min_lr", "lr_warmup_steps": "optim.warmup_iters",
                 "lr_decay_steps": "optim.decay_iters (else train.iters)", "lr_decay_style": "optim.decay_style",
                 "start_wd": "optim.weight_decay", "end_wd": "optim.weight_decay",
                 "wd_incr_steps": "optim.decay_iters (else train.iters)", "wd_incr_style": "weight decay increment style"}


def _walk(tree, fn) -> None:
    """Call ``fn`` on every sharded entry (tensor, factory, object) of a nested state dict."""
    if isinstance(tree, dict):
        for v in tree.values():
            _walk(v, fn)
    elif isinstance(tree, list):
        for v in tree:
            _walk(v, fn)
    elif hasattr(tree, "key"):
        fn(tree)


def _rename_to_stored(state: dict, src: MegatronLMCheckpoint) -> None:
    """Point the model's sharded entries at the checkpoint's key names (the local spec's unfused norms);
    the optimizer's entries, built from these, follow."""
    renames = {name: stored for name, stored in src.model_keys.items() if name != stored}

    def rename(entry) -> None:
        if entry.key in renames:
            entry.key = renames[entry.key]

    if renames:
        _walk(state, rename)


@contextmanager
def _layers_stacked(chunks, stacked: bool):
    """While on, the chunks' sharded state dicts stack the transformer layers under one key, as
    Megatron-Core does for a MoE model whose config has an integer ``moe_layer_freq`` (every layer
    MoE); megacli builds such a model with the per-layer list, which keys each layer on its own.
    Same model, same weights: only the checkpoint keys differ."""
    if not stacked:
        yield
        return
    configs = {id(c): c for c in (getattr(m, "config", None) for ch in chunks for m in ch.modules())
               if c is not None and isinstance(getattr(c, "moe_layer_freq", None), list)}
    saved = {k: c.moe_layer_freq for k, c in configs.items()}
    for c in configs.values():
        if not all(c.moe_layer_freq):
            raise UserError("the checkpoint stacks its MoE layers under one key (every layer MoE), but this "
                            f"model has dense layers (model.moe.layer_freq {c.moe_layer_freq}); use the run's "
                            "layer_freq (`megacli reshard inspect` shows it)")
        c.moe_layer_freq = 1
    try:
        yield
    finally:
        for k, c in configs.items():
            c.moe_layer_freq = saved[k]


def has_optimizer_state(src: MegatronLMCheckpoint) -> bool:
    return any(k.startswith("optimizer") for k in (*src.reader.tensors, *src.reader.objects))


def _layout_now() -> dict:
    from megatron.core import parallel_state as ps

    return {"tensor": ps.get_tensor_model_parallel_world_size(), "pipeline": ps.get_pipeline_model_parallel_world_size(),
            "data": ps.get_data_parallel_world_size(), "expert": ps.get_expert_model_parallel_world_size()}


def _sharding_type(src: MegatronLMCheckpoint) -> str | None:
    """The distributed optimizer's checkpoint format (None for the plain optimizer's)."""
    if not arg(src.args, "use_distributed_optimizer", False):
        return None
    meta = src.common.get("content_metadata") or {}
    if "distrib_optim_sharding_type" in meta:
        return meta["distrib_optim_sharding_type"]
    # A checkpoint from before Megatron-Core 0.13 (no content metadata), as Megatron-LM's load_checkpoint reads it.
    return "fully_sharded_model_space" if arg(src.args, "ckpt_fully_parallel_save", False) else "dp_zero_gather_scatter"


def _optimizer_metadata(src: MegatronLMCheckpoint) -> dict:
    from megatron.core import parallel_state as ps

    meta = {k: v for k, v in (src.common.get("content_metadata") or {}).items()}
    kind = _sharding_type(src)
    if kind is not None:
        meta["distrib_optim_sharding_type"] = kind
    meta["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return meta


def _check_optimizer(src: MegatronLMCheckpoint, optimizer) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    saved = bool(arg(src.args, "use_distributed_optimizer", False))
    running = any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))
    kind = {True: "distributed", False: "standard"}
    if saved != running:
        raise UserError(f"{src.it_dir} holds the {kind[saved]} optimizer's state (use_distributed_optimizer="
                        f"{saved}) but this run uses the {kind[running]} one: set parallel.distributed_optimizer="
                        f"{str(saved).lower()}, or checkpoint.load_optimizer=false to load the weights only")
    sharding = _sharding_type(src)
    if sharding is not None and sharding not in (*_RESHARDABLE, "dp_reshardable"):
        raise UserError(f"{src.it_dir}: distributed-optimizer state in Megatron-LM's {sharding!r} format is not "
                        f"supported (dp_reshardable and fully_reshardable are); set checkpoint.load_optimizer=false "
                        f"to load the weights only")
    now = _layout_now()
    if sharding == "dp_reshardable" and (now["tensor"], now["pipeline"]) != (src.tp, src.pp):
        raise UserError(f"{src.it_dir}: its distributed-optimizer state is dp_reshardable (Megatron-LM's default): it "
                        f"loads only under the tensor/pipeline layout it was saved with, parallel.tensor={src.tp} and "
                        f"parallel.pipeline={src.pp} (this run: {now['tensor']} and {now['pipeline']}). Resume with "
                        f"those, or set checkpoint.load_optimizer=false to load the weights only")


def _scheduler_state(src: MegatronLMCheckpoint, scheduler) -> dict:
    """The checkpoint's scheduler in megacli's units (iterations), checked against the run's."""
    saved = src.common.get("opt_param_scheduler")
    if not isinstance(saved, dict):
        raise UserError(f"{src.common_where}: no opt_param_scheduler (needed to resume); set "
                        f"checkpoint.load_optimizer=false to load the weights only")
    gbs = int(arg(src.args, "global_batch_size", 0) or 0)
    if arg(src.args, "rampup_batch_size"):
        raise UserError(f"{src.it_dir}: the run ramped its batch size up (rampup_batch_size): its scheduler's sample "
                        f"counts are not a number of iterations; set checkpoint.load_optimizer=false to load the weights only")
    if gbs <= 0:
        raise UserError(f"{src.common_where}: args has no global_batch_size (needed to read the scheduler)")
    state = scale_scheduler(saved, 1 / gbs, src.common_where)
    ours = scheduler.state_dict()
    wrong = []
    for field, recipe_field in _SCHED_FIELDS.items():
        if field in state and field in ours and state[field] != ours[field]:
            wrong.append(f"{recipe_field} gives {field} {ours[field]!r} (checkpoint: {state[field]!r})")
    if wrong:
        raise UserError(f"cannot resume {src.it_dir}: this recipe's schedule differs from the run's: {'; '.join(wrong)}. "
                        f"Use the run's values (`megacli reshard inspect {src.root}` shows them), or set "
                        f"checkpoint.load_optimizer=false to start a new schedule from its weights")
    return state


def _rng_entry(src: MegatronLMCheckpoint):
    """The sharded RNG object of this rank as Megatron-LM saved it, or (None, why) when it cannot be restored."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if not any(k.startswith("rng_state") for k in src.reader.objects):
        return None, "it holds no RNG state"
    now = _layout_now()
    ep = int(arg(src.args, "expert_model_parallel_size", 1) or 1)
    dp_saved = int(arg(src.args, "data_parallel_size", now["data"]) or now["data"])
    if (now["tensor"], now["pipeline"]) != (src.tp, src.pp) or (ep > 1 and (now["data"], now["expert"]) != (dp_saved, ep)):
        return None, "its RNG state is per rank of the layout it was saved with, and this run's layout differs"
    pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    dp = ps.get_data_parallel_rank(with_context_parallel=True)
    if ep > 1:
        return ShardedObject("rng_state", None, (src.pp, src.tp, dp_saved), (pp, tp, dp), replica_id=0), None
    return ShardedObject("rng_state", None, (src.pp, src.tp), (pp, tp), replica_id=dp), None


def _set_rng(states) -> str | None:
    """Restore Megatron-LM's saved RNG list (one entry, or one per data-parallel rank)."""
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from megacli.checkpoint.rng import restore_tracker

    if not isinstance(states, list) or not states or not isinstance(states[0], dict):
        return "its RNG state is not in Megatron-LM's layout"
    state = states[ps.get_data_parallel_rank()] if len(states) > 1 else states[0]
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tracker = state.get("rng_tracker_states") or {}
    if tracker:
        restore_tracker(tensor_parallel.get_cuda_rng_tracker(), tracker)
    return None


def load(*, source: Source, chunks, optimizer, scheduler, load_optimizer: bool, keep, model_keys,
         prepare_optimizer, load_arguments):
    """Load a Megatron-LM torch_dist iteration directory into the built chunks, bare (no DDP or
    Float16Module wrappers), and with ``load_optimizer`` the optimizer, scheduler and RNG state;
    ``load_arguments(reader)``: dist_checkpointing.load's further arguments for the installed
    Megatron-Core. Returns (iteration, consumed samples, notes); (0, 0, notes) when only the weights
    were loaded."""
    from megatron.core import dist_checkpointing

    from megacli.checkpoint.safe_pickle import allow_checked_globals, load_failure

    src = MegatronLMCheckpoint(source)
    notes = []
    resume = load_optimizer and optimizer is not None
    if resume and not has_optimizer_state(src):
        notes.append(f"{src.it_dir} holds no optimizer state (saved with --no-save-optim): its weights were loaded, "
                     f"training starts at iteration 0")
        resume = False
    state: dict = {}
    sched_state = None
    with _layers_stacked(chunks, src.moe_layers_stacked):
        for key, chunk in zip(model_keys(chunks), chunks):
            state[key] = chunk.sharded_state_dict()
            if keep is not None:
                state[key] = {k: v for k, v in state[key].items() if keep(k)}
        _rename_to_stored(state, src)
        if resume:
            _check_optimizer(src, optimizer)
            sched_state = _scheduler_state(src, scheduler)
            prepare_optimizer(optimizer)
            model_state = dict(state)
            state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=True,
                                                              metadata=_optimizer_metadata(src))
        rng, why = _rng_entry(src)
        if rng is not None:
            state["rng_state"] = rng
        else:
            notes.append(f"RNG re-seeded from train.seed: {why}")
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        with allow_checked_globals():
            loaded = dist_checkpointing.load(state, str(src.it_dir), **load_arguments(src.reader))
    except UserError:
        raise
    except (Exception, CheckpointException) as exc:
        raise load_failure(exc, src.it_dir) or UserError(f"cannot load the Megatron-LM checkpoint {src.it_dir}: {exc}") from exc
    for key, chunk in zip(model_keys(chunks), chunks):
        missing, unexpected = chunk.load_state_dict(loaded[key], strict=keep is None)
        left = [k for k in missing if keep(k)] if keep is not None else []
        if unexpected or left:
            raise UserError(f"cannot load the Megatron-LM checkpoint {src.it_dir}: missing {left[:4]}, "
                            f"unexpected {unexpected[:4]}")
    if not resume:
        if optimizer is not None:
            optimizer.reload_model_params()
        return 0, 0, notes
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(sched_state)
    if "rng_state" in loaded:
        why = _set_rng(loaded["rng_state"])
        if why:
            notes.append(f"RNG re-seeded from train.seed: {why}")
    consumed = arg(src.args, "consumed_train_samples")
    if consumed is None:
        consumed = src.iteration * int(arg(src.args, "global_batch_size", 0) or 0)
        notes.append(f"args has no consumed_train_samples: taken as iteration × global batch ({consumed})")
    return src.iteration, int(consumed), notes
