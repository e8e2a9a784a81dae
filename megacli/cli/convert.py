"""`megacli convert`: a recipe (``megacli convert RECIPE``) or one-off (``megacli convert SRC DST``)
conversion between Hugging Face, megacli and Megatron-LM legacy checkpoints, or
``--print-structure PATH``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from megacli.cli.root import app
from megacli.cli.common import TRUST_PICKLE_HELP, SetOpt, guarded

PathsArg = Annotated[Optional[List[str]], typer.Argument(metavar="[RECIPE | SRC DST | PATH]",
    help="RECIPE (YAML with a convert: section), or SRC DST, or PATH with --print-structure.", show_default=False)]


@app.command(help="Convert checkpoints: Hugging Face ⇄ megacli (GPT-2, Llama, Mistral, Qwen2/3, Mixtral, "
                  "Qwen-MoE, OLMo 2, Phi-3, Gemma 2/3, DeepSeek V2/V3, BERT, T5) at any TP/PP, "
                  "Megatron-LM (legacy, torch_dist) -> either, HF or megacli -> Megatron-LM torch_dist (--to megatron); "
                  "--print-structure lists any checkpoint's tensors.")
@guarded
def convert(
    paths: PathsArg = None,
    to: Annotated[Optional[str], typer.Option("--to", help="Target format: hf, megacli or megatron (Megatron-LM torch_dist; "
                                                           "default: megacli from HF and Megatron-LM sources, hf from "
                                                           "megacli).", show_default=False)] = None,
    spec: Annotated[Optional[str], typer.Option("--spec", help="--to megatron: Megatron-LM layer spec, te (default) or "
                                                               "local.", show_default=False)] = None,
    tensor: Annotated[Optional[int], typer.Option("--tensor", help="Tensor-parallel size a megacli result is prepared for "
                                                                   "(vocabulary padding, recipe.yaml).", show_default=False)] = None,
    pipeline: Annotated[Optional[int], typer.Option("--pipeline", help="Pipeline-parallel size (recipe.yaml).", show_default=False)] = None,
    virtual_pipeline: Annotated[Optional[int], typer.Option("--virtual-pipeline", help="Virtual pipeline stages (recipe.yaml).",
                                                            show_default=False)] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="fp32, bf16 or fp16 (default: the source's).", show_default=False)] = None,
    max_shard_size: Annotated[Optional[str], typer.Option("--max-shard-size", help="HF export: largest shard, e.g. 2GB.",
                                                          show_default=False)] = None,
    print_structure: Annotated[bool, typer.Option("--print-structure", help="List keys, shapes and dtypes of PATH.")] = False,
    trusted: Annotated[bool, typer.Option("--trust-pickle", help=TRUST_PICKLE_HELP)] = False,
    set_: SetOpt = None,
) -> None:
    from megacli.errors import UserError

    paths = paths or []
    if print_structure:
        if len(paths) != 1:
            raise UserError("--print-structure takes one PATH (an HF directory, a megacli or a Megatron-LM legacy checkpoint)")
        from megacli.checkpoint.source import user_source
        from megacli.convert.structure import structure

        for line in structure(user_source(paths[0], trusted)):
            typer.echo(line)
        return
    flags = {"convert.to": to, "convert.spec": spec, "convert.dtype": dtype, "convert.max_shard_size": max_shard_size,
             "parallel.tensor": tensor, "parallel.pipeline": pipeline, "parallel.virtual_pipeline": virtual_pipeline}
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None]
    recipe = _load_recipe(paths, overrides + list(set_ or []), trusted=trusted)
    c = recipe.convert
    if c.to == "megatron":
        dst = _to_megatron(c, tensor=tensor, pipeline=pipeline, virtual_pipeline=virtual_pipeline)
        typer.echo(f"wrote {dst}")
        return
    from megacli.checkpoint.source import user_source
    from megacli.convert import convert as run

    dst = run(user_source(c.source, c), c.destination, to=c.to, parallel=recipe.parallel, dtype=c.dtype,
              max_shard_size=c.max_shard_size, say=typer.echo)
    typer.echo(f"wrote {dst}")


def _load_recipe(paths: list[str], overrides: list[str], *, trusted: bool = False):
    """The convert recipe: RECIPE or SRC DST, then the flags and --set; ``trusted`` (the user's
    --trust-pickle) grants the convert section's pickle trust."""
    from megacli.errors import UserError
    from megacli.recipe import base, trust
    from megacli.recipe.convert import ConvertRecipe

    if len(paths) == 1 and paths[0].endswith((".yaml", ".yml")):
        raw, source = base.read_yaml(paths[0]), paths[0] + (" with --set " + " ".join(overrides) if overrides else "")
    elif len(paths) == 2:
        raw, source = {"convert": {"source": paths[0], "destination": paths[1]}}, f"convert {paths[0]} {paths[1]}"
    else:
        raise UserError("usage: megacli convert RECIPE.yaml | megacli convert SRC DST [options] | "
                        "megacli convert PATH --print-structure")
    if trusted:
        trust.grant_pickles(raw, "convert")
    return base.validate(ConvertRecipe, base.apply_overrides(raw, overrides), source)


def _to_megatron(c, *, tensor, pipeline, virtual_pipeline) -> Path:
    """A Megatron-LM torch_dist checkpoint from a megacli or Megatron-LM legacy checkpoint (through
    reshard, with its optimizer state), or from an HF model (its weights converted as they are
    written)."""
    from megacli.checkpoint.source import HF, user_source
    from megacli.errors import UserError
    from megacli.recipe.reshard import ReshardSection
    from megacli.recipe.sections import ParallelSection
    from megacli.reshard import core
    from megacli.reshard.view import print_result
    from rich.console import Console

    src, dst = Path(c.source).expanduser(), Path(c.destination).expanduser()
    given = user_source(src, c)
    if c.dtype is not None:
        raise UserError("--dtype with --to megatron: a Megatron-LM checkpoint keeps the source's precision (its "
                        "optimizer state belongs to it); convert to megacli with --dtype first")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UserError(f"{dst} exists and is not empty; choose a new or empty directory")
    job = ReshardSection(source=str(src), output=str(dst), tensor=tensor, pipeline=pipeline,
                         virtual_pipeline=virtual_pipeline, format="megatron", spec=c.spec,
                         progress=False, overwrite=dst.exists())
    if given.kind == HF:
        from megacli.convert.run import hf_plan, hf_tokenizer_section, pipeline_split, resolve_source

        layout = ParallelSection(tensor=tensor or 1, pipeline=pipeline or 1, virtual_pipeline=virtual_pipeline)
        source = resolve_source(given)
        plan, arch = hf_plan(source, parallel=layout, dtype=None, tokenizer=hf_tokenizer_section(source.path),
                             resume=dst.resolve(), say=typer.echo, per_rank_chunks=True)
        typer.echo(pipeline_split(plan.recipe, asked=layout))
        result = core.export_converted(job, plan, source_layout=f"Hugging Face {arch}")
    else:
        result = core.reshard(job, source=given)
    print_result(result, Console(highlight=False))
    return dst
