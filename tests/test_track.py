"""Seeing a run: the experiment trackers of train.loggers (TensorBoard, W&B offline, the MLflow file
store) hold what metrics.jsonl holds and the recipe, a resumed run continues the same tracker run,
a tracker that cannot start is reported and the run goes on; `megacli plot` draws metrics.jsonl
(PNG, self-contained HTML, text), with resumed segments joined."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import MOCK_GPT as TINY, cli, layout, pretrain, records

LOGGED = ["train.iters=4", "train.eval_interval=2", "train.eval_iters=1", "train.loggers=[tensorboard,wandb,mlflow]",
          "train.plot=true"]


def run(run_dir: Path, overrides: list[str]) -> None:
    """`megacli pretrain` with every logger, wandb offline, none of this environment's tracker settings."""
    env = {**{k: None for k in os.environ if k.startswith(("WANDB_", "MLFLOW_"))}, "WANDB_MODE": "offline"}
    out = pretrain(run_dir, [*TINY, *layout(), *LOGGED, *overrides], env=env)
    assert "logger off" not in out.stdout, out.stdout


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Steps 1-2, then a resumed process for steps 3-4 (evaluations at 2 and 4); the tracker ids
    after the first process."""
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    ck = f"checkpoint.dir={run_dir.parent / 'ck'}"
    run(run_dir, [ck, "train.exit_after_iters=2"])
    first_ids = json.loads((run_dir / "trackers.json").read_text())
    run(run_dir, [ck])
    return run_dir, first_ids


def wandb_records(path: Path):
    """The protobuf records of a W&B offline run file (a LevelDB-style log: a 7-byte header, then
    32 KiB blocks of records, each with a 7-byte header: crc, length, type; FULL=1 ... LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.slow
def test_wandb_offline_run_holds_the_losses_and_recipe_and_resume_continues_it(tracked):
    run_dir, first_ids = tracked
    run_id = first_ids["wandb"]
    assert json.loads((run_dir / "trackers.json").read_text())["wandb"] == run_id
    segments = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(segments) == 2, "the resumed process continues the W&B run of the first"
    logged, configs = {}, []
    for segment in segments:
        for record in wandb_records(segment / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id
                configs.append({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "history":
                items = {i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json) for i in record.history.item}
                logged.setdefault(record.history.step.num, {}).update(items)
    for r in records(run_dir):
        for key, value in r.items():
            if key != "iteration" and value is not None:
                assert logged[r["iteration"]][key] == pytest.approx(value, rel=1e-6), (r["iteration"], key)
    assert [logged[i]["loss"] for i in range(1, 5)] == pytest.approx([r["loss"] for r in records(run_dir) if "loss" in r])
    config = configs[0]
    assert config["recipe"]["train"]["iters"] == 4 and config["recipe"]["model"]["hidden_size"] == 64
    assert config["run_dir"] == str(run_dir.resolve()) and config["versions"]["torch"]


@pytest.mark.slow
def test_mlflow_file_store_holds_the_losses_and_recipe_and_resume_continues_it(tracked, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    run_dir, first_ids = tracked
    run_id = first_ids["mlflow"]
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"] == run_id
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("megacli")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(r["iteration"], pytest.approx(r[key])) for r in records(run_dir) if key in r], key
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["train.iters"] == "4" and run.data.params["model.hidden_size"] == "64"
    assert run.data.tags["run_dir"] == str(run_dir.resolve()) and run.data.tags["version.torch"]
    assert "recipe.yaml" in [a.path for a in client.list_artifacts(run_id)]


@pytest.mark.slow
def test_tensorboard_and_plot_png_written_by_the_run(tracked):
    run_dir, _ = tracked
    assert any((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_redraw_after_a_save_runs_beside_the_loop_and_the_last_one_waits_for_it(tmp_path):
    """A published save redraws plot.png in a process of its own (the loop does not wait for it, nor
    start a second one while it draws); the run's last redraw waits for it, then draws."""
    import torch

    from megacli.engine.metrics import MetricsLog

    log = MetricsLog(run_dir=str(tmp_path), enabled=True, total_iters=2, start_iter=0, tokens_per_step=1,
                     flops_per_step=1.0, world_size=1, device=torch.device("cpu"), loggers=[])
    try:
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "loss": 3.0 - i, "lr": 1e-3}) + "\n"
                                                        for i in (1, 2)))
        start = time.perf_counter()
        log.plot(background=True)
        drawing = log.plotter
        log.plot(background=True)
        assert time.perf_counter() - start < 0.5 and drawing.poll() is None  # importing matplotlib alone takes longer
        assert log.plotter is drawing and not (tmp_path / "plot.png").exists()
        log.plot()
        assert drawing.returncode == 0 and log.plotter is None
        assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        log.close()


def test_train_plot_false_draws_nothing(tmp_path):
    import torch

    from megacli.engine.metrics import MetricsLog

    log = MetricsLog(run_dir=str(tmp_path), enabled=True, total_iters=2, start_iter=0, tokens_per_step=1,
                     flops_per_step=1.0, world_size=1, device=torch.device("cpu"), loggers=[], plot=False)
    try:
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "loss": 3.0, "lr": 1e-3}) + "\n")
        log.plot(background=True)
        log.plot()
        assert log.plotter is None and not (tmp_path / "plot.png").exists()
    finally:
        log.close()


