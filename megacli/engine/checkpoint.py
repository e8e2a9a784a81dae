"""Distributed checkpoints (Megatron dist_checkpointing, torch_dist), saved atomically.

Layout of a checkpoint directory:
    latest                 the name of the newest complete iteration (replaced atomically)
    iter_0000100/          torch_dist shards + recipe.yaml + megacli.json (iteration, data position, layout, run id)
                           + manifest.json (every file's size and checksum, checked before a load)
    iter_0000200.tmp/      a save in progress; never read, removed by the next save

A save writes iter_N.tmp, waits for every rank, renames it to iter_N and only then moves `latest`,
so a crash mid-save leaves the previous checkpoint and pointer intact. The model and the
(distributed) optimizer are saved in a layout-free form, so a checkpoint loads under any TP/PP/DP.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megacli.checkpoint import manifest, space
from megacli.engine import nonfinite
from megacli.engine.core_compat import async_save_kwargs, write_common_file
from megacli.checkpoint.layout import (LATEST, META, find_checkpoint, iter_name, lora_base_of,
                                      read_meta, read_recipe)
from megacli.checkpoint.rng import restore_tracker, tracker_states
from megacli.checkpoint.replace import check_replaceable
from megacli.checkpoint.safe_pickle import allow_checked_globals, check_torch_dist, load_failure
from megacli.checkpoint.source import MEGATRON_LM, Source
from megacli.errors import UserError

__all__ = ["LATEST", "META", "find_checkpoint", "iter_name", "lora_base_of", "read_meta", "load", "save"]

NONFINITE = ".nonfinite-"  # + rank: a file a writer leaves when the tensors it wrote are not finite
OPTIM_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


@dataclass(frozen=True)
class Restored:
    iteration: int
    consumed_samples: int
    path: Path
    run_id: str | None = None  # the training run the checkpoint belongs to (None: weights only, or an older checkpoint)
    notes: tuple[str, ...] = ()  # what of the checkpoint was not restored, and why


def _layout(chunks) -> dict:
    from megatron.core import parallel_state as ps

    from megacli.engine.models.common import unwrap

    layout = {
        "tensor": ps.get_tensor_model_parallel_world_size(),
        "pipeline": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline": ps.get_virtual_pipeline_model_parallel_world_size(),
        "data": ps.get_data_parallel_world_size(),
        "context": ps.get_context_parallel_world_size(),
    }
    config = getattr(unwrap(chunks[0]), "config", None)  # none: a stand-in for a model chunk
    for key in ("first_stage_layers", "last_stage_layers"):
        given = getattr(config, f"num_layers_in_{key.split('_')[0]}_pipeline_stage", None)
        if given is not None:  # uneven stages only: even layouts keep the keys older checkpoints have
            layout[key] = given
    return layout


def _model_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _rng_state():
    from megatron.core import tensor_parallel

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tracker_states(tensor_parallel.get_cuda_rng_tracker()),
    }


def _set_rng_state(state) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    restore_tracker(tensor_parallel.get_cuda_rng_tracker(), state["tracker"])


def _rng_sharded_object(state):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", state,
                         (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _sharded_state(chunks, optimizer, scheduler, *, loading: bool, with_optimizer: bool, with_rng: bool,
                   keep=None) -> dict:
    """``keep``: which model entries (by state-dict key) to include; all when None."""
    from megacli.engine.models.common import unwrap

    state: dict = {}
    for key, chunk in zip(_model_keys(chunks), chunks):
        state[key] = unwrap(chunk).sharded_state_dict()
        if keep is not None:
            state[key] = {k: v for k, v in state[key].items() if keep(k)}
    if with_optimizer:
        model_state = {k: v for k, v in state.items()}
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=OPTIM_SHARDING)
        state["scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_sharded_object(_rng_state())
    return state


def save(*, ckpt_dir: str | Path, iteration: int, consumed_samples: int, chunks, optimizer, scheduler,
         recipe_yaml: str, keep_last: int | None = None, run_id: str | None = None, extra_meta: dict | None = None,
         lora_base: Path | None = None, queue=None, check_finite: bool = False, strategy=None) -> Path:
    """Save atomically; returns the final iteration directory. Collective: every rank calls it.
    ``run_id`` (kept in megacli.json) names the training run across resumes: ``keep_last`` prunes
    only the checkpoints of this run.
    With ``optimizer=None`` only the model weights are saved (no optimizer, scheduler or RNG
    state, as in a converted checkpoint); ``extra_meta`` adds entries to megacli.json.
    ``lora_base``: save only the LoRA adapters, noting the checkpoint holding the frozen base weights.
    ``queue``: Megatron-Core's AsyncCallsQueue; the shards of the state as it is now are written by
    a background process, and the directory is published (and `latest` moved) only when the
    queue finalizes the request, after every rank's write completed. Without it, before returning.
    ``check_finite``: the writer checks the values it wrote, and a save holding a non-finite one is
    removed instead of published (nonfinite.NonFiniteSave).
    ``strategy``: a torch_dist save strategy kept across saves of one structure (engine.saves); the
    shards' access check runs at its first save only."""
    request, final = _start_save(ckpt_dir=Path(ckpt_dir), iteration=iteration, consumed_samples=consumed_samples,
                                 chunks=chunks, optimizer=optimizer, scheduler=scheduler, recipe_yaml=recipe_yaml,
                                 keep_last=keep_last, run_id=run_id, extra_meta=extra_meta, lora_base=lora_base,
                                 check_finite=check_finite, strategy=strategy)
    if queue is None:
        request.execute_sync()
    else:
        queue.schedule_async_request(request)
    return final


