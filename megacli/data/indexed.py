"""Megatron indexed datasets on disk: a ``.bin`` of token ids back to back and a ``.idx`` index.

``.idx`` layout (all little-endian), as Megatron-Core's ``IndexedDataset`` reads it:

    b"MMIDIDX\\x00\\x00"   9-byte magic
    u64 1                 version
    u8  dtype code        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    u64 S                 sequence count
    u64 D + 1             length of the document index (documents + 1)
    i32[S]                tokens per sequence
    i64[S]                byte offset of each sequence in .bin
    i64[D + 1]            document index: sequence number where each document starts, from 0

The writer streams: tokens go straight to ``.bin``, per-sequence lengths and document bounds to
spill files beside it, so memory stays flat however large the corpus. Everything is written under
``*.partial`` names and renamed into place by ``commit()``; an interrupted run leaves no file
under the final names (and an existing dataset there is replaced only by a complete one).
"""

from __future__ import annotations

import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from megacli.errors import UserError
from megacli.filekind import not_regular

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
PARTIAL = ".partial"
_COPY_CHUNK = 1 << 22  # elements per chunk when streaming index arrays


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when the vocabulary has fewer than 65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.bin"


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.idx"


def strip_suffix(prefix: str) -> str:
    """Accept ``x.bin`` / ``x.idx`` / ``x.`` where a prefix is expected."""
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDatasetWriter:
    """Streams documents into ``{prefix}.bin/.idx``; use as a context manager, call ``commit()``.

    Leaving the ``with`` block without ``commit()`` (an error, Ctrl-C) deletes the partial files.
    """

    def __init__(self, prefix: str | os.PathLike, dtype) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._paths = {name: f"{self.prefix}.{name}{PARTIAL}" for name in ("bin", "idx", "lengths", "docs")}
        self._bin = open(self._paths["bin"], "wb")
        self._lengths = open(self._paths["lengths"], "wb")
        self._docs = open(self._paths["docs"], "wb")
        self._docs.write(np.zeros(1, np.int64).tobytes())
        self.sequences = 0
        self.documents = 0
        self.tokens = 0
        self.committed = False

    # ---- writing ----
    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray, sequences_per_document: np.ndarray) -> None:
        """Append documents: their tokens back to back, the length of each sequence (sentence,
        or the whole document), and how many sequences each document has (0 = empty document)."""
        tokens = np.asarray(tokens)
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        self._bin.write(tokens.tobytes())
        self._lengths.write(np.asarray(sequence_lengths, dtype=np.int32).tobytes())
        ends = self.sequences + np.cumsum(np.asarray(sequences_per_document, dtype=np.int64))
        self._docs.write(ends.tobytes())
        self.sequences += len(sequence_lengths)
        self.documents += len(sequences_per_document)
        self.tokens += tokens.size

    def add_document(self, tokens: Iterable[int], sequence_lengths: Optional[list[int]] = None) -> None:
        """One document; ``sequence_lengths`` defaults to a single sequence of all its tokens."""
        arr = np.asarray(list(tokens), dtype=self.dtype)
        lengths = [arr.size] if sequence_lengths is None else list(sequence_lengths)
        if sum(lengths) != arr.size:
            raise ValueError("sequence lengths do not add up to the document's tokens")
        self.add_documents(arr, np.asarray(lengths, np.int32), np.asarray([len(lengths)], np.int64))

    def add_dataset(self, prefix: str) -> None:
        """Append an existing dataset (same dtype): its .bin is copied, its index shifted."""
        index = read_index(prefix)
        if index.dtype != self.dtype:
            raise UserError(f"cannot merge {prefix} ({index.dtype}) into a {self.dtype} dataset: token dtypes differ")
        with open(bin_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._bin, 1 << 24)
        for start in range(0, index.sequence_count, _COPY_CHUNK):
            self._lengths.write(np.asarray(index.sequence_lengths[start:start + _COPY_CHUNK], np.int32).tobytes())
        doc_index = index.document_indices
        for start in range(1, len(doc_index), _COPY_CHUNK):
            chunk = np.asarray(doc_index[start:start + _COPY_CHUNK], np.int64) + self.sequences
            self._docs.write(chunk.tobytes())
        self.sequences += index.sequence_count
        self.documents += index.document_count
        self.tokens += int(index.total_tokens)

    # ---- finishing ----
    def commit(self) -> None:
        """Write the index, then move both files to their final names (the old .idx goes first, so
        no moment pairs a new .bin with a stale .idx)."""
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        itemsize = self.dtype.itemsize
        with open(self._paths["idx"], "wb") as out:
            out.write(MAGIC)
            out.write(struct.pack("<Q", VERSION))
            out.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            out.write(struct.pack("<Q", self.sequences))
            out.write(struct.pack("<Q", self.documents + 1))
            with open(self._paths["lengths"], "rb") as src:
                shutil.copyfileobj(src, out, 1 << 24)
            offset = np.int64(0)
            lengths = np.memmap(self._paths["lengths"], dtype=np.int32, mode="r") if self.sequences else np.zeros(0, np.int32)
            for start in range(0, self.sequences, _COPY_CHUNK):
                sizes = lengths[start:start + _COPY_CHUNK].astype(np.int64) * itemsize
                ends = np.cumsum(sizes) + offset
                out.write((ends - sizes).tobytes())
                offset = ends[-1]
            del lengths
            with open(self._paths["docs"], "rb") as src:
                shutil.copyfileobj(src, out, 1 << 24)
        final_idx, final_bin = idx_path(self.prefix), bin_path(self.prefix)
        if os.path.exists(final_idx):
            os.remove(final_idx)
        os.replace(self._paths["bin"], final_bin)
        os.replace(self._paths["idx"], final_idx)
        self._remove(("lengths", "docs"))
        self.committed = True

    def abort(self) -> None:
        for f in (self._bin, self._lengths, self._docs):
            f.close()
        self._remove(tuple(self._paths))

    def _remove(self, names) -> None:
        for name in names:
            try:
                os.remove(self._paths[name])
            except FileNotFoundError:
                pass

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.committed:
            self.abort()


