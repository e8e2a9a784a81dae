"""Every ``megacli`` command shown in docs/ and README.md is checked. A shell block (```bash,
```console, ```sh or unmarked) holding one carries a title saying how (see docs/index.md, "The
examples on these pages"):

- ``Run by the docs tests``: the block's commands run as written, in order, in-process (preprocess,
  which forks, in its own process), in one scratch directory shared by all blocks, which run in
  page order (a block may use what an earlier block of its page wrote). It is built once per
  session (see ``scratch``) and holds the repository's recipes, README.md,
  two small runs (``runs/a``, ``runs/b``), a small corpus and tokenizers under ``data/``, and tiny
  models and checkpoints at the paths the pages name. In a block with ``$`` prompts, the lines
  after a command are its output (``...`` stands for anything) and an output starting with
  ``error:`` means exit code 2, anything else 0.
- ``Run by the docs tests with --dry-run``: each command runs with ``--dry-run`` added.
- ``Run by the docs tests with a few steps in one process``: as run, with ``--set`` FEW_STEPS_SETS
  added to each ``pretrain`` and ``finetune`` (two steps, one process).
- ``<reason> · command line parsed by the docs tests``, the reason one of REASONS (a GPU, a cluster
  or the network, which the tests do not have): the real command line parses it (subcommand, every
  option and its value), without running it.
- ``Run by tests/test_X.py``: that test reads the page and runs the command; it is parsed here.

A block without one of these titles, or a command outside a shell block, fails."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
SHELL = {"", "bash", "sh", "shell", "console"}
RUN = "Run by the docs tests"
DRY_RUN = "Run by the docs tests with --dry-run"
FEW_STEPS = "Run by the docs tests with a few steps in one process"
# What FEW_STEPS adds to pretrain and finetune (the scratch's runs/gpt stopped at step 1). Layouts
# over several processes are tested on their own (tests/test_pretrain.py, test_finetune.py, ...).
FEW_STEPS_SETS = ("train.iters=2", "train.eval_iters=1", "launch.nproc=1", "parallel.tensor=1", "parallel.pipeline=1")
PARSED = " · command line parsed by the docs tests"
# A server runs until it is stopped, so a block of `megacli serve` command lines is parsed here;
# tests/test_serve.py starts those servers on tiny checkpoints (loopback only).
REASONS = {"Needs a GPU", "Needs a cluster", "Needs the network", "Starts a server"}
OTHER_TEST = re.compile(r"Run by (tests/test_\w+\.py)")
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    block: int  # the line of the block's first command
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
                    examples.append(Example(name, line + offset, line, title.group(1), tuple(args), output))
    return examples, problems


EXAMPLES = [e for page in PAGES for e in _examples(page)[0]]


def _kind(title: str) -> str | None:
    """How an example with this title is checked (None: an unknown title)."""
    if title in (RUN, DRY_RUN, FEW_STEPS):
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


def _megacli(*args: str) -> str:
    """Run a megacli command in-process; its output (exit code 0 asserted)."""
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, f"megacli {shlex.join(args)}\n{result.output}"
    return result.output


def _data_tool(name: str, *args: str) -> None:
    """Run data_tools/NAME.py's main with ARGS, as `python data_tools/NAME.py ARGS` would."""
    import importlib

    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "data_tools"))
        assert not importlib.import_module(name).main(list(args))


# The run behind runs/gpt and megatron/gpt-run: a tiny GPT, one process, one step.
TINY_GPT = """model: {arch: gpt, num_layers: 2, hidden_size: 32, num_attention_heads: 4, ffn_hidden_size: 64,
  seq_length: 32, position_embedding: rope, normalization: rmsnorm, activation: swiglu, add_bias_linear: false}
launch: {nproc: 1}
tokenizer: {type: huggingface, path: data/tokenizer}
data: {path: data/corpus_text_document, split: "98,2,0"}
train: {iters: 1, micro_batch_size: 1, global_batch_size: 4, precision: fp32, eval_interval: 1, eval_iters: 1}
optim: {decay_iters: 100}
checkpoint: {dir: RUN/checkpoints, save_interval: 1}
run: {dir: RUN}
"""


