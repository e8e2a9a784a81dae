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


@app.command(help="Convert checkpoints: Hugging Face ⇄ megacli (GPT-2, Llama, Mistral, Qwen2) at any TP/PP, "
                  "Megatron-LM legacy -> either; --print-structure lists any checkpoint's tensors.")
@guarded
def convert(
    paths: PathsArg = None,
    to: Annotated[Optional[str], typer.Option("--to", help="Target format: hf or megacli (default: megacli from HF and "
                                                           "legacy sources, hf from megacli).", show_default=False)] = None,
    tensor: Annotated[Optional[int], typer.Option("--tensor", help="Tensor-parallel size a megacli result is prepared for "
                                                                   "(vocabulary padding, recipe.yaml).", show_default=False)] = None,
    pipeline: Annotated[Optional[int], typer.Option("--pipeline", help="Pipeline-parallel size (recipe.yaml).", show_default=False)] = None,
    virtual_pipeline: Annotated[Optional[int], typer.Option("--virtual-pipeline", help="Virtual pipeline stages (recipe.yaml).",
                                                            show_default=False)] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="fp32, bf16 or fp16 (default: the source's).", show_default=False)] = None,
    max_shard_size: Annotated[Optional[str], typer.Option("--max-shard-size", help="HF export: largest shard, e.g. 2GB.",
                                                          show_default=False)] = None,
    print_structure: Annotated[bool, typer.Option("--print-structure", help="List keys, shapes and dtypes of PATH.")] = False,
    trust_pickle: Annotated[bool, typer.Option("--trust-pickle", help=TRUST_PICKLE_HELP)] = False,
    set_: SetOpt = None,
) -> None:
    from megacli.errors import UserError

    paths = paths or []
    if print_structure:
        if len(paths) != 1:
            raise UserError("--print-structure takes one PATH (an HF directory, a megacli or a Megatron-LM legacy checkpoint)")
        from megacli.convert.structure import structure

        for line in structure(Path(paths[0]), trust_pickle=trust_pickle):
            typer.echo(line)
        return
    flags = {"convert.to": to, "convert.dtype": dtype, "convert.max_shard_size": max_shard_size,
             "parallel.tensor": tensor, "parallel.pipeline": pipeline, "parallel.virtual_pipeline": virtual_pipeline}
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None]
    if trust_pickle:
        overrides.append("convert.trust_pickle=true")
    recipe = _load_recipe(paths, overrides + list(set_ or []))
    from megacli.convert import convert as run

    c = recipe.convert
    dst = run(c.source, c.destination, to=c.to, parallel=recipe.parallel, dtype=c.dtype, max_shard_size=c.max_shard_size,
              trust_pickle=c.trust_pickle, say=typer.echo)
    typer.echo(f"wrote {dst}")


def _load_recipe(paths: list[str], overrides: list[str]):
    from megacli.errors import UserError
    from megacli.recipe import base
    from megacli.recipe.convert import ConvertRecipe

    if len(paths) == 1 and paths[0].endswith((".yaml", ".yml")):
        return base.load(ConvertRecipe, paths[0], overrides)
    if len(paths) == 2:
        raw = base.apply_overrides({"convert": {"source": paths[0], "destination": paths[1]}}, overrides)
        return base.validate(ConvertRecipe, raw, f"convert {paths[0]} {paths[1]}")
    raise UserError("usage: megacli convert RECIPE.yaml | megacli convert SRC DST [options] | "
                    "megacli convert PATH --print-structure")
