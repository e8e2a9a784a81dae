"""A Hugging Face model directory or a Megatron-LM legacy checkpoint given to generate, serve or eval
as their checkpoint: converted by ``megacli.convert.convert`` (what `megacli convert` runs) into
RUN_DIR/converted/NAME, and reused there only while the source provably holds the same files.

Beside the conversion, NAME.source.json records the conversion's options and the name, size and
SHA-256 of every file the converter reads (a Hugging Face directory's own files; every file of a
legacy checkpoint, by its path inside it). The conversion
is reused when that record equals what the source and options give now; otherwise it is made
again in its place. A lock on RUN_DIR/converted serialises the processes converting there (the
ranks of a torchrun job, two servers started together).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from megacli.checkpoint.source import Source
from megacli.errors import UserError

CONVERTED_DIR = "converted"
_CHUNK = 1 << 24


def converted_in_run(source: Source, run_dir: Path, *, tensor: int, pipeline: int, dtype: str | None,
                     say: Callable[[str], None]) -> Path:
    """The megacli checkpoint of ``source``, a Hugging Face directory or a Megatron-LM legacy checkpoint,
    under ``run_dir`` (converted for
    TP=``tensor`` PP=``pipeline`` in ``dtype``, None: the source's), made now or reused; ``say`` gets
    one line saying which, with the path."""
    import megacli
    from megacli.checkpoint.layout import find_checkpoint
    from megacli.checkpoint.replace import check_replaceable
    from megacli.convert.run import PRECISIONS, convert
    from megacli.recipe.sections import ParallelSection
    from megacli.rundir import unwritable_names

    if dtype is not None and dtype not in PRECISIONS:
        raise UserError(f"train.precision = {dtype!r}: expected one of {', '.join(PRECISIONS)}")
    from megacli.checkpoint.source import LEGACY

    src = source.path
    legacy = source.kind == LEGACY
    kind = "a Megatron-LM legacy checkpoint" if legacy else "a Hugging Face model"
    folder = run_dir / CONVERTED_DIR
    name = src.resolve().name
    dst, record_file = folder / name, folder / f"{name}.source.json"
    record = {"megacli": megacli.__version__, "tensor": tensor, "pipeline": pipeline, "dtype": dtype,
              "files": fingerprint(src, recursive=legacy)}
    draft = folder / f".{record_file.name}.draft"
    made = [d for d in (run_dir, folder) if not d.exists()]
    with unwritable_names(run_dir, "run.dir", draft), _locked(folder):
        if _read_record(record_file) == record and _complete(dst, find_checkpoint):
            say(f"{src}: using {dst}, converted from the same files before")
            return dst
        try:
            record_file.unlink(missing_ok=True)
            check_replaceable(dst, field="the earlier conversion")
            shutil.rmtree(dst, ignore_errors=True)
            say(f"{src}: {kind}; converting it (TP={tensor} PP={pipeline}, "
                f"{dtype or 'its own precision'}) into {dst}")
            convert(source, dst, to="megacli", parallel=ParallelSection(tensor=tensor, pipeline=pipeline), dtype=dtype,
                    say=lambda _line: None)
            draft.write_text(json.dumps(record, indent=1) + "\n")
            draft.replace(record_file)
        except BaseException:
            for d in reversed(made):  # the directories made for this conversion, when nothing else is in them
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
    return dst


def fingerprint(src: Path, *, recursive: bool = False) -> list[list]:
    """[name, size, sha256] of every file directly in ``src`` (``recursive``: every file under it,
    named by its path inside ``src``), by name."""
    out = []
    try:
        for f in sorted(src.rglob("*") if recursive else src.iterdir()):
            if f.is_file():
                digest = hashlib.sha256()
                with open(f, "rb") as fh:
                    while chunk := fh.read(_CHUNK):
                        digest.update(chunk)
                out.append([f.relative_to(src).as_posix(), f.stat().st_size, digest.hexdigest()])
    except OSError as exc:
        raise UserError(f"{src}: cannot read the model's files ({exc.strerror or exc})") from None
    return out


def _read_record(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: not a proof
        return None


def _complete(dst: Path, find_checkpoint) -> bool:
    try:
        return find_checkpoint(dst) is not None
    except UserError:  # a `latest` naming no complete checkpoint
        return False


@contextlib.contextmanager
def _locked(folder: Path):
    """``folder``, created if need be, locked for the block (a folder removed while this waited for
    its lock is made and locked anew)."""
    import fcntl

    while True:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(folder).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)
