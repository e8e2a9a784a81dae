"""A checkpoint's manifest: every file's size and xxh3-64 checksum, in manifest.json beside them.

Written at save (each rank hashes the shard files it wrote; rank 0 the shared files, then merges
them into one manifest before the checkpoint is published) and checked before a load, so a
truncated or bit-flipped shard is refused, naming the file, instead of loading silently.
Checkpoints without a manifest (older ones, other tools') load unchecked."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from megacli.errors import UserError

MANIFEST = "manifest.json"
ALGORITHM = "xxh3_64"
_CHUNK = 8 << 20
_SHARD = re.compile(r"__(\d+)_\d+\.distcp$")  # torch_dist shards: __<writing rank>_<n>.distcp


def checksum(path: Path) -> str:
    """xxh3-64 of a file, read in chunks into one buffer: memory-mapping it instead would add the
    whole file to this process's resident set while it is hashed."""
    h = xxhash.xxh3_64()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def _threads(n_files: int) -> int:
    return max(1, min(n_files, 8, os.cpu_count() or 1))


def describe(root: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"size", "xxh3_64"}} for files under root, hashed in parallel when more than one is
    large (starting threads costs more than hashing small files: a save's finalize step hashes its
    metadata files while the training loop waits)."""
    root = Path(root)
    sizes = [(root / name).stat().st_size for name in names]
    threads = _threads(sum(size >= _CHUNK for size in sizes))
    if threads == 1:
        sums = [checksum(root / name) for name in names]
    else:
        with ThreadPoolExecutor(threads) as pool:
            sums = list(pool.map(lambda name: checksum(root / name), names))
    return {name: {"size": size, ALGORITHM: s} for name, size, s in zip(names, sizes, sums)}


def part_name(rank: int) -> str:
    """A save directory's file with ``rank``'s description of the files it wrote (see described)."""
    return f".manifest-part-{rank}.json"


def files_of_rank(root: Path, rank: int, world_size: int) -> list[str]:
    """The files of a save directory that ``rank`` hashes: the shards it wrote; rank 0 also every
    other file (metadata, common state, ...). The manifest and its parts are not listed."""
    names = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*")
                   if p.is_file() and p.name != MANIFEST and not p.name.startswith(".manifest-part-"))
    mine = []
    for name in names:
        shard = _SHARD.search(name)
        writer = int(shard.group(1)) if shard and int(shard.group(1)) < world_size else 0
        if writer == rank:
            mine.append(name)
    return mine


def describe_part(root: Path, rank: int, world_size: int) -> None:
    """Describe the files ``rank`` has written so far into its part file (a writer process does it,
    once its shards are written, while they are in the page cache). A part it cannot write (a full
    disk) is left out, without a traceback from the writer process: ``described`` then hashes those
    files itself, and the save's finalize step reports the failed write."""
    names = files_of_rank(root, rank, world_size)
    part = Path(root) / part_name(rank)
    try:
        part.write_text(json.dumps(describe(root, names)))
    except OSError:
        part.unlink(missing_ok=True)


def described(root: Path, rank: int, world_size: int) -> dict[str, dict]:
    """``rank``'s share of the manifest: its part file (removed), completed with what it does not
    describe (written later, e.g. the save's metadata)."""
    part = Path(root) / part_name(rank)
    done = json.loads(part.read_text()) if part.is_file() else {}
    part.unlink(missing_ok=True)
    rest = [name for name in files_of_rank(root, rank, world_size) if name not in done]
    return {**done, **describe(root, rest)}


def write(root: Path, parts: list[dict[str, dict]]) -> None:
    """Merge the ranks' descriptions into root/manifest.json."""
    files = {k: v for part in parts for k, v in part.items()}
    data = {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    (Path(root) / MANIFEST).write_text(json.dumps(data, indent=1) + "\n")


def problems(root: Path, *, rank: int = 0, world_size: int = 1) -> list[str]:
    """What does not match root's manifest, file by file (empty when all match or there is no
    manifest); with several ranks each checks its share of the files."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        return []
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return [f"{path}: not a readable manifest"]
    if not isinstance(files, dict) or not all(_entry_ok(name, want) for name, want in files.items()):
        return [f"{path}: not a readable manifest (files must map names inside the checkpoint to their size and "
                f"{ALGORITHM})"]
    share = sorted(files)[rank::world_size]

    def check(name: str) -> str | None:
        f = root / name
        want = files[name]
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f}: {size} bytes, the manifest says {want['size']}"
        if checksum(f) != want[ALGORITHM]:
            return f"{f}: checksum differs from the manifest (the file is corrupt)"
        return None

    with ThreadPoolExecutor(_threads(len(share))) as pool:
        return [p for p in pool.map(check, share) if p]


def _entry_ok(name: str, want) -> bool:
    inside = bool(name) and not os.path.isabs(name) and ".." not in Path(name).parts
    return (inside and isinstance(want, dict) and type(want.get("size")) is int
            and isinstance(want.get(ALGORITHM), str))


def mismatch_error(root: Path, found: list[str]) -> UserError:
    return UserError(f"checkpoint {root} does not match its manifest: {found[0]}"
                     + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
                     + "; set checkpoint.verify: false to load it anyway")


def located(path: str | Path) -> Path:
    """The iteration directory a path means: itself, or the one its `latest` pointer names."""
    path = Path(path)
    pointer = path / "latest"
    if not (path / MANIFEST).is_file() and pointer.is_file():
        return path / pointer.read_text().strip()
    return path


def verify(path: str | Path) -> str | None:
    """Check a checkpoint (iteration directory, or a directory with `latest`) against its manifest
    in this process; raise UserError naming the first mismatching file, else return a summary line
    (None without a manifest)."""
    root = located(path)
    found = problems(root)
    if found:
        raise mismatch_error(root, found)
    manifest = root / MANIFEST
    if not manifest.is_file():
        return None
    files = json.loads(manifest.read_text())["files"]
    size = sum(f["size"] for f in files.values())
    return f"manifest: OK - {len(files)} files ({size / 1024**3:.2f} GiB) in {root} match their sizes and checksums"
