"""Checkpoint save time with and without the manifest (every file's size and xxh3-64 checksum),
side by side: the median of several saves of a ~100M-parameter fp32 state through megacli's own
`checkpoint.save`, in one CPU process, alternating the two kinds of save. Prints both medians and
the manifest's overhead.

    python benchmarks/checkpoint_bench.py [--params 100e6] [--repeats 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def sharded_state(params: float) -> dict:
    """Transformer-like fp32 weights: 64 matrices of 1024 columns summing to ``params``."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rows = max(1, int(params / 64 / 1024))
    gen = torch.Generator().manual_seed(0)
    return {f"decoder.layers.{i}.weight": ShardedTensor.from_rank_offsets(
        f"decoder.layers.{i}.weight", torch.randn(rows, 1024, generator=gen), replica_id=0) for i in range(64)}


class Weights:
    """Stands in for a model chunk: checkpoint.save asks it for its sharded state dict."""

    def __init__(self, state: dict):
        self.state = state

    def sharded_state_dict(self) -> dict:
        return self.state


@contextlib.contextmanager
def without_manifest():
    from megacli.checkpoint import manifest

    describe, write = manifest.describe, manifest.write
    manifest.describe, manifest.write = (lambda root, names: {}), (lambda root, parts: None)
    try:
        yield
    finally:
        manifest.describe, manifest.write = describe, write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    from megacli.checkpoint import manifest
    from megacli.convert.megatron_io import megatron_process
    from megacli.engine import checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt_bench_"))
    times: dict[str, list[float]] = {"with manifest": [], "without": [], "hashing": []}
    with megatron_process():  # one gloo process, Megatron's parallel state (CPU backend without CUDA)
        state = sharded_state(args.params)
        n = sum(sh.data.numel() for sh in state.values())
        try:
            for r in range(args.repeats + 1):  # round 0 warms up (imports, allocator) and is not counted
                for kind in (("with manifest", "without") if r % 2 else ("without", "with manifest")):
                    target = work / kind.replace(" ", "_")
                    with contextlib.nullcontext() if kind == "with manifest" else without_manifest():
                        start = time.perf_counter()
                        saved = checkpoint.save(ckpt_dir=target, iteration=r + 1, consumed_samples=0, chunks=[Weights(state)],
                                        optimizer=None, scheduler=None, recipe_yaml="{}\n")
                        elapsed = time.perf_counter() - start
                    if r:
                        times[kind].append(elapsed)
                    if r and kind == "with manifest":  # the hashing alone, as the save does it (files in the page cache)
                        start = time.perf_counter()
                        manifest.describe(saved, manifest.files_of_rank(saved, 0, 1))
                        times["hashing"].append(time.perf_counter() - start)
                    shutil.rmtree(target)
        finally:
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
    with_m, without = (statistics.median(times[k]) for k in ("with manifest", "without"))
    print(f"{n / 1e6:.1f}M fp32 parameters ({n * 4 / 1024**3:.2f} GiB), median of {args.repeats} saves each")
    print(f"  save without manifest: {without:.3f} s")
    print(f"  save with manifest:    {with_m:.3f} s")
    print(f"  manifest overhead:     {with_m / without - 1:+.1%} (ratio {with_m / without:.3f})")
    hashing = statistics.median(times["hashing"])
    print(f"  hashing the files alone: {hashing:.3f} s ({hashing / without:.1%} of a save without manifest)")


if __name__ == "__main__":
    main()
