"""lm-evaluation-harness task templates (Jinja) cannot run code under megacli: every template-bearing
field renders in Jinja's sandbox while megacli drives the harness (check_tasks, the eval job's and
training's evaluate), and the harness's built-in task templates render there exactly as in the
harness's own environment. --trust-task-code gives the harness's own environment back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from tests.conftest import certain_lm  # noqa: E402

ESCAPE = "{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}"
DOCS = [{"text": "a b c", "choices": ["x", "y"], "label": 0}, {"text": "d e f", "choices": ["y", "x"], "label": 1}]


def escaping_task(root: Path, field: str) -> tuple[Path, Path]:
    """A task in root/tasks whose ``field`` holds a template that creates root/<field>-ran."""
    marker = root / f"{field}-ran"
    tasks = root / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    fields = {"output_type": "multiple_choice", "doc_to_text": "{{text}}", "doc_to_choice": "{{choices}}",
              "doc_to_target": "{{label}}"}
    fields[field] = ESCAPE.format(marker=marker) + fields.get(field, "")
    if field == "gen_prefix":
        fields["output_type"] = "generate_until"
        del fields["doc_to_choice"]
    body = "".join(f"{k}: {json.dumps(v)}\n" for k, v in fields.items())
    (tasks / f"escape_{field}.yaml").write_text(f"task: escape_{field}\ndataset_path: json\ndataset_kwargs:\n"
                                                f"  data_files:\n    test: {data}\ntest_split: test\n{body}")
    return tasks, marker


@pytest.mark.parametrize("field", ["doc_to_text", "doc_to_choice", "doc_to_target", "description", "gen_prefix"])
def test_a_template_reaching_python_is_stopped(tmp_path, field):
    """check_tasks (which the eval command and training run before any model loads) and evaluate
    (the eval job and training-time eval) refuse the template, naming the cause; nothing runs."""
    from megacli.errors import UserError
    from megacli.inference.evaluate import check_tasks, evaluate
    from megacli.recipe.eval import EvalSection

    tasks, marker = escaping_task(tmp_path, field)
    ev = EvalSection(tasks=[f"escape_{field}"], include_path=str(tasks), limit=2, bootstrap_iters=0)
    refusal = r"tried to reach Python internals.*unsafe.*--trust-task-code"
    if field in ("doc_to_text", "doc_to_choice", "doc_to_target"):  # rendered on the first document as it loads
        with pytest.raises(UserError, match=f"task escape_{field}: a task template {refusal}"):
            check_tasks(ev)
    with pytest.raises(UserError, match=refusal):
        evaluate(certain_lm(), ev)
    assert not marker.exists()
    import lm_eval.utils

    assert type(lm_eval.utils.env).__name__ == "Environment"  # the harness's own, back in place


def test_trusted_task_code_renders_in_the_harness_environment(tmp_path):
    """The escaping task really runs its command when trusted: the refusal above is the sandbox's."""
    from megacli.inference.evaluate import check_tasks
    from megacli.recipe.eval import EvalSection

    tasks, marker = escaping_task(tmp_path, "doc_to_text")
    check_tasks(EvalSection(tasks=["escape_doc_to_text"], include_path=str(tasks), trust_task_code=True))
    assert marker.exists()


def test_the_eval_command_refuses_it_with_one_message(tmp_path):
    from tests.conftest import cli
    from tests.test_checkpoint_safety import write_checkpoint

    tasks, marker = escaping_task(tmp_path, "doc_to_choice")
    write_checkpoint(tmp_path / "ck")
    res = cli("eval", tmp_path / "ck", "--tasks", "escape_doc_to_choice", "--include-path", tasks)
    assert res.exit_code == 2 and "task escape_doc_to_choice: a task template tried to reach Python" in res.output, \
        res.output
    assert "Traceback" not in res.output and not marker.exists()


def _template_fields(cfg, out: list[str]) -> None:
    from megacli.inference.task_templates import TEMPLATE_FIELDS

    if isinstance(cfg, dict):
        for key, value in cfg.items():
            if key in TEMPLATE_FIELDS and isinstance(value, str) and ("{{" in value or "{%" in value):
                out.append(value)
            else:
                _template_fields(value, out)


def _fills():
    """Values for a template's free variables, tried in turn until the harness's own environment
    renders it: text, a list of texts, a number, a record of texts."""
    words = "alpha beta gamma delta"

    class Record(dict):
        def __missing__(self, key):
            return words

    return [words, words.split(), 1, Record(text=words, label=["A", "B"])]


def test_builtin_task_templates_render_the_same_in_the_sandbox():
    """Every 16th built-in task YAML's template fields, rendered in the harness's own environment
    (the reference) and in megacli's sandbox with the same documents: the same text, or the same
    error where the reference fails."""
    import lm_eval.tasks
    import lm_eval.utils
    import yaml
    from jinja2 import meta

    from megacli.inference.task_templates import sandbox_of

    class Tags(yaml.CSafeLoader):
        pass

    Tags.add_multi_constructor("!", lambda loader, suffix, node: None)
    files = sorted(Path(lm_eval.tasks.__file__).parent.glob("**/*.yaml"))[::16]
    templates: list[str] = []
    for path in files:
        try:
            _template_fields(yaml.load(path.read_bytes(), Loader=Tags), templates)  # noqa: S506 - a safe loader
        except yaml.YAMLError:
            continue
    plain, box = lm_eval.utils.env, sandbox_of(lm_eval.utils.env)
    rendered = 0
    for template in sorted(set(templates)):
        free = meta.find_undeclared_variables(plain.parse(template))
        for fill in _fills():
            doc = dict.fromkeys(free, fill)
            try:
                expected = plain.from_string(template).render(**doc)
            except Exception:  # noqa: BLE001 - this fill does not suit the template; try the next
                continue
            assert box.from_string(template).render(**doc) == expected, template
            rendered += 1
            break
    assert len(files) > 500 and rendered > 150 and rendered >= 0.9 * len(set(templates)), \
        (len(files), len(set(templates)), rendered)
