"""Which files megacli reads from a checkpoint or model directory: regular files, named by a relative
path that stays inside it. A FIFO, device or socket in a shard's place would block or never end a
read; a name that leaves the directory would read any file of the machine.

Symbolic links: a Hugging Face model directory may hold shards linked elsewhere (its cache links
snapshots to blobs), so there only the name is judged; a torch_dist checkpoint (megacli's,
Megatron-LM's) has no such convention, and a link that leaves it is refused - except in a staging
directory this process built (``staged``), whose links point at the files of a checkpoint it has
already checked.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from megacli.errors import UserError
from megacli.filekind import kind_of_mode as _kind


def named_inside(root: Path, name, *, named_by: str) -> Path:
    """``root / name`` for a file that ``named_by`` (an index, a metadata file) names, refused unless
    the name is relative and stays inside ``root``."""
    inside = isinstance(name, str) and name and not os.path.isabs(name) and not name.startswith("~")
    if not inside or Path(os.path.normpath(name)).parts[0] == "..":
        raise UserError(f"{named_by} names the file {name!r}, which is outside {root}; it may only name files "
                        f"in that directory")
    return root / name


def require_regular(path: Path) -> None:
    """Refuse ``path`` unless it is (or links to) a regular file."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{path}: {_kind(mode)}, not a regular file; a checkpoint may only hold regular files")


_staged: set[Path] = set()


def staged(directory: Path) -> Path:
    """Mark ``directory`` as a staging directory this process built, linking to checked files."""
    _staged.add(directory.resolve())
    return directory


def check_members(root: Path) -> None:
    """Refuse a torch_dist checkpoint directory holding anything but regular files and directories,
    or a symbolic link that leaves it (unless the directory is ``staged``)."""
    top = root.resolve()
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        path = Path(entry.path)
        leaves = entry.is_symlink() and not Path(os.path.realpath(path)).is_relative_to(top)
        if leaves and top not in _staged:
            raise UserError(f"{path}: a symbolic link to {os.path.realpath(path)}, outside the checkpoint {root}; "
                            f"copy the file into the checkpoint instead")
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UserError(f"{path}: {_kind(mode)}, not a regular file; a checkpoint may only hold regular files")
