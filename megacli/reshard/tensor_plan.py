"""What a layout change does to a megacli torch_dist checkpoint, as a plan of tensors to write.

What depends on the layout (TP/PP/VP/DP) in a megacli torch_dist checkpoint, and what does not:

* model weights - no. ``GPTModel.sharded_state_dict()`` stores every tensor in its global shape,
  transformer layers stacked along a leading axis by *global* layer number; the chunks in the
  files are only how the saving ranks happened to split the work;
* optimizer state - no, for a given optimizer kind. The standard optimizer stores Adam moments
  (``optimizer.state.exp_avg.<key>``, ``exp_avg_sq``; mixed precision adds ``fp32_param``) shaped
  like the weights; the distributed optimizer's ``fully_reshardable`` format stores the same
  plus the fp32 main weights as ``optimizer.state.param.<key>``, gathered from its flat DP shards.
  Switching the *kind* (``parallel.distributed_optimizer``, usually with DP) changes names and
  the non-tensor part (``common.pt``: param groups, step);
* scheduler, iteration, consumed samples (the data position) - no: counted in global steps and
  samples;
* the padded vocabulary - sometimes: the embedding (and an untied output layer) has
  ``make_vocab_size_divisible_by × TP`` rows, so a TP change can pad or trim rows;
* RNG state - yes: one ``rng_state/shard_{pp}.{tp}_{PP}.{TP}`` object per (pipeline, tensor)
  rank, holding that rank's Python/NumPy/torch generators and Megatron's RNG tracker (whose
  tensor-parallel streams are seeded per TP rank);
* the recorded layout (``megacli.json``) and the ``parallel:``/``launch:`` sections of
  ``recipe.yaml`` - yes, labels.

So a reshard copies global tensors (re-chunked the way the new layout's ranks read them),
converts the optimizer kind when asked, fits the vocabulary rows, re-labels the RNG state for
the new (pipeline, tensor) grid and rewrites the labels.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Optional

import torch

from megacli.checkpoint.sharding import is_vocab_key
from megacli.checkpoint.torch_dist import TensorEntry
from megacli.checkpoint.megacli_checkpoint import OPT_PREFIX, Checkpoint, Layout, split_optimizer_key, target_chunks
from megacli.checkpoint.writer import Plan, Target
from megacli.errors import UserError
from megacli.recipe.sections import sequence_parallel_on
from megacli.recipe.stages import pick_split
from megacli.reshard.objects import plan_objects

# ---------------------------------------------------------------- the target


def resolve_target(src_layout: Layout, src_parallel: dict, *, tensor=None, pipeline=None, virtual_pipeline=None,
                   data_parallel=None, distributed_optimizer=None, sequence_parallel=None, overrides=(),
                   num_layers: Optional[int] = None) -> Target:
    """Fill what the user did not give from the source: TP/PP/DP and the optimizer kind are kept;
    virtual stages are kept when PP is unchanged (``1`` = none); sequence parallelism is kept
    where TP > 1. Uneven stages are kept when PP and VP are; otherwise a split of the model's
    ``num_layers`` is picked (even where they divide; ``--set parallel.first_stage_layers=N``
    chooses another)."""
    tp = tensor or src_layout.tensor
    pp = pipeline or src_layout.pipeline
    if virtual_pipeline is None:
        vp = src_layout.virtual_pipeline if pp == src_layout.pipeline else None
    else:
        vp = virtual_pipeline if virtual_pipeline > 1 else None
    dp = data_parallel or src_layout.data
    dist_opt = bool(src_parallel.get("distributed_optimizer", False)) if distributed_optimizer is None else distributed_optimizer
    if sequence_parallel is None:
        sp = tp > 1 and sequence_parallel_on(src_parallel.get("sequence_parallel", False), tensor=tp)
    else:
        sp = sequence_parallel
    first, last = src_layout.first_stage_layers, src_layout.last_stage_layers
    if (pp, vp) != (src_layout.pipeline, src_layout.virtual_pipeline) and num_layers is not None:
        first, last = pick_split(num_layers, pp, vp) or (None, None)  # None: the recipe check says why
    layout = Layout(tensor=tp, pipeline=pp, virtual_pipeline=vp, data=dp, context=src_layout.context,
                    first_stage_layers=first, last_stage_layers=last)
    return Target(layout=layout, distributed_optimizer=dist_opt, sequence_parallel=sp, overrides=tuple(overrides))


def target_recipe(src: Checkpoint, target: Target):
    """The source recipe with the target's ``parallel:``/``launch:`` and the overrides, validated."""
    from megacli.recipe.base import apply_overrides, validate
    from megacli.recipe.pretrain import TrainingRecipe

    raw = copy.deepcopy(src.recipe_raw)
    lay = target.layout
    parallel = dict(raw.get("parallel") or {})
    parallel.update(tensor=lay.tensor, pipeline=lay.pipeline, virtual_pipeline=lay.virtual_pipeline,
                    first_stage_layers=lay.first_stage_layers, last_stage_layers=lay.last_stage_layers,
                    context=lay.context, distributed_optimizer=target.distributed_optimizer,
                    sequence_parallel=target.sequence_parallel)
    if not target.distributed_optimizer:
        parallel["overlap_param_gather"] = False
    raw["parallel"] = parallel
    launch = dict(raw.get("launch") or {})
    nnodes = int(launch.get("nnodes", 1) or 1)
    world = lay.world_size
    if nnodes > 1 and world % nnodes == 0:
        launch["nproc"] = world // nnodes
    else:
        launch.update(nproc=world, nnodes=1, node_rank=0)
    raw["launch"] = launch
    raw = apply_overrides(raw, target.overrides)
    recipe = validate(TrainingRecipe, raw, f"for {lay} (edit the written recipe with --set key=value)")
    if recipe.data_parallel_size != lay.data:
        raise UserError(f"the written recipe has data-parallel size {recipe.data_parallel_size}, not {lay.data} "
                        f"(launch.nproc × launch.nnodes must be TP × PP × CP × DP = {world})")
    return recipe