@dataclass
class Index:
    """A parsed ``.idx`` (arrays are read-only views of a memory map)."""

    path: str
    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray

    @property
    def sequence_count(self) -> int:
        return len(self.sequence_lengths)

    @property
    def document_count(self) -> int:
        return len(self.document_indices) - 1

    @property
    def total_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def document_lengths(self) -> np.ndarray:
        """Tokens per document (0 for empty documents)."""
        cum = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return cum[self.document_indices[1:]] - cum[self.document_indices[:-1]]


def read_index(prefix: str) -> Index:
    path = idx_path(prefix)
    problem = not_regular(path)
    if problem is not None:
        raise UserError(f"{path}: {'no such index file' if problem == 'no such file' else problem}")
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(head) < HEADER_BYTES or head[:len(MAGIC)] != MAGIC:
        raise UserError(f"{path}: not a Megatron indexed-dataset index (bad header)")
    version, code, seqs, docs = struct.unpack("<QBQQ", head[len(MAGIC):])
    if version != VERSION or code not in DTYPE_CODES:
        raise UserError(f"{path}: unsupported index version {version} or dtype code {code}")
    expected = HEADER_BYTES + seqs * 4 + seqs * 8 + docs * 8
    actual = os.path.getsize(path)
    if actual < expected:
        raise UserError(f"{path}: truncated ({actual} bytes, the header promises {expected})")
    mm = np.memmap(path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(mm, np.int32, seqs, HEADER_BYTES)
    pointers = np.frombuffer(mm, np.int64, seqs, HEADER_BYTES + seqs * 4)
    doc_index = np.frombuffer(mm, np.int64, docs, HEADER_BYTES + seqs * 12)
    return Index(path, np.dtype(DTYPE_CODES[code]), lengths, pointers, doc_index)


def validate(prefix: str) -> Index:
    """The index of ``prefix``, checked against its ``.bin`` before anything memory-maps the pair:
    the header, the document index (from 0 to the sequence count, never decreasing), and sequence
    pointers that lay the sequences back to back and end exactly at the end of the ``.bin``."""
    index = read_index(prefix)
    path, data = index.path, bin_path(prefix)
    problem = not_regular(data)
    if problem is not None:
        raise UserError(f"{data}: {'no such data file' if problem == 'no such file' else problem} "
                        f"(the index {path} needs it)")
    docs = index.document_indices
    if len(docs) == 0 or docs[0] != 0 or docs[-1] != index.sequence_count or np.any(np.diff(docs) < 0):
        raise UserError(f"{path}: corrupt document index (it must run from 0 to the {index.sequence_count} sequences)")
    if index.document_count == 0:
        raise UserError(f"{path}: holds no documents")
    itemsize = index.dtype.itemsize
    offset = 0
    for start in range(0, index.sequence_count, _COPY_CHUNK):
        lengths = np.asarray(index.sequence_lengths[start:start + _COPY_CHUNK], np.int64)
        if np.any(lengths < 0):
            raise UserError(f"{path}: corrupt index (a negative sequence length)")
        ends = np.cumsum(lengths * itemsize) + offset
        if not np.array_equal(index.sequence_pointers[start:start + _COPY_CHUNK], ends - lengths * itemsize):
            raise UserError(f"{path}: corrupt index (sequence pointers do not follow the sequence lengths)")
        offset = int(ends[-1])
    actual = os.path.getsize(data)
    if offset == 0:
        raise UserError(f"{path}: its documents hold no tokens")
    if actual != offset:
        what = "truncated" if actual < offset else "longer than its index says"
        raise UserError(f"{data}: {what} ({actual} bytes, the index {path} describes {offset})")
    return index


def read_document(prefix: str, index: Index, doc: int) -> np.ndarray:
    """Tokens of document ``doc`` (all its sequences)."""
    first, last = int(index.document_indices[doc]), int(index.document_indices[doc + 1])
    if first == last:
        return np.zeros(0, index.dtype)
    start = int(index.sequence_pointers[first])
    count = int(index.sequence_lengths[first:last].sum(dtype=np.int64))
    data = np.memmap(bin_path(prefix), dtype=index.dtype, mode="r", offset=start, shape=(count,)) if count else []
    return np.array(data, dtype=index.dtype)


def merge(prefixes: list[str], output_prefix: str) -> IndexedDatasetWriter:
    """Concatenate datasets in the given order into ``output_prefix`` (committed on return)."""
    if not prefixes:
        raise UserError("merge: no input datasets")
    for p in prefixes:
        for path in (idx_path(p), bin_path(p)):
            problem = not_regular(path)
            if problem is not None:
                raise UserError(f"merge: {path}: {problem} (an input is a {p}.bin/{p}.idx pair)")
    if strip_suffix(output_prefix) in prefixes:
        raise UserError(f"merge: the output {output_prefix} is also an input")
    dtype = read_index(prefixes[0]).dtype
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for p in prefixes:
            writer.add_dataset(p)
        writer.commit()
    return writer