@pytest.mark.slow
def test_only_the_last_pipeline_stage_logs(tmp_path):
    """PP=2 on two processes: one W&B run and one MLflow run, from the stage that holds the loss."""
    run_dir = tmp_path / "run"
    sets = [*TINY, *layout(pp=2), "train.iters=2", "train.loggers=[wandb,mlflow]", f"run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "MEGACLI_"))}
    env.update(WANDB_MODE="offline")
    out = subprocess.run([sys.executable, "-m", "megacli", "pretrain", *[x for s in sets for x in ("--set", s)]],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert [p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")] == [ids["wandb"]]
    experiments = [p for p in (run_dir / "mlruns").iterdir() if p.is_dir() and (p / "meta.yaml").is_file() and p.name != "0"]
    assert len(experiments) == 1
    assert [p.name for p in experiments[0].iterdir() if (p / "meta.yaml").is_file()] == [ids["mlflow"]]


@pytest.mark.slow
def test_a_missing_logger_package_warns_and_the_run_goes_on_without_plot_too(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no matplotlib: no plot.png, nothing said
    monkeypatch.setenv("MEGACLI_IN_PROCESS", "1")
    run_dir = tmp_path / "run"
    sets = [*TINY, *layout(), "train.iters=2", "train.loggers=[wandb,tensorboard]", f"run.dir={run_dir}"]
    _register()
    out = CliRunner().invoke(app, ["pretrain", *[x for s in sets for x in ("--set", s)]], env={"COLUMNS": "300"})
    assert out.exit_code == 0, out.output
    warnings = [line for line in out.output.splitlines() if "wandb logger off" in line]
    assert len(warnings) == 1 and "megacli[wandb]" in warnings[0], out.output
    assert [r["iteration"] for r in records(run_dir)] == [1, 2]
    assert any((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert not (run_dir / "trackers.json").exists(), "no W&B run id to keep"
    assert not (run_dir / "plot.png").exists() and "plot" not in out.output


def test_a_tracker_with_a_bad_uri_says_why_and_the_others_start(tmp_path, monkeypatch):
    from megacli.engine.trackers import Trackers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    said = []
    trackers = Trackers(names=["mlflow", "tensorboard"], run_dir=str(tmp_path), run_name=None, recipe={"train": {"iters": 2}},
                        versions={"torch": "x"}, resumed=False, warn=said.append)
    try:
        assert [t.name for t in trackers.active] == ["tensorboard"]
        assert len(said) == 1 and said[0].startswith("mlflow logger off: could not start: ") and "\n" not in said[0]
        trackers.log({"iteration": 1, "loss": 2.0, "grad_norm": None, "skipped_step": True})
    finally:
        trackers.close()


@pytest.mark.parametrize("saved", [b'{"wandb": "ab', b'\xff\xfe{}', b'["wandb"]', b'{"wandb": 12}'])
def test_an_unreadable_trackers_file_is_one_warning_and_the_trackers_start(tmp_path, saved):
    from megacli.engine.trackers import IDS_FILE, Trackers

    (tmp_path / IDS_FILE).write_bytes(saved)
    said = []
    trackers = Trackers(names=["tensorboard"], run_dir=str(tmp_path), run_name=None, recipe={}, versions={},
                        resumed=True, warn=said.append)
    try:
        assert [t.name for t in trackers.active] == ["tensorboard"]
        assert len(said) == 1 and said[0].startswith(f"{tmp_path / IDS_FILE}: ") and "start new runs" in said[0], said
    finally:
        trackers.close()


def test_wandb_without_an_api_key_keeps_the_run_offline_and_says_how_to_sync(tmp_path, monkeypatch):
    """No WANDB_MODE, no key anywhere (env, netrc, settings): the run is kept offline, never turned off."""
    from google.protobuf.message import DecodeError

    from megacli.engine.trackers import Trackers

    for var in [v for v in os.environ if v.startswith("WANDB_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there: no network either
    run_dir = tmp_path / "run"
    said = []
    trackers = Trackers(names=["wandb"], run_dir=str(run_dir), run_name=None, recipe={"train": {"iters": 2}},
                        versions={}, resumed=False, warn=said.append)
    try:
        assert [t.name for t in trackers.active] == ["wandb"], said
        trackers.log({"iteration": 1, "loss": 2.5})
    finally:
        trackers.close()
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    assert len(said) == 1 and said[0].endswith(f"kept offline in {offline}: upload it with `wandb sync {offline}`"), said
    run_file = offline / f"run-{offline.name.rsplit('-', 1)[1]}.wandb"
    deadline = time.monotonic() + 60  # W&B's own process finishes writing the file after finish() returns
    while True:
        try:
            written = list(wandb_records(run_file))
        except (OSError, AssertionError, DecodeError):  # not there yet, or its last record half-written
            written = []
        if any(r.WhichOneof("record_type") == "exit" for r in written) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    history = [{i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json) for i in r.history.item}
               for r in written if r.WhichOneof("record_type") == "history"]
    assert [h["loss"] for h in history] == [2.5]


def test_recipe_loggers_and_the_older_tensorboard_flag():
    from megacli.recipe.sections import TrainSection

    assert TrainSection(loggers=["wandb"], tensorboard=True).loggers_in_use == ["tensorboard", "wandb"]
    assert TrainSection(loggers=["tensorboard"], tensorboard=True).loggers_in_use == ["tensorboard"]
    assert TrainSection().loggers_in_use == []
    with pytest.raises(ValueError, match="named twice"):
        TrainSection(loggers=["wandb", "wandb"])
    with pytest.raises(ValueError):
        TrainSection(loggers=["neptune"])


# --- plots ---------------------------------------------------------------------------------------

RESUMED_LOG = [  # steps 1-4 and an evaluation at 2; the process died saving 4 and resumed from 2
    {"iteration": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": None},
    {"iteration": 2, "loss": 4.0, "lr": 9e-4, "grad_norm": 1.5},
    {"iteration": 2, "val_loss": 4.5, "val_ppl": 90.0},
    {"iteration": 3, "loss": 3.9, "lr": 8e-4, "grad_norm": 1.4},
    {"iteration": 4, "loss": 3.8, "lr": 7e-4, "grad_norm": 1.3},
    {"iteration": 3, "loss": 3.5, "lr": 8e-4, "grad_norm": 1.2},
    {"iteration": 4, "loss": 3.0, "lr": 7e-4, "grad_norm": 1.1},
    {"iteration": 4, "val_loss": 3.2, "val_ppl": 25.0},
]


def write_run(path: Path, lines: list[dict]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_resumed_segments_joined_the_later_replacing_the_earlier(tmp_path):
    from megacli.plot.series import read_runs

    run_dir = write_run(tmp_path / "run", RESUMED_LOG)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"iteration": 5, "lo')  # a line cut off by a crash is not a record
    (run,) = read_runs([run_dir])
    assert run.label == "run"
    assert (run.curves["loss"].iterations, run.curves["loss"].values) == ([1, 2, 3, 4], [5.0, 4.0, 3.5, 3.0])
    assert (run.curves["grad_norm"].iterations, run.curves["grad_norm"].values) == ([2, 3, 4], [1.5, 1.2, 1.1])
    assert (run.curves["val_loss"].iterations, run.curves["val_loss"].values) == ([2, 4], [4.5, 3.2])
    assert run.curves["val_loss"].evaluation and not run.curves["loss"].evaluation


@pytest.mark.slow
def test_plot_png_panels_hold_the_runs_metrics(tracked, tmp_path):
    from PIL import Image

    from megacli.plot.figure import build_figure
    from megacli.plot.series import choose_metrics, read_runs

    run_dir, _ = tracked
    other = write_run(tmp_path / "other", RESUMED_LOG)
    runs = read_runs([run_dir, other])
    panels = choose_metrics(runs, None)
    assert panels == ["loss", "val_loss", "lr", "grad_norm", "tokens_per_s"]  # no MFU on CPU
    figure = build_figure(runs, panels)
    shown = [ax for ax in figure.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == panels
    logged = records(run_dir)
    for ax, metric in zip(shown, panels):
        lines = {line.get_label(): line for line in ax.get_lines()}
        want = [(r["iteration"], r[metric]) for r in logged if metric in r]
        assert list(zip(lines["run"].get_xdata(), lines["run"].get_ydata())) == want, metric
        assert ("other" in lines) == any(metric in r for r in RESUMED_LOG), metric  # overlaid where it has the metric
    validation = {line.get_label(): line for line in shown[0].get_lines()}["run validation"]
    assert list(validation.get_ydata()) == [r["val_loss"] for r in logged if "val_loss" in r]

    out = cli("plot", run_dir, other, "-o", tmp_path / "both.png")
    assert out.exit_code == 0, out.output
    with Image.open(tmp_path / "both.png") as image:
        assert image.format == "PNG" and image.size == (1280, 1020)  # 3 rows of 2 panels at 100 dpi
        assert len(set(image.convert("L").getdata())) > 10, "not a blank image"


def test_plot_html_is_self_contained(tmp_path):
    run_dir = write_run(tmp_path / "run", RESUMED_LOG)
    out = cli("plot", run_dir, "-o", tmp_path / "plot.html", "--metrics", "loss,val_ppl")
    assert out.exit_code == 0, out.output
    html = (tmp_path / "plot.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") == 1
    for fetched in ("<script", "<link", "src=", "<img", "@import", "url(http"):
        assert fetched not in html, fetched
    assert html.count('<g id="axes_') == 2 and "<!-- loss -->" in html and "<!-- val_ppl -->" in html, "two panels"
    assert not list(tmp_path.glob(".*.tmp"))


def test_plot_ascii_draws_the_loss_curve(tmp_path):
    run_dir = write_run(tmp_path / "run", RESUMED_LOG)
    out = cli("plot", run_dir, "--ascii")
    assert out.exit_code == 0, out.output
    rows = [line.split("|", 1) for line in out.output.splitlines() if "|" in line]
    assert rows[0][0].strip() == "5" and rows[-1][0].strip() == "3", "labelled with the highest and lowest loss"
    grid = [cells for _, cells in rows]
    assert grid[0][0] == "*" and grid[-1][-1] == "*", "loss 5 at iteration 1 top left, 3 at iteration 4 bottom right"
    marked = [max(r for r, cells in enumerate(grid) if cells[c] == "*") for c in range(len(grid[0]))]
    assert marked == sorted(marked), "a falling loss: every column's mark at or below the one before"
    assert not (tmp_path / "plot.png").exists() and not Path("plot.png").exists()


@pytest.mark.parametrize("output", ["plot.png", "plot.html", None])
def test_plot_leaves_out_what_cannot_be_drawn_and_says_so(tmp_path, output):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        '{"iteration": 1, "loss": 5.0, "lr": 1e-3}\n{"iteration": 2, "loss": Infinity, "lr": NaN}\n'
        '{"iteration": 3, "loss": -1e308, "lr": 1e-3}\n{"iteration": 4, "loss": 1e308}\n'
        '{"iteration": 5, "loss": 3.0, "lr": true}\n')
    out = cli("plot", run_dir, *(["-o", tmp_path / output] if output else ["--ascii"]), "--metrics", "loss,lr")
    assert out.exit_code == 0, out.output
    assert "loss at iteration 2, 3, 4" in out.output and "lr at iteration 2" in out.output, out.output
    if output:
        assert (tmp_path / output).stat().st_size > 0
    else:
        rows = [line.split("|", 1) for line in out.output.splitlines() if "|" in line]
        assert rows[0][0].strip() == "5" and rows[-1][0].strip() == "3", "drawn from the finite losses"
    from megacli.plot.series import read_runs

    (run,) = read_runs([run_dir])
    assert run.curves["loss"].values == [5.0, 3.0] and run.curves["lr"].iterations == [1, 3], "true is not a number"


@pytest.mark.parametrize("content, expected", [
    (b'{"iteration": 1, "loss": 2.0}\n{"iteration": 2, "loss": 1.0, "note": "\xff"}\n', "line 2: not UTF-8 text"),
    (b'{"iteration": true, "loss": 2.0}\n', "line 1: not a metrics record"),
    (b'{"iteration": -3, "loss": 2.0}\n', "line 1: not a metrics record"),
])
def test_plot_unreadable_records_are_named_by_line(tmp_path, content, expected):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_bytes(content)
    out = cli("plot", run_dir, "--ascii")
    assert out.exit_code == 2 and expected in out.output and str(run_dir / "metrics.jsonl") in out.output, out.output


@pytest.mark.parametrize("case", ["no_metrics_file", "unknown_metric", "bad_extension", "broken_record"])
def test_plot_bad_input_exits_2_with_one_message(tmp_path, case):
    run_dir = write_run(tmp_path / "run", RESUMED_LOG)
    output = tmp_path / "plot.png"
    args = {"no_metrics_file": [tmp_path], "unknown_metric": [run_dir, "--metrics", "loss,perplexity"],
            "bad_extension": [run_dir, "-o", tmp_path / "plot.jpg"], "broken_record": [run_dir]}[case]
    if case == "broken_record":
        (run_dir / "metrics.jsonl").write_text('{"iteration": 1, "loss": 2.0}\nnot json\n{"iteration": 2, "loss": 1.0}\n')
    out = cli("plot", *args, *([] if "-o" in args else ["-o", output]))
    assert out.exit_code == 2, out.output
    message = out.output.strip()
    assert message.startswith("error:") and "\n" not in message and "Traceback" not in message, message
    expected = {"no_metrics_file": "has no metrics.jsonl", "unknown_metric": "perplexity not in metrics.jsonl",
                "bad_extension": "unknown format '.jpg'", "broken_record": "line 2: not a JSON record"}[case]
    assert expected in message, message
    assert not output.exists() and not (tmp_path / "plot.jpg").exists()
