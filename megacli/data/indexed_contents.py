"""`megacli preprocess inspect`: what an indexed dataset holds — counts, dtype, a histogram of
document lengths and the first documents (decoded when a tokenizer is given)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megacli.data import indexed
from megacli.data.tokenizer_base import Tokenizer
from megacli.errors import UserError


@dataclass
class Report:
    prefix: str
    dtype: str
    documents: int
    sequences: int
    tokens: int
    bin_bytes: int
    min_len: int
    mean_len: float
    max_len: int
    histogram: list[tuple[str, int]]  # (length range, documents)
    samples: list[tuple[int, int, str]]  # (document, tokens, text or ids)


def length_histogram(lengths: np.ndarray) -> list[tuple[str, int]]:
    """Documents per power-of-two length bucket: 0, 1, 2-3, 4-7, ..."""
    if lengths.size == 0:
        return []
    buckets = np.zeros(lengths.size, np.int64)
    nonzero = lengths > 0
    buckets[nonzero] = np.floor(np.log2(lengths[nonzero])).astype(np.int64) + 1
    counts = np.bincount(buckets)
    rows = []
    for b, n in enumerate(counts):
        if b == 0:
            label = "0"
        else:
            lo, hi = 1 << (b - 1), (1 << b) - 1
            label = str(lo) if lo == hi else f"{lo}-{hi}"
        rows.append((label, int(n)))
    # drop empty buckets at the ends only, so gaps in the middle stay visible
    while rows and rows[0][1] == 0:
        rows.pop(0)
    while rows and rows[-1][1] == 0:
        rows.pop()
    return rows


def inspect_dataset(prefix: str, tokenizer: Optional[Tokenizer] = None, docs: int = 3, max_chars: int = 400) -> Report:
    prefix = indexed.strip_suffix(prefix)
    if not indexed.exists(prefix):
        raise UserError(f"{prefix}: no {prefix}.bin/{prefix}.idx pair")
    index = indexed.read_index(prefix)
    if tokenizer is not None and index.dtype == np.uint16 and tokenizer.vocab_size > 65535:
        raise UserError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids; this dataset's uint16 tokens cannot hold them")
    lengths = index.document_lengths()
    bin_bytes = os.path.getsize(indexed.bin_path(prefix))
    expected = int(index.total_tokens) * index.dtype.itemsize
    if bin_bytes != expected:
        raise UserError(f"{prefix}.bin has {bin_bytes} bytes, the index describes {expected}: the pair does not match")
    samples = []
    for d in range(min(docs, index.document_count)):
        ids = indexed.read_document(prefix, index, d)
        if tokenizer is not None:
            text = tokenizer.decode(ids.tolist())
        else:
            text = " ".join(map(str, ids[:200].tolist())) + (" ..." if ids.size > 200 else "")
        if len(text) > max_chars:
            text = text[:max_chars] + " ..."
        samples.append((d, int(ids.size), text))
    return Report(
        prefix=prefix, dtype=index.dtype.name, documents=index.document_count, sequences=index.sequence_count,
        tokens=index.total_tokens, bin_bytes=bin_bytes,
        min_len=int(lengths.min()) if lengths.size else 0,
        mean_len=float(lengths.mean()) if lengths.size else 0.0,
        max_len=int(lengths.max()) if lengths.size else 0,
        histogram=length_histogram(lengths), samples=samples,
    )


def render(report: Report, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    head = Table(title=f"{report.prefix}", show_header=False, title_justify="left", min_width=len(str(report.prefix)))
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_row("documents", f"{report.documents:,}")
    head.add_row("sequences", f"{report.sequences:,}")
    head.add_row("tokens", f"{report.tokens:,}")
    head.add_row("dtype", report.dtype)
    head.add_row(".bin size", f"{report.bin_bytes:,} bytes")
    head.add_row("tokens per document", f"min {report.min_len:,} · mean {report.mean_len:,.1f} · max {report.max_len:,}")
    console.print(head)
    if report.histogram:
        hist = Table(title="document length (tokens)", title_justify="left")
        hist.add_column("tokens", justify="right")
        hist.add_column("documents", justify="right")
        hist.add_column("")
        top = max(n for _, n in report.histogram) or 1
        for label, n in report.histogram:
            hist.add_row(label, f"{n:,}", "█" * max(1 if n else 0, round(30 * n / top)))
        console.print(hist)
    for d, n, text in report.samples:
        console.print(f"[bold]document {d}[/] ({n:,} tokens)")
        console.print(escape(text), soft_wrap=True)
