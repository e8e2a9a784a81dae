"""Corpus readers: JSONL (plain or .gz), plain text (a document per line or per file), Parquet,
Arrow files and local Hugging Face ``datasets`` directories (``save_to_disk`` output).

Nothing is read whole: each source yields ``Chunk``s of about ``chunk_bytes``. Line-based chunks
carry raw bytes that a worker process parses (``parse_chunk``), so the reading process stays
light; columnar chunks carry the selected columns. Every record keeps its file and line (or row)
number for error messages.

    for file, line, record in iter_records(["corpus.jsonl"]): ...
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from megacli.data.jsonl import not_utf8
from megacli.errors import UserError
from megacli.filekind import not_regular

try:  # orjson parses several times faster and accepts a subset of what json does
    from orjson import loads as _strict_loads
except ImportError:
    def _strict_loads(raw: bytes):
        return json.loads(raw.decode("utf-8"))

FORMATS = ("auto", "jsonl", "text", "parquet", "arrow", "hf")
_EXTENSIONS = {
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
    ".txt": "text", ".text": "text",
    ".parquet": "parquet", ".arrow": "arrow",
}
LINE_FORMATS = ("jsonl", "text")


@dataclass(frozen=True)
class Source:
    """One input file (or a byte range of one, for partitions), with its format."""

    path: str
    format: str
    size: int
    compressed: bool = False
    start: int = 0
    end: Optional[int] = None
    split: str = "train"  # the split of a DatasetDict directory

    @property
    def splittable(self) -> bool:
        return self.format in LINE_FORMATS and not self.compressed


@dataclass
class Chunk:
    """A run of consecutive records of one source.

    kind "lines": ``payload`` is whole lines (bytes) of a jsonl/text file; "columns": a dict of
    key -> list of values. ``first_line`` numbers the first record from 1 within the source's
    byte range starting at ``source.start``. ``nbytes`` is the input it accounts for (progress)."""

    source: Source
    first_line: int
    kind: str
    payload: Any
    nbytes: int


@dataclass
class Parsed:
    """Records of a chunk, with the bad ones reported rather than kept."""

    values: dict[str, list] = field(default_factory=dict)  # key -> text (str) or sentences (list[str]) per good record
    errors: list[tuple[int, str]] = field(default_factory=list)  # (line within the chunk's range, message)
    records: int = 0


def is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _format_of(path: Path) -> tuple[str, bool]:
    suffixes = path.suffixes
    compressed = bool(suffixes) and suffixes[-1] == ".gz"
    ext = suffixes[-2] if compressed and len(suffixes) >= 2 else (suffixes[-1] if suffixes else "")
    return _EXTENSIONS.get(ext.lower(), ""), compressed


def resolve_sources(inputs: list[str], input_format: str = "auto", split: str = "train") -> list[Source]:
    """Expand globs and directories (sorted) into sources, each with its format."""
    sources: list[Source] = []
    for spec in inputs:
        spec = os.path.expanduser(spec)
        matches = sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else [spec]
        if not matches:
            raise UserError(f"input {spec!r}: no file matches")
        for m in matches:
            p = Path(m)
            if not p.exists():
                raise UserError(f"input {m!r}: no such file or directory")
            if input_format == "hf" or (input_format == "auto" and is_hf_dataset_dir(p)):
                sources.append(Source(str(p), "hf", _dir_size(p), split=split))
            elif p.is_dir():
                files = [f for f in sorted(p.rglob("*")) if f.is_file() and (input_format != "auto" or _format_of(f)[0])]
                if not files:
                    raise UserError(f"input {m!r}: a directory with no .jsonl/.txt/.parquet/.arrow files")
                sources.extend(_file_source(f, input_format) for f in files)
            elif not_regular(p) is not None:  # a FIFO would be waited on forever
                raise UserError(f"input {m!r}: {not_regular(p)}")
            else:
                sources.append(_file_source(p, input_format))
    return sources


def _file_source(p: Path, input_format: str) -> Source:
    fmt, compressed = _format_of(p)
    if input_format not in ("auto", ""):
        fmt = input_format
        compressed = p.suffix == ".gz"
    if not fmt:
        raise UserError(f"input {str(p)!r}: cannot tell the format from the name; "
                        "set preprocess.input_format (jsonl, text, parquet, arrow, hf)")
    return Source(str(p), fmt, p.stat().st_size, compressed)


def _dir_size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def partition(sources: list[Source], parts: int) -> list[list[Source]]:
    """Cut the sources into ``parts`` contiguous groups of about equal size, in input order.
    Uncompressed jsonl/text files may be cut inside, at line boundaries."""
    total = sum(s.size for s in sources)
    target = total / parts
    pieces: list[Source] = []
    for s in sources:
        if not s.splittable or s.size <= target:
            pieces.append(s)
            continue
        cuts = _line_cuts(s.path, s.size, max(1, round(s.size / target)))
        pieces.extend(Source(s.path, s.format, b - a, False, a, b, s.split) for a, b in zip(cuts, cuts[1:]) if b > a)
    groups: list[list[Source]] = [[] for _ in range(parts)]
    done = 0
    for piece in pieces:
        # the group whose share of the bytes this piece's middle falls in
        g = min(parts - 1, int((done + piece.size / 2) / target)) if target else 0
        groups[g].append(piece)
        done += piece.size
    return groups


def _line_cuts(path: str, size: int, n: int) -> list[int]:
    """Byte offsets 0 < c1 < ... < size cutting the file into ``n`` pieces at line starts."""
    cuts = [0]
    with open(path, "rb") as f:
        for i in range(1, n):
            f.seek(max(cuts[-1], size * i // n))
            if f.tell() > 0:
                f.seek(f.tell() - 1)
                f.readline()  # to the start of the next line
            pos = f.tell()
            if cuts[-1] < pos < size:
                cuts.append(pos)
    cuts.append(size)
    return cuts


# ---- reading chunks ----
def iter_chunks(source: Source, keys: list[str], chunk_bytes: int, document_per_line: bool = True) -> Iterator[Chunk]:
    if source.format in LINE_FORMATS:
        if source.format == "text" and not document_per_line:
            yield from _whole_text_file(source, keys)
        else:
            yield from _line_chunks(source, chunk_bytes)
    elif source.format == "parquet":
        yield from _parquet_chunks(source, keys, chunk_bytes)
    elif source.format == "arrow":
        yield from _arrow_chunks(source, keys, chunk_bytes)
    elif source.format == "hf":
        yield from _hf_chunks(source, keys, chunk_bytes)
    else:
        raise UserError(f"{source.path}: unknown input format {source.format!r}")


def _line_chunks(source: Source, chunk_bytes: int) -> Iterator[Chunk]:
    line = 1
    if source.compressed:
        raw = open(source.path, "rb")
        stream = gzip.GzipFile(fileobj=raw, mode="rb")
        position = raw.tell
    else:
        raw = stream = open(source.path, "rb")
        stream.seek(source.start)
        position = stream.tell
    remaining = None if source.end is None else source.end - source.start
    with raw, stream:
        carry = b""
        reported = position()
        while True:
            want = chunk_bytes if remaining is None else min(chunk_bytes, remaining)
            try:
                block = stream.read(want) if want > 0 else b""
            except (OSError, EOFError) as exc:
                raise UserError(f"{source.path}: cannot read ({exc}) after line {line - 1}") from None
            if remaining is not None:
                remaining -= len(block)
            if not block:
                if carry:
                    yield Chunk(source, line, "lines", carry + b"\n", position() - reported)
                return
            data = carry + block
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                carry = data
                continue
            payload, carry = data[:cut], data[cut:]
            now = position()
            yield Chunk(source, line, "lines", payload, now - reported)
            reported = now
            line += payload.count(b"\n")


def _whole_text_file(source: Source, keys: list[str]) -> Iterator[Chunk]:
    opener = gzip.open if source.compressed else open
    with opener(source.path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{source.path}: not UTF-8 text ({exc})") from None
    yield Chunk(source, 1, "columns", {keys[0]: [text]}, source.size)


def _columns(table_or_batch, keys: list[str], where: str) -> dict[str, list]:
    names = table_or_batch.schema.names
    missing = [k for k in keys if k not in names]
    if missing:
        raise UserError(f"{where}: no column {missing[0]!r} (columns: {', '.join(names[:12])})")
    return {k: table_or_batch.column(k).to_pylist() for k in keys}


def _rows_per_chunk(size: int, rows: int, chunk_bytes: int) -> int:
    return max(1, int(chunk_bytes * rows / max(size, 1))) if rows else 1024


def _parquet_chunks(source: Source, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(source.path)
    except Exception as exc:
        raise UserError(f"{source.path}: not a Parquet file ({exc})") from None
    rows = pf.metadata.num_rows
    missing = [k for k in keys if k not in pf.schema_arrow.names]
    if missing:
        raise UserError(f"{source.path}: no column {missing[0]!r} (columns: {', '.join(pf.schema_arrow.names[:12])})")
    row = 1
    batches = pf.iter_batches(batch_size=_rows_per_chunk(source.size, rows, chunk_bytes), columns=keys)
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises OSError, ArrowInvalid, ... for a damaged file
            raise UserError(f"{source.path}: corrupt Parquet data after row {row - 1} ({exc})") from None
        if batch is None:
            return
        yield Chunk(source, row, "columns", _columns(batch, keys, source.path), source.size * batch.num_rows // max(rows, 1))
        row += batch.num_rows


def _arrow_chunks(source: Source, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(pa.memory_map(source.path))
        batches = iter(reader)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.memory_map(source.path))
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    row = 1
    for batch in batches:
        step = _rows_per_chunk(batch.nbytes, batch.num_rows, chunk_bytes)
        for off in range(0, batch.num_rows, step):
            part = batch.slice(off, step)
            yield Chunk(source, row, "columns", _columns(part, keys, source.path), part.nbytes)
            row += part.num_rows


def load_hf_split(source: Source):
    """The split a `datasets` directory source names (load_from_disk; no download)."""
    import datasets

    try:
        ds = datasets.load_from_disk(source.path)
    except Exception as exc:
        raise UserError(f"{source.path}: cannot load the datasets directory ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        if source.split not in ds:
            raise UserError(f"{source.path}: no split {source.split!r} (splits: {', '.join(ds)})")
        ds = ds[source.split]
    return ds


def _hf_chunks(source: Source, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
    ds = load_hf_split(source)
    missing = [k for k in keys if k not in ds.column_names]
    if missing:
        raise UserError(f"{source.path}: no column {missing[0]!r} (columns: {', '.join(ds.column_names[:12])})")
    table = ds.select_columns(keys).with_format("arrow")
    rows = len(table)
    step = _rows_per_chunk(source.size, rows, chunk_bytes)
    for off in range(0, rows, step):
        part = table[off:off + step]
        yield Chunk(source, off + 1, "columns", _columns(part, keys, source.path), source.size * part.num_rows // max(rows, 1))


# ---- parsing (in worker processes) ----
def _check_value(value: Any, key: str) -> Optional[str]:
    """None when ``value`` is a document (a string or a list of strings), else the complaint."""
    if isinstance(value, str):
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return None
    return f"{key!r} is {type(value).__name__ if value is not None else 'null'}, expected a string"


def parse_chunk(chunk: Chunk, keys: list[str]) -> Parsed:
    """Records of ``chunk`` as per-key values; malformed records become (line, message) errors
    and are left out of every key (so the keys' datasets stay aligned)."""
    out = Parsed(values={k: [] for k in keys})
    if chunk.kind == "columns":
        columns = chunk.payload
        n = len(columns[keys[0]]) if keys else 0
        for i in range(n):
            row = [columns[k][i] for k in keys]
            problem = next((p for p in (_check_value(v, k) for k, v in zip(keys, row)) if p), None)
            if problem:
                out.errors.append((chunk.first_line + i, problem))
                continue
            for k, v in zip(keys, row):
                out.values[k].append(v)
            out.records += 1
        return out

    lines = chunk.payload.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    as_text = chunk.source.format == "text"
    quick_key = keys[0] if len(keys) == 1 and not as_text else None
    for i, raw in enumerate(lines):
        if quick_key is not None:
            # The common case, quickly: strict JSON (orjson) with a string under the key. Anything
            # else (blank lines too) takes the path below: the json module's verdict and messages.
            try:
                value = _strict_loads(raw)[quick_key]
            except (ValueError, KeyError, TypeError):
                value = None
            if type(value) is str:
                out.values[quick_key].append(value)
                out.records += 1
                continue
        if not raw.strip():
            continue  # blank lines hold no record
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            out.errors.append((chunk.first_line + i, not_utf8(exc)))
            continue
        if as_text:
            out.values[keys[0]].append(line[:-1] if line.endswith("\r") else line)
            out.records += 1
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            out.errors.append((chunk.first_line + i, f"malformed JSON ({exc})"))
            continue
        if not isinstance(record, dict):
            out.errors.append((chunk.first_line + i, f"expected a JSON object, got {type(record).__name__}"))
            continue
        values = [record.get(k, _MISSING) for k in keys]
        problem = None
        for k, v in zip(keys, values):
            if v is _MISSING:
                shown = ", ".join(list(record)[:8]) or "none"
                problem = f"no key {k!r} (keys: {shown})"
                break
            problem = _check_value(v, k)
            if problem:
                break
        if problem:
            out.errors.append((chunk.first_line + i, problem))
            continue
        for k, v in zip(keys, values):
            out.values[k].append(v)
        out.records += 1
    return out


_MISSING = object()


def location(source: Source, line: int) -> str:
    """``file:line`` for a record, counting lines before a partition's byte range when needed."""
    if source.start:
        with open(source.path, "rb") as f:
            before, left = 0, source.start
            while left:
                block = f.read(min(left, 1 << 24))
                if not block:
                    break
                before += block.count(b"\n")
                left -= len(block)
        line += before
    unit = "row " if source.format in ("parquet", "arrow", "hf") else ""
    return f"{source.path}:{unit}{line}"


def iter_records(inputs: list[str], keys: list[str] = ("text",), input_format: str = "auto",
                 document_per_line: bool = True, chunk_bytes: int = 1 << 20) -> Iterator[tuple[str, int, dict]]:
    """(file, line, record) for every good record, in input order; the first bad one raises."""
    keys = list(keys)
    for source in resolve_sources(list(inputs), input_format):
        for chunk in iter_chunks(source, keys, chunk_bytes, document_per_line):
            parsed = parse_chunk(chunk, keys)
            if parsed.errors:
                line, message = parsed.errors[0]
                raise UserError(f"{location(source, line)}: {message}")
            # line numbers of good records: recover them by re-walking the chunk
            numbers = _good_line_numbers(chunk, keys)
            for j, number in enumerate(numbers):
                yield source.path, number, {k: parsed.values[k][j] for k in keys}


def _good_line_numbers(chunk: Chunk, keys: list[str]) -> list[int]:
    if chunk.kind == "columns":
        return [chunk.first_line + i for i in range(len(chunk.payload[keys[0]]))]
    lines = chunk.payload.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [chunk.first_line + i for i, raw in enumerate(lines) if raw.strip()]
