"""What a command may delete to put its output in place (checkpoint.replace): a checkpoint and
nothing else; never a folder that merely exists there, the source, or the working directory. A tiny
torch_dist checkpoint written directly (test_checkpoint_safety's) is the source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import cli
from tests.test_checkpoint_safety import ITER, write_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("overwrite") / "ck"
    write_checkpoint(root)
    return root


def tree(path: Path) -> dict[str, bytes | None]:
    """Every entry under ``path`` with a file's bytes: what must survive a refusal unchanged."""
    return {p.relative_to(path).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


def refused(res, *words: str) -> str:
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert all(w in text for w in words), text
    return text


def project(root: Path) -> Path:
    (root / "code").mkdir(parents=True)
    (root / "code" / "main.py").write_text("print('mine')\n")
    (root / "notes.txt").write_text("months of notes\n")
    return root


def test_overwrite_refuses_a_sibling_run_and_a_project_folder(source, tmp_path):
    runs = tmp_path / "runs"
    shutil.copytree(source, runs / "a" / "checkpoints")
    sibling = runs / "b"
    shutil.copytree(source, sibling / "checkpoints")
    (sibling / "metrics.jsonl").write_text('{"iteration": 1}\n')
    folder = project(tmp_path / "project")
    shutil.copytree(source, folder / "ck")
    before = {p: tree(p) for p in (runs, folder)}

    text = refused(cli("reshard", runs / "a" / "checkpoints", sibling, "--tensor", "2", "--overwrite"),
                   "is not a checkpoint", "'metrics.jsonl'")
    assert "--overwrite" not in text.split(":", 1)[1], text  # nothing suggests the deletion
    refused(cli("reshard", runs / "a" / "checkpoints", runs, "--tensor", "2", "--overwrite"),
            "holds the checkpoint being read")
    text = refused(cli("reshard", folder / "ck", folder, "--tensor", "2", "--overwrite"), "holds the checkpoint being read")
    refused(cli("reshard", source, folder, "--tensor", "2", "--overwrite"), "is not a checkpoint", "'notes.txt'", "'code'")
    for without in (cli("reshard", source, folder, "--tensor", "2"), cli("reshard", source, sibling, "--tensor", "2")):
        assert "--overwrite" not in refused(without, "is not a checkpoint")
    assert {p: tree(p) for p in (runs, folder)} == before
    assert not list(tmp_path.glob(".*")), "no temporary directory left"


def test_overwrite_refuses_the_working_directory(source, tmp_path, monkeypatch):
    here = project(tmp_path / "here")
    monkeypatch.chdir(here)
    before = tree(tmp_path)
    refused(cli("reshard", source, ".", "--tensor", "2", "--overwrite"), "working directory")
    refused(cli("reshard", source, "..", "--tensor", "2", "--overwrite"), "working directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    refused(cli("reshard", source, ".", "--tensor", "2", "--overwrite"), "working directory")
    refused(cli("convert", source, "."), "working directory")
    assert tree(tmp_path) == {**before, "empty": None}


def test_overwrite_replaces_a_checkpoint_and_only_a_bare_one(source, tmp_path):
    out = tmp_path / "out"
    assert cli("reshard", source, out, "--tensor", "2").exit_code == 0
    assert "pass --overwrite" in refused(cli("reshard", source, out, "--tensor", "1"), "already holds a checkpoint")
    res = cli("reshard", source, out, "--tensor", "1", "--overwrite")
    assert res.exit_code == 0, res.output
    assert json.loads((out / ITER / "megacli.json").read_text())["layout"]["tensor"] == 1
    (out / "notes.txt").write_text("mine\n")
    refused(cli("reshard", source, out, "--tensor", "2", "--overwrite"), "also 'notes.txt'")
    assert (out / "notes.txt").read_text() == "mine\n" and (out / ITER / "megacli.json").is_file()


def test_the_rule_itself(source, tmp_path):
    from megacli.checkpoint.replace import why_not_replaceable

    assert why_not_replaceable(tmp_path / "absent") is None
    assert why_not_replaceable(source) is None and why_not_replaceable(source / ITER) is None
    (tmp_path / "empty").mkdir()
    assert why_not_replaceable(tmp_path / "empty") is None
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert "is not a checkpoint" in why_not_replaceable(hf)  # a config.json marks too many folders
    (tmp_path / "file").write_text("x")
    assert "not a directory" in why_not_replaceable(tmp_path / "file")
    assert "being read" in why_not_replaceable(source, reads=[source / ITER])
