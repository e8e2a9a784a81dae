"""Every YAML megacli reads goes through one loader (megacli.recipe.yaml_text) that refuses an alias
bomb quickly with exit 2 — recipes, --set values, a checkpoint's recipe.yaml, the task YAMLs an eval
scans — and every error message is cut to a readable length by one rule (megacli.errors.readable)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT, cli

# 12 lines, aliases 8 deep: 9^8 = 43 million values once expanded.
BOMB = "".join(f"{a}: &{a} [{', '.join([f'*{p}'] * 9)}]\n" for p, a in zip("abcdefgh", "bcdefghi"))
BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + BOMB + "model:\n  arch: gpt\ntrain: {iters: *i}\n"


def refused_quickly(res, *names: str) -> None:
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output[:2000]
    assert "aliases expand this document by" in res.output and all(n in res.output for n in names), res.output[:2000]
    assert len(res.output) < 2000


def test_the_bomb_is_twelve_lines_eight_aliases_deep():
    import yaml

    assert len(BOMB.splitlines()) == 12 and BOMB.count("*h") == 9
    nodes = yaml.compose(BOMB)  # composing shares the aliased nodes: cheap; expanding them is not
    assert nodes is not None


def test_an_alias_bomb_is_refused_everywhere(tmp_path):
    from tests.test_checkpoint_safety import write_checkpoint

    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(BOMB)
    refused_quickly(cli("recipe", "show", recipe), str(recipe))
    refused_quickly(cli("pretrain", recipe, "--dry-run"), str(recipe))
    flow = "[" + ", ".join(["&a [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
        f"&{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefg", "bcdefgh")]) + "]"
    refused_quickly(cli("recipe", "show", ROOT / "recipes" / "gpt_tiny.yaml", "--set", f"train.iters={flow}"), "--set")
    write_checkpoint(tmp_path / "ck")
    saved = tmp_path / "ck" / "iter_0000002" / "recipe.yaml"
    good = saved.read_text()
    saved.write_text(BOMB)
    refused_quickly(cli("recipe", "from", tmp_path / "ck"), str(saved))
    refused_quickly(cli("generate", "-c", tmp_path / "ck", "--prompt", "x"), str(saved))
    saved.write_text(good)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "bomb.yaml").write_text("task: bomb\n" + BOMB.replace("train: {iters: *i}", "doc_to_choice: *i"))
    refused_quickly(cli("eval", tmp_path / "ck", "--tasks", "bomb", "--include-path", tasks), str(tasks / "bomb.yaml"))


def test_aliases_within_the_budget_and_a_self_reference():
    from megacli.recipe.yaml_text import ALIAS_BUDGET, AliasBomb, load_yaml_text

    shared = load_yaml_text("base: &base {hidden_size: 64, num_layers: 2}\nmodel:\n  <<: *base\n  num_layers: 4\n")
    assert shared["model"] == {"hidden_size": 64, "num_layers": 4}
    def aliases(n: int) -> str:  # each *x adds the 100 values of x
        return "x: &x [" + ", ".join(["1"] * 99) + "]\ny: [" + ", ".join(["*x"] * n) + "]\n"

    assert len(load_yaml_text(aliases(ALIAS_BUDGET // 100))["y"]) == ALIAS_BUDGET // 100  # exactly the budget
    with pytest.raises(AliasBomb, match=f"by {ALIAS_BUDGET + 100} values, more than the {ALIAS_BUDGET} allowed"):
        load_yaml_text(aliases(ALIAS_BUDGET // 100 + 1))
    with pytest.raises(AliasBomb, match="refers to a value that contains it"):
        load_yaml_text("a: &a [1, *a]\n")


def test_one_yaml_loader():
    """No module of megacli reads YAML but through megacli.recipe.yaml_text."""
    loaders = {"load", "safe_load", "full_load", "unsafe_load", "load_all", "safe_load_all", "full_load_all",
               "unsafe_load_all", "compose", "parse"}
    found = []
    for path in sorted((ROOT / "megacli").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "yaml" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and node.attr in loaders and getattr(node.value, "id", None) == "yaml":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: yaml.{node.attr}")
    assert [f.split(":")[0] for f in found] == ["megacli/recipe/yaml_text.py"], found


def test_a_message_is_cut_to_a_readable_length():
    from megacli.errors import LONGEST_LINE, MOST_LINES, readable

    line = "model.x = [" + "1, " * 1_000_000 + "]: expected a number; set model.x"
    shown = readable(line)
    assert len(shown) < LONGEST_LINE + 100 and shown.startswith("model.x = [1, 1") and shown.endswith("; set model.x")
    assert f"({len(line) - LONGEST_LINE} characters left out)" in shown
    many = "\n".join(f"problem {i}" for i in range(1000))
    assert readable(many).splitlines()[MOST_LINES // 2] == f"... ({1000 - MOST_LINES} more lines) ..."
    assert readable("short\nmessage") == "short\nmessage"
    res = cli("recipe", "show", ROOT / "recipes" / "gpt_tiny.yaml", "--set", "model.num_layers=" + "x" * 100_000)
    assert res.exit_code == 2 and "characters left out" in res.output and len(res.output) < 2 * LONGEST_LINE, res.output


def test_the_checkpoint_recipe_reader_names_the_file(tmp_path):
    from megacli.checkpoint.layout import read_recipe
    from megacli.errors import UserError

    (tmp_path / "recipe.yaml").write_text(BOMB)
    with pytest.raises(UserError, match=rf"{tmp_path / 'recipe.yaml'}: cannot read \(aliases expand"):
        read_recipe(Path(tmp_path))
