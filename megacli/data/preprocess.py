"""The preprocessing pipeline: corpus -> ``{prefix}_{key}_{document|sentence}.bin/.idx``.

The main process only reads raw chunks (``readers``), hands them to worker processes and writes
the results in input order; the workers parse JSON, split sentences and tokenize a whole chunk
per batched tokenizer call, returning numpy arrays. At most two chunks per worker are in flight,
so memory stays flat for any corpus size. Output is byte-identical to Megatron-LM's
``tools/preprocess_data.py`` for the same input, tokenizer and options, whatever the number of
workers or partitions.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from megacli.data import indexed, readers
from megacli.data.tokenizers import Tokenizer, load_tokenizer
from megacli.errors import UserError

MB = 1024 * 1024


@dataclass(frozen=True)
class Options:
    """What a worker needs to know besides the tokenizer (picklable)."""

    keys: tuple[str, ...]
    split_sentences: bool
    keep_newlines: bool
    lang: str
    append_eod: bool
    add_bos: bool
    dtype: str


@dataclass
class Encoded:
    """One chunk, tokenized: per key (tokens, sequence lengths, sequences per document)."""

    source: readers.Source
    arrays: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    errors: list[tuple[int, str]]
    records: int
    nbytes: int


@dataclass
class Stats:
    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    bytes_in: int = 0
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)


# ---- worker side ----
_worker: dict = {}


def _init_worker(tokenizer: Tokenizer, options: Options, quiet_signals: bool) -> None:
    if quiet_signals:
        # Ctrl-C is the parent's to handle; workers are terminated by it (SIGTERM, default action:
        # the parent's SIGTERM handler, inherited through fork, must not run here).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker["tokenizer"] = tokenizer
    _worker["options"] = options
    if options.split_sentences:
        from megacli.data.sentences import SentenceSplitter

        _worker["splitter"] = SentenceSplitter(options.keep_newlines, options.lang)


def encode_chunk(chunk: readers.Chunk) -> Encoded:
    tok: Tokenizer = _worker["tokenizer"]
    opt: Options = _worker["options"]
    parsed = readers.parse_chunk(chunk, list(opt.keys))
    arrays = {key: _encode_documents(parsed.values[key], tok, opt) for key in opt.keys}
    return Encoded(chunk.source, arrays, parsed.errors, parsed.records, chunk.nbytes)


def _encode_documents(docs: list, tok: Tokenizer, opt: Options):
    """Tokenize documents as Megatron-LM does: each sentence (or the whole text) separately, empty
    sequences dropped, eod appended to the last sequence of a non-empty document."""
    dtype = np.dtype(opt.dtype)
    prefix = [tok.bos] if opt.add_bos else []
    if not opt.split_sentences and all(type(d) is str for d in docs):
        seqs = tok.encode_batch(docs)
        per_doc = np.fromiter((1 if s else 0 for s in seqs), np.int64, len(seqs))
        seqs = [s for s in seqs if s]
    else:
        splitter = _worker.get("splitter")
        pieces: list[list[str]] = [d if isinstance(d, list) else (splitter(d) if splitter else [d]) for d in docs]
        flat = tok.encode_batch(list(chain.from_iterable(pieces))) if pieces else []
        seqs, counts, at = [], [], 0
        for p in pieces:
            kept = [s for s in flat[at:at + len(p)] if s]
            at += len(p)
            seqs.extend(kept)
            counts.append(len(kept))
        per_doc = np.asarray(counts, np.int64)
    # seqs holds only non-empty sequences; mark each document's first and last of them
    if opt.append_eod or prefix:
        ends = np.cumsum(per_doc)[per_doc > 0]
        if opt.append_eod:
            for e in ends:
                seqs[e - 1].append(tok.eod)
        if prefix:
            for s in ends - per_doc[per_doc > 0]:
                seqs[s] = prefix + seqs[s]
    lengths = np.fromiter(map(len, seqs), np.int32, len(seqs))
    tokens = np.fromiter(chain.from_iterable(seqs), dtype, int(lengths.sum(dtype=np.int64)))
    return tokens, lengths, per_doc


# ---- main side ----
@dataclass
class Job:
    """Everything one run needs (built from a PreprocessRecipe by ``job_from_recipe``)."""

    inputs: list[str]
    output_prefix: str
    keys: list[str]
    tokenizer_type: str
    tokenizer_path: Optional[str]
    input_format: str = "auto"
    split: str = "train"
    document_per_line: bool = True
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    append_eod: bool = False
    add_bos: bool = False
    workers: Optional[int] = None
    chunk_mb: float = 1.0
    skip_bad_records: bool = False
    partitions: int = 1
    progress: bool = True

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def prefix_of(self, key: str) -> str:
        return f"{self.output_prefix}_{key}_{self.level}"


def job_from_recipe(recipe) -> Job:
    p, t = recipe.preprocess, recipe.tokenizer
    return Job(
        inputs=list(p.inputs), output_prefix=p.output_prefix, keys=list(p.json_keys),
        tokenizer_type=t.type, tokenizer_path=t.path, input_format=p.input_format, split=p.split,
        document_per_line=p.document_per_line, split_sentences=p.split_sentences,
        keep_newlines=p.keep_newlines, lang=p.lang, append_eod=p.append_eod, add_bos=p.add_bos,
        workers=p.workers, chunk_mb=p.chunk_mb, skip_bad_records=p.skip_bad_records,
        partitions=p.partitions, progress=p.progress,
    )


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


@dataclass
class Result:
    outputs: dict[str, str]
    stats: Stats
    seconds: float
    bytes_out: int
    dtype: np.dtype
    notes: list[str]
    tokenizer: str = ""


def run(job: Job, console=None) -> Result:
    """Preprocess ``job``'s corpus; returns what was written. Raises UserError on bad input."""
    from rich.console import Console

    console = console or Console(stderr=True, highlight=False)
    start = time.perf_counter()
    if job.add_bos and job.tokenizer_type == "none":
        raise UserError("preprocess.add_bos: tokenizer type none has no bos token")
    tokenizer = load_tokenizer(type=job.tokenizer_type, path=job.tokenizer_path)
    if job.add_bos and tokenizer.bos is None:
        raise UserError(f"preprocess.add_bos: tokenizer {tokenizer.name} has no bos token")
    dtype = indexed.optimal_dtype(tokenizer.vocab_size)
    options = Options(tuple(job.keys), job.split_sentences, job.keep_newlines, job.lang,
                      job.append_eod, job.add_bos, dtype.name)
    sources = readers.resolve_sources(job.inputs, job.input_format, job.split)
    if any(s.format == "text" for s in sources) and len(job.keys) != 1:
        raise UserError(f"plain-text input has one field; give one json key (got {', '.join(job.keys)})")
    notes: list[str] = []
    if job.split_sentences:
        from megacli.data.sentences import SentenceSplitter

        note = SentenceSplitter(job.keep_newlines, job.lang).note
        if note:
            notes.append(note)
            console.print(f"[yellow]note:[/] {note}")

    stats = Stats()
    outputs = {key: job.prefix_of(key) for key in job.keys}
    total_bytes = sum(s.size for s in sources)
    workers = default_workers() if job.workers is None else job.workers
    with _Progress(console, total_bytes, job.progress) as progress:
        if job.partitions <= 1:
            _run_sources(sources, outputs, tokenizer, options, job, workers, stats, progress)
        else:
            _run_partitioned(sources, outputs, tokenizer, options, job, workers, stats, progress)
    seconds = time.perf_counter() - start
    bytes_out = sum(os.path.getsize(indexed.bin_path(p)) + os.path.getsize(indexed.idx_path(p)) for p in outputs.values())
    return Result(outputs, stats, seconds, bytes_out, dtype, notes, f"{tokenizer.name} ({tokenizer.vocab_size:,} ids)")


