"""A save that runs out of disk space: say so plainly (where, how much was needed, how much is
free) instead of the writer's low-level error, and leave no partial save behind."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from megacli.errors import UserError

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def size_text(n: int) -> str:
    """Bytes in the largest unit that keeps the number at 1 or more: 512 B, 1.5 MiB, 12.3 GiB."""
    value, unit = float(n), UNITS[0]
    for unit in UNITS:
        if abs(value) < 1024 or unit == UNITS[-1]:
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def state_bytes(state) -> int:
    """Bytes of tensor data this rank writes for a sharded state dict (main replicas only)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

    total = 0
    for value in nested_values(state):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and is_main_replica(value.replica_id):
            total += value.data.numel() * value.data.element_size()
    return total


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC anywhere in the exception's chain or in its text (the checkpoint writer wraps the
    errors of its writer processes, so only their text may reach us)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return "No space left on device" in str(exc) or f"[Errno {errno.ENOSPC}]" in str(exc)


def disk_full_error(exc: BaseException, *, ckpt_dir: Path, partial: Path, needed: int, remove: bool) -> UserError | None:
    """The error to raise for a failed save when the disk is full (also when the writer only
    reported a short write: less free space than the save needs), else None. ``remove``: this rank
    deletes the partial save directory."""
    free = shutil.disk_usage(ckpt_dir).free + _tree_bytes(partial)  # what is free once the partial save is gone
    if not (is_disk_full(exc) or free < needed):
        return None
    if remove:
        shutil.rmtree(partial, ignore_errors=True)
    return UserError(f"no space left on device in {ckpt_dir} (needed ~{size_text(needed)}, free {size_text(free)}): "
                     f"the partial save {partial.name} was removed and the earlier checkpoints are intact. Free some "
                     f"space (checkpoint.keep_last prunes old checkpoints) or choose another checkpoint.dir")
