"""What a run reports: one console line per log interval, a rich progress bar with ETA,
metrics.jsonl (one JSON object per logged step or evaluation), the experiment trackers of
train.loggers (engine.trackers) and <run.dir>/plot.png. Only the reporting rank (last pipeline
stage, first TP/DP/CP rank: it holds the loss) writes."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import psutil
import torch

# Dense bf16/fp16 tensor-core peak per GPU (FLOP/s), for MFU. Unknown devices report no MFU.
PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "A100": 312e12, "A800": 312e12,
              "L40S": 362e12, "A10": 125e12, "B200": 2250e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def loss_metrics(reports: dict[str, tuple[float, float]]) -> dict[str, float]:
    """A step's losses from the schedule's reports (key -> (sum, count) over micro-batches and
    data-parallel ranks): each key becomes a metric name ("lm loss" -> "lm_loss") holding sum / count,
    and "loss" is the sum of the loss terms - what was optimised (GPT/T5: "lm loss"; BERT: "lm loss"
    + "sop loss"). A key with a "/" ("rewards/chosen") is a measurement, not a loss term: it is
    always given and never summed into loss. With a single loss term only "loss" is given for it.
    No reports (not the last pipeline stage): loss is nan."""
    means = {k.replace(" ", "_"): (s / n if n else float("nan")) for k, (s, n) in reports.items()}
    terms = {k: v for k, v in means.items() if "/" not in k}
    out = {"loss": sum(terms.values()) if terms else float("nan")}
    if len(terms) > 1:
        out.update(terms)
    out.update({k: v for k, v in means.items() if "/" in k})
    return out


def is_preference(losses: dict[str, float]) -> bool:
    """Losses of a preference objective (no language-model loss, so no perplexity)."""
    return "rewards/accuracy" in losses


def perplexity(losses: dict[str, float]) -> float:
    """exp of the language-model term of loss_metrics' losses (the loss itself when it is the only term)."""
    return math.exp(min(losses.get("lm_loss", losses["loss"]), 50.0))


def _describe_losses(losses: dict | None) -> str:
    return "".join(f" | {k} {v:.4f}" for k, v in (losses or {}).items())


def _describe_experts(experts: dict | None) -> str:
    if not experts:
        return ""
    lb = f" | load balancing {experts['load_balancing_loss']:.4f}" if "load_balancing_loss" in experts else ""
    return f"{lb} | tokens/expert {experts['expert_tokens_min']:,.0f}-{experts['expert_tokens_max']:,.0f}"


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    return psutil.Process().memory_info().rss / 1024**3


def drop_records_after(path: Path, iteration: int) -> None:
    """Keep the records up to `iteration`, where this run starts: those after it came from a run
    that stopped before its next checkpoint, and this run logs those iterations again."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _iteration_of(line) <= iteration]
    if len(kept) < len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def _iteration_of(line: str) -> float:
    """A record's iteration; a line cut short by a killed run counts as after every iteration."""
    try:
        return json.loads(line).get("iteration", 0)
    except ValueError:
        return float("inf")


def scheduler_fields(env=os.environ) -> dict[str, int]:
    """Under Slurm, how often the job was restarted (requeued) before this run of it."""
    if "SLURM_JOB_ID" not in env:
        return {}
    return {"slurm_restart_count": int(env.get("SLURM_RESTART_COUNT") or 0)}