def _run_partitioned(sources, outputs, tokenizer, options, job, workers, stats, progress) -> None:
    """Write each partition as its own dataset (kept across runs, so a rerun after an interruption
    redoes only the missing ones), then merge them in order and remove them."""
    groups = [g for g in readers.partition(sources, job.partitions) if g]
    fingerprint = _fingerprint(sources, tokenizer, options, len(groups))
    part_prefixes = [{key: f"{prefix}.part{i + 1}of{len(groups)}" for key, prefix in outputs.items()}
                     for i in range(len(groups))]
    for group, parts in zip(groups, part_prefixes):
        stamp = Path(next(iter(parts.values())) + ".done")
        if stamp.is_file() and stamp.read_text() == fingerprint and all(indexed.exists(p) for p in parts.values()):
            progress.advance(sum(s.size for s in group))
            stats.bytes_in += sum(s.size for s in group)
            first = indexed.read_index(next(iter(parts.values())))
            stats.documents += first.document_count
            for p in parts.values():
                idx = indexed.read_index(p)
                stats.sequences += idx.sequence_count
                stats.tokens += idx.total_tokens
            continue
        _run_sources(group, parts, tokenizer, options, job, workers, stats, progress)
        stamp.write_text(fingerprint)
    for key, prefix in outputs.items():
        indexed.merge([parts[key] for parts in part_prefixes], prefix)
    for parts in part_prefixes:
        for p in parts.values():
            for path in (indexed.bin_path(p), indexed.idx_path(p)):
                os.remove(path)
        Path(next(iter(parts.values())) + ".done").unlink(missing_ok=True)


