"""lm-evaluation-harness tasks during training (recipe `eval:`): a tiny GPT pretrained at PP=2
writes eval/<task>/<metric> at each train.eval_interval, and each value equals `megacli eval` on
the checkpoint saved at that step (log-likelihood metrics to 1e-4, accuracies and exact matches
exactly). The tasks are test_eval's local JSONL tasks; the harness runs on rank 0 (the first
stage), the record is written by the last stage. Plus the recipe refusals (and `megacli eval`'s
refusal of T5)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")

from tests.conftest import megacli, megacli_here  # noqa: E402
from tests.test_eval import TASKS, write_tasks  # noqa: E402

LIMIT = 4
TINY = [
    "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null", "model.num_layers=2", "model.hidden_size=32",
    "model.num_attention_heads=4", "model.ffn_hidden_size=64", "model.seq_length=32", "train.iters=4",
    "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_interval=2", "train.eval_iters=1",
    "train.log_interval=1", "optim.warmup_iters=0", "optim.lr=1e-2", "train.precision=fp32", "parallel.tensor=1",
    "parallel.sequence_parallel=false",
]


def _sets(items) -> list[str]:
    return [x for s in items for x in ("--set", s)]


def _metrics(results: dict) -> dict:
    from megacli.inference.evaluate import metrics

    return metrics(results)


def _same(key: str, got: float, want: float) -> bool:
    if key.rsplit("/", 1)[-1].startswith(("acc", "exact_match")):
        return got == want
    return abs(got - want) <= 1e-4 * abs(want)


@pytest.mark.slow
def test_training_eval_equals_megacli_eval_of_the_saved_checkpoint(tmp_path):
    tasks = write_tasks(tmp_path)
    ckpt = tmp_path / "ckpt"
    harness = [f"eval.tasks=[{','.join(TASKS)}]", f"eval.include_path={tasks}", f"eval.limit={LIMIT}",
               "eval.batch_size=3"]
    res = megacli_here("pretrain", *_sets([*TINY, *harness, "parallel.pipeline=2", "launch.nproc=2",
                                           f"checkpoint.dir={ckpt}", "checkpoint.save_interval=2",
                                           f"run.dir={tmp_path / 'run'}"]), workers=True)
    assert res.returncode == 0, res.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["iteration"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in records
             if any(k.startswith("eval/") for k in r)}
    assert sorted(evals) == [2, 4]
    assert "eval/tiny_lambada/acc" in evals[2] and "eval/tiny_choice/acc_norm" in evals[2]
    assert "eval/tiny_rolling/word_perplexity" in evals[2] and "eval/tiny_generate/exact_match" in evals[2]
    assert evals[2] != evals[4], "the model trained between the two evaluations"
    assert "tiny_lambada/perplexity" in res.stdout  # the console line
    # Both checkpoints through `megacli eval`, one after the other in one process (the command's
    # single-process path runs in the process that calls it).
    runs = [["eval", str(ckpt / f"iter_{step:07d}"), "--tasks", ",".join(TASKS), "--include-path", str(tasks),
             "--limit", str(LIMIT), "--batch-size", "3", "-o", str(tmp_path / f"eval_{step}.json"),
             *_sets(["eval.bootstrap_iters=0", f"run.dir={tmp_path / f'eval_run_{step}'}"])] for step in evals]
    script = ("import sys, json\nfrom megacli.cli import _register, app\n_register()\n"
              "for args in json.loads(sys.argv[1]):\n    app(args, standalone_mode=False)\n")
    res = subprocess.run([sys.executable, "-c", script, json.dumps(runs)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    for step, logged in evals.items():
        want = _metrics(json.loads((tmp_path / f"eval_{step}.json").read_text()))
        assert set(logged) == set(want), (step, logged, want)
        for key, value in want.items():
            assert _same(key, logged[key], value), (step, key, logged[key], value)


def test_training_eval_refusals(tmp_path):
    from megacli.recipe.jobs import load_job_recipe

    tasks = write_tasks(tmp_path)
    base = [*TINY, f"eval.include_path={tasks}", "parallel.pipeline=1", "launch.nproc=1", f"run.dir={tmp_path / 'run'}"]
    cases = [
        (["eval.tasks=[tiny_lambada]", "train.eval_interval=0"], "train.eval_interval"),
        (["eval.tasks=[tiny_lambada]", "parallel.tensor=2", "parallel.sequence_parallel=auto", "launch.nproc=2"],
         "parallel.sequence_parallel"),
        (["eval.tasks=[tiny_lambada]", "parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.num_layers=4",
          "launch.nproc=2"], "parallel.virtual_pipeline"),
        (["eval.tasks=[]"], "eval.tasks"),
    ]
    for extra, message in cases:
        with pytest.raises(Exception, match=message.replace(".", r"\.")):
            load_job_recipe("pretrain", None, [*base, *extra])
    load_job_recipe("pretrain", None, [*base, "eval.tasks=[tiny_lambada]"])
    # `megacli eval` refuses T5 with the reason.
    from megacli.recipe import base as recipe_base
    from megacli.recipe.eval import EvalRecipe

    t5 = {"model": {"arch": "t5", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
                    "seq_length": 32, "position_embedding": "relative"}, "tokenizer": {"type": "byte"},
          "eval": {"tasks": ["tiny_generate"]}, "generate": {"checkpoint": str(tmp_path)}, "launch": {"nproc": 1}}
    with pytest.raises(Exception, match="for T5 the harness's log-likelihood tasks need target scoring"):
        recipe_base.validate(EvalRecipe, t5, "test")
    # Before any worker starts: the harness's own task check, as `megacli eval` runs it (its
    # unknown-task and missing-data messages are test_eval's; this one needs no task index).
    res = megacli("pretrain", *_sets([*base, "eval.tasks=[tiny_lambada]", f"eval.include_path={tmp_path / 'nowhere'}"]),
                  in_process=True)
    assert res.returncode == 2 and "eval.include_path" in res.stderr and "no such directory" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
