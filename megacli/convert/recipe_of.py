"""`megacli recipe from`: the training recipe that reproduces a checkpoint, read by the readers that
already understand it: a megacli checkpoint's own recipe.yaml, a Megatron-LM (torch_dist or
legacy) run's args mapped field by field (megacli.checkpoint.megatron_lm.args_to_recipe), a Hugging Face
directory's config.json mapped by its convert family. What does not map is returned as notes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megacli.checkpoint.source import Source
from megacli.errors import UserError


@dataclasses.dataclass(frozen=True)
class CheckpointRecipe:
    recipe: object
    """The validated TrainingRecipe."""
    source: str
    """What was read, for the written file's header."""
    not_mapped: list[str]
    """What of the checkpoint's run the recipe does not carry."""
    next_steps: list[str]
    """What to set before using the recipe."""


def recipe_of(source: Source) -> CheckpointRecipe:
    from megacli.checkpoint.source import HF, locate

    source = source.at(source.path.expanduser())
    if source.kind == HF:
        return _from_hf(source)
    src, kind = locate(source.path)
    if kind == "megacli":
        return _from_megacli(src)
    return _from_megatron_lm(source.at(src), kind)


def _validated(raw: dict, source: str):
    """The recipe read out of a checkpoint, validated; whatever trust it claims is dropped."""
    from megacli.recipe import trust
    from megacli.recipe.base import RecipeErrors, validate
    from megacli.recipe.pretrain import TrainingRecipe

    try:
        return validate(TrainingRecipe, trust.carried(raw), source)
    except RecipeErrors as exc:
        raise UserError(f"{source}: its recipe does not validate: " + "; ".join(exc.problems)) from None


def _from_megacli(ckpt: Path) -> CheckpointRecipe:
    from megacli.checkpoint.layout import RECIPE, read_recipe

    raw = read_recipe(ckpt)
    if not raw:
        raise UserError(f"{ckpt}: the checkpoint carries no {RECIPE}")
    source = f"megacli checkpoint {ckpt}"
    return CheckpointRecipe(_validated(raw, source), source, [],
                            [f"to continue this run: --set checkpoint.resume={ckpt}"])


def _from_megatron_lm(source: Source, kind: str) -> CheckpointRecipe:
    from megacli.checkpoint.megatron_lm.args import arg
    from megacli.checkpoint.megatron_lm.args_to_recipe import recipe_from_args
    from megacli.checkpoint.megatron_lm.args import args_not_reproduced

    src = source.path
    if kind == "megatron-lm":
        from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint

        ck = MegatronLMCheckpoint(source)
        raw = ck.recipe()
        if raw is None:
            raise UserError(f"{src}: its model has no megacli recipe: " + "; ".join(ck.unmapped()))
        not_mapped = ck.not_mapped()
        label = "Megatron-LM torch_dist checkpoint"
    else:
        from megacli.checkpoint.megatron_lm.legacy_reader import LegacyCheckpoint

        ck = LegacyCheckpoint(source)
        raw = recipe_from_args(ck)
        not_mapped = ck.tokenizer_not_found()
        label = "Megatron-LM legacy checkpoint"
    source = f"{label} {src} (iteration {ck.iteration}), from its run's args"
    steps = []
    data = raw.get("data") or {}
    if data.get("path") or data.get("blend"):
        steps.append("data: the run's --data-path; set data.path (or data.blend) to where the data is on this machine")
    else:
        steps.append("data: the run's args name no --data-path; set data.path (or data.mock: true)")
    steps.append(f"to continue this run: --set checkpoint.resume={src}")
    if arg(ck.args, "tokenizer_type") and not ck.tokenizer_not_found():
        steps.append(f"tokenizer: {raw['tokenizer'].get('path')} (found from the run's args)")
    recipe = _validated(raw, source)
    not_mapped += args_not_reproduced(ck.args, recipe)
    return CheckpointRecipe(recipe, source, not_mapped, steps)


def _from_hf(source: Source) -> CheckpointRecipe:
    from megacli.convert import families, hf_io
    from megacli.checkpoint.hf_config import read_config
    from megacli.convert.run import tokenizer_section
    from megacli.precision import precision_of

    src = source.path
    config = read_config(src / hf_io.CONFIG)
    family, arch = families.for_hf_config(config)
    model = family.model_section(config)
    present = [name for name in ("tokenizer.json", "tokenizer.model") if (src / name).is_file()]
    precision = precision_of(hf_io.HFWeights(source).dtype())
    raw = {"model": model, "tokenizer": tokenizer_section(src, present), "train": {"precision": precision},
           "data": {"mock": True} if model["arch"] == "gpt" else {"path": "SET/data.path/TO/A/PREFIX_text_sentence"}}
    source = f"Hugging Face {arch} directory {src}"
    notes = list(getattr(family, "import_notes", lambda _config: [])(config))
    steps = [f"weights: convert them first (megacli convert {src} CKPT), then --set checkpoint.pretrained=CKPT "
             f"(finetune) or checkpoint.resume=CKPT",
             "data: set data.path (the recipe names " + ("mock data)" if model["arch"] == "gpt" else "a placeholder)")]
    return CheckpointRecipe(_validated(raw, source), source, notes, steps)


def render(found: CheckpointRecipe) -> str:
    """The recipe file: a header naming its source, what does not map and what to set, then every
    field of the resolved recipe."""
    from megacli.recipe.base import dump
    from megacli.recipe.schema import schema_path

    lines = [f"# yaml-language-server: $schema={schema_path('pretrain')}",
             f"# The recipe of the {found.source}; written by `megacli recipe from`."]
    if found.not_mapped:
        lines.append("# Not mapped (the checkpoint's run has these; this recipe does not):")
        lines += [f"#   - {item}" for item in found.not_mapped]
    if found.next_steps:
        lines.append("# Before running:")
        lines += [f"#   - {item}" for item in found.next_steps]
    return "\n".join(lines) + "\n" + dump(found.recipe)
