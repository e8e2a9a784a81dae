"""The command line: its subcommands, instant help (no torch/megatron import), recipe errors as
one message with exit code 2, dry-run arithmetic."""

import subprocess
import sys
from pathlib import Path

import pytest

SUBCOMMANDS = ["preprocess", "pretrain", "finetune", "submit", "plot", "generate", "eval", "serve", "convert", "reshard", "recipe"]


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "megacli", *args], capture_output=True, text=True, **kw)


def test_help_lists_the_subcommands_in_order():
    out = run("--help")
    assert out.returncode == 0
    listed = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ") and line.split()]
    assert [c for c in listed if c in SUBCOMMANDS] == SUBCOMMANDS


def test_help_imports_neither_torch_nor_megatron():
    code = ("import sys; sys.argv = ['megacli'] + sys.argv[1:] + ['--help']\n"
            "from megacli.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformers')]\n"
            "assert not bad, bad\n")
    for cmd in ([], *[[c] for c in SUBCOMMANDS]):
        out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_subcommand_help(cmd):
    out = run(cmd, "--help")
    assert out.returncode == 0 and "Usage" in out.stdout


def test_bad_recipe_exits_2_with_one_message(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  num_attention_heads: 6\nparallel:\n  tensor: 4\nlaunch:\n  nproc: 4\n")
    out = run("pretrain", str(recipe), "--dry-run")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert str(recipe) in out.stderr and "parallel.tensor = 4" in out.stderr and "num_attention_heads = 6" in out.stderr


def test_missing_recipe_file():
    out = run("pretrain", "nope.yaml")
    assert out.returncode == 2 and "nope.yaml" in out.stderr and "not found" in out.stderr


def test_missing_data_is_named_before_launch(tmp_path):
    out = run("pretrain", "--set", "data.path=" + str(tmp_path / "corpus"), "--set", "launch.nproc=1",
              "--set", "parallel.tensor=1", "--set", "parallel.pipeline=1", "--set", "parallel.sequence_parallel=false",
              "--set", f"run.dir={tmp_path}/run")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "corpus.bin" in out.stderr and "megacli preprocess" in out.stderr


def test_dry_run_prints_layout_and_memory():
    out = run("pretrain", "--dry-run", "--set", "model.vocab_size=4096")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "TP 2 × PP 2 × CP 1 × DP 1 = 4" in text
    assert "4 = global 16 / (micro 4 × DP 1)" in text
    assert "2,048 = 16 × 128" in text
    assert "with distributed optimizer" in text and "activations" in text


SHIPPED = sorted(p for p in (Path(__file__).parent.parent / "recipes").glob("*.yaml") if not p.name.startswith("preprocess"))
ONE_CHANGE = ["parallel.tensor=1", "train.iters=4", "data.mock=true", "tokenizer.type=none", "tokenizer.type=null",
              "train.eval_interval=0", "checkpoint.save_interval=0"]


def _refusal(recipe: Path, change: str) -> str | None:
    """The reason a shipped recipe rightly refuses a change (None: the dry run must succeed)."""
    text = recipe.read_text()
    masked = "arch: bert" in text or "arch: t5" in text
    if change == "data.mock=true" and masked:
        return "data.mock = True: "  # Megatron's masked datasets have no mock variant
    if change.startswith("tokenizer.type="):
        if "vocab_size:" not in text:
            return "tokenizer.type: none needs an explicit model.vocab_size"
        if masked or "sft:" in text:
            return "tokenizer.type = 'none'"  # masking and instruction data need a real tokenizer
    return None


@pytest.mark.parametrize("change", ONE_CHANGE)
@pytest.mark.parametrize("recipe", SHIPPED, ids=lambda p: p.stem)
def test_one_change_to_a_shipped_recipe_dry_runs(recipe, change):
    """What a new user tries first: one --set on a shipped recipe either dry-runs or is refused
    (exit 2, one message) for a reason of the recipe's own, never for a spelling."""
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    job = "finetune" if recipe.stem.endswith("_sft") or recipe.stem.startswith("sft") else "pretrain"
    out = CliRunner().invoke(app, [job, str(recipe), "--dry-run", "--set", change])
    refusal = _refusal(recipe, change)
    if refusal is None:
        assert out.exit_code == 0, out.output
        assert "layout" in out.output and "activations" in out.output
    else:
        assert out.exit_code == 2 and "Traceback" not in out.output, out.output
        assert refusal in " ".join(out.output.split()), out.output
