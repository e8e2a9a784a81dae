"""`megacli plan`: the layouts it enumerates are exactly those the recipe's checks accept, its memory
is the dry-run's, its time model follows the GPU benchmark results it is calibrated from, and the
command's outputs (table, --json, -o) and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megacli.recipe.jobs import load_job_recipe, repo_recipes_dir
from tests.conftest import cli

RECIPES = repo_recipes_dir()
TINY = RECIPES / "gpt_tiny.yaml"
ROOT = Path(__file__).resolve().parent.parent


def _plan(name: str, gpus: int, sets=(), **kw):
    from megacli.planner import plan_layouts
    from megacli.planner.gpus import GPUS

    recipe = load_job_recipe("pretrain", RECIPES / name, list(sets))
    return recipe, plan_layouts(recipe, recipe.model.vocab_size or 1000, gpus=gpus, gpu=kw.pop("gpu", GPUS["h100-80gb"]),
                                gpus_per_node=kw.pop("gpus_per_node", 8), **kw)


def test_enumerated_layouts_are_exactly_those_loading_accepts(tmp_path):
    """On 8 GPUs, every (TP, PP, VP, micro-batch) of the tiny GPT is tried: the accepted ones load as a
    recipe with those values set, the refused ones fail to load with the reason the planner gives."""
    from megacli.recipe.base import RecipeErrors

    recipe, found = _plan("gpt_tiny.yaml", 8)
    accepted = {(r.layout["tensor"], r.layout["pipeline"], r.layout["virtual_pipeline"], r.layout["micro_batch_size"],
                 r.layout["sequence_parallel"]) for r in found.rows if r.layout["context"] == 1}
    assert (2, 2, None, 4, True) in accepted and (8, 1, None, 1, True) not in accepted  # 4 heads: TP <= 4
    assert found.tried == len(found.rows) + sum(found.rejected.values())
    checked = 0
    for tp in (1, 2, 4, 8):
        for b in (1, 2, 4, 8):
            sets = ["train.global_batch_size=16", "parallel.pipeline=1", "parallel.sequence_parallel=auto",
                    f"parallel.tensor={tp}", f"train.micro_batch_size={b}", "launch.nproc=8"]
            try:
                load_job_recipe("pretrain", TINY, sets)
                loads = True
            except RecipeErrors:
                loads = False
            assert loads == ((tp, 1, None, b, tp > 1) in accepted), (tp, b)
            checked += 1
    assert checked == 16
    # A row's recipe is a recipe as loading makes it: its YAML loads back to the same recipe.
    from megacli.recipe.base import dump

    for row in found.rows[:: max(1, len(found.rows) // 20)]:
        written = tmp_path / "row.yaml"
        written.write_text(dump(row.recipe))
        assert load_job_recipe("pretrain", written) == row.recipe


def test_memory_is_the_dry_runs_model():
    """The planner's memory of the recipe's own layout is megacli.plan.estimate's (what --dry-run
    prints), plus the stated allowance."""
    from megacli import plan
    from megacli.planner.gpus import Constants
    from megacli.planner.memory import layout_memory, process_groups

    recipe = load_job_recipe("pretrain", RECIPES / "mixtral_8x7b.yaml")
    counts, dry = plan.estimate(recipe, 32000, device="cuda")
    mem = layout_memory(recipe, counts, 32000, Constants())
    tensors = dry.total_gib
    assert mem.stage == dry.stage and mem.params == dry.params
    assert mem.weights + mem.gradients + mem.optimizer + mem.activations == pytest.approx(tensors)
    c = Constants()
    assert mem.other == pytest.approx(c.cuda_context_gib + c.nccl_buffers_gib * process_groups(recipe) + c.fragmentation * tensors)
    assert process_groups(recipe) == 3  # pipeline, expert, data


def test_time_model_is_calibrated_from_the_stored_gpu_results():
    """The MFU curve passes through the measured benchmark points it is fitted to, which are the
    stored results' numbers; on one GPU with the benchmark's settings the prediction is that MFU."""
    from megacli.planner.gpus import GPUS, H100_MEASURED, H200_MEASURED, Constants, achievable_mfu, matmul_work

    h100 = json.loads((ROOT / "benchmarks/results/h100_gpu_bench_2026-11-24.json").read_text())["results"]
    h200 = json.loads((ROOT / "benchmarks/results/h200_gpu_bench_2026-11-27_variants.json").read_text())["results"]
    assert [m for _, _, m in H100_MEASURED] == [round(h100[s]["megacli"]["mfu"], 3) for s in ("124m", "350m", "1.3b")]
    assert [m for _, _, m in H200_MEASURED] == [round(h200[s]["megacli:default"]["mfu"], 3) for s in ("124m", "1.3b")]
    for gpu, points in (("h100-80gb", H100_MEASURED[1:]), ("h200", H200_MEASURED)):
        for hidden, tokens, mfu in points:
            assert achievable_mfu(GPUS[gpu], matmul_work(hidden, tokens, 1), Constants()) == pytest.approx(mfu, rel=1e-9)
    # 1.3B on one H100 at the benchmark's settings (sequence 2048, micro-batch 4): the measured 43.6%.
    _, found = _plan("gpt2_1.3b.yaml", 1, ["model.seq_length=2048", "model.max_position_embeddings=2048",
                                           "train.global_batch_size=16"])
    row = next(r for r in found.rows if r.layout["micro_batch_size"] == 4 and r.layout["recompute"] == "none")
    assert row.mfu == pytest.approx(0.436, rel=1e-3)


def test_bubble_and_parts_follow_the_layout():
    from megacli.planner.speed import PARTS

    _, found = _plan("llama2_7b.yaml", 16)
    for row in found.rows[:200]:
        lay, parts = row.layout, row.time.parts
        micro = row.recipe.num_microbatches
        assert parts["bubble"] == pytest.approx(parts["compute"] * (lay["pipeline"] - 1) / (micro * (lay["virtual_pipeline"] or 1)))
        assert (parts["tensor"] > 0) == (lay["tensor"] > 1) and (parts["context"] > 0) == (lay["context"] > 1)
        assert row.time.seconds == pytest.approx(sum(parts[p] for p in PARTS))
    fits = [r.tokens_per_second_per_gpu for r in found.fitting]
    assert fits == sorted(fits, reverse=True)


def test_plan_json_and_output_recipe_run_unchanged(tmp_path):
    from megacli.planner import layout_of

    out = tmp_path / "chosen.yaml"
    res = cli("plan", str(RECIPES / "llama2_7b.yaml"), "--gpus", "16", "--json", "--top", "3", "-o", str(out))
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert len(rows) == 3
    for key in ("tensor", "pipeline", "virtual_pipeline", "context", "expert", "data", "micro_batch_size", "recompute",
                "distributed_optimizer", "sequence_parallel", "fits", "tokens_per_second_per_gpu", "mfu"):
        assert key in rows[0], key
    assert set(rows[0]["memory_gib"]) == {"weights", "gradients", "optimizer", "activations", "other", "total"}
    assert rows[0]["fits"] and rows[0]["memory_gib"]["total"] <= 79.2
    chosen = load_job_recipe("pretrain", out)
    assert layout_of(chosen) == {k: rows[0][k] for k in ("tensor", "pipeline", "virtual_pipeline", "context", "expert", "data",
                                 "micro_batch_size", "recompute", "distributed_optimizer", "sequence_parallel")}
    dry = cli("pretrain", str(out), "--dry-run")
    assert dry.exit_code == 0, dry.output
    table = cli("plan", str(RECIPES / "llama2_7b.yaml"), "--gpus", "16", "--top", "4", "--set", "launch.nnodes=2")
    assert table.exit_code == 0 and "fastest that fits" in table.stdout
    assert "the recipe's own layout (TP2 PP1 CP1 EP1 DP8, micro-batch 1, selective) ranks #" in table.stdout


TINY_16 = [str(TINY), "--set", "train.global_batch_size=16"]


@pytest.mark.parametrize("args, says", [
    (TINY_16 + ["--gpus", "7"], ["no layout of this model uses 7 GPUs", "smallest GPU count that fits is 1",
                                 "next count above 7 that works is 8"]),
    (TINY_16 + ["--gpus", "4", "--gpu", "v100"], ["unknown GPU", "h100-80gb, h200, a100-80gb, b200"]),
    ([str(RECIPES / "gpt2_1.3b.yaml"), "--gpus", "1", "--gpu-memory", "12"],
     ["none of the 30 layouts for 1 GPUs fits in h100-80gb's 12.0 GiB", "smallest GPU count that fits is 3"]),
    (TINY_16 + ["--gpus", "4", "--constant", "bus_speed=2"], ["unknown constant 'bus_speed'", "bus_efficiency"]),
    (TINY_16 + ["--gpus", "4", "--constant", "bus_efficiency=fast"], ["'fast' is not a number"]),
    (TINY_16 + ["--gpus", "12"], ["12 GPUs are not whole nodes of 8"]),
    ([str(TINY), "--gpus", "4", "--set", "parallel.tensor=3"], ["parallel.tensor = 3"]),
])
def test_plan_bad_input_exits_2_with_one_message(args, says, tmp_path):
    out = tmp_path / "chosen.yaml"
    res = cli("plan", *args, "-o", str(out))
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.stderr.count("error:") == 1
    for text in says:
        assert text in res.stderr, res.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing written


def test_prediction_imports_no_torch():
    """`megacli plan` predicts without importing torch (the time of a 70B-class recipe for 1,024 GPUs:
    benchmarks/plan_bench.py)."""
    code = ("import sys; from megacli.cli import _register, app; _register(); "
            "app(['plan', 'recipes/llama2_7b.yaml', '--gpus', '16', '--json', '--top', '1'], standalone_mode=False); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)[0]["fits"]


def test_measure_runs_the_top_layouts_and_reranks_them(tmp_path):
    """--measure 2 on CPU: the two top layouts of a tiny GPT on one process run a few steps
    each through `megacli pretrain`; their measured step time and peak memory come back next to
    the prediction, ordered by measured speed, and -o writes the fastest measured layout."""
    from megacli.planner import layout_of

    sets = ["launch.device=cpu", "data.mock=true", "data.path=null", "tokenizer.type=none", "tokenizer.path=null",
            "model.vocab_size=512", "train.global_batch_size=8", "parallel.distributed_optimizer=false"]
    out = tmp_path / "chosen.yaml"
    res = cli("plan", str(TINY), "--gpus", "1", "--measure", "2", "--measure-dir", str(tmp_path / "m"), "--json",
              "-o", str(out), *[x for s in sets for x in ("--set", s)])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert len(rows) == 2 and {r["rank"] for r in rows} == {1, 2}
    for row in rows:
        assert row["measured_error"] is None
        assert row["measured_step_time_s"] > 0 and row["measured_peak_memory_gib"] > 0
    assert rows[0]["measured_tokens_per_second_per_gpu"] >= rows[1]["measured_tokens_per_second_per_gpu"]
    assert sorted((tmp_path / "m").iterdir()) == [tmp_path / "m" / "layout1", tmp_path / "m" / "layout2"]
    assert all(len(steps) == 3 for steps in ([line for line in (d / "metrics.jsonl").read_text().splitlines()
                                               if "step_time_s" in line] for d in (tmp_path / "m").iterdir()))
    chosen = layout_of(load_job_recipe("pretrain", out))
    assert chosen == {k: rows[0][k] for k in chosen}
