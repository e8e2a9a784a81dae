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
from itertools import chain
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from megacli.data import fast_tokenize, indexed, readers
from megacli.data.preprocess_report import MB, ProgressBar, Result, Stats
from megacli.data.tokenizers import Tokenizer, load_tokenizer
from megacli.errors import UserError

SAMPLE_BYTES = 1 << 16  # read from each input's start for the sample a faster encoder is checked on


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


# ---- worker side ----
_worker: dict = {}


def _init_worker(tokenizer: Tokenizer, options: Options, quiet_signals: bool) -> None:
    if quiet_signals:
        # Ctrl-C is the parent's to handle (it kills the workers); SIGTERM gets its default action
        # (the parent's handler, inherited through fork, must not run here).
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
    sequences dropped, bos before the first and eod after the last sequence of a non-empty document."""
    if not opt.split_sentences and all(type(d) is str for d in docs):
        texts, pieces = docs, np.ones(len(docs), np.int64)
    else:
        splitter = _worker.get("splitter")
        split = [d if isinstance(d, list) else (splitter(d) if splitter else [d]) for d in docs]
        texts, pieces = list(chain.from_iterable(split)), np.fromiter(map(len, split), np.int64, len(split))
    tokens, lengths = tok.encode_flat(texts) if texts else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    return megatron_layout(tokens, lengths, pieces, np.dtype(opt.dtype),
                           bos=tok.bos if opt.add_bos else None, eod=tok.eod if opt.append_eod else None)


def megatron_layout(tokens: np.ndarray, lengths: np.ndarray, pieces: np.ndarray, dtype: np.dtype,
                    bos: Optional[int], eod: Optional[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encoded pieces (``tokens`` back to back, ``lengths`` per piece, ``pieces`` per document) ->
    (tokens, sequence lengths, sequences per document) as written: empty pieces dropped, ``bos``
    before the first and ``eod`` after the last remaining sequence of each document."""
    kept = lengths > 0
    doc_of_seq = np.repeat(np.arange(len(pieces)), pieces)[kept]
    lengths = lengths[kept]
    per_doc = np.bincount(doc_of_seq, minlength=len(pieces)).astype(np.int64)
    if (bos is None and eod is None) or not len(lengths):
        return tokens.astype(dtype, copy=False), lengths.astype(np.int32), per_doc
    new_doc = np.diff(doc_of_seq, prepend=-1, append=len(pieces)) != 0
    first, last = new_doc[:-1], new_doc[1:]  # sequence opens / closes its document
    before = first if bos is not None else np.zeros(len(lengths), bool)
    after = last if eod is not None else np.zeros(len(lengths), bool)
    new_lengths = lengths + before + after
    new_starts = np.cumsum(new_lengths) - new_lengths
    bos_at, eod_at = new_starts[before], (new_starts + new_lengths - 1)[after]
    out = np.empty(int(new_lengths.sum()), dtype)
    text_at = np.ones(out.size, bool)
    text_at[bos_at] = text_at[eod_at] = False
    out[text_at] = tokens
    if bos is not None:
        out[bos_at] = bos
    if eod is not None:
        out[eod_at] = eod
    return out, new_lengths.astype(np.int32), per_doc


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
        _init_worker(tokenizer, options, quiet_signals=False)
        for chunk in chunks:
            yield encode_chunk(chunk)
        return
    import multiprocessing as mp

    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    # A Ctrl-C while the workers start would orphan some of them.
    with _signals_held():
        pool = _Workers(ctx, workers, tokenizer, options)
        stack.callback(pool.kill)
    yield from pool.imap(chunks, 2 * workers)
    pool.close()