class MetricsLog:
    def __init__(self, *, run_dir: str, enabled: bool, total_iters: int, start_iter: int, tokens_per_step: int,
                 flops_per_step: float, world_size: int, device: torch.device, loggers: list[str],
                 run_name: str | None = None, run_config: dict | None = None, resumed: bool = False,
                 plot: bool = True):
        """``loggers``: train.loggers_in_use; ``run_config``: the resolved recipe as a dict (the
        trackers' run config); ``resumed``: continue the tracker runs named in the run directory;
        ``plot``: redraw plot.png (train.plot)."""
        self.enabled = enabled
        self.plots = plot
        self.plotter = None  # the process redrawing plot.png in the background
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = flops_per_step
        self.world_size = world_size
        self.device = device
        self.peak = peak_flops(device)
        self.progress = None
        self.trackers = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_records_after(self.path, start_iter)
        self.console = Console(highlight=False, emoji=False)
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[loss]}"),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=True)
        self.task = self.progress.add_task("train", total=total_iters, completed=start_iter, loss="")
        self.progress.start()
        if loggers:
            from megacli.engine.trackers import Trackers
            from megacli.rundir import versions

            self.trackers = Trackers(names=loggers, run_dir=run_dir, run_name=run_name, recipe=run_config or {},
                                     versions=versions(), resumed=resumed, warn=self.warn)

    def say(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, markup=False)  # the text names user paths and values

    def warn(self, text: str) -> None:
        if self.enabled:
            from rich.text import Text

            self.console.print(Text("warning: ", style="yellow") + Text(text))  # user text printed as is

    def plot(self, *, background: bool = False) -> None:
        """Redraw <run.dir>/plot.png from metrics.jsonl; skipped without matplotlib or with train.plot
        off. ``background``: in a process of its own that the training loop does not wait for (a
        redraw takes a second or more on a long run), skipped while the previous one still draws. A
        redraw in the foreground waits for the one in the background first."""
        import importlib.util

        if not (self.enabled and self.plots) or not self.path.is_file() or importlib.util.find_spec("matplotlib") is None:
            return
        if self.plotter is not None:
            if background and self.plotter.poll() is None:
                return
            self.plotter.wait()
            self.plotter = None
        if background:
            import subprocess
            import sys

            self.plotter = subprocess.Popen(
                [sys.executable, "-c", "import sys; from megacli.plot.figure import write_run_plot; "
                 "from pathlib import Path; write_run_plot(Path(sys.argv[1]))", str(self.path.parent)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return
        from megacli.plot.figure import write_run_plot

        try:
            write_run_plot(self.path.parent)
        except Exception as exc:  # a picture is not worth stopping the training for
            self.warn(f"plot.png not written: {exc}")

    def _write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.trackers is not None:
            self.trackers.log(record)

    def step(self, *, iteration: int, loss: float, lr: float, grad_norm: float | None, seconds_per_step: float,
             loss_scale: float | None = None, extra: dict | None = None, losses: dict | None = None,
             experts: dict | None = None) -> None:
        """One logged step; ``losses``: the loss terms besides ``loss`` (see loss_metrics); ``experts``:
        a MoE model's load-balancing loss and tokens per expert (see engine.models.moe.ExpertStats)."""
        if not self.enabled:
            return
        tokens_per_s = self.tokens_per_step / seconds_per_step
        tflops = self.flops_per_step / seconds_per_step / self.world_size / 1e12  # per device
        record = {"iteration": iteration, "loss": loss, **(losses or {}), "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tokens_per_s, "step_time_s": seconds_per_step, "tflops_per_device": tflops,
                  "memory_gib": memory_gib(self.device)}
        if self.peak:
            record["mfu"] = tflops * 1e12 / self.peak
        if loss_scale is not None:
            record["loss_scale"] = loss_scale
        record.update(experts or {})
        record.update(extra or {})
        record.update(scheduler_fields())
        self._write(record)
        gn = f"{grad_norm:.3f}" if grad_norm is not None else "-"
        mfu = f" | MFU {record['mfu'] * 100:.1f}%" if "mfu" in record else ""
        self.console.print(f"iter {iteration:>6} | loss {loss:.4f}{_describe_losses(losses)}{_describe_experts(experts)} | "
                           f"lr {lr:.3e} | grad norm {gn} | "
                           f"{tokens_per_s:,.0f} tok/s | {tflops:.3g} TFLOP/s{mfu} | mem {record['memory_gib']:.2f} GiB")
        self.progress.update(self.task, completed=iteration, loss=f"loss {loss:.4f}")

    def advance(self, iteration: int) -> None:
        if self.enabled:
            self.progress.update(self.task, completed=iteration)

    def evaluation(self, *, iteration: int, val: dict | None, named: dict[str, dict | None] | None = None,
                   tasks: dict[str, float] | None = None) -> None:
        """One evaluation record: ``val``, the split-based validation losses (see loss_metrics; None
        without a validation split), as val_loss, val_<term> and val_ppl; ``named``, each named
        validation set's losses, as val_loss/<name> and val_ppl/<name>; ``tasks``, the harness
        metrics by their keys (eval/<task>/<metric>)."""
        named = {k: v for k, v in (named or {}).items() if v is not None}
        if not self.enabled or (val is None and not named and not tasks):
            return
        record, parts = {"iteration": iteration}, []
        if val is not None:
            losses = {k: v for k, v in val.items() if k != "loss"}
            record.update({"val_loss": val["loss"], **{f"val_{k}": v for k, v in losses.items()}})
            ppl = "" if is_preference(val) else f" | perplexity {perplexity(val):.2f}"
            if not is_preference(val):
                record["val_ppl"] = perplexity(val)
            parts.append(f"loss {val['loss']:.4f}{_describe_losses(losses)}{ppl}")
        for name, losses in named.items():
            record[f"val_loss/{name}"] = losses["loss"]
            if is_preference(losses):
                record.update({f"val_{k}/{name}": v for k, v in losses.items() if "/" in k})
                parts.append(f"{name}: loss {losses['loss']:.4f}, reward accuracy {losses['rewards/accuracy']:.3f}")
            else:
                record[f"val_ppl/{name}"] = perplexity(losses)
                parts.append(f"{name}: loss {losses['loss']:.4f}, perplexity {perplexity(losses):.2f}")
        for key, value in (tasks or {}).items():
            record[key] = value
            parts.append(f"{key.removeprefix('eval/')} {value:.4g}")
        self._write(record)
        self.console.print(f"[bold]validation[/] iter {iteration} | " + " | ".join(parts))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.trackers is not None:
            self.trackers.close()


class Stopwatch:
    """Wall time between marks, synchronising CUDA so the numbers are real."""

    def __init__(self, device: torch.device):
        self.device = device
        self.last = time.perf_counter()

    def lap(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed
