"""The .npy files a run caches and reads back (Megatron-Core's dataset indices, preference tuning's
reference log-probabilities): only a plain numeric array is read, never one of Python objects (a
pickle inside could run code). A file that is not what megacli writes there is refused with one
message that says to delete it, as it is rebuilt."""

from __future__ import annotations

import tokenize
from pathlib import Path

import numpy as np

from megacli.errors import UserError
from megacli.filekind import not_regular

_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def array_header(path: Path) -> tuple[tuple[int, ...], np.dtype] | str:
    """(shape, dtype) from the header of the .npy file at ``path``, or what is wrong with it."""
    problem = not_regular(path)
    if problem is not None:
        return problem
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            if version not in _HEADER_READERS:
                return f"a .npy file of format version {version}"
            shape, _, dtype = _HEADER_READERS[version](fh)
    # numpy re-tokenizes a header it cannot parse as written by older numpy: TokenError, SyntaxError
    except (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError) as exc:
        return f"not a .npy array file ({exc})"
    return "an array of Python objects" if dtype.hasobject else (shape, dtype)


def not_plain_array(path: Path) -> str | None:
    """What is wrong with ``path`` as a plain (numeric) .npy array file; None when nothing is."""
    header = array_header(path)
    return header if isinstance(header, str) else None


def load_cached(path: Path, *, shape: tuple[int, ...], dtype, what: str) -> np.ndarray:
    """The array cached at ``path``: of exactly ``shape`` and ``dtype``, finite, read without
    unpickling; else a UserError naming ``what`` it should hold."""
    header = array_header(path)
    problem = header if isinstance(header, str) else None
    if problem is None and header != (tuple(shape), np.dtype(dtype)):
        problem = f"an array of shape {list(header[0])} and dtype {header[1]} (expected {list(shape)}, {np.dtype(dtype)})"
    array = None
    if problem is None:
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:  # shorter than its header says
            problem = f"unreadable ({exc})"
    if problem is None and not np.isfinite(array).all():
        problem = "holds non-finite values"
    if problem is not None:
        raise UserError(f"{path}: {problem}, not the {what} megacli caches there. Delete it (it is rebuilt)")
    return array
