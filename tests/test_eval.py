"""`megacli eval` against lm-evaluation-harness's own Hugging Face backend (`hf`) on tiny random
GPT-2 and Llama models converted with `megacli convert`.

Four harness tasks are defined from local JSONL files (a LAMBADA-style last word, a multiple
choice, a rolling perplexity over texts longer than the model's context, a short greedy
generate_until); one spawned process builds the models and runs the `hf` backend on them; the
`megacli eval` command line then runs the same tasks at TP=1 (both models) and at TP=2 × PP=2
(Llama, four gloo processes, all tasks in one run). Log-likelihood metrics must agree to 1e-4,
accuracies and the generated texts exactly. The same at TP=1 for a mixture-of-experts model
(Mixtral-style) and for eval.add_bos against the hf backend's add_bos_token. Plus the errors a
user sees before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megacli.checkpoint.source import Source

pytest.importorskip("lm_eval")

NAMES = ["gpt2", "llama_tied_gqa"]
MOE = "mixtral"  # a mixture-of-experts GPT: 4 experts, top-2
TASKS = ["tiny_lambada", "tiny_choice", "tiny_rolling", "tiny_generate"]
LIMIT = 4
WORDS = "the quick brown fox jumps over the lazy dog".split()

LAMBADA = ["the quick brown fox jumps over the lazy dog", "over the lazy dog the quick brown fox",
           "the lazy dog jumps over the quick fox", "a brown dog and a quick fox"]
CHOICE = [{"question": "the quick brown", "choices": ["fox", "dog", "the lazy dog"], "label": 0},
          {"question": "jumps over the", "choices": ["lazy dog", "quick", "brown fox jumps"], "label": 0},
          {"question": "the lazy", "choices": ["dog", "cat", "fox over"], "label": 0},
          {"question": "fox", "choices": [" jumps", " over the dog", " the"], "label": 1}]
# The first two are longer than the models' 64-position context: several rolling windows.
ROLLING = [" ".join(WORDS * 9), "Zebras & yaks: " + " ".join(reversed(WORDS * 4)), "the dog", "quick!"]
GENERATE = [{"prompt": "the quick brown", "answer": "fox"}, {"prompt": "over the lazy dog the", "answer": "quick"},
            {"prompt": "fox", "answer": "jumps"}, {"prompt": "the lazy dog jumps over the quick brown fox and", "answer": "the"}]

TASK_YAMLS = {
    "tiny_lambada": """
output_type: loglikelihood
doc_to_text: "{{text.split(' ')[:-1]|join(' ')}}"
doc_to_target: "{{' ' + text.split(' ')[-1]}}"
metric_list:
  - {metric: perplexity, aggregation: perplexity, higher_is_better: false}
  - {metric: acc, aggregation: mean, higher_is_better: true}
""",
    "tiny_choice": """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
  - {metric: acc_norm, aggregation: mean, higher_is_better: true}
""",
    "tiny_rolling": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - {metric: word_perplexity}
  - {metric: byte_perplexity}
  - {metric: bits_per_byte}
""",
    "tiny_generate": """
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["dog"], max_gen_toks: 10, do_sample: false}
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true}
""",
}
DATA = {"tiny_lambada": [{"text": t} for t in LAMBADA], "tiny_choice": CHOICE,
        "tiny_rolling": [{"text": t} for t in ROLLING], "tiny_generate": GENERATE}


def write_tasks(root: Path, *, missing: bool = False) -> Path:
    """Harness task YAMLs in root/tasks, their data in root/data (JSONL); ``missing``: one task
    whose data file is not there."""
    tasks, data = root / "tasks", root / "data"
    tasks.mkdir(parents=True, exist_ok=True)
    data.mkdir(exist_ok=True)
    for name, body in TASK_YAMLS.items():
        file = data / f"{name}.jsonl"
        file.write_text("".join(json.dumps(d) + "\n" for d in DATA[name]))
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {file}\ntest_split: test\n"
        (tasks / f"{name}.yaml").write_text(head + body)
    if missing:
        head = f"task: tiny_missing\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data / 'nowhere.jsonl'}\ntest_split: test\n"
        (tasks / "tiny_missing.yaml").write_text(head + TASK_YAMLS["tiny_lambada"])
    return tasks


