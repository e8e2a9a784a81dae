"""The training-loop stall of a checkpoint save, synchronous against asynchronous
(checkpoint.async_save), in one run; with --manifest instead, a save's time with and without the
manifest (every file's size and xxh3-64 checksum).

Stall: a ~100M-parameter fp32 model stand-in with Adam's two moments trains in rounds of
--steps-per-save steps (each step a fixed amount of matrix work plus an in-place Adam-like update of
the weights and moments).
A round either saves nothing, or saves at its first step through the training loop's own save
owner (engine.saves.Saves: megacli's checkpoint.save, Megatron-Core's async torch_dist writer and
AsyncCallsQueue) and waits for the save at its end. A save's stall is its round's wall time minus
the median time of the rounds without a save: the time the loop blocked (planning, copies, fork,
finalize) and what the background writer slowed the steps by. The three kinds of round alternate;
the medians and their ratio are printed. One process: CUDA (NCCL) where there is a GPU, else the
CPU backend (gloo).

    python benchmarks/checkpoint_bench.py [--params 100e6] [--repeats 5] [--steps-per-save 8] [--workdir DIR]
    python benchmarks/checkpoint_bench.py --manifest [--params 100e6] [--repeats 5]
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


def manifest_overhead(args) -> None:
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
                    shutil.rmtree(work / kind, ignore_errors=True)  # not timed: only the newest save is kept
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



class Model:
    """Trainable stand-in with Adam's state: the weights as parameters (the save checks they are
    finite) and two moments each, all saved, all changed in place by every step."""

    def __init__(self, params: float, device):
        import torch

        rows = max(1, int(params / 64 / 1024))
        gen = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(rows, 1024, generator=gen).to(device))
                                               for _ in range(64)])
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.weights]
        self.work = torch.randn(1024, 1024, generator=gen).to(device)

    def parameters(self):
        return self.weights.parameters()

    def sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        state = {}
        for i, (p, (m, v)) in enumerate(zip(self.weights, self.moments)):
            for key, tensor in ((f"decoder.layers.{i}.weight", p.data), (f"optimizer.exp_avg.{i}", m),
                                (f"optimizer.exp_avg_sq.{i}", v)):
                state[key] = ShardedTensor.from_rank_offsets(key, tensor, replica_id=0)
        return state

    def step(self, matmuls: int) -> None:
        import torch

        with torch.no_grad():
            x = self.work
            for _ in range(matmuls):
                x = torch.tanh(x @ self.work)
            g = x[0, 0] * 1e-6
            for p, (m, v) in zip(self.weights, self.moments):  # what an Adam step does to every page of its state
                m.mul_(0.9).add_(g)
                v.mul_(0.999).add_(g * g)
                p.sub_(m / (v.sqrt() + 1e-8) * 1e-6)
        if x.is_cuda:
            torch.cuda.synchronize()


class _Log:
    def say(self, text: str) -> None:
        pass

    def plot(self, *, background: bool = False) -> None:
        pass


def saves_for(model, ckpt_dir: Path, *, async_save: bool, steps_per_save: int):
    from types import SimpleNamespace

    from megacli.engine.saves import Saves

    recipe = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(ckpt_dir), async_save=async_save, save_interval=steps_per_save,
                                                        keep_last=None),
                             train=SimpleNamespace(on_nonfinite="stop"))
    trainer = SimpleNamespace(chunks=[model], optimizer=None, scheduler=None)
    return Saves(recipe=recipe, trainer=trainer, recipe_yaml="{}\n", run_id="bench", lora_base=None, last_good=None,
                 log=_Log(), stream_meta=lambda: None)


@contextlib.contextmanager
def one_process():
    """One rank with Megatron's parallel state: NCCL on a GPU, else gloo on the CPU backend."""
    import torch

    if not torch.cuda.is_available():
        from megacli.convert.megatron_io import megatron_process

        with megatron_process():
            yield torch.device("cpu")
        return
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel()
    try:
        yield torch.device("cuda", 0)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


# Where the loop blocked in a round with a save: in the step boundary that starts the save, in the
# later ones (an asynchronous save's completion checks and its finalize step), and in the wait for
# the save at the round's end (the writer not done yet, then the finalize step).
PHASES = ("at the save", "later boundaries", "at the round's end")


def save_stall(args) -> None:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckpt_bench_"))
    k = args.steps_per_save
    rounds: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    blocked: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with one_process() as device:
        model = Model(args.params, device)
        n = sum(p.numel() for p in model.parameters())
        saves = {kind: saves_for(model, work / kind, async_save=kind == "async", steps_per_save=k) for kind in blocked}
        counted = 0
        try:
            # rounds 0 and 1 warm up (imports, allocator, first fork; the saves' plan, reused from the third
            # save on) and are not counted
            for r in range(args.repeats + 2):
                order = ("none", "sync", "async") if r % 2 else ("async", "sync", "none")
                for kind in order:
                    counted += 1
                    start, waited = time.perf_counter(), dict.fromkeys(PHASES, 0.0)
                    for i in range(k):
                        model.step(args.matmuls)
                        if kind != "none":  # due at the round's first step (a multiple of k) only
                            t0 = time.perf_counter()
                            saves[kind].step(iteration=counted * k + i, consumed=0, last=False)
                            waited[PHASES[min(i, 1)]] += time.perf_counter() - t0
                    if kind != "none":
                        t0 = time.perf_counter()
                        saves[kind].finish()
                        waited[PHASES[2]] += time.perf_counter() - t0
                    elapsed = time.perf_counter() - start
                    shutil.rmtree(work / kind, ignore_errors=True)  # not timed: only the newest save is kept
                    if r > 1:
                        rounds[kind].append(elapsed)
                        if kind != "none":
                            blocked[kind].append(waited)
        finally:
            for s in saves.values():
                s.abort()
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(rounds["none"])
    stall = {kind: statistics.median(t - base for t in rounds[kind]) for kind in blocked}
    wait = {kind: statistics.median(sum(w.values()) for w in blocked[kind]) for kind in blocked}
    print(f"{n / 1e6:.1f}M fp32 parameters with Adam's moments ({n * 12 / 1024**3:.2f} GiB saved) on {device.type}, "
          f"a save every {k} steps "
          f"of {base / k * 1e3:.0f} ms, median of {args.repeats} rounds each")
    for kind in blocked:
        split = ", ".join(f"{phase} {statistics.median(w[phase] for w in blocked[kind]):.3f} s" for phase in PHASES)
        print(f"  {kind:5} save: the loop blocked {wait[kind]:.3f} s ({split}); round stall {stall[kind]:.3f} s")
    print(f"  async / sync, loop blocked: {wait['async'] / wait['sync']:.1%}; "
          f"round stall: {stall['async'] / stall['sync']:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps-per-save", type=int, default=8)
    parser.add_argument("--matmuls", type=int, default=4, help="1024×1024 matrix products per step")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--manifest", action="store_true", help="measure the manifest's share of a save instead")
    args = parser.parse_args()
    (manifest_overhead if args.manifest else save_stall)(args)


if __name__ == "__main__":
    main()
