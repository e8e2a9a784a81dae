"""What the CUDA acceptance tests (tests/test_gpu.py) share with their CPU variants: the recipe
overrides of a run on a given device and precision, a run of `megacli pretrain` through the real
launcher, the comparisons of two runs' records, and the `--dry-run` memory estimate of a recipe as
plan.estimate computes it. (Reading metrics.jsonl back, assert_close: tests/conftest.py.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import ROOT, megacli, ok, sets_args

RECIPES = ROOT / "recipes"

# A tiny GPT on mock data, one process; 20 steps (a loss curve long enough to compare bitwise).
TINY_GPT = [
    "data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null",
    "model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
    "model.seq_length=32", "model.make_vocab_size_divisible_by=128",
    "parallel.tensor=1", "parallel.pipeline=1", "parallel.sequence_parallel=false", "launch.nproc=1",
    "train.iters=20", "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_interval=1",
    "train.eval_interval=null", "optim.warmup_iters=1", "optim.lr=1e-2", "checkpoint.dir=null",
]

# train.fp8's tiny GPT (tests/test_fp8.py emulated on CPU, tests/test_gpu.py on FP8 matrix units): two
# layers, 64 wide (every linear's shape a multiple of 16), one micro-batch of 4 × 32 tokens a step,
# bf16, 50 steps of a cosine schedule (the one docs/gpu.md derives the FP8 tolerance on).
FP8_GPT = [
    "data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null",
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
    "model.seq_length=32", "model.make_vocab_size_divisible_by=256",
    "train.iters=50", "train.micro_batch_size=4", "train.global_batch_size=4", "train.log_interval=1",
    "train.eval_interval=null", "optim.warmup_iters=2", "optim.lr=3e-3", "train.precision=bf16", "checkpoint.dir=null",
]


def on_device(device: str, precision: str, *, deterministic: bool = False) -> list[str]:
    """Overrides that put a run on `device` ("cuda" or "cpu") in `precision`."""
    return [f"launch.device={device}", f"train.precision={precision}", f"train.deterministic={str(deterministic).lower()}"]


def pretrain(run_dir: Path, overrides: list[str], recipe: Path | None = None, timeout: int = 900,
             in_process: bool = False) -> subprocess.CompletedProcess:
    """`megacli pretrain [recipe] --set ...` in a fresh process; fails the test with the run's output
    when it fails. ``in_process``: a one-worker run's worker runs in that process (the CLI's
    in-process path) instead of one the launcher starts."""
    args = ["pretrain", *([recipe] if recipe else []), *sets_args([*overrides, f"run.dir={run_dir}"])]
    return ok(megacli(*args, in_process=in_process, timeout=timeout, cwd=ROOT))


def assert_bitwise(a: dict[int, dict], b: dict[int, dict], keys=("loss", "grad_norm")) -> None:
    """Two runs logged the same steps with exactly the same values (JSON keeps every float bit)."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for i in sorted(a):
        for k in keys:
            assert a[i][k] == b[i][k], f"step {i} {k}: {a[i][k]!r} vs {b[i][k]!r}"


def assert_loss_falls(records: dict[int, dict], by: float, key: str = "loss") -> None:
    first, last = records[min(records)][key], records[max(records)][key]
    assert last < first - by, [round(r[key], 4) for _, r in sorted(records.items())]


def memory_estimate(recipe: Path, overrides: list[str]):
    """plan.estimate's memory of the busiest rank (a RankMemory) for the recipe with overrides,
    with the vocabulary --dry-run uses."""
    from megacli import plan
    from megacli.cli.plan_view import vocab_size_of
    from megacli.recipe.jobs import load_job_recipe

    loaded = load_job_recipe("pretrain", recipe, overrides)
    vocab, _ = vocab_size_of(loaded)
    return plan.estimate(loaded, vocab)[1]


def peak_memory_gib(records: dict[int, dict]) -> float:
    """The highest `memory_gib` logged (on CUDA: torch.cuda.max_memory_allocated)."""
    return max(r["memory_gib"] for r in records.values())
