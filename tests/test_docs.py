"""Every ``megacli`` command shown in docs/ and README.md is checked. A shell block (```bash,
```console, ```sh or unmarked) holding one carries a title saying how (see docs/index.md, "The
examples on these pages"):

- ``Run by the docs tests``: each command runs as written, in-process, in a scratch directory that
  holds the repository's recipes, README.md and two small runs (``runs/a``, ``runs/b``). In a block
  with ``$`` prompts, the lines after a command are its output (``...`` stands for anything) and an
  output starting with ``error:`` means exit code 2, anything else 0.
- ``Run by the docs tests with --dry-run``: each command runs with ``--dry-run`` added.
- ``<reason> · command line parsed by the docs tests``, the reason one of REASONS: the real
  command line parses it (subcommand, every option and its value), without running it.
- ``Run by tests/test_X.py``: that test reads the page and runs the command; it is parsed here.

A block without one of these titles, or a command outside a shell block, fails."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
SHELL = {"", "bash", "sh", "shell", "console"}
RUN = "Run by the docs tests"
DRY_RUN = "Run by the docs tests with --dry-run"
PARSED = " · command line parsed by the docs tests"
REASONS = {"Needs a GPU", "Needs a cluster", "Needs a large model", "Needs a checkpoint", "Needs a corpus",
           "Needs the network", "Takes minutes on CPU"}
OTHER_TEST = re.compile(r"Run by (tests/test_\w+\.py)")
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    title: str
    args: tuple[str, ...]  # after `megacli`
    output: str | None  # the output shown after a `$` command, if any

    def __str__(self):
        return f"{self.page}:{self.line}: megacli {shlex.join(self.args)}"


def _invocations(command: str) -> list[list[str]]:
    """The argument lists after each ``megacli`` (or ``-m megacli``) in one shell line."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    found, segment = [], []
    for token in [*lexer, ";"]:
        if token and set(token) <= set("();<>|&"):
            if "megacli" in segment:
                found.append(segment[segment.index("megacli") + 1:])
            segment = []
        else:
            segment.append(token)
    return found


def _commands(body: str) -> list[tuple[int, str, str | None]]:
    """(line offset, command, output shown) for each command line of a block's body."""
    lines = body.replace("\\\n", " ").split("\n")
    if not any(line.startswith("$ ") for line in lines):
        return [(i, line, None) for i, line in enumerate(lines) if line.strip()]
    commands = []
    for i, line in enumerate(lines):
        if line.startswith("$ "):
            commands.append((i, line[2:], []))
        elif commands:
            commands[-1][2].append(line)
    return [(i, command, "\n".join(output).strip() or None) for i, command, output in commands]


def _examples(page: Path) -> tuple[list[Example], list[str]]:
    """The page's examples, and what is wrong with its blocks (an untitled one, a command in a
    block that is not a shell block)."""
    text = page.read_text(encoding="utf-8")
    name = str(page.relative_to(ROOT))
    examples, problems = [], []
    for block in FENCE.finditer(text):
        language, info, body = block.groups()
        line = text.count("\n", 0, block.start()) + 2
        if language not in SHELL:
            if any(re.match(r"(\$ )?megacli ", row) for row in body.splitlines()):
                problems.append(f"{name}:{line}: a megacli command in a ```{language} block")
            continue
        title = re.search(r'title="([^"]*)"', info)
        for offset, command, output in _commands(body):
            try:
                invocations = _invocations(command)
            except ValueError as exc:  # unbalanced quotes
                problems.append(f"{name}:{line + offset}: {exc}: {command}")
                continue
            for args in invocations:
                if title is None:
                    problems.append(f"{name}:{line + offset}: megacli {shlex.join(args)} has no title saying how it is checked")
                else:
                    examples.append(Example(name, line + offset, title.group(1), tuple(args), output))
    return examples, problems


EXAMPLES = [e for page in PAGES for e in _examples(page)[0]]


def _kind(title: str) -> str | None:
    """How an example with this title is checked (None: an unknown title)."""
    if title in (RUN, DRY_RUN):
        return title
    if title.endswith(PARSED) and title[: -len(PARSED)] in REASONS:
        return PARSED
    if OTHER_TEST.fullmatch(title):
        return "other test"
    return None


def _parse(args: tuple[str, ...]) -> None:
    """Parse a command line with the real command tree, invoking nothing: an unknown subcommand or
    option, a missing argument or a bad value raises typer's (click's) UsageError."""
    import typer

    from megacli.cli import _register, app

    _register()
    command, rest, parent = typer.main.get_command(app), list(args), None
    while True:
        ctx = command.make_context("megacli" if parent is None else command.name, rest, parent=parent)
        if not hasattr(command, "resolve_command"):  # a command, not a group
            return
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args  # click >= 8.2
        rest = [*protected, *ctx.args]
        if not rest:
            return
        _, command, rest = command.resolve_command(ctx, rest)
        parent = ctx


