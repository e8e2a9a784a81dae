"""`megacli preprocess --dry-run`: the resolved recipe, the inputs (sizes, record counts), the
tokenizer and the files a run would write, without tokenizing anything."""

from __future__ import annotations

import os


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def print_preprocess_plan(recipe) -> None:
    from rich.table import Table
    from rich.text import Text

    from megacli.cli.common import output_console
    from megacli.cli.plan_view import print_recipe
    from megacli.data import indexed, readers
    from megacli.data.fast_tokenize import accelerate, describe_encoder
    from megacli.data.preprocess import default_workers, job_from_recipe, sample_texts
    from megacli.data.survey import count_records
    from megacli.data.tokenizers import describe_specials, load_tokenizer

    console = output_console()
    print_recipe(recipe, console)
    job = job_from_recipe(recipe)
    sources = readers.resolve_sources(job.inputs, job.input_format, job.split)

    inputs = Table(title="inputs")
    for column, justify in (("file", "left"), ("format", "left"), ("size", "right"), ("records", "right")):
        inputs.add_column(column, justify=justify, overflow="fold")
    total, exact = 0, True
    for source in sources:
        count = count_records(source, document_per_line=job.document_per_line)
        total += count.records
        exact = exact and count.exact
        records = f"{count.records:,}" if count.exact else f"~{count.records:,} (from the first {_bytes(count.sampled)})"
        fmt = source.format + (" (gzip)" if source.compressed else "")
        inputs.add_row(source.path, fmt, _bytes(source.size), records)
    inputs.add_row("total", "", _bytes(sum(s.size for s in sources)), f"{'' if exact else '~'}{total:,}")
    console.print(inputs)

    tokenizer = load_tokenizer(type=job.tokenizer_type, path=job.tokenizer_path)
    tok = Table(title="tokenizer", show_header=False)
    tok.add_row("type", job.tokenizer_type)
    tok.add_row("path", str(job.tokenizer_path or "(none: built in)"))
    tok.add_row("vocabulary", f"{tokenizer.vocab_size:,} ids, {describe_specials(tokenizer)}")
    encoder, note = accelerate(tokenizer, lambda: sample_texts(sources, job))
    tok.add_row("encoder", Text(describe_encoder(encoder) + (f"\n({note})" if note else "")))
    tok.add_row("per document", ", ".join(filter(None, ["BOS first" if job.add_bos else "", "EOD appended" if job.append_eod else "",
                                                        f"split into sentences ({job.lang})" if job.split_sentences else ""])) or "as is")
    console.print(tok)

    outputs = Table(title=f"outputs ({indexed.optimal_dtype(tokenizer.vocab_size).name} tokens)")
    outputs.add_column("key")
    outputs.add_column("files", overflow="fold")
    outputs.add_column("now")
    for key in job.keys:
        prefix = job.prefix_of(key)
        files = [indexed.bin_path(prefix), indexed.idx_path(prefix)]
        now = "exist: would be replaced" if any(os.path.exists(f) for f in files) else "new"
        outputs.add_row(key, "\n".join(files), now)
    console.print(outputs)
    workers = default_workers() if job.workers is None else job.workers
    parts = f"; written as {job.partitions} partitions (PREFIX.partIofN), merged, then removed" if job.partitions > 1 else ""
    console.print(f"{workers} worker process(es){parts}. Nothing was written (--dry-run).", soft_wrap=True)