def _build_data(root: Path) -> None:
    """data/: a small corpus (data_tools/build_corpus.py, 50 KB) and what the pages make of it: the
    byte-level BPE (also as GPT-2 vocab.json/merges.txt), a WordPiece vocabulary, two indexed
    datasets, a titled copy, prompts and texts to score, recipes/sft_tiny.yaml's instructions
    and model (data_tools/build_sft_data.py) and recipes/dpo_tiny.yaml's preference pairs
    (data_tools/build_preference_data.py), all at smaller sizes than the pages' own commands."""
    from tokenizers import Tokenizer

    _data_tool("build_corpus", "--output", "data/corpus.jsonl", "--max-mb", "0.05")
    _data_tool("train_tokenizer", "--input", "data/corpus.jsonl", "--output", "data/tokenizer", "--vocab-size", "512")
    _data_tool("train_wordpiece", "--input", "data/corpus.jsonl", "--output", "data/wordpiece", "--vocab-size", "512")
    shutil.copytree("data/tokenizer", "data/gpt2")  # a gpt2 tokenizer directory: tokenizer.json, vocab.json, merges.txt
    Tokenizer.from_file("data/tokenizer/tokenizer.json").model.save("data/gpt2")
    texts = [json.loads(line)["text"] for line in Path("data/corpus.jsonl").read_text().splitlines()]
    Path("data/more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:10]))
    Path("data/articles.jsonl").write_text("".join(json.dumps({"title": t.splitlines()[0], "text": t}) + "\n" for t in texts))
    for name in ("corpus", "more"):
        _megacli("preprocess", "--input", f"data/{name}.jsonl", "--output-prefix", f"data/{name}", "--tokenizer",
                 "data/tokenizer", "--append-eod")
    Path("convert.yaml").write_text("convert: {source: ckpt/gpt, destination: hf/gpt}\n")
    Path("reshard.yaml").write_text("reshard: {source: runs/gpt/checkpoints, output: runs/gpt/tp2, tensor: 2}\n")
    Path("eval.yaml").write_text("eval: {checkpoint: ckpt/llama, tasks: [my_task], include_path: my_tasks, limit: 4}\n")
    Path("my_tasks").mkdir()
    Path("my_tasks/my_task.yaml").write_text(
        "task: my_task\ndataset_path: json\ndataset_kwargs: {data_files: {test: lambada.jsonl}}\ntest_split: test\n"
        "output_type: loglikelihood\ndoc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
        "doc_to_target: \"{{' ' + text.split(' ')[-1]}}\"\nmetric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]\n")
    Path("my.jsonl").write_text("".join(json.dumps({"prompt": f"Say {w}.", "response": w}) + "\n"
                                        for w in ("yes", "no", "maybe", "later") * 4))  # instructions to finetune on
    Path("prompts.jsonl").write_text('{"prompt": "The capital of France is"}\n{"prompt": "Return the"}\n')
    Path("text.jsonl").write_text("".join(json.dumps({"text": t[:200]}) + "\n" for t in texts[:2]))
    Path("lambada.jsonl").write_text("".join(json.dumps({"text": " ".join(t.split()[:12])}) + "\n" for t in texts[:8]))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "data_tools"))
        import build_sft_data

        build_sft_data.build_data(Path("data/corpus.jsonl"), Path("data/sft"), n=40, seed=0)
        build_sft_data.build_model(Path("recipes/sft_tiny.yaml"), Path("data/tokenizer"), Path("data/tiny_llama_hf"), seed=0)
    _data_tool("build_preference_data", "--pairs", "64")