def _start_save(*, ckpt_dir: Path, iteration: int, consumed_samples: int, chunks, optimizer, scheduler,
                recipe_yaml: str, keep_last, run_id, extra_meta, lora_base, check_finite: bool, strategy):
    """Everything of a save that needs the live state (the shards' plan and copies, common.pt), as
    Megatron-Core's AsyncRequest whose one finalize step completes and publishes the save."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    final = ckpt_dir / iter_name(iteration)
    tmp = ckpt_dir / (iter_name(iteration) + ".tmp")
    check_replaceable(final, field="checkpoint.dir iteration")  # on every rank, before anything is written
    rank = dist.get_rank()
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob("iter_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    weights_only = optimizer is None
    keep = None
    if lora_base is not None:
        from megacli.engine.models.lora import is_adapter_key

        keep = is_adapter_key
        extra_meta = {**(extra_meta or {}), "lora": {"base": str(Path(lora_base).resolve())}}
    state = _sharded_state(chunks, optimizer, scheduler, loading=False, with_optimizer=not weights_only,
                           with_rng=not weights_only, keep=keep)
    needed = torch.tensor([space.state_bytes(state)], dtype=torch.float64, device=_device())
    dist.all_reduce(needed)  # also the barrier after which every rank finds tmp made
    needed = int(needed.item())
    write_common_file(state, tmp)
    try:
        checked = strategy is not None and strategy.cached_local_plan is not None  # it saved this structure
        request = dist_checkpointing.save(state, str(tmp), sharded_strategy=strategy, async_sharded_save=True,
                                          validate_access_integrity=not checked, **async_save_kwargs())
    except BaseException as exc:  # torch's CheckpointException derives from BaseException
        full = space.disk_full_error(exc, ckpt_dir=ckpt_dir, partial=tmp, needed=needed, remove=rank == 0)
        if full is not None:
            raise full from None
        raise
    meta = {"iteration": iteration, "consumed_samples": consumed_samples, "layout": _layout(chunks), "format": "torch_dist"}
    if weights_only:
        meta.update(has_optimizer=False, has_rng_state=False)
    if run_id is not None:
        meta["run_id"] = run_id
    meta.update(extra_meta or {})
    if request.async_fn is not None:  # this rank writes shards: its writer then describes them for the manifest
        request = request._replace(async_fn=functools.partial(_write_and_describe, request.async_fn, tmp, rank,
                                                              dist.get_world_size(), check_finite))
    written = request.finalize_fns  # Megatron's: collect every rank's write results, then the DCP metadata

    def finalize() -> None:
        try:
            for fn in written:
                fn()
        except BaseException as exc:
            full = space.disk_full_error(exc, ckpt_dir=ckpt_dir, partial=tmp, needed=needed, remove=rank == 0)
            if full is not None:
                raise full from None
            raise
        _complete(tmp, final, ckpt_dir, meta=meta, recipe_yaml=recipe_yaml, needed=needed, keep_last=keep_last,
                  run_id=run_id, check_finite=check_finite)

    return request._replace(finalize_fns=[finalize]), final


def _write_and_describe(write, tmp: Path, rank: int, world: int, check_finite: bool, *args, **kwargs) -> None:
    """Megatron-Core's shard writer, then the description of the files this rank wrote and (with
    ``check_finite``) whether the tensors it wrote are finite, in the same (background) process."""
    write(*args, **kwargs)  # its errors (a full disk) go to the save's finalize step, which reports them
    manifest.describe_part(tmp, rank, world)
    buckets = args[1]  # (file, key, (bytes items, [(item, tensor), ...])) per file, as the writer took them
    if check_finite and not nonfinite.tensors_finite(t for _, _, (_, items) in buckets for _, t in items):
        (tmp / f"{NONFINITE}{rank}").touch()


def _complete(tmp: Path, final: Path, ckpt_dir: Path, *, meta: dict, recipe_yaml: str, needed: int, keep_last, run_id,
              check_finite: bool) -> None:
    """Collective, once every rank's shards are written: the manifest of the files as they are on
    disk, then the rename into place and the `latest` pointer."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    # One exchange (the training loop waits for it): whether each rank wrote a non-finite value, and
    # its description of the files it wrote.
    reports = [None] * world
    dist.all_gather_object(reports, (check_finite and (tmp / f"{NONFINITE}{rank}").exists(),
                                     manifest.described(tmp, rank, world)))
    if any(nonfinite_written for nonfinite_written, _ in reports):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise nonfinite.NonFiniteSave(meta["iteration"])
    if os.environ.get("MEGACLI_TEST_CRASH_IN_SAVE") == str(meta["iteration"]):
        # Fault injection for the atomic-save tests: fail after the shards are written, before publishing.
        raise RuntimeError(f"injected crash while saving iteration {meta['iteration']}")
    if rank == 0:
        try:
            (tmp / "recipe.yaml").write_text(recipe_yaml)
            (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
            manifest.write(tmp, [*(part for _, part in reports), manifest.describe(tmp, ["recipe.yaml", META])])
        except OSError as exc:
            full = space.disk_full_error(exc, ckpt_dir=ckpt_dir, partial=tmp, needed=needed, remove=True)
            raise (full or exc) from None
        _publish(tmp, final, ckpt_dir)
        if keep_last and run_id is not None:
            _prune(ckpt_dir, keep_last, run_id)
    dist.barrier()


def _device() -> torch.device:
    """Where this process's collectives take their tensors."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _publish(tmp: Path, final: Path, ckpt_dir: Path) -> None:
    """Rename the finished save into place, then move the `latest` pointer (both atomic renames)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer_tmp = ckpt_dir / (LATEST + ".tmp")
    pointer_tmp.write_text(final.name + "\n")
    os.replace(pointer_tmp, ckpt_dir / LATEST)


def _prune(ckpt_dir: Path, keep_last: int, run_id: str) -> None:
    """Delete the oldest checkpoints of run ``run_id`` beyond its newest ``keep_last``. Other runs'
    checkpoints in the directory, and the one `latest` names, are never touched."""
    latest = (ckpt_dir / LATEST).read_text().strip()
    ours = [p for p in saved_iterations(ckpt_dir) if (p / META).is_file() and read_meta(p).get("run_id") == run_id]
    for old in ours[:-keep_last]:
        if old.name != latest:
            shutil.rmtree(old, ignore_errors=True)


def saved_iterations(ckpt_dir: str | Path) -> list[Path]:
    """The iteration directories in ckpt_dir (complete or not; saves in progress excluded), oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.glob("iter_*") if p.is_dir() and not p.name.endswith(".tmp"))


def _prepare_distributed_optimizer_load(optimizer) -> None:
    """Work around three failures of Megatron-Core 0.16's DistributedOptimizer when loading its
    fully_reshardable state with torch's Adam (no Apex or Transformer Engine, as on the CPU backend):

    * state_dict() - which sharded_state_dict() calls when loading too - reads the step from the
      per-parameter state and asserts there is exactly one; a fresh optimizer has none. Allocate
      zero state with step 0 (load_state_dict reuses it and overwrites tensors and step);
    * _set_main_param_and_optimizer_states() copies every key of the destination state, 'step'
      included, from the loaded tensors, which never hold 'step' (it comes from the param
      groups): KeyError. Copy the loaded keys the state has (Megatron-LM's dp_reshardable
      entries add a 'padding' flag);
    * load_state_dict() gives every parameter the same step tensor, which torch's Adam then
      increments once per parameter per step (wrong bias correction after a resume). Give each
      parameter its own."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    if HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if (not isinstance(opt, DistributedOptimizer) or not isinstance(inner, torch.optim.Adam)
                or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8):
            continue
        if not len(inner.state):
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p.data),
                                      "exp_avg_sq": torch.zeros_like(p.data)}

        @torch.no_grad()  # dp_reshardable loads call it outside no_grad; fp32 main params are views of leaves
        def set_states(model_param, tensors, opt=opt):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
            state = opt.optimizer.state[main_param]
            dst = {"param": main_param, **state}
            for key, value in tensors.items():
                # dp_reshardable entries also carry a 'padding' flag, and the 'step' of the state they
                # were loaded into (not saved: the step comes from the param groups)
                if key in dst and key != "step":
                    dst[key].copy_(value)
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

        opt._set_main_param_and_optimizer_states = set_states


