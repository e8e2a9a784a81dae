"""Which Megatron-Core release is installed: asked by the engine's compatibility module
(engine/core_compat.py, each difference named there) and by the checkpoint formats' per-release
tables (Megatron-LM's argument defaults). Nothing is imported at import time."""

from __future__ import annotations

import functools


@functools.cache
def core_version():
    """The installed Megatron-Core release (packaging's Version)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("megatron-core"))


@functools.cache
def core_since(release: str) -> bool:
    """Whether the installed Megatron-Core is ``release`` or newer."""
    from packaging.version import Version

    return core_version() >= Version(release)
