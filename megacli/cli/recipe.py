"""`megacli recipe`: what a recipe may hold (schema, explain), what one resolves to (show), and the
recipe that reproduces a checkpoint (from)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from megacli.cli.common import TRUST_PICKLE_HELP, SetOpt, guarded, write_whole
from megacli.cli.root import app

recipe_app = typer.Typer(
    help="Recipes: their JSON Schema, what a field means and which rules involve it, a recipe resolved, "
         "and the recipe that reproduces a checkpoint.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(recipe_app, name="recipe")

KindOpt = Annotated[Optional[str], typer.Option("--kind", "-k", help="Recipe kind: pretrain, finetune, preprocess, "
                                                "generate, eval, reshard or convert.", show_default=False)]


def _check_kind(kind: str) -> str:
    from megacli.errors import UserError
    from megacli.recipe.jobs import KINDS

    if kind not in KINDS:
        raise UserError(f"recipe kind {kind!r}: expected one of {', '.join(KINDS)}")
    return kind


@recipe_app.command("schema", help="Print the JSON Schema of a recipe kind (default pretrain; finetune recipes use the "
                                   "pretrain schema). The shipped copies are in recipes/schemas/.")
@guarded
def schema_command(kind: Annotated[str, typer.Argument(help="pretrain, finetune, preprocess, generate, eval, reshard "
                                                            "or convert.")] = "pretrain") -> None:
    from megacli.recipe.schema import schema_text

    typer.echo(schema_text(_check_kind(kind)), nl=False)


@recipe_app.command("explain", help="A field's type, default, allowed values and description, and the cross-field "
                                    "rules of the recipe checks that involve it.")
@guarded
def explain_command(field: Annotated[str, typer.Argument(help="Dotted field, e.g. model.ffn_hidden_size.",
                                                         show_default=False)],
                    kind: KindOpt = None) -> None:
    from megacli.recipe.explain import explain

    typer.echo(explain(field, _check_kind(kind or "pretrain")))


@recipe_app.command("show", help="Print the resolved recipe (every field, defaults included, --set applied) as YAML, "
                                 "without the dry run's layout and memory tables.")
@guarded
def show_command(recipe: Annotated[Path, typer.Argument(help="YAML recipe.", show_default=False)],
                 set_: SetOpt = None, kind: KindOpt = None) -> None:
    from megacli.recipe.base import dump, load
    from megacli.recipe.jobs import kind_of_recipe, recipe_model

    kind = _check_kind(kind or kind_of_recipe(recipe))
    typer.echo(dump(load(recipe_model(kind), recipe, set_ or [])), nl=False)


@recipe_app.command("from", help="Write the training recipe that reproduces a checkpoint: a megacli checkpoint, a "
                                 "Megatron-LM torch_dist or legacy checkpoint (its args mapped; what does not map is "
                                 "listed in a comment) or a Hugging Face directory.")
@guarded
def from_command(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint (run or iteration directory) or Hugging Face directory.",
                                               show_default=False)],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the recipe here (default: print it).",
                                                   show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing --output file.")] = False,
    trusted: Annotated[bool, typer.Option("--trust-pickle", help=TRUST_PICKLE_HELP)] = False,
) -> None:
    from megacli.checkpoint.source import user_source
    from megacli.convert.recipe_of import recipe_of, render
    from megacli.errors import UserError

    if output is not None and output.is_dir():
        raise UserError(f"{output} is a directory; give a file name such as {output / 'recipe.yaml'}")
    if output is not None and output.exists() and not force:
        raise UserError(f"{output} exists; pass --force to replace it")
    text = render(recipe_of(user_source(checkpoint, trusted)))
    if output is None:
        typer.echo(text, nl=False)
        return
    write_whole(output, text)
    typer.echo(f"wrote {output}", err=True)