# ---------------------------------------------------------------- the plan


def build_plan(src: Checkpoint, target: Target, recipe=None) -> Plan:
    """The entries of the target checkpoint. ``recipe``: the target's recipe (default: the source's
    with the target layout, see target_recipe)."""
    recipe = recipe if recipe is not None else target_recipe(src, target)
    p = recipe.parallel  # uneven stages as the written recipe has them (--set may choose them)
    target = replace(target, layout=replace(target.layout, first_stage_layers=p.first_stage_layers,
                                            last_stage_layers=p.last_stage_layers))
    notes: list[str] = []

    # Vocabulary rows of the target layout.
    rows_now, rows_new = _vocab_rows(src, recipe)
    if rows_now is not None and rows_new != rows_now:
        notes.append(f"vocabulary padding {rows_now} → {rows_new} rows (make_vocab_size_divisible_by × TP); "
                     f"{'new rows are zeros' if rows_new > rows_now else 'padding rows beyond the vocabulary are dropped'}")
    entry = _entry_maker(src.reader, rows_now, rows_new, tp=target.layout.tensor, gated=recipe.model.gated)
    tensors = [entry(key, key) for key in src.model_keys]
    common = copy.deepcopy(src.common)
    tensors += _optimizer_entries(src, entry, target, recipe.train.precision != "fp32", notes, common)

    objects = plan_objects(src, target, recipe, notes)
    meta = {k: v for k, v in src.meta.items() if k not in ("layout", "resharded_from")}
    meta.update(layout=target.layout.as_meta(), format="torch_dist",
                resharded_from={"path": str(src.path.resolve()), "layout": src.layout.as_meta(),
                                "distributed_optimizer": bool(src.section("parallel").get("distributed_optimizer", False))})
    return Plan(source=src, target=target, recipe=recipe, tensors=tensors, objects=objects, common=common, meta=meta, notes=notes)


def _entry_maker(reader, rows_now: Optional[int], rows_new: Optional[int], *, tp: int, gated: bool):
    """``entry(key_out, key_in, how, cast)``: the target tensor ``key_out`` read from the source's
    ``key_in``, its vocabulary rows padded or cut to ``rows_new``, chunked for the target TP."""

    def entry(key_out: str, key_in: str, how: str = "copy", cast: Optional[torch.dtype] = None) -> TensorEntry:
        info = reader.tensors[key_in]
        _, base = split_optimizer_key(key_in)
        shape = tuple(info.shape)
        rows = None  # rows of the source that exist, when the vocabulary padding changes
        if rows_now is not None and rows_new != rows_now and is_vocab_key(base) and shape and shape[0] == rows_now:
            shape = (rows_new,) + shape[1:]
            rows = rows_now
            how = f"{how}, vocab rows {rows_now} → {rows_new}"
        dtype = cast or info.dtype

        def region(offsets, sizes, key_in=key_in, rows=rows, dtype=dtype):
            if rows is not None and offsets[0] + sizes[0] > rows:
                out = torch.zeros(sizes, dtype=dtype)  # padding rows past the source's
                have = max(0, rows - offsets[0])
                if have:
                    out[:have] = reader.read_region(key_in, offsets, (have,) + tuple(sizes[1:])).to(dtype)
                return out
            t = reader.read_region(key_in, offsets, sizes)
            return t if t.dtype == dtype else t.to(dtype)

        return TensorEntry(key=key_out, shape=shape, dtype=dtype, how=how, region=region,
                           chunks=target_chunks(key_out, shape, tp=tp, gated=gated))

    return entry