def _matches(shown: str, output: str) -> bool:
    """Whether the output holds what the page shows, white space aside (the console wraps lines),
    ``...`` standing for anything."""
    pattern = ".*?".join(re.escape(" ".join(part.split())) for part in shown.split("..."))
    return re.search(pattern, " ".join(output.split()), re.DOTALL) is not None


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """The directory run examples run in: the recipes, README.md, and runs/a, runs/b with a few
    logged steps and one evaluation each (what `megacli plot` reads)."""
    root = tmp_path_factory.mktemp("docs_examples")
    shutil.copytree(ROOT / "recipes", root / "recipes")
    shutil.copy(ROOT / "README.md", root / "README.md")
    for name, scale in (("a", 1.0), ("b", 1.2)):
        run = root / "runs" / name
        run.mkdir(parents=True)
        records = [{"iteration": i, "loss": scale * (6 - i / 2), "lr": 1e-3, "grad_norm": 1.0} for i in range(1, 7)]
        records.append({"iteration": 6, "val_loss": scale * 3.2, "val_ppl": 24.5})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def test_every_example_block_says_how_it_is_checked():
    problems = [p for page in PAGES for p in _examples(page)[1]]
    problems += [f"{e}: unknown title {e.title!r}" for e in EXAMPLES if _kind(e.title) is None]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("example", [e for e in EXAMPLES if _kind(e.title) in (RUN, DRY_RUN)], ids=str)
def test_example_runs(example, scratch, monkeypatch):
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    monkeypatch.chdir(scratch)
    args = list(example.args)
    if example.title == DRY_RUN:
        assert "--dry-run" not in args, f"{example}: already a dry run; title it {RUN!r}"
        args.append("--dry-run")
    result = CliRunner().invoke(app, args)
    expected = 2 if example.output and example.output.startswith("error:") else 0
    assert result.exit_code == expected, f"{example}\n{result.output}"
    assert "Traceback" not in result.output, f"{example}\n{result.output}"
    if example.output:
        assert _matches(example.output, result.output), f"{example}: shown\n{example.output}\ngot\n{result.output}"


@pytest.mark.parametrize("example", [e for e in EXAMPLES if _kind(e.title) in (PARSED, "other test")], ids=str)
def test_example_parses(example):
    _parse(example.args)
    match = OTHER_TEST.fullmatch(example.title)
    if match:
        test = (ROOT / match.group(1)).read_text(encoding="utf-8")
        assert example.page in test, f"{match.group(1)} does not read {example.page}"


def test_the_parse_check_catches_a_wrong_command_line():
    """What a parsed-only example proves: a subcommand or option that does not exist, a bad value
    or a missing argument fails, at every level of the command tree."""
    from typer.testing import CliRunner

    from megacli.cli import app

    _parse(("reshard", "a", "b", "--tensor", "2"))
    _parse(("reshard", "inspect", "a", "--json"))
    _parse(("generate", "-c", "ckpt", "--tensor", "2"))
    for wrong, message in [(("reshard", "a", "b", "--tensors", "2"), "No such option: --tensors"),
                           (("reshard", "inspect", "a", "--jsn"), "No such option: --jsn"),
                           (("generate", "-c", "ckpt", "--tensor", "two"), "valid integer"),
                           (("preprocess", "merge", "a"), "Missing"),
                           (("nosuch",), "No such command 'nosuch'")]:
        with pytest.raises(Exception, match=re.escape(message)):
            _parse(wrong)
        result = CliRunner().invoke(app, list(wrong))  # the real command line refuses it too
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_examples_are_found():
    """The extraction itself: chained commands, `python -m megacli`, `$` prompts with output."""
    assert _invocations('pip install -e . && megacli preprocess --input x --tokenizer "a b" && megacli pretrain') \
        == [["preprocess", "--input", "x", "--tokenizer", "a b"], ["pretrain"]]
    assert _invocations("torchrun --nproc-per-node 8 -m megacli pretrain r.yaml   # torchrun") == [["pretrain", "r.yaml"]]
    assert _invocations('python -c "import torch" 2>/dev/null || pip install torch') == []
    assert _commands("$ megacli x\nerror: y\n...\n$ megacli z\n") == [(0, "megacli x", "error: y\n..."), (3, "megacli z", None)]
    assert _matches("error: ... b = 3: c", "error: invalid a\n b = 3:\n c d") and not _matches("error: x", "error: y")
    kinds = {_kind(e.title) for e in EXAMPLES}
    assert kinds == {RUN, DRY_RUN, PARSED, "other test"}, kinds


def _pytest_commands(text: str) -> list[str]:
    """The shell commands (continued lines joined) that run pytest."""
    return [" ".join(line.split()) for line in text.replace("\\\n", " ").splitlines() if "pytest" in line]


def test_readme_test_command_is_what_ci_runs():
    """README.md and docs/index.md show the command .ci/run runs, word for word."""
    ci = _pytest_commands((ROOT / ".ci" / "run").read_text())
    for page in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        shown = [c for block in FENCE.finditer(page.read_text()) for c in _pytest_commands(block.group(3))]
        assert shown == ci and len(ci) == 1, (page.name, shown, ci)


def test_readme_fits_in_two_screens():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_every_page_is_in_the_navigation():
    """mkdocs build --strict (in .ci/run) refuses a page left out of nav; this says so without mkdocs."""
    import yaml

    def pages(nav):
        for entry in nav:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                yield from pages(value) if isinstance(value, list) else [value]

    nav = list(pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))
    on_disk = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(nav) == on_disk and len(set(nav)) == len(nav)