def summary(results: dict) -> dict:
    """Per task: its metrics (stderr left out) and each document's filtered model answers."""
    out = {}
    for task in TASKS:
        metrics = {k: v for k, v in results["results"][task].items() if "," in k and "stderr" not in k}
        answers = [s["filtered_resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]
        out[task] = {"metrics": metrics, "answers": answers}
    return out


def _prepare(rank, world, root: str):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from megacli.convert import convert
    from tests import _convert_models as cm

    root = Path(root)
    tasks = write_tasks(root)
    refs = {}
    for name in [*NAMES, MOE]:
        hf = root / name / "hf"
        cm.build_hf(name, hf, with_tokenizer=True)
        # The model's end-of-text id is its tokenizer's (the harness's hf backend stops at the config's).
        for file in ("config.json", "generation_config.json"):
            config = json.loads((hf / file).read_text())
            config.update(bos_token_id=0, eos_token_id=0)
            (hf / file).write_text(json.dumps(config))
        convert(Source(hf), root / name / "mc", say=lambda *_: None)
        results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32", tasks=TASKS,
                                          batch_size=1, limit=LIMIT, task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                                          log_samples=True, bootstrap_iters=0, device="cpu")
        refs[name] = json.loads(json.dumps(summary(results), default=str))
    # The harness's hf backend with a BOS token in front of every context (its add_bos_token).
    hf = root / "gpt2" / "hf"
    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32,add_bos_token=True",
                                      tasks=TASKS, batch_size=1, limit=LIMIT, task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                                      log_samples=True, bootstrap_iters=0, device="cpu")
    refs["gpt2+bos"] = json.loads(json.dumps(summary(results), default=str))
    return refs


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("eval")
    return root, spawn(_prepare, 1, str(root), timeout=1800)[0]


def _eval_args(root: Path, name: str, out: Path, *layout: str) -> list[str]:
    """``layout``: more command-line arguments (--tensor, --pipeline, --set)."""
    return [str(a) for a in (root / name / "mc", "--tasks", ",".join(TASKS), "--include-path", root / "tasks",
                             "--limit", LIMIT, "--batch-size", 3, "-o", out, *layout, "--set", "eval.log_samples=true",
                             "--set", "eval.bootstrap_iters=0", "--set", f"run.dir={out.parent / 'run'}")]


def _run_ours(root: Path, name: str, out: Path, *layout: str) -> dict:
    from tests.conftest import megacli

    res = megacli("eval", *_eval_args(root, name, out, *layout))
    assert res.returncode == 0, res.stderr[-4000:]
    return _read_ours(res.stdout, out)


def _read_ours(stdout: str, out: Path) -> dict:
    for task in TASKS:
        assert task in stdout and f"{task}: " in stdout  # the table and the speed line
    record = json.loads(out.read_text())
    assert set(record["megacli"]["timing"]) == set(TASKS)
    assert all(t["tokens"] > 0 and t["tokens_per_second"] > 0 for t in record["megacli"]["timing"].values())
    return summary(record)


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= 1e-4 * abs(want)


def _assert_same(ours: dict, ref: dict) -> None:
    """Metrics and every document's answers: log-likelihoods to 1e-4, accuracies, greedy flags and
    generated texts exactly."""
    for task in TASKS:
        got, want = ours[task]["metrics"], ref[task]["metrics"]
        assert set(got) == set(want), (task, got, want)
        for key, value in want.items():
            same = got[key] == value if key.startswith(("acc", "exact_match")) else _close(got[key], value)
            assert same, (task, key, got[key], value)
        for doc, (mine, theirs) in enumerate(zip(ours[task]["answers"], ref[task]["answers"], strict=True)):
            for a, b in zip(mine, theirs, strict=True):
                if task == "tiny_generate":
                    assert a == b, (doc, a, b)
                elif task == "tiny_rolling":
                    assert _close(a, b), (doc, a, b)
                else:  # (log-likelihood, is greedy)
                    assert _close(a[0], b[0]) and a[1] == b[1], (task, doc, a, b)


@pytest.fixture(scope="module")
def tp1_runs(prepared, tmp_path_factory):
    """The one-process `megacli eval` runs (each model at TP=1, and GPT-2 with eval.add_bos), in
    conftest's warm interpreter."""
    from tests.conftest import megacli_here

    root, _ = prepared
    base = tmp_path_factory.mktemp("eval_tp1")
    runs = {name: (name, ()) for name in [*NAMES, MOE]}
    runs["gpt2+bos"] = ("gpt2", ("--set", "eval.add_bos=true"))
    found = {}
    for key, (name, extra) in runs.items():
        out = base / key.replace("+", "_") / "results.json"
        res = megacli_here("eval", *_eval_args(root, name, out, *extra))
        assert res.returncode == 0, res.stderr[-4000:]
        found[key] = _read_ours(res.stdout, out)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", [*NAMES, MOE])
