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
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from megacli.data import fast_tokenize, indexed, readers
from megacli.data.preprocess_report import MB, ProgressBar, Result, Stats
from megacli.data.preprocess_workers import Encoded, Options, WorkerPool, encode_chunk, init_worker
from megacli.data.tokenizers import load_tokenizer
from megacli.errors import UserError

SAMPLE_BYTES = 1 << 16  # read from each input's start for the sample a faster encoder is checked on


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


def run(job: Job, console=None) -> Result:
    """Preprocess ``job``'s corpus; returns what was written. Raises UserError on bad input."""
    from rich.console import Console
    from rich.markup import escape

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
    tokenizer, note = fast_tokenize.accelerate(tokenizer, lambda: sample_texts(sources, job))
    if note:
        notes.append(note)
        console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
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
    with ProgressBar(console, total_bytes, job.progress) as progress:
        if job.partitions <= 1:
            _run_sources(sources, outputs, tokenizer, options, job, workers, stats, progress)
        else:
            _run_partitioned(sources, outputs, tokenizer, options, job, workers, stats, progress)
    seconds = time.perf_counter() - start
    bytes_out = sum(os.path.getsize(indexed.bin_path(p)) + os.path.getsize(indexed.idx_path(p)) for p in outputs.values())
    return Result(outputs, stats, seconds, bytes_out, dtype, notes, f"{tokenizer.name} ({tokenizer.vocab_size:,} ids)",
                  fast_tokenize.describe_encoder(tokenizer))


def sample_texts(sources: list[readers.Source], job: Job, limit: int = 256) -> list[str]:
    """Up to ``limit`` texts from the start of the corpus (the first chunk of each source until
    there are enough), for checking a faster encoder against the tokenizer."""
    texts: list[str] = []
    for source in sources:
        for chunk in readers.iter_chunks(source, list(job.keys), SAMPLE_BYTES, job.document_per_line):
            for values in readers.parse_chunk(chunk, list(job.keys)).values.values():
                texts.extend(t for v in values for t in (v if isinstance(v, list) else [v]))
            break
        if len(texts) >= limit:
            break
    return texts[:limit]


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
                 stats: Stats, progress: ProgressBar) -> None:
    with _interrupts():
        stack = ExitStack()
        try:
            with _signals_held():  # no Ctrl-C between creating a partial file and owning its cleanup
                writers = {key: stack.enter_context(indexed.IndexedDatasetWriter(prefix, np.dtype(options.dtype)))
                           for key, prefix in prefixes.items()}
            for encoded in _encoded(sources, tokenizer, options, job, workers, stack):
                _check_errors(encoded, job, stats)
                for key, (tokens, lengths, per_doc) in encoded.arrays.items():
                    writers[key].add_documents(tokens, lengths, per_doc)
                    stats.sequences += len(lengths)
                    stats.tokens += tokens.size
                stats.documents += encoded.records
                stats.bytes_in += encoded.nbytes
                progress.update(encoded.nbytes, stats)
            with _signals_held():  # every key's dataset, or none
                for w in writers.values():
                    w.commit()
        finally:
            with _signals_held():  # a second Ctrl-C must not cut the cleanup short
                stack.close()


def _encoded(sources, tokenizer, options, job: Job, workers: int, stack: ExitStack) -> Iterator[Encoded]:
    """Encoded chunks in input order: in this process when workers == 0, else from worker
    processes with at most 2 chunks per worker in flight."""
    chunks = _chunks(sources, job)
    if workers == 0:
        init_worker(tokenizer, options, quiet_signals=False)
        for chunk in chunks:
            yield encode_chunk(chunk)
        return
    import multiprocessing as mp

    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    # A Ctrl-C while the workers start would orphan some of them.
    with _signals_held():
        pool = WorkerPool(ctx, workers, tokenizer, options)
        stack.callback(pool.kill)
    yield from pool.imap(chunks, 2 * workers)
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
    """Defer SIGINT/SIGTERM around steps that must not be cut in two (within ``_interrupts``);
    one that arrives meanwhile raises KeyboardInterrupt when the outermost hold ends.

    The signals are also blocked, for the processes forked meanwhile; but blocking is per thread,
    the kernel hands the signal to a thread that does not block it (a tokenizer's thread pool),
    and Python then runs the handler in the main thread anyway: hence the handler's check of
    ``depth``."""

    depth = 0  # holds open (main thread)
    caught = False

    def __enter__(self):
        _signals_held.depth += 1
        self._mask = None
        if hasattr(signal, "pthread_sigmask"):
            self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        return self

    def __exit__(self, *exc):
        if self._mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        _signals_held.depth -= 1
        if not _signals_held.depth and _signals_held.caught:
            _signals_held.caught = False
            raise KeyboardInterrupt


class _interrupts:
    """While writing: SIGTERM, and SIGINT where Python's default handler has it, raise
    KeyboardInterrupt (so partial files are removed as for Ctrl-C), deferred inside ``_signals_held``."""

    def __enter__(self):
        import threading

        self._old = {}
        _signals_held.caught = False
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                old = signal.getsignal(signum)
                # Handlers set outside Python (None) cannot be put back; an ignored SIGINT stays ignored.
                if old is not None and (signum == signal.SIGTERM or old is signal.default_int_handler):
                    self._old[signum] = old
                    signal.signal(signum, self._handler)
        return self

    @staticmethod
    def _handler(signum, frame):
        if _signals_held.depth:
            _signals_held.caught = True
        else:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        for signum, old in self._old.items():
            signal.signal(signum, old)