def _build_checkpoints(root: Path) -> None:
    """Tiny random models (tests/_convert_models.py) where the pages name big ones: hf/Llama-3.2-1B
    (Llama-3.2-1B's config at toy sizes), and as megacli checkpoints ckpt/llama (from it), ckpt/gpt (GPT-2) and
    ckpt/mistral (sliding window, Llama 3.1 RoPE scaling); runs/gpt, a one-step pretrain of
    TINY_GPT with its optimizer state, and megatron/gpt-run, the same as Megatron-LM writes it,
    with gpt-run.yaml, the recipe it was trained with."""
    from tests import _convert_models as cm

    cm.build_hf("llama3_2", root / "hf" / "Llama-3.2-1B", with_tokenizer=True)
    cm.build_hf("gpt2", root / "hf" / "gpt2", with_tokenizer=True)
    cm.build_hf("mistral_window_llama3_1", root / "hf" / "mistral", with_tokenizer=True)
    for hf, ckpt in (("Llama-3.2-1B", "llama"), ("gpt2", "gpt"), ("mistral", "mistral")):
        _megacli("convert", f"hf/{hf}", f"ckpt/{ckpt}")
    Path("gpt.yaml").write_text(TINY_GPT.replace("RUN", "runs/gpt"))
    Path("gpt-run.yaml").write_text(TINY_GPT.replace("RUN", "runs/gpt-run"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGACLI_IN_PROCESS", "1")
        _megacli("pretrain", "gpt.yaml")
    _megacli("convert", "runs/gpt/checkpoints", "megatron/gpt-run", "--to", "megatron")


@pytest.fixture(scope="session")
def scratch(tmp_path_factory):
    """The directory run examples run in: the recipes, README.md, runs/a, runs/b with a few logged
    steps and one evaluation each (what `megacli plot` reads), data/ and tiny checkpoints."""
    import contextlib

    root = tmp_path_factory.mktemp("docs_examples")
    shutil.copytree(ROOT / "recipes", root / "recipes")
    shutil.copy(ROOT / "README.md", root / "README.md")
    for name, scale in (("a", 1.0), ("b", 1.2)):
        run = root / "runs" / name
        run.mkdir(parents=True)
        records = [{"iteration": i, "loss": scale * (6 - i / 2), "lr": 1e-3, "grad_norm": 1.0} for i in range(1, 7)]
        records.append({"iteration": 6, "val_loss": scale * 3.2, "val_ppl": 24.5})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with contextlib.chdir(root):
        _build_data(root)
        _build_checkpoints(root)
    return root


def test_every_example_block_says_how_it_is_checked():
    problems = [p for page in PAGES for p in _examples(page)[1]]
    problems += [f"{e}: unknown title {e.title!r}" for e in EXAMPLES if _kind(e.title) is None]
    assert not problems, "\n".join(problems)


def test_only_a_gpu_a_cluster_the_network_or_a_server_excuse_an_example_from_running():
    assert _kind("Needs the network" + PARSED) == PARSED
    assert _kind("Starts a server" + PARSED) == PARSED
    for reason in ("Needs a checkpoint", "Needs a corpus", "Needs a large model", "Takes minutes on CPU", "Too slow"):
        assert _kind(reason + PARSED) is None, reason


def _blocks() -> list[list[Example]]:
    """The run blocks, each once: a block repeated word for word on another page is run once."""
    blocks: dict[tuple, list[Example]] = {}
    for e in EXAMPLES:
        if _kind(e.title) in (RUN, DRY_RUN, FEW_STEPS):
            blocks.setdefault((e.page, e.block), []).append(e)
    unique = {}
    for block in blocks.values():
        unique.setdefault(tuple((e.title, e.args, e.output) for e in block), block)
    return list(unique.values())


@pytest.mark.parametrize("block", _blocks(), ids=lambda block: f"{block[0].page}:{block[0].block}")
def test_example_runs(block, scratch, monkeypatch):
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    monkeypatch.chdir(scratch)
    monkeypatch.setenv("MEGACLI_IN_PROCESS", "1")  # one-process runs in this process
    for example in block:
        args = list(example.args)
        if example.title == DRY_RUN:
            assert "--dry-run" not in args, f"{example}: already a dry run; title it {RUN!r}"
            args.append("--dry-run")
        if example.title == FEW_STEPS and args[0] in ("pretrain", "finetune"):
            args += [arg for item in FEW_STEPS_SETS for arg in ("--set", item)]
        if args[0] == "preprocess":
            # Its own process: preprocess forks its workers, and a fork of this process, which
            # holds the threads of the in-process training runs, can crash.
            done = subprocess.run([sys.executable, "-m", "megacli", *args], capture_output=True, text=True)
            exit_code, output = done.returncode, done.stdout + done.stderr
        else:
            result = CliRunner().invoke(app, args)
            exit_code, output = result.exit_code, result.output
        expected = 2 if example.output and example.output.startswith("error:") else 0
        assert exit_code == expected, f"{example}\n{output}"
        assert "Traceback" not in output, f"{example}\n{output}"
        if example.output:
            assert _matches(example.output, output), f"{example}: shown\n{example.output}\ngot\n{output}"


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
    assert kinds == {RUN, DRY_RUN, FEW_STEPS, PARSED, "other test"}, kinds


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
