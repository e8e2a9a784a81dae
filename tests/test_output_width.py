"""Tables into a pipe or a file (issue 31): rich assumes 80 columns there and folds cells; megacli's
tables are laid out at their content's width instead, so a path or tensor name sits whole on one
line. CliRunner's output is not a terminal, as a pipe is not. (reshard inspect: tests/test_recipe_from.py.)"""

from __future__ import annotations

from typer.testing import CliRunner

LONG = "a_directory_name_long_enough_that_a_table_row_holding_it_is_wider_than_any_terminal_" * 2


def cli(*args):
    from megacli.cli import _register, app

    _register()
    return CliRunner().invoke(app, [str(a) for a in args])


def test_pretrain_dry_run_rows_stay_whole(tmp_path):
    missing = tmp_path / LONG / "tokenizer"
    res = cli("pretrain", "--dry-run", "--set", "data.mock=true", "--set", f"tokenizer.path={missing}")
    assert res.exit_code == 0, res.output
    row = [line for line in res.output.splitlines() if line.startswith("│ vocabulary ")]
    assert len(row) == 1 and str(missing) in row[0] and "→ padded" in row[0], res.output


def test_preprocess_dry_run_paths_stay_whole(tmp_path):
    folder = tmp_path / LONG
    folder.mkdir()
    corpus = folder / "corpus.jsonl"
    corpus.write_text('{"text": "one"}\n{"text": "two"}\n')
    res = cli("preprocess", "--dry-run", "--input", corpus, "--output-prefix", folder / "out", "--tokenizer", "byte")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    for path in (corpus, folder / "out_text_document.bin", folder / "out_text_document.idx"):
        assert any(str(path) in line and line.startswith("│") for line in lines), (path, res.output)
