"""How many records an input holds, for `megacli preprocess --dry-run`: exact where the format
says it (Parquet metadata, Arrow batches, a datasets directory) or the file is small; estimated
from a sample of the first bytes of large line files."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from megacli.data.readers import Source, load_hf_split
from megacli.errors import UserError

SAMPLE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class RecordCount:
    records: int
    exact: bool  # False: extrapolated from the first ``sampled`` bytes of the file
    sampled: int = 0


def count_records(source: Source, *, document_per_line: bool, sample_bytes: int = SAMPLE_BYTES) -> RecordCount:
    """Records (documents before any sentence splitting) in ``source``."""
    if source.format == "text" and not document_per_line:
        return RecordCount(1, True)
    if source.format == "parquet":
        import pyarrow.parquet as pq

        return RecordCount(pq.ParquetFile(source.path).metadata.num_rows, True)
    if source.format == "arrow":
        return RecordCount(_arrow_rows(source.path), True)
    if source.format == "hf":
        return RecordCount(_hf_rows(source), True)
    return _line_records(source, sample_bytes)


def _line_records(source: Source, sample_bytes: int) -> RecordCount:
    """Non-blank lines in the first ``sample_bytes`` of the file (compressed bytes for gzip): all
    of them when the file ends there, else the sample's lines per file byte times the file's size."""
    lines, read, carry = 0, 0, b""
    inflate = zlib.decompressobj(wbits=31) if source.compressed else None
    with open(source.path, "rb") as f:
        while read < sample_bytes:
            block = f.read(min(1 << 20, sample_bytes - read))
            if not block:
                break
            read += len(block)
            if inflate is not None:
                inflate, block = _gunzip(inflate, block, source.path)
            data = carry + block
            cut = data.rfind(b"\n") + 1
            lines += _nonblank(data[:cut])
            carry = data[cut:]
        ended = not f.read(1)
    if ended:
        return RecordCount(lines + _nonblank(carry), True)
    return RecordCount(round(lines * source.size / max(read, 1)), False, read)


def _nonblank(data: bytes) -> int:
    return sum(1 for line in data.splitlines() if line.strip())


def _gunzip(inflate, block: bytes, path: str):
    """Decompress the next bytes of a gzip file, across concatenated members."""
    try:
        out = inflate.decompress(block)
        while inflate.eof and inflate.unused_data:
            rest, inflate = inflate.unused_data, zlib.decompressobj(wbits=31)
            out += inflate.decompress(rest)
    except zlib.error as exc:
        raise UserError(f"{path}: not valid gzip ({exc})") from None
    return inflate, out


def _arrow_rows(path: str) -> int:
    import pyarrow as pa

    try:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(pa.memory_map(path)))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.memory_map(path))
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


def _hf_rows(source: Source) -> int:
    return load_hf_split(source).num_rows