def _check_optimizer_kind(ckpt: Path, optimizer) -> None:
    """The distributed and the standard optimizer save differently named state; loading one into
    the other fails deep inside Megatron. Say what to do instead."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    recipe = read_recipe(ckpt)
    saved = bool((recipe.get("parallel") or {}).get("distributed_optimizer", False))
    # muon's distributed optimizer is Megatron's layer-wise one: a chain of plain optimizers, each flagged
    running = any(isinstance(o, DistributedOptimizer) or getattr(o.config, "use_layer_wise_distributed_optimizer", False)
                  for o in getattr(optimizer, "chained_optimizers", [optimizer]))
    if saved != running:
        kind = {True: "distributed", False: "standard"}
        flag = "--distributed-optimizer" if running else "--no-distributed-optimizer"
        raise UserError(
            f"{ckpt} holds {kind[saved]}-optimizer state but this run uses the {kind[running]} optimizer "
            f"(parallel.distributed_optimizer={str(running).lower()}). Convert it with "
            f"`megacli reshard {ckpt} NEW_DIR {flag}`, or set checkpoint.load_optimizer=false to load the weights only.")


def load(*, source: Source, chunks, optimizer, scheduler, load_optimizer: bool, verify: bool = True) -> Restored:
    """Load model (and optimizer, scheduler, RNG when asked and possible) into the built chunks.
    The RNG state is restored only when the layout is unchanged (it is per rank). ``verify``: check
    the files against the checkpoint's manifest first.

    A model with LoRA adapters takes its base weights from a full checkpoint (the adapters keep
    their initial values) or from the base a LoRA checkpoint names, then the adapters from it.
    ``source`` (an iteration directory) carries the user's trust in its pickles (megacli.checkpoint.safe_pickle)."""
    from megacli.engine.models.common import unwrap
    from megacli.engine.models.lora import is_adapter_key

    has_adapters = any(is_adapter_key(name) for c in chunks for name, _ in unwrap(c).named_parameters())
    ckpt = source.path
    base = lora_base_of(ckpt)
    if base is None:
        keep = None if not has_adapters else (lambda k: not is_adapter_key(k))
        return _load(source=source, chunks=chunks, optimizer=optimizer, scheduler=scheduler, load_optimizer=load_optimizer,
                     keep=keep, verify=verify)
    if not has_adapters:
        raise UserError(f"{ckpt} holds LoRA adapters only: load it with its recipe's lora section, or merge them into "
                        f"the base weights first (`megacli convert {ckpt} DST --to megacli`)")
    _load(source=source.at(base), chunks=chunks, optimizer=None, scheduler=None, load_optimizer=False,
          keep=lambda k: not is_adapter_key(k), verify=verify)
    return _load(source=source, chunks=chunks, optimizer=optimizer, scheduler=scheduler, load_optimizer=load_optimizer,
                 keep=is_adapter_key, verify=verify)


