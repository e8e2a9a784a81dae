"""User errors at the command line: one message, exit code 2, no traceback, user text shown as
written (no rich markup or emoji codes), checked before anything slow starts."""

import subprocess
import sys

import pytest

SUBCOMMANDS = ["preprocess", "pretrain", "finetune", "generate", "convert", "reshard"]


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "megacli", *args], capture_output=True, text=True, **kw)


def assert_clear_error(out, *expected):
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    text = " ".join(out.stderr.split())
    for part in expected:
        assert part in text, text


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_recipe_that_is_not_utf8(cmd, tmp_path):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes("run:\n  name: caf\u00e9\n".encode("latin-1"))
    assert_clear_error(run(cmd, str(recipe)), str(recipe), "line 2: not UTF-8 text (byte 0xe9")


@pytest.mark.parametrize("cmd", ["pretrain", "generate"])
def test_a_directory_given_as_the_recipe(cmd, tmp_path):
    assert_clear_error(run(cmd, str(tmp_path)), f"invalid recipe {tmp_path}: a directory, not a YAML recipe file")


def test_a_dry_run_notes_every_missing_file_a_run_refuses(tmp_path):
    sets = ["--set", f"data.path={tmp_path / 'corpus'}", "--set", "tokenizer.type=huggingface",
            "--set", f"tokenizer.path={tmp_path / 'tok'}", "--set", "model.vocab_size=4096", "--set", f"run.dir={tmp_path / 'run'}"]
    missing = [f"data prefix '{tmp_path / 'corpus'}': missing {tmp_path / 'corpus.bin'} and {tmp_path / 'corpus.idx'}",
               f"tokenizer.path '{tmp_path / 'tok'}' does not exist"]
    out = run("pretrain", "--dry-run", *sets)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert all(f"note: a run would refuse this: {m}" in text for m in missing), text[-1000:]
    assert_clear_error(run("pretrain", *sets), missing[0])
    assert not (tmp_path / "run").exists()


def test_empty_recipe_names_no_data(tmp_path):
    recipe = tmp_path / "empty.yaml"
    recipe.write_text("")
    assert_clear_error(run("pretrain", str(recipe), "--dry-run"), str(recipe), "names no training data",
                       "data.mock: true")


def test_a_recipe_with_mock_data_still_validates(tmp_path):
    recipe = tmp_path / "mock.yaml"
    recipe.write_text("data:\n  mock: true\ntokenizer:\n  type: byte\n")
    out = run("pretrain", str(recipe), "--dry-run")
    assert out.returncode == 0, out.stderr


def test_finetune_needs_pretrained_weights(tmp_path):
    recipe = tmp_path / "ft.yaml"
    recipe.write_text(f"data:\n  mock: true\ntokenizer:\n  type: byte\nrun:\n  dir: {tmp_path / 'run'}\n"
                      "model:\n  num_layers: 1\n  hidden_size: 16\n  num_attention_heads: 2\n  seq_length: 16\n"
                      "train:\n  iters: 1\n  micro_batch_size: 1\n  global_batch_size: 1\n  eval_interval: null\n"
                      "  precision: fp32\n")
    out = run("finetune", str(recipe))
    assert_clear_error(out, "checkpoint.pretrained", "megacli pretrain")
    assert not (tmp_path / "run").exists(), "nothing is written for a refused run"


def test_layer_division_message_names_each_value_once():
    out = run("pretrain", "--dry-run", "--set", "parallel.pipeline=3", "--set", "launch.nproc=6")
    assert_clear_error(out, "must be divisible by parallel.pipeline = 3 (4 % 3 = 1)")


def test_user_text_in_errors_is_not_rich_markup(tmp_path):
    missing = tmp_path / "[bold]corpus:smile:x"
    out = run("pretrain", "--set", f"data.path='{missing}'", "--set", "launch.nproc=1", "--set", "parallel.tensor=1",
              "--set", "parallel.pipeline=1", "--set", "parallel.sequence_parallel=false",
              "--set", f"run.dir={tmp_path}/run")
    assert_clear_error(out, f"{missing}.bin")


def test_generate_output_directory_is_checked_before_loading(tmp_path):
    ckpt = tmp_path / "ck" / "iter_0000001"
    ckpt.mkdir(parents=True)
    (tmp_path / "ck" / "latest").write_text("iter_0000001")
    (ckpt / "megacli.json").write_text("{}")
    (ckpt / "recipe.yaml").write_text("data:\n  mock: true\ntokenizer:\n  type: byte\nlaunch:\n  nproc: 1\n"
                                  "train:\n  micro_batch_size: 1\n")
    out = run("generate", "-c", str(tmp_path / "ck"), "-p", "hi", "-o", str(tmp_path / "nope" / "out.jsonl"),
              "--set", f"run.dir={tmp_path}/run")
    assert_clear_error(out, "generate.output", f"{tmp_path / 'nope'}", "does not exist")


def test_empty_jsonl_warns_of_an_empty_dataset(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = run("preprocess", "--input", str(empty), "--output-prefix", str(tmp_path / "o"), "--tokenizer", "byte",
              "--workers", "0")
    assert out.returncode == 0, out.stderr
    assert "warning: the input held no documents" in " ".join(out.stderr.split())


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_seed_numpy_cannot_take_is_refused_before_anything_starts(seed, tmp_path):
    recipe = tmp_path / "mock.yaml"
    recipe.write_text("data:\n  mock: true\ntokenizer:\n  type: byte\n")
    out = run("pretrain", str(recipe), "--dry-run", "--set", f"train.seed={seed}")
    assert_clear_error(out, f"train.seed = {seed}")
    assert run("pretrain", str(recipe), "--dry-run", "--set", f"train.seed={2**32 - 1}").returncode == 0