def _optimizer_entries(src: Checkpoint, entry, target: Target, mixed: bool, notes: list[str], common: dict) -> list[TensorEntry]:
    """Optimizer state, converted between the standard and the distributed optimizer's format
    (``common``'s optimizer state converted in place, a note added)."""
    reader = src.reader
    kind = src.optimizer_kind
    opt_keys = [k for k in reader.tensors if k.startswith(OPT_PREFIX)]
    want = "distributed" if target.distributed_optimizer else "standard"
    if kind is None:
        if opt_keys:
            raise UserError(f"{src.path}: optimizer tensors without optimizer state in {reader.common_where or reader.path}")
        return []
    if kind == want:
        return [entry(k, k) for k in opt_keys]
    notes.append(f"optimizer: {kind} → {want} format" + (
        " (fp32 main weights taken from the fp32 model weights)" if want == "distributed" and not mixed else ""))
    tensors: list[TensorEntry] = []
    by_state: dict[str, list[str]] = {}
    for k in opt_keys:
        state, base = split_optimizer_key(k)
        by_state.setdefault(state, []).append(base)
    for state, bases in by_state.items():
        if want == "distributed" and state == "fp32_param":
            tensors += [entry(f"{OPT_PREFIX}param.{b}", f"{OPT_PREFIX}fp32_param.{b}", how="fp32_param → param") for b in bases]
        elif want == "standard" and state == "param":
            if mixed:
                tensors += [entry(f"{OPT_PREFIX}fp32_param.{b}", f"{OPT_PREFIX}param.{b}", how="param → fp32_param") for b in bases]
            # fp32: the standard optimizer steps the model weights themselves; the main copy is dropped
        else:
            tensors += [entry(f"{OPT_PREFIX}{state}.{b}", f"{OPT_PREFIX}{state}.{b}") for b in bases]
    if want == "distributed" and not mixed:
        if "fp32_param" in by_state:
            raise UserError(f"{src.path}: mixed-precision optimizer state (fp32_param) but the recipe says fp32")
        bases = by_state.get("exp_avg") or by_state.get("exp_avg_sq") or []
        tensors += [entry(f"{OPT_PREFIX}param.{b}", b, how="model weight → param", cast=torch.float32) for b in bases]
    common["optimizer"] = convert_optimizer_common(src.common["optimizer"], kind, want, mixed)
    return tensors


def convert_optimizer_common(opt: dict, kind: str, want: str, mixed: bool) -> dict:
    """The non-tensor optimizer state (param groups, step, grad scaler) in the other format."""
    if kind == "distributed":
        inner = opt["optimizer"]
        groups = [dict(g) for g in inner["param_groups"]]
        steps = {g.pop("step") for g in groups if "step" in g}
        step = steps.pop() if len(steps) == 1 else None
        scaler = opt.get("grad_scaler")
    else:
        inner = opt["optimizer"] if mixed else opt
        groups = [dict(g) for g in inner["param_groups"]]
        step = inner.get("state", {}).get("common_step")
        if step is None:
            steps = {g.pop("step") for g in groups if "step" in g}
            step = steps.pop() if len(steps) == 1 else None
        scaler = opt.get("grad_scaler") if mixed else None
    if want == "distributed":
        value = float(step.item() if isinstance(step, torch.Tensor) else (step or 0))
        for g in groups:
            g["step"] = value
        out: dict = {"optimizer": {"param_groups": groups}}
        if scaler is not None:
            out["grad_scaler"] = scaler
        out["param_state_sharding_type"] = "fully_reshardable"
        return out
    state = {}
    if step:
        state["common_step"] = step if isinstance(step, torch.Tensor) else torch.tensor(float(step))
    body = {"state": state, "param_groups": groups}
    if not mixed:
        return body
    out = {"optimizer": body}
    if scaler is not None:
        out["grad_scaler"] = scaler
    return out


def _vocab_rows(src: Checkpoint, recipe) -> tuple[Optional[int], Optional[int]]:
    """(rows in the checkpoint, rows the target layout pads to)."""
    from megacli.recipe.model import padded_vocab_size

    emb = src.reader.tensors.get("embedding.word_embeddings.weight")
    if emb is None:
        return None, None
    rows = emb.shape[0]
    m = recipe.model
    div = m.make_vocab_size_divisible_by
    src_tp = src.layout.tensor
    new_tp = recipe.parallel.tensor
    # The real vocabulary lies in (rows - div·TP_src, rows]; when every size there pads the same
    # way under the new TP, the tokenizer is not needed.
    lo, hi = max(1, rows - div * src_tp + 1), rows
    if m.vocab_size:
        vocab = m.vocab_size
    elif padded_vocab_size(lo, divisible_by=div, tensor_parallel=new_tp) == padded_vocab_size(hi, divisible_by=div, tensor_parallel=new_tp):
        vocab = hi
    else:
        try:
            from megacli.data.tokenizers import load_tokenizer

            vocab = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path).vocab_size
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"TP {src_tp} → {new_tp} changes the vocabulary padding, and the real vocabulary size is "
                            f"unknown: the recipe's tokenizer cannot be loaded ({exc}); pass --set model.vocab_size=N") from None
    if vocab > rows:
        raise UserError(f"the vocabulary ({vocab}) is larger than the checkpoint's embedding ({rows} rows)")
    return rows, padded_vocab_size(vocab, divisible_by=div, tensor_parallel=new_tp)
