"""Megatron-LM's own code on megacli's checkpoints and arguments. Opt-in (marker ``megatron_lm``):
the tests skip unless MEGATRON_LM_CHECKOUT points at a checkout of NVIDIA/Megatron-LM (nothing of it
is part of this repository) of the tag for this Python's Megatron-Core: core_v0.16.1 with Megatron-Core
0.16 (Python 3.11), core_v0.19.0 (or a later core_v0.19.x) with Megatron-Core 0.19 (Python 3.12); another
fails saying which tag to use. E.g. ``MEGATRON_LM_CHECKOUT=~/Megatron-LM-0.16.1 python3.11 -m pytest -m
megatron_lm tests/test_megatron_lm_checkout.py`` and ``MEGATRON_LM_CHECKOUT=~/Megatron-LM-0.19.0
python3.12 -m pytest -m megatron_lm tests/test_megatron_lm_checkout.py``.

Each test runs one of the by-hand checks in benchmarks/ (their docstrings say what they do) in its
own process and asserts on what it prints (naming the checkout's release, from its package_info):

- megatron_lm_args_check.py: megacli's args table against ``parse_args`` / ``validate_args``, the
  flag table and preprocess's spellings against the checkout's parsers;
- megatron_lm_load_check.py: pretrain_gpt.py's ``setup_model_and_optimizer`` + ``load_checkpoint``
  on megacli runs exported as Megatron-LM checkpoints (torch_dist: both specs, TP2 x PP2, the
  distributed optimizer; legacy; MoE): the restored iteration, scheduler, optimizer step and RNG
  state, and the logits against the run's Hugging Face export;
- megatron_lm_save_check.py: a MoE run that Megatron-LM's ``train_step`` and ``save_checkpoint``
  wrote, read by megacli (convert, the engine, reshard, generate, a resumed pretrain).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import importlib.util

import pytest

from tests.conftest import ROOT, MOCK_LLAMA, megacli, ok, pretrain

CHECKOUT = os.environ.get("MEGATRON_LM_CHECKOUT")
pytestmark = [pytest.mark.megatron_lm,
              pytest.mark.skipif(not CHECKOUT, reason="MEGATRON_LM_CHECKOUT (a core_v0.16.1 or core_v0.19.x "
                                                      "checkout) is not set")]

ITERS, GBS = 2, 2
RUN = [*MOCK_LLAMA, f"train.iters={ITERS}", "train.micro_batch_size=1", f"train.global_batch_size={GBS}",
       f"checkpoint.save_interval={ITERS}", *["parallel.tensor=1", "parallel.pipeline=1", "launch.nproc=1"]]
# A Qwen2-MoE-shaped run: 4 experts (top 2) with a gated shared expert in layer 0, layer 1 dense.
MOE = ["model.moe.num_experts=4", "model.moe.router_topk=2", "model.moe.ffn_hidden_size=48", "model.moe.layer_freq=[1,0]",
       "model.moe.shared_expert_ffn_hidden_size=32", "model.moe.shared_expert_gate=true"]
LOADED = re.compile(r"loaded: iteration (\d+), scheduler num_steps (\d+), optimizer step (\S+), "
                    r"Python RNG state equal to the checkpoint's: (True|False|\(none saved\))")
NUMBER = r"([0-9.]+(?:e[-+]?\d+)?)"


@pytest.fixture(scope="module")
def release() -> str:
    """The checkout's release ("0.19.1"), as the checks name it; the test fails unless it is this
    Python's Megatron-Core's minor release."""
    spec = importlib.util.spec_from_file_location("megatron_lm_checkout", ROOT / "benchmarks" / "megatron_lm_checkout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.checkout_release(CHECKOUT)
    except SystemExit as wrong:
        pytest.fail(f"MEGATRON_LM_CHECKOUT: {wrong}", pytrace=False)


@pytest.fixture(scope="module")
def checkout(release) -> str:
    return CHECKOUT


def check(script: str, *args, timeout: float = 1800) -> str:
    """benchmarks/SCRIPT ARGS in a fresh interpreter: what it printed (the test fails unless it exits 0)."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return done.stdout


def number(pattern: str, text: str) -> float:
    found = re.search(pattern.replace("NUMBER", NUMBER), text)
    assert found, f"{pattern!r} not in:\n{text[-4000:]}"
    return float(found.group(1))


# ---------------------------------------------------------------- arguments