def _check_manifest(ckpt: Path) -> None:
    """Collective: every rank checks its share of the files; all refuse alike on a mismatch."""
    import torch.distributed as dist

    world = dist.get_world_size()
    found = [None] * world
    dist.all_gather_object(found, manifest.problems(ckpt, rank=dist.get_rank(), world_size=world))
    found = sorted(p for part in found for p in part)
    if found:
        raise manifest.mismatch_error(ckpt, found)


def _load(*, source: Source, chunks, optimizer, scheduler, load_optimizer: bool, keep, verify: bool) -> Restored:
    from megatron.core import dist_checkpointing

    ckpt = source.path
    check_torch_dist(ckpt, trust=source.trust)  # Megatron and torch unpickle these files unrestricted
    if verify:
        _check_manifest(ckpt)
    if source.kind == MEGATRON_LM:  # Megatron-LM's own torch_dist checkpoint
        from megacli.checkpoint.megatron_lm import resume as megatron_lm_resume
        from megacli.engine.core_compat import common_state_load_kwargs
        from megacli.engine.models.common import unwrap

        iteration, consumed, notes = megatron_lm_resume.load(
            source=source, chunks=[unwrap(c) for c in chunks], optimizer=optimizer, scheduler=scheduler, load_optimizer=load_optimizer,
            keep=keep, model_keys=_model_keys, prepare_optimizer=_prepare_distributed_optimizer_load,
            load_arguments=common_state_load_kwargs)
        return Restored(iteration=iteration, consumed_samples=consumed, path=ckpt, notes=tuple(notes))
    meta = read_meta(ckpt)
    restore_rng = meta.get("layout") == _layout(chunks) and meta.get("has_rng_state", True)
    has_optimizer = load_optimizer and meta.get("has_optimizer", True)
    if has_optimizer:
        _check_optimizer_kind(ckpt, optimizer)
        _prepare_distributed_optimizer_load(optimizer)
    state = _sharded_state(chunks, optimizer, scheduler, loading=True, with_optimizer=has_optimizer, with_rng=restore_rng,
                           keep=keep)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        with allow_checked_globals():  # a Megatron-LM common.pt holds its run's args (a Namespace)
            loaded = dist_checkpointing.load(state, str(ckpt))
    except (Exception, CheckpointException) as exc:
        raise load_failure(exc, ckpt) or UserError(f"cannot load checkpoint {ckpt}: {exc}") from exc
    from megacli.engine.models.common import unwrap

    for key, chunk in zip(_model_keys(chunks), chunks):
        missing, unexpected = unwrap(chunk).load_state_dict(loaded[key], strict=keep is None)
        left = [k for k in missing if keep(k)] if keep is not None else []
        if unexpected or left:
            raise UserError(f"cannot load checkpoint {ckpt}: missing {left[:4]}, unexpected {unexpected[:4]}")
    if has_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])
    elif optimizer is not None:
        # Weights only (finetuning, a converted checkpoint): mixed-precision and distributed
        # optimizers step fp32 main copies made when they were built; refresh them from the
        # loaded weights, or the first step would write the initial weights back.
        optimizer.reload_model_params()
    if restore_rng and "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    if not has_optimizer:
        return Restored(iteration=0, consumed_samples=0, path=ckpt)
    return Restored(iteration=meta["iteration"], consumed_samples=meta["consumed_samples"], path=ckpt,
                    run_id=meta.get("run_id"))
