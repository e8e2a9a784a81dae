"""Recipes described from their models (issue 31): the generated reference page and JSON Schemas are
current, every shipped recipe names its schema and validates against it with the independent
``jsonschema`` validator, schema and pydantic agree on good and bad recipes, and `megacli recipe
schema | explain | show` answer from the same models."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from megacli.recipe import base
from megacli.recipe.jobs import recipe_model
from megacli.recipe.regenerate import generated

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))
MODELINE = re.compile(r"# yaml-language-server: \$schema=(schemas/(\w+)\.json)\n")


def cli(*args: str):
    from megacli.cli import _register, app

    _register()
    return CliRunner().invoke(app, list(args))


GENERATED = generated()  # each generated file -> the text the models give it now


@pytest.mark.parametrize("path", sorted(GENERATED), ids=lambda p: p.name)
def test_generated_file_is_current(path):
    name = path.relative_to(ROOT)
    assert path.is_file(), f"{name} missing: run python -m megacli.recipe.regenerate"
    assert path.read_text(encoding="utf-8") == GENERATED[path], f"{name} is stale: run python -m megacli.recipe.regenerate"


def test_regenerate_check_reports_a_stale_file(tmp_path, monkeypatch, capsys):
    from megacli.recipe import regenerate

    monkeypatch.setattr(regenerate, "ROOT", tmp_path)
    assert regenerate.main(["--check"]) == 1  # nothing written there yet
    assert "docs/reference/recipe.md is out of date" in capsys.readouterr().out
    assert regenerate.main([]) == 0 and regenerate.main(["--check"]) == 0
    page = tmp_path / "docs" / "reference" / "recipe.md"
    page.write_text(page.read_text() + "hand edit\n")
    assert regenerate.main(["--check"]) == 1


def test_reference_lists_every_field_with_its_docstring():
    from megacli.recipe.fields import walk
    from megacli.recipe.reference import render

    page = render()
    for kind in ("pretrain", "preprocess", "reshard"):
        for f in walk(recipe_model(kind)):
            assert f.doc and f.doc.replace("|", "\\|") in page, f.path
    row = next(line for line in page.splitlines() if line.startswith("| `activation` "))
    assert row.startswith("| `activation` | `gelu | gelu_tanh | swiglu | geglu | relu | squared_relu` | `gelu` | MLP"), row
    assert "| `num_experts` | `int > 0` | `(required)` |" in page


def _validator(path: Path):
    head = path.read_text(encoding="utf-8").split("\n", 1)[0] + "\n"
    found = MODELINE.fullmatch(head)
    assert found, f"{path.name}: first line {head!r} is not a yaml-language-server schema line"
    schema = json.loads((path.parent / found.group(1)).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema), found.group(2)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_recipe_names_its_schema_and_validates(path):
    validator, kind = _validator(path)
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(raw)]
    assert errors == []
    base.load(recipe_model(kind), path)  # and pydantic agrees


# (kind, recipe, valid): valid ones pass every check; invalid ones break a rule the schema can express.
CASES = [
    ("pretrain", {"data": {"mock": True}}, True),
    ("pretrain", {"data": {"mock": True}, "model": {"activation": "swiglu", "normalization": "rmsnorm",
                                                    "position_embedding": "rope", "num_query_groups": 4,
                                                    "rope_scaling": {"type": "linear", "factor": 2.0}}}, True),
    ("pretrain", {"data": {"mock": True}, "model": {"moe": {"num_experts": 4, "router_topk": 2, "layer_freq": [1, 0] * 6}},
                  "parallel": {"expert": 1}}, True),
    ("pretrain", {"data": {"sources": [{"source": "jsonl", "files": ["a.jsonl"], "weight": 2.0}]}}, True),
    ("pretrain", {"data": {"mock": True}, "lora": {"rank": 4, "targets": ["linear_qkv"]},
                  "checkpoint": {"pretrained": "ckpt/base"}}, True),
    ("preprocess", {"preprocess": {"input": "a.jsonl", "output_prefix": "data/a"}}, True),
    ("reshard", {"reshard": {"source": "a", "output": "b", "tensor": 2}}, True),
    ("pretrain", {"data": {"mock": True}, "modle": {}}, False),  # unknown section
    ("pretrain", {"data": {"mock": True}, "model": {"num_layer": 4}}, False),  # unknown field
    ("pretrain", {"data": {"mock": True}, "model": {"num_layers": "four"}}, False),  # wrong type
    ("pretrain", {"data": {"mock": True}, "model": {"hidden_size": 0}}, False),  # not positive
    ("pretrain", {"data": {"mock": True}, "model": {"activation": "relu6"}}, False),  # not an allowed value
    ("pretrain", {"data": {"mock": True}, "model": {"dropout": 1.5}}, False),  # out of range
    ("pretrain", {"data": {"mock": True}, "model": {"moe": {"router_topk": 1}}}, False),  # required field missing
    ("pretrain", {"data": {"mock": True}, "train": {"iters": None}}, False),  # null where null is not allowed
    ("pretrain", {"data": {"sources": [{"source": "s3", "files": ["a"]}]}}, False),  # list item
    ("pretrain", {"data": {"mock": True}, "lora": {"targets": ["linear_q"]}}, False),
    ("pretrain", {"data": {"mock": True}, "parallel": {"sequence_parallel": "sometimes"}}, False),
    ("pretrain", {"data": {"mock": True}, "model": {"rope_scaling": {"type": "yarn"}}}, False),  # factor missing
    ("preprocess", {"preprocess": {"input": "a.jsonl"}}, False),  # output_prefix missing
    ("preprocess", {"preprocess": {"input": "a.jsonl", "output_prefix": "a", "workers": -1}}, False),
    ("reshard", {"reshard": {"source": "a", "output": "b", "format": "zip"}}, False),
]


@pytest.mark.parametrize("kind,raw,valid", CASES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(CASES)])
def test_schema_and_pydantic_agree(kind, raw, valid):
    from megacli.recipe.schema import recipe_schema

    by_schema = jsonschema.Draft202012Validator(recipe_schema(kind)).is_valid(raw)
    try:
        base.validate(recipe_model(kind), raw, "case")
        by_pydantic = True
    except base.RecipeErrors:
        by_pydantic = False
    assert (by_schema, by_pydantic) == (valid, valid)


def test_recipe_schema_prints_the_shipped_schema():
    res = cli("recipe", "schema", "finetune")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == json.loads((ROOT / "recipes" / "schemas" / "pretrain.json").read_text())
    res = cli("recipe", "schema", "pretrian")
    assert res.exit_code == 2 and "expected one of pretrain, finetune" in res.output and "Traceback" not in res.output


def explained(field: str, *options: str) -> str:
    """`megacli recipe explain` output with its line wrapping undone."""
    res = cli("recipe", "explain", field, *options)
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def test_explain_gives_type_default_docstring_and_the_rules_from_the_checks():
    text = explained("model.ffn_hidden_size")
    assert "type: int > 0 | null default: null MLP inner width" in text
    # The rule TrainingRecipe._check_arithmetic raises for it, as the code writes it.
    assert ("model.ffn_hidden_size: must be divisible by parallel.tensor = {tp} when m.ffn_size % tp "
            "(pretrain.TrainingRecipe._check_arithmetic)") in text
    # A field the message names, not the field raised on.
    assert "parallel.sequence_parallel: needs parallel.tensor > 1" in explained("parallel.tensor")
    # A field named by a loop over literal names, or by an assignment.
    assert "model.norm_position or model.bert_token_types: is for bert, not {m.arch}" in explained("model.bert_token_types")
    assert ("parallel.first_stage_layers or parallel.last_stage_layers: uneven stages need parallel.pipeline >= 2"
            in explained("parallel.last_stage_layers"))
    assert "allowed: learned, rope, alibi, relative, none" in explained("model.position_embedding")


def test_explain_rules_follow_the_code(monkeypatch, tmp_path):
    """The rule list is read from the validators: a new check in the code is a new rule."""
    from megacli.recipe import rules

    src = tmp_path / "extra.py"
    src.write_text("class ParallelSection:\n    def _check(self):\n        if self.tensor > 64:\n"
                   "            raise RecipeError('parallel.tensor', self.tensor, 'is more than model.num_layers allows')\n")
    for path in sorted(rules.RECIPE_DIR.glob("*.py")):
        (tmp_path / path.name).write_text(path.read_text())
    monkeypatch.setattr(rules, "RECIPE_DIR", tmp_path)
    rules.all_rules.cache_clear()
    try:
        found = [r for r in rules.rules_for(recipe_model("pretrain"), "model.num_layers") if r.where == "extra.ParallelSection._check"]
    finally:
        rules.all_rules.cache_clear()
    assert [(r.field, r.when, r.says) for r in found] == [("parallel.tensor", "self.tensor > 64",
                                                           "is more than model.num_layers allows")]


def test_explain_an_unknown_field_exits_2_with_close_matches():
    res = cli("recipe", "explain", "model.ffn_hiden_size")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "no such field in pretrain recipes" in res.output and "did you mean model.ffn_hidden_size" in res.output


def test_explain_other_kinds_and_list_items():
    text = explained("preprocess.keep_newlines", "--kind", "preprocess")
    assert "preprocess.keep_newlines: only applies with preprocess.split_sentences: true" in text
    res = cli("recipe", "explain", "data.sources.0.weight")
    assert res.exit_code == 0 and res.output.startswith("data.sources[].weight  (pretrain recipe)"), res.output


def test_show_prints_the_resolved_recipe_only(tmp_path):
    res = cli("recipe", "show", str(ROOT / "recipes" / "gpt_tiny.yaml"), "--set", "model.num_layers=8")
    assert res.exit_code == 0, res.output
    shown = yaml.safe_load(res.output)
    want = base.load(recipe_model("pretrain"), ROOT / "recipes" / "gpt_tiny.yaml", ["model.num_layers=8"])
    assert base.validate(recipe_model("pretrain"), shown, "shown") == want
    assert shown["model"]["num_layers"] == 8 and "memory" not in res.output.lower()
    # The kind comes from the recipe's schema line.
    res = cli("recipe", "show", str(ROOT / "recipes" / "preprocess_corpus.yaml"))
    assert res.exit_code == 0 and yaml.safe_load(res.output)["preprocess"]["output_prefix"] == "data/corpus"
    res = cli("recipe", "show", str(ROOT / "recipes" / "gpt_tiny.yaml"), "--set", "parallel.tensor=3")
    assert res.exit_code == 2 and "parallel.tensor = 3: must divide" in res.output


PAGE = ROOT / "docs/commands/recipe.md"
BLOCK = re.compile(r'^```\w* title="Run by tests/test_recipe_schema.py"\n(.*?)^```', re.MULTILINE | re.DOTALL)


def _page_examples() -> list[tuple[list[str], str | None]]:
    """(arguments after `megacli`, the output the page shows or None) of each example this file runs."""
    import shlex

    examples = []
    for body in BLOCK.findall(PAGE.read_text(encoding="utf-8")):
        lines = body.rstrip("\n").split("\n")
        if lines[0].startswith("$ "):
            examples.append((shlex.split(lines[0][2:]), "\n".join(lines[1:])))
        else:
            examples += [(shlex.split(line), None) for line in lines if line.strip()]
    return examples


def test_the_recipe_page_examples_run_as_shown(monkeypatch, tmp_path):
    examples = _page_examples()
    assert len(examples) == 4
    monkeypatch.chdir(ROOT)
    for args, shown in examples:
        assert args[0] == "megacli", args
        args = args[1:]
        target = None
        if ">" in args:  # the example's redirection
            args, target = args[:args.index(">")], args[args.index(">") + 1]
        res = cli(*args)
        want_code = 2 if shown is not None and shown.startswith("error:") else 0
        assert res.exit_code == want_code, (args, res.output)
        if shown is not None:
            assert res.output.strip() == shown.strip(), args
        if target is not None:
            assert json.loads(res.output)["title"] == "megacli pretrain recipe", target
