"""What a path is when it is not the regular file megacli wants to read: one wording for every
message about a FIFO, socket, device or directory in a file's place (a FIFO would block a read
forever, so it is named before anything opens it)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from megacli.errors import UserError


def kind_of_mode(mode: int) -> str:
    """A file type in words: "a FIFO (named pipe)", "a socket", "a device", "a directory"."""
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a plain file"


def not_regular(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as a regular file ("no such file", "a FIFO (named pipe), not a
    regular file", ...); None when it is one (or a link to one)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot read ({exc.strerror or exc})"
    return None if stat.S_ISREG(mode) else f"{kind_of_mode(mode)}, not a regular file"


def require_file(path: str | Path, what: str = "") -> None:
    """Refuse ``path`` unless it is a regular file; ``what`` follows the reason (", the index x needs it")."""
    problem = not_regular(path)
    if problem is not None:
        raise UserError(f"{path}: {problem}{what}")
