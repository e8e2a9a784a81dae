"""Export a checkpoint plan (megacli.checkpoint.writer: a reshard's, a megacli checkpoint under its
target layout, or a conversion's weights) as a Megatron-LM torch_dist checkpoint
(megacli.checkpoint.megatron_lm.dist_writer): the plan's tensors as they are, its objects and common
state in Megatron-LM's form, its recipe as Megatron-LM's full ``args``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megacli.checkpoint.megatron_lm import dist_writer as mlw
from megacli.checkpoint.megatron_lm.args_namespace import megatron_args, unsupported
from megacli.errors import UserError
from megacli.checkpoint.megatron_lm.args_to_recipe import scale_scheduler


def check_exportable(recipe, where, spec: str | None = None) -> None:
    """Refuse, before anything is written, a model Megatron-LM's GPT arguments cannot describe, or
    one its ``spec`` (te or local) cannot build."""
    problems = unsupported(recipe)
    if problems:
        raise UserError(f"{where}: cannot write a Megatron-LM checkpoint: " + "; ".join(problems))
    if spec is None:
        return
    if spec not in mlw.SPECS:
        raise UserError(f"--spec {spec!r}: expected one of {', '.join(mlw.SPECS)}")
    if spec == "local" and recipe.model.position_embedding == "relative":
        raise UserError(f"{where}: --spec local with model.position_embedding relative: Megatron-LM core_v0.16.1 "
                        f"builds T5's relative position biases with Transformer Engine only (its validate_args "
                        f"refuses them with --transformer-impl local, and the local spec's attention takes no "
                        f"bias); write --spec te")


def export(plan, root: Path, *, spec: str = "te", progress=None) -> list[str]:
    """Write ``plan`` under ``root`` (an existing empty directory) as a Megatron-LM checkpoint with the ``spec`` layer names (te or local). Returns notes for the user."""
    recipe = plan.recipe
    check_exportable(recipe, plan.origin, spec)
    iteration = int(plan.meta.get("iteration", 0))
    gbs = recipe.train.global_batch_size
    consumed = int(plan.meta.get("consumed_samples", iteration * gbs))
    emb = next((t for t in plan.tensors if t.key == "embedding.word_embeddings.weight"), None)
    args = megatron_args(recipe, ckpt_format="torch_dist", iteration=iteration, consumed_samples=consumed,
                         padded_vocab_size=emb.shape[0] if emb is not None else None,
                         transformer_impl=mlw.TRANSFORMER_IMPL[spec])
    sched = plan.common.get("scheduler")
    if sched is not None:  # megacli counts scheduler steps in iterations, Megatron-LM in samples
        sched = scale_scheduler(sched, gbs, str(plan.origin))
    common = mlw.common_state(args=args, iteration=iteration, optimizer=plan.common.get("optimizer"),
                              opt_param_scheduler=sched, distributed_optimizer=recipe.parallel.distributed_optimizer)
    m = recipe.model
    objects = mlw.megatron_objects(plan.objects, spec=spec, num_layers=m.num_layers, qk_layernorm=m.qk_layernorm,
                                   moe_layers=m.moe_layers() if m.moe is not None else None, t5=m.arch == "t5",
                                   source=plan.source.source if plan.source is not None else None)
    notes = [f"Megatron-LM torch_dist checkpoint for the {spec} layer spec (--transformer-impl {mlw.TRANSFORMER_IMPL[spec]})"]
    if "optimizer" not in plan.common:
        notes.append("weights only (the source has no optimizer state): load with --finetune or --no-load-optim "
                     "--no-load-rng")
    if m.add_bias_linear and m.activation in ("gelu", "squared_relu"):
        notes.append(f"{m.activation} with biases: in Megatron-LM pass --no-bias-gelu-fusion (its fused bias-GeLU, on "
                     f"by default, is the tanh approximation; --use-checkpoint-args does not carry the option)")
    rng = plan.source.rng_objects if plan.source is not None else {}
    if rng and plan.source.reader.read_object(next(iter(rng.values())))[0].get("cuda") is None:
        notes.append("RNG state is the CPU backend's (CPU generator states): in Megatron-LM on CUDA, load with "
                     "--no-load-rng")
    tensors = [dataclasses.replace(t, key=mlw.stored_key(t.key, spec)) for t in plan.tensors]
    mlw.write(root, iteration=iteration, tensors=tensors, objects=objects, common=common, progress=progress)
    return notes