def test_tp1_equals_the_harness_hf_backend(prepared, tp1_runs, name):
    _, refs = prepared
    _assert_same(tp1_runs[name], refs[name])
    assert any(text for text in refs[name]["tiny_generate"]["answers"]), "something was generated"


@pytest.mark.slow
def test_tp2_pp2_equals_the_harness_hf_backend(prepared, tmp_path):
    root, refs = prepared
    ours = _run_ours(root, "llama_tied_gqa", tmp_path / "results.json", "--tensor", 2, "--pipeline", 2)
    _assert_same(ours, refs["llama_tied_gqa"])


@pytest.mark.slow
def test_add_bos_equals_the_hf_backend_with_add_bos_token(prepared, tp1_runs):
    """eval.add_bos puts the BOS token first in every context as the hf backend's add_bos_token
    does; the two references differ, so a run that ignored add_bos would fail here."""
    _, refs = prepared
    with_bos, without = refs["gpt2+bos"], refs["gpt2"]
    assert all(with_bos[t]["answers"] != without[t]["answers"] for t in TASKS), "BOS changes every task's answers"
    _assert_same(tp1_runs["gpt2+bos"], with_bos)


def _eval_here(*args):
    """`megacli eval ARGS` in this process, through its CLI (these runs stop before any model loads)."""
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    return CliRunner().invoke(app, ["eval", *map(str, args)], env={"COLUMNS": "400"})


@pytest.mark.slow
def test_errors_come_before_the_model_loads(prepared, tmp_path):
    root, _ = prepared
    tasks = write_tasks(tmp_path, missing=True)
    ckpt = root / "gpt2" / "mc"
    res = _eval_here(ckpt, "--tasks", "tiny_missing", "--include-path", tasks, "--set", f"run.dir={tmp_path / 'run'}")
    assert res.exit_code == 2 and "task tiny_missing" in res.stderr and "nowhere.jsonl" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "run").exists()
    res = _eval_here(ckpt, "--tasks", "tiny_lambada,no_such_task", "--include-path", tasks)
    assert res.exit_code == 2 and "unknown lm-evaluation-harness task(s) no_such_task" in res.stderr, res.stderr
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(f"eval:\n  checkpoint: {ckpt}\n  include_path: {tasks}\n  tasks: [tiny_lambada, no_such_task]\n")
    res = _eval_here("--recipe", recipe)
    assert res.exit_code == 2 and "unknown lm-evaluation-harness task(s) no_such_task" in res.stderr, res.stderr
    res = _eval_here(ckpt, "--include-path", tasks)
    assert res.exit_code == 2 and "eval.tasks" in res.stderr, res.stderr
    res = _eval_here(tmp_path, "--tasks", "tiny_lambada")
    assert res.exit_code == 2 and "not a megacli checkpoint" in res.stderr, res.stderr


def write_code_tasks(root: Path, marker: Path) -> Path:
    """Task YAMLs naming Python whose import creates ``marker``: fnt (``!function utils.doc_to_text``
    beside it), inc (no tag itself; it includes ../shared/base.yaml, which has one) and metric (a
    metric script that Hugging Face evaluate would load)."""
    tasks, shared = root / "tasks", root / "shared"
    tasks.mkdir(parents=True)
    shared.mkdir()
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    head = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    body = "output_type: loglikelihood\ndoc_to_target: \"{{' ' + text.split(' ')[-1]}}\"\n"
    importing = f"open({str(marker)!r}, 'w').close()\ndef doc_to_text(doc):\n    return doc['text']\n"
    for where in (tasks, shared):
        (where / "utils.py").write_text(importing)
    (tasks / "fnt.yaml").write_text("task: fnt\n" + head + body + "doc_to_text: !function utils.doc_to_text\n")
    (shared / "base.yaml").write_text(head + body + "doc_to_text: !function utils.doc_to_text\n")
    (tasks / "inc.yaml").write_text("task: inc\ninclude: ../shared/base.yaml\n")
    return tasks


