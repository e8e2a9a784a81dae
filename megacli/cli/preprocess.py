"""`megacli preprocess`: corpus -> Megatron indexed datasets; `merge` and `inspect` beside it."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from megacli.cli.root import app
from megacli.cli.common import DefaultCommandGroup, RecipeArg, SetOpt, fail, guarded, output_console


class PreprocessGroup(DefaultCommandGroup):
    """Reads Megatron-LM's preprocess_data.py spellings (see megatron_spellings) for the default command."""

    def parse_args(self, ctx, args):
        if args and (args[0] == "run" or args[0] not in self.commands):
            from rich.markup import escape

            from megacli.cli.megatron_spellings import translate_argv
            from megacli.errors import UserError

            try:
                args = translate_argv(args)
            except UserError as exc:
                raise fail(escape(str(exc))) from None
        return super().parse_args(ctx, args)


preprocess_app = typer.Typer(
    cls=PreprocessGroup,
    help="Turn a corpus (JSONL, text, Parquet, datasets) into Megatron indexed datasets (.bin/.idx).\n\n"
         "megacli preprocess RECIPE [--set k=v] | megacli preprocess --input F --output-prefix P --tokenizer T [...]",
    no_args_is_help=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(preprocess_app, name="preprocess")

_ONE_OFF = "one-off options (override the recipe)"
_MEGATRON = "Megatron-LM's spellings (tools/preprocess_data.py)"


@preprocess_app.command("run", help="Preprocess a corpus from a recipe and/or Megatron-LM-style options (the default command).")
@guarded
def run_command(
    recipe: RecipeArg = None,
    set_: SetOpt = None,
    input: Annotated[Optional[List[str]], typer.Option("--input", "-i", help="Corpus file, directory or glob (repeatable).", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    output_prefix: Annotated[Optional[str], typer.Option("--output-prefix", "-o", help="Output prefix: writes PREFIX_KEY_document.bin/.idx.", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    json_keys: Annotated[Optional[List[str]], typer.Option("--json-keys", help="JSON keys to tokenize: --json-keys text title, repeated, or comma-separated (default text).", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", "-t", help="'byte' (the default), a Hugging Face tokenizer directory, a SentencePiece .model or a WordPiece vocab .txt.", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    append_eod: Annotated[Optional[bool], typer.Option("--append-eod/--no-append-eod", help="Append the end-of-document token to each document.", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    add_bos: Annotated[Optional[bool], typer.Option("--add-bos/--no-add-bos", help="Prepend the beginning-of-sequence token to each document.", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    split_sentences: Annotated[Optional[bool], typer.Option("--split-sentences/--no-split-sentences", help="Split documents into sentences (nltk Punkt).", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    keep_newlines: Annotated[Optional[bool], typer.Option("--keep-newlines/--no-keep-newlines", help="Keep newlines between sentences when splitting.", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    workers: Annotated[Optional[int], typer.Option("--workers", "-w", help="Worker processes (default: all cores; 0 = none).", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    partitions: Annotated[Optional[int], typer.Option("--partitions", help="Write in this many resumable partitions, then merge.", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    input_format: Annotated[Optional[str], typer.Option("--input-format", help="auto, jsonl, text, parquet, arrow or hf.", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    skip_bad_records: Annotated[Optional[bool], typer.Option("--skip-bad-records/--stop-on-bad-records", help="Skip malformed records (counted) instead of stopping.", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    lang: Annotated[Optional[str], typer.Option("--lang", help="Punkt language for --split-sentences.", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    progress: Annotated[Optional[bool], typer.Option("--progress/--no-progress", help="Show the progress bar.", rich_help_panel=_ONE_OFF, show_default=False)] = None,
    tokenizer_type: Annotated[Optional[str], typer.Option("--tokenizer-type", help="HuggingFaceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer (adds a BOS), BertWordPieceLowerCase, BertWordPieceCase, GPT2BPETokenizer; with the file options below (instead of --tokenizer).", rich_help_panel=_MEGATRON, show_default=False)] = None,
    tokenizer_model: Annotated[Optional[str], typer.Option("--tokenizer-model", help="Hugging Face tokenizer directory or SentencePiece .model.", rich_help_panel=_MEGATRON, show_default=False)] = None,
    vocab_file: Annotated[Optional[str], typer.Option("--vocab-file", help="WordPiece vocab.txt, or GPT-2's vocab.json (beside its tokenizer.json).", rich_help_panel=_MEGATRON, show_default=False)] = None,
    merge_file: Annotated[Optional[str], typer.Option("--merge-file", help="GPT-2's merges.txt (beside vocab.json and tokenizer.json).", rich_help_panel=_MEGATRON, show_default=False)] = None,
    log_interval: Annotated[Optional[int], typer.Option("--log-interval", help="Accepted; the progress bar reports continuously, so N is not used.", rich_help_panel=_MEGATRON, show_default=False)] = None,
    keep_sequential_samples: Annotated[bool, typer.Option("--keep-sequential-samples", help="Accepted; megacli keeps the input order with any --partitions.", rich_help_panel=_MEGATRON)] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the resolved recipe, the inputs (sizes, record counts), the tokenizer and the files it would write; write nothing.")] = False,
) -> None:
    from rich.console import Console

    from megacli.data.preprocess import job_from_recipe, run as run_job
    from megacli.data.preprocess_report import summary_table
    from megacli.data.tokenizers import guess_tokenizer_type
    from megacli.errors import UserError
    from megacli.recipe.base import apply_overrides, read_yaml, validate
    from megacli.recipe.preprocess import PreprocessRecipe

    raw = read_yaml(recipe) if recipe is not None else {}
    section = dict(raw.get("preprocess") or {})
    given = {
        "input": input, "output_prefix": output_prefix, "append_eod": append_eod, "add_bos": add_bos,
        "split_sentences": split_sentences, "keep_newlines": keep_newlines, "workers": workers,
        "partitions": partitions, "input_format": input_format, "skip_bad_records": skip_bad_records,
        "lang": lang, "progress": progress,
        "json_keys": [k for item in json_keys for k in item.split(",") if k] if json_keys else None,
    }
    section.update({k: v for k, v in given.items() if v is not None})
    if recipe is None and not section.get("input"):
        raise UserError("give a recipe, or --input and --output-prefix (see megacli preprocess --help)")
    raw["preprocess"] = section
    if tokenizer is not None:
        kind, path = guess_tokenizer_type(tokenizer)
        raw["tokenizer"] = {"type": kind, "path": path}
    if tokenizer_type or tokenizer_model or vocab_file or merge_file:
        if tokenizer is not None:
            raise UserError("give --tokenizer or Megatron-LM's --tokenizer-type/--tokenizer-model/--vocab-file, not both")
        from megacli.cli.megatron_spellings import megatron_tokenizer

        raw["tokenizer"], implied = megatron_tokenizer(tokenizer_type, model=tokenizer_model, vocab_file=vocab_file,
                                                       merge_file=merge_file, split_sentences=bool(section.get("split_sentences")))
        section.update(implied)
    raw = apply_overrides(raw, set_ or [])
    source = str(recipe) if recipe is not None else "(command line)"
    resolved = validate(PreprocessRecipe, raw, source)
    if dry_run:
        from megacli.cli.preprocess_view import print_preprocess_plan

        print_preprocess_plan(resolved)
        return

    result = run_job(job_from_recipe(resolved))
    out = output_console()
    out.print(summary_table(result))
    stats = result.stats
    err = Console(stderr=True, highlight=False, emoji=False)
    if stats.documents == 0:
        err.print("[yellow]warning:[/] the input held no documents: the dataset is empty and cannot be trained on",
                  soft_wrap=True)
    if stats.skipped:
        err.print(f"[yellow]skipped {stats.skipped:,} bad record(s)[/], for example:", soft_wrap=True)
        for line in stats.skipped_examples:
            err.print(f"  {line}", markup=False, soft_wrap=True)


@preprocess_app.command("merge", help="Concatenate indexed datasets (same dtype), in the order given, into one.")
@guarded
def merge_command(
    inputs: Annotated[List[str], typer.Argument(help="Dataset prefixes (PREFIX or PREFIX.bin/.idx) to join, in order.", show_default=False)],
    output: Annotated[str, typer.Option("--output", "-o", help="Prefix of the merged dataset.", show_default=False)],
) -> None:
    from rich.console import Console

    from megacli.data import indexed

    prefixes = [indexed.strip_suffix(p) for p in inputs]
    writer = indexed.merge(prefixes, indexed.strip_suffix(output))
    Console(highlight=False).print(
        f"merged {len(prefixes)} dataset(s) into {writer.prefix}.bin/.idx: {writer.documents:,} documents, "
        f"{writer.sequences:,} sequences, {writer.tokens:,} tokens ({writer.dtype.name})", soft_wrap=True)


@preprocess_app.command("inspect", help="Show an indexed dataset: counts, dtype, length histogram, first documents.")
@guarded
def inspect_command(
    prefix: Annotated[str, typer.Argument(help="Dataset prefix (PREFIX or PREFIX.bin/.idx).", show_default=False)],
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", "-t", help="Decode documents with this tokenizer ('byte', a HF directory, a .model, a vocab .txt).", show_default=False)] = None,
    docs: Annotated[int, typer.Option("--docs", "-n", help="How many documents to show.")] = 3,
    chars: Annotated[int, typer.Option("--chars", help="Characters to show per document.")] = 400,
) -> None:
    from megacli.data.indexed_contents import inspect_dataset, render
    from megacli.data.tokenizers import guess_tokenizer_type, load_tokenizer

    tok = None
    if tokenizer is not None:
        kind, path = guess_tokenizer_type(tokenizer)
        tok = load_tokenizer(type=kind, path=path)
    render(inspect_dataset(prefix, tok, docs=docs, max_chars=chars), output_console())