def _fingerprint(sources, tokenizer, options, parts: int) -> str:
    described = [(s.path, s.size, os.path.getmtime(s.path), s.start, s.end) for s in sources]
    text = json.dumps([described, repr(tokenizer), repr(options), parts], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _chunks(sources, job: Job) -> Iterator[readers.Chunk]:
    chunk_bytes = max(4096, int(job.chunk_mb * MB))
    for source in sources:
        yield from readers.iter_chunks(source, list(job.keys), chunk_bytes, job.document_per_line)


def _run_sources(sources, prefixes: dict[str, str], tokenizer, options: Options, job: Job, workers: int,
                 stats: Stats, progress: "_Progress") -> None:
    with ExitStack() as stack:
        with _signals_held():  # no Ctrl-C between creating a partial file and owning its cleanup
            writers = {key: stack.enter_context(indexed.IndexedDatasetWriter(prefix, np.dtype(options.dtype)))
                       for key, prefix in prefixes.items()}
            stack.enter_context(_terminate_as_interrupt())
        for encoded in _encoded(sources, tokenizer, options, job, workers, stack):
            _check_errors(encoded, job, stats)
            for key, (tokens, lengths, per_doc) in encoded.arrays.items():
                writers[key].add_documents(tokens, lengths, per_doc)
                stats.sequences += len(lengths)
                stats.tokens += tokens.size
            stats.documents += encoded.records
            stats.bytes_in += encoded.nbytes
            progress.update(encoded.nbytes, stats)
        for w in writers.values():
            w.commit()


def _encoded(sources, tokenizer, options, job: Job, workers: int, stack: ExitStack) -> Iterator[Encoded]:
    """Encoded chunks in input order: in this process when workers == 0, else from a pool with
    at most 2 chunks per worker in flight."""
    chunks = _chunks(sources, job)
    if workers == 0:
        _init_worker(tokenizer, options, quiet_signals=False)
        for chunk in chunks:
            yield encode_chunk(chunk)
        return
    import multiprocessing as mp

    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    # A Ctrl-C while the pool starts would orphan its workers (and hang the exit).
    with _signals_held():
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer, options, True))
        stack.callback(pool.join)
        stack.callback(pool.terminate)
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(encode_chunk, (chunk,)))
        if len(pending) >= 2 * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()
    pool.close()


def _check_errors(encoded: Encoded, job: Job, stats: Stats) -> None:
    if not encoded.errors:
        return
    if not job.skip_bad_records:
        line, message = encoded.errors[0]
        raise UserError(f"{readers.location(encoded.source, line)}: {message}\n"
                        "nothing was written; fix the record, or set preprocess.skip_bad_records: true "
                        "(--skip-bad-records) to skip bad records")
    stats.skipped += len(encoded.errors)
    for line, message in encoded.errors[: max(0, 5 - len(stats.skipped_examples))]:
        stats.skipped_examples.append(f"{readers.location(encoded.source, line)}: {message}")


class _signals_held:
    """Defer SIGINT/SIGTERM (delivered on exit) around setup steps that must not be cut in two."""

    def __enter__(self):
        self._held = None
        if hasattr(signal, "pthread_sigmask"):
            self._held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        return self

    def __exit__(self, *exc):
        if self._held is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._held)


class _terminate_as_interrupt:
    """SIGTERM raises KeyboardInterrupt while writing, so partial files are removed as for Ctrl-C."""

    def __enter__(self):
        import threading

        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handler)
        return self

    @staticmethod
    def _handler(signum, frame):
        raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


class _Progress:
    """A rich progress bar over input bytes: documents, MB/s, tokens/s, ETA."""

    def __init__(self, console, total_bytes: int, enabled: bool) -> None:
        self.console, self.total, self.enabled = console, total_bytes, enabled
        self.start = time.perf_counter()
        self._bar = None

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]preprocess[/]"), BarColumn(), TaskProgressColumn(),
                TextColumn("{task.fields[docs]} docs · {task.fields[mbs]} MB/s · {task.fields[tps]} tok/s"),
                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=True,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("preprocess", total=self.total or None, docs=0, mbs="-", tps="-")
        return self

    def update(self, nbytes: int, stats: Stats) -> None:
        if self._bar is None:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self._bar.update(self._task, advance=nbytes, docs=f"{stats.documents:,}",
                         mbs=f"{stats.bytes_in / MB / elapsed:.1f}", tps=_si(stats.tokens / elapsed))

    def advance(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=nbytes)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def summary_table(result: Result):
    """The closing summary as a rich Table."""
    from rich.table import Table

    s = result.stats
    secs = max(result.seconds, 1e-9)
    table = Table(title="preprocess summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("tokenizer", result.tokenizer)
    table.add_row("documents", f"{s.documents:,}")
    if s.sequences != s.documents:
        table.add_row("sequences", f"{s.sequences:,}")
    table.add_row("tokens", f"{s.tokens:,}")
    table.add_row("bytes in", f"{s.bytes_in:,} ({s.bytes_in / MB:.1f} MB)")
    table.add_row("bytes out", f"{result.bytes_out:,} ({result.bytes_out / MB:.1f} MB, {result.dtype.name})")
    table.add_row("seconds", f"{result.seconds:.2f}")
    table.add_row("throughput", f"{s.bytes_in / MB / secs:.2f} MB/s · {_si(s.tokens / secs)} tokens/s")
    if s.skipped:
        table.add_row("skipped bad records", f"{s.skipped:,}")
    for key, prefix in result.outputs.items():
        table.add_row(f"output ({key})", f"{prefix}.bin/.idx")
    return table