def test_task_code_is_refused_unless_trusted(tmp_path):
    """`!function` (directly, or in a YAML reached through `include:`) is refused before anything
    is imported, naming the file and the function; --trust-task-code lets it run."""
    from megacli.errors import UserError
    from megacli.inference.evaluate import check_tasks
    from megacli.inference.task_code import task_code
    from megacli.recipe.harness import HarnessSection

    marker = tmp_path / "code-ran"
    tasks = write_code_tasks(tmp_path, marker)
    (tasks / "metric.yaml").write_text("task: metric\ndataset_path: json\noutput_type: loglikelihood\n"
                                       f"metric_list:\n  - {{metric: {tmp_path / 'evil.py'}}}\n")
    found = "\n".join(task_code(tasks))
    assert f"{tasks / 'fnt.yaml'}: doc_to_text: !function utils.doc_to_text" in found, found
    assert f"{(tmp_path / 'shared' / 'base.yaml')}: doc_to_text: !function utils.doc_to_text" in found, found
    assert f"{tasks / 'metric.yaml'}: metric_list.0.metric: metric '{tmp_path / 'evil.py'}'" in found, found
    assert task_code(write_tasks(tmp_path / "plain")) == []  # harness tasks without code pass
    import lm_eval.tasks

    builtin = sorted(Path(lm_eval.tasks.__file__).parent.glob("**/*.yaml"))
    builtin = next(f for f in builtin if "!function" in f.read_text())  # the harness's own code: not counted
    (tmp_path / "uses_builtin").mkdir()
    (tmp_path / "uses_builtin" / "b.yaml").write_text(f"task: b\ninclude: {builtin}\n")
    assert task_code(tmp_path / "uses_builtin") == []
    for name in ("fnt", "inc"):
        with pytest.raises(UserError, match=r"fnt\.yaml: doc_to_text: !function utils\.doc_to_text.*--trust-task-code"):
            check_tasks(HarnessSection(tasks=[name], include_path=str(tasks)))
    assert not marker.exists()
    (tasks / "metric.yaml").unlink()
    check_tasks(HarnessSection(tasks=["fnt"], include_path=str(tasks), trust_task_code=True))
    assert marker.exists()  # the test's task really imports code


def _bare_checkpoint(root: Path) -> Path:
    """A directory that passes for a megacli checkpoint up to its weights (megacli.json, recipe.yaml):
    enough for the checks that come before any model loads."""
    from megacli.recipe import base
    from megacli.recipe.pretrain import TrainingRecipe

    ckpt = root / "ckpt"
    ckpt.mkdir()
    (ckpt / "megacli.json").write_text("{}")
    (ckpt / "recipe.yaml").write_text(base.dump(base.load(TrainingRecipe, None, ["data.mock=true"])))
    return ckpt


def test_an_existing_directory_as_output_is_refused_before_the_model_loads(tmp_path):
    ckpt = _bare_checkpoint(tmp_path)
    res = _eval_here(ckpt, "--tasks", "tiny_lambada", "-o", tmp_path)
    assert res.exit_code == 2 and f"eval.output = '{tmp_path}': is a directory" in res.stderr, res.stderr
    (tmp_path / "file").write_text("")
    res = _eval_here(ckpt, "--tasks", "tiny_lambada", "-o", tmp_path / "file" / "results.json")
    assert res.exit_code == 2 and "is a file, not a directory" in res.stderr, res.stderr


def test_recipe_errors_name_the_recipe_the_user_gave(tmp_path):
    ckpt = _bare_checkpoint(tmp_path)
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"eval:\n  checkpoint: {ckpt}\n  tasks: [tiny_lambada]\n  limit: 0\n")
    res = _eval_here("--recipe", recipe)
    assert res.exit_code == 2 and f"invalid recipe {recipe} (over {ckpt / 'recipe.yaml'})" in res.stderr, res.stderr
    assert "eval.limit = 0" in res.stderr, res.stderr


def test_the_harness_run_prints_no_git_error_outside_a_repository(tmp_path, monkeypatch, capfd):
    from megacli.inference.evaluate import evaluate
    from megacli.recipe.eval import EvalSection
    from tests.conftest import certain_lm

    tasks = write_tasks(tmp_path)
    monkeypatch.chdir(tmp_path)
    ev = EvalSection(tasks=["tiny_lambada"], include_path=str(tasks), limit=2, bootstrap_iters=0)
    results = evaluate(certain_lm(), ev)
    assert results["results"]["tiny_lambada"]["acc,none"] == 1.0 and results["git_hash"] is None
    assert "not a git repository" not in capfd.readouterr().err
