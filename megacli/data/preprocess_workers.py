"""Preprocessing's worker side: a chunk of raw records in, its documents tokenized into the
arrays the indexed dataset stores out (``encode_chunk``), and the worker processes that run it
(``WorkerPool``), handing results back in input order."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from itertools import chain
from typing import Iterator, Optional

import numpy as np

from megacli.data import readers
from megacli.data.tokenizer_base import Tokenizer


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


_worker: dict = {}


def init_worker(tokenizer: Tokenizer, options: Options, quiet_signals: bool) -> None:
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


class WorkerPool:
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

    init_worker(tokenizer, options, quiet_signals=True)
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