def test_args_and_option_spellings_are_the_checkouts(checkout, release):
    out = check("megatron_lm_args_check.py", checkout)
    assert f"checkout: Megatron-LM {release}\n" in out, out
    # 1. every field parse_args defines, with its default
    assert re.search(r"1\. parse_args defines (\d+) fields, megacli's table \1\n", out), out
    section1 = out.split("1. ", 1)[1].split("\n2. ", 1)[0]
    assert "only in Megatron-LM: []" in section1 and "only in megacli: []" in section1
    assert "defaults that differ: {}" in section1, section1
    # 2. validate_args's result for the same model, field for field, in each precision
    sections = re.findall(r"^2\. (bf16|fp16|fp32), after validate_args:.*?(?=^2\. |^3\. )", out, re.M | re.S)
    assert len(sections) == 3, out
    for precision in ("bf16", "fp16", "fp32"):
        text = re.search(rf"^2\. {precision}, after validate_args:.*?(?=^2\. |^3\. )", out, re.M | re.S).group(0)
        assert "only in Megatron-LM: []" in text, text
        # padded_vocab_size is set by training, not by parse_args / validate_args: the one value that differs
        assert "values that differ (megacli, Megatron-LM; padded_vocab_size is set by training): 1\n" in text, text
        assert "padded_vocab_size: 320 vs None" in text, text
    # 3. the flag table's options are the parser's
    assert f"rows that are not Megatron-LM {release}'s option for their field: 0\n" in out, out
    # 4. preprocess's spellings
    assert "the refusal says so for exactly these: True" in out, out
    assert f"tokenizer types megacli names that Megatron-LM {release} lacks: []" in out, out


# ---------------------------------------------------------------- Megatron-LM loads megacli's checkpoints


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two-step runs (checkpoint at 2, with optimizer state) and their Hugging Face exports:
    fp32 (plain optimizer), bf16 (distributed optimizer), a Qwen2-MoE-shaped one."""
    root = tmp_path_factory.mktemp("megatron_lm_checkout")
    for name, extra in (("fp32", []), ("bf16", ["train.precision=bf16", "parallel.distributed_optimizer=true"]),
                        ("moe", MOE)):
        pretrain(root / name, [*RUN, *extra, f"checkpoint.dir={root / name / 'ck'}"])
        ok(megacli("convert", root / name / "ck", root / name / "hf", "--to", "hf"))
    return root


LOADS = {  # name: (run, megacli reshard options, the load check's extra options)
    "local": ("fp32", ["--format", "megatron", "--spec", "local"], []),
    "te": ("fp32", ["--format", "megatron"], []),
    "legacy": ("fp32", ["--format", "legacy", "--spec", "local"], []),
    "te_tp2pp2_distopt_bf16": ("bf16", ["--format", "megatron", "--tensor", "2", "--pipeline", "2",
                                        "--distributed-optimizer"], ["--use-distributed-optimizer"]),
    "moe_local": ("moe", ["--format", "megatron", "--spec", "local"], []),
}


@pytest.mark.parametrize("name", list(LOADS))
def test_megatron_lm_loads_the_export_with_its_state_and_the_hf_logits(checkout, runs, name, tmp_path):
    run, options, extra = LOADS[name]
    ok(megacli("reshard", runs / run / "ck", tmp_path / "mlm", *options, "--no-progress"))
    out = check("megatron_lm_load_check.py", checkout, tmp_path / "mlm", runs / run / "hf", *extra)
    loaded = LOADED.search(out)
    assert loaded, out[-4000:]
    iteration, num_steps, step, rng = loaded.groups()
    assert int(iteration) == ITERS and int(num_steps) == ITERS * GBS, loaded.group(0)  # the scheduler counts samples
    assert float(step) == ITERS, loaded.group(0)
    # the RNG state is per rank: restored in the layout it was saved in (Megatron-LM skips it in another)
    assert rng == ("True" if "--tensor" not in options else "False"), loaded.group(0)
    assert number(r"max \|Megatron-LM logits - HF logits\| = NUMBER", out) <= 1e-6


# ---------------------------------------------------------------- megacli reads Megatron-LM's own checkpoints


@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_megacli_reads_what_megatron_lms_save_checkpoint_wrote(checkout, optimizer, tmp_path):
    extra = ["--use-distributed-optimizer"] if optimizer == "distributed" else []
    out = check("megatron_lm_save_check.py", checkout, tmp_path, *extra, timeout=2400)
    assert "decoder.layers.mlp.router.weight (2, 4, 64)" in out, out  # the MoE layers stacked, as Megatron-LM saves them
    for what in ("HF - Megatron-LM", "engine - Megatron-LM", r"engine\(resharded\) - Megatron-LM"):
        assert number(rf"max \|{what}\| logits = NUMBER", out) <= 2e-7, what
    assert "HF greedy continuation equal to Megatron-LM's: True" in out, out
    assert re.search(r"equal to Megatron-LM's greedy continuation \([\d ]+\): True", out), out
    assert re.search(r"resumed from \S+iter_0000002 at iteration 2", out), out
    # the resumed run's losses are Megatron-LM's, bitwise
    diffs = re.findall(r"step (\d+): megacli \S+, Megatron-LM \S+, \|diff\| (\S+)", out)
    assert [step for step, _ in diffs] == ["3", "4"], out[-3000:]
    assert all(diff == "0" for _, diff in diffs), diffs
