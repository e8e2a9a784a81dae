"""The command line: seven subcommands, instant help (no torch/megatron import), recipe errors as
one message with exit code 2, dry-run arithmetic."""

import subprocess
import sys

import pytest

SUBCOMMANDS = ["preprocess", "pretrain", "finetune", "plot", "generate", "convert", "reshard"]


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