class _Workers:
    """Worker processes running ``encode_chunk``, each over its own pair of pipes, driven by the
    calling thread alone: a chunk goes only to an idle worker (one waiting to read it), results are
    read as they come and handed out in input order. No helper thread, so stopping is a SIGKILL
    and a reap, which cannot wait on anything.

    (multiprocessing.Pool's terminate() can hang: it joins a task-handler thread that may be
    blocked writing a large chunk into a pipe whose readers it has just terminated; and a Ctrl-C
    inside Pool() leaves its worker-handler thread running without a finalizer, re-forking the
    workers that the exit handler terminates: they outlive the parent and hold its stdout/stderr.)
    """

    def __init__(self, ctx, n: int, tokenizer: Tokenizer, options: Options) -> None:
        self._procs, self._tasks, self._results = [], [], []
        try:
            for _ in range(n):
                task_r, task_w = ctx.Pipe(duplex=False)
                result_r, result_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_work, args=(task_r, result_w, tokenizer, options, os.getpid()),
                                   daemon=True)
                proc.start()
                self._procs.append(proc)
                self._tasks.append(task_w)
                self._results.append(result_r)
                # Only the worker holds its ends now: a dead worker reads as EOF / a broken pipe.
                task_r.close()
                result_w.close()
        except BaseException:
            self.kill()
            raise

    def imap(self, chunks: Iterator[readers.Chunk], limit: int) -> Iterator[Encoded]:
        """``encode_chunk`` of each chunk, in order, with at most ``limit`` chunks taken and not yet
        handed out."""
        from multiprocessing.connection import wait

        idle = list(range(len(self._procs)))[::-1]
        holds: dict[int, int] = {}  # busy worker -> index of its chunk
        done: dict[int, Encoded] = {}  # index -> result waiting for its turn
        sent = given = 0
        more = True
        while True:
            while more and idle and sent - given < limit:
                chunk = next(chunks, None)
                if chunk is None:
                    more = False
                    break
                worker = idle.pop()
                self._send(worker, chunk)
                holds[worker] = sent
                sent += 1
            if given in done:
                yield done.pop(given)
                given += 1
                continue
            if not holds:
                return
            busy = {self._results[w]: w for w in holds}
            # A timeout, so that a Ctrl-C taken by another thread is acted on here within it.
            for conn in wait(list(busy), timeout=0.2):
                worker = busy[conn]
                done[holds.pop(worker)] = self._receive(worker)
                idle.append(worker)

    def _send(self, worker: int, chunk: readers.Chunk) -> None:
        try:
            self._tasks[worker].send(chunk)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(worker) from None

    def _receive(self, worker: int) -> Encoded:
        try:
            item = self._results[worker].recv()
        except EOFError:
            raise self._died(worker) from None
        if isinstance(item, _WorkerError):
            raise item.exc from _RemoteTraceback(item.traceback)
        return item

    def _died(self, worker: int) -> RuntimeError:
        proc = self._procs[worker]
        proc.join(5)
        return RuntimeError(f"preprocessing worker {proc.pid} died (exit code {proc.exitcode})")

    def close(self) -> None:
        """After the last result: let the workers exit."""
        for conn in self._tasks:
            conn.send(None)
        for proc in self._procs:
            proc.join()

    def kill(self) -> None:
        """Stop the workers now (an error, Ctrl-C) and reap them; a no-op after ``close``."""
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._tasks + self._results:
            conn.close()


@dataclass
class _WorkerError:
    exc: BaseException
    traceback: str


class _RemoteTraceback(Exception):
    def __str__(self) -> str:
        return f"in a preprocessing worker:\n{self.args[0]}"


def _work(tasks, results, tokenizer: Tokenizer, options: Options, parent: int) -> None:
    """A worker's loop: chunk in, Encoded (or the error) out, until None or the parent is gone."""
    import traceback

    _init_worker(tokenizer, options, quiet_signals=True)
    while True:
        while not tasks.poll(1.0):
            if os.getppid() != parent:  # the parent was killed: nothing will come
                return
        chunk = tasks.recv()
        if chunk is None:
            return
        try:
            item = encode_chunk(chunk)
        except Exception as exc:
            item = _WorkerError(exc, traceback.format_exc())
        try:
            results.send(item)
        except Exception as exc:  # an unpicklable error, or one holding an unpicklable value
            if not isinstance(item, _WorkerError):
                raise
            results.send(_WorkerError(RuntimeError(f"{type(exc).__name__}: {exc}"), item.traceback))


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
