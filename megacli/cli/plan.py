"""`megacli plan RECIPE --gpus N`: the layouts of the recipe's model on N GPUs, ranked by predicted
speed, with memory per GPU; `--json` for the rows, `-o` for the recipe of the top one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from megacli.cli.common import RecipeArg, SetOpt, guarded, write_whole
from megacli.cli.root import app

_GPU = "GPU and cluster"


@app.command(help="Rank every layout (TP × PP × VP × CP × EP × DP, micro-batch, recompute, distributed optimizer, "
                  "sequence parallelism) of a recipe's model on N GPUs by predicted speed, with memory per GPU.")
@guarded
def plan(
    recipe: RecipeArg = None,
    gpus: Annotated[int, typer.Option("--gpus", "-g", min=1, help="GPUs of the job.")] = 8,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=1, help="GPUs per node (tensor parallelism stays inside one).", rich_help_panel=_GPU)] = 8,
    gpu: Annotated[str, typer.Option("--gpu", help="GPU: h100-80gb, h200, a100-80gb or b200.", rich_help_panel=_GPU)] = "h100-80gb",
    gpu_memory: Annotated[Optional[float], typer.Option("--gpu-memory", min=0.001, help="GiB per GPU (overrides --gpu's).", rich_help_panel=_GPU, show_default=False)] = None,
    gpu_tflops: Annotated[Optional[float], typer.Option("--gpu-tflops", min=0.001, help="Dense bf16 peak TFLOP/s (overrides --gpu's).", rich_help_panel=_GPU, show_default=False)] = None,
    intra_node_bandwidth: Annotated[Optional[float], typer.Option("--intra-node-bandwidth", min=0.001, help="GB/s per GPU inside a node (NVLink).", rich_help_panel=_GPU, show_default=False)] = None,
    inter_node_bandwidth: Annotated[Optional[float], typer.Option("--nodes-bandwidth", "--inter-node-bandwidth", min=0.001, help="GB/s per GPU between nodes.", rich_help_panel=_GPU, show_default=False)] = None,
    constant: Annotated[Optional[List[str]], typer.Option("--constant", "-c", help="Override a prediction constant: NAME=VALUE (repeatable; see docs/commands/plan.md).", show_default=False)] = None,
    top: Annotated[int, typer.Option("--top", "-k", min=1, help="Layouts to show.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="The rows as a JSON list on stdout.")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the recipe with the top layout here.", show_default=False)] = None,
    measure: Annotated[int, typer.Option("--measure", min=0, help="Run the top K layouts for a few steps each (megacli pretrain) and re-rank them by measured speed.")] = 0,
    measure_dir: Annotated[Path, typer.Option("--measure-dir", help="Where --measure's short runs write.")] = Path("runs/plan-measure"),
    set_: SetOpt = None,
) -> None:
    from megacli.cli.plan_view import vocab_size_of
    from megacli.planner import plan_layouts
    from megacli.planner.advice import no_layout_message
    from megacli.recipe.jobs import load_job_recipe

    loaded = load_job_recipe("pretrain", recipe, set_ or [])
    chosen_gpu = _gpu(gpu, gpu_memory, gpu_tflops, intra_node_bandwidth, inter_node_bandwidth)
    constants = _constants(constant or [])
    vocab, _ = vocab_size_of(loaded)
    found = plan_layouts(loaded, vocab, gpus=gpus, gpu=chosen_gpu, gpus_per_node=gpus_per_node, constants=constants)
    if not found.fitting:
        from megacli.errors import UserError

        raise UserError(no_layout_message(loaded, vocab, found, gpus=gpus, gpu=chosen_gpu,
                                          gpus_per_node=gpus_per_node, constants=constants))
    measured = []
    if measure:
        from megacli.planner.measure import measure as run_layouts, reranked

        measured = reranked(run_layouts(found.fitting[:measure], measure_dir))
    if output is not None:
        _write_recipe((measured[0].row if measured and measured[0].step_time_s else found.fitting[0]).recipe, output)
    if as_json:
        import json

        typer.echo(json.dumps(rows_json(found, top) if not measured else measured_json(found, measured), indent=1))
    else:
        print_table(found, loaded, top, chosen_gpu)
        if measured:
            print_measured(found, measured)
        if output is not None:
            typer.echo(f"wrote {output} (the top layout{' as measured' if measured else ''}; "
                       f"`megacli pretrain {output}` runs it)")


def _gpu(name: str, memory, tflops, intra, inter):
    import dataclasses

    from megacli.errors import UserError
    from megacli.planner.gpus import GPUS

    if name not in GPUS:
        raise UserError(f"--gpu {name!r}: unknown GPU; known: {', '.join(GPUS)} "
                        f"(or give --gpu-memory and --gpu-tflops for another)")
    changes = {"memory_gib": memory, "peak_tflops": tflops, "intra_node_gbps": intra, "inter_node_gbps": inter}
    return dataclasses.replace(GPUS[name], **{k: v for k, v in changes.items() if v is not None})


def _constants(pairs: list[str]):
    from megacli.errors import UserError
    from megacli.planner.gpus import Constants, constant_names

    values = {}
    for pair in pairs:
        name, _, text = pair.partition("=")
        if name not in constant_names():
            raise UserError(f"--constant {pair!r}: unknown constant {name!r}; known: {', '.join(constant_names())}")
        try:
            values[name] = float(text)
        except ValueError:
            raise UserError(f"--constant {pair!r}: {text!r} is not a number") from None
        if values[name] < 0:
            raise UserError(f"--constant {pair!r}: must not be negative")
    return Constants().with_overrides(values)


def _write_recipe(chosen, output: Path) -> None:
    """The recipe with the chosen layout, whole (every field), written in one step (no half-written file)."""
    from megacli.recipe.base import dump

    text = "# yaml-language-server: $schema=schemas/pretrain.json\n# written by `megacli plan`\n" + dump(chosen)
    write_whole(output, text)


def rows_json(found, top: int, rows=None) -> list[dict]:
    """The shown rows: the layout under the recipe's field names, memory per GPU in GiB, speed."""
    from megacli.planner import why_slower

    best = found.rows[0]
    rows = found.rows[:top] if rows is None else rows
    return [{"rank": found.rows.index(row) + 1, **row.layout, "memory_gib": {k: round(v, 3) for k, v in row.memory.as_gib().items()},
             "fits": row.fits, "headroom_gib": round(row.headroom_gib, 3),
             "tokens_per_second_per_gpu": round(row.tokens_per_second_per_gpu, 1), "mfu": round(row.mfu, 4),
             "step_time_s": round(row.time.seconds, 4),
             "step_time_parts_s": {k: round(v, 4) for k, v in row.time.parts.items()},
             "train_hours": round(row.train_hours(), 2),
             "gpu_hours": round(row.train_hours() * row.recipe.world_size, 1), "why": why_slower(row, best)}
            for row in rows]


def measured_json(found, measured) -> list[dict]:
    """The measured rows, fastest measured first: the predicted row with what was measured."""
    rows = rows_json(found, 0, [m.row for m in measured])
    for row, m in zip(rows, measured):
        row.update(measured_step_time_s=m.step_time_s, measured_peak_memory_gib=m.peak_memory_gib,
                   measured_tokens_per_second_per_gpu=m.tokens_per_second_per_gpu, measured_error=m.error or None)
    return rows


def print_measured(found, measured) -> None:
    from rich.table import Table

    from megacli.cli.common import output_console
    from megacli.planner.advice import layout_text

    console = output_console()
    table = Table(title=f"the top {len(measured)} layouts as measured ({measured[0].row.recipe.launch.device}), "
                        f"fastest first", box=None, pad_edge=False)
    for name in ("measured #", "predicted #", "layout", "mbs", "recompute", "step s (predicted)", "step s (measured)",
                 "GiB (predicted)", "peak GiB (measured)"):
        table.add_column(name, overflow="fold")
    for i, m in enumerate(measured):
        lay = m.row.layout
        table.add_row(str(i + 1), str(found.rows.index(m.row) + 1), layout_text(lay), str(lay["micro_batch_size"]),
                      lay["recompute"], f"{m.row.time.seconds:.3f}",
                      f"{m.step_time_s:.3f}" if m.step_time_s is not None else m.error,
                      f"{m.row.memory.total:.2f}", f"{m.peak_memory_gib:.2f}" if m.peak_memory_gib is not None else "–")
    console.print(table)


def own_layout_rank(found, recipe) -> Optional[int]:
    """Where the recipe's own layout ranks among ``found``'s rows (None: not among them)."""
    from megacli.planner import layout_of

    if recipe.world_size != found.rows[0].recipe.world_size:
        return None
    own = layout_of(recipe)
    return next((i + 1 for i, row in enumerate(found.rows) if row.layout == own), None)


def print_table(found, recipe, top: int, gpu) -> None:
    from rich import box
    from rich.table import Table

    from megacli.cli.common import output_console
    from megacli.planner import layout_of, why_slower
    from megacli.planner.advice import layout_text

    console = output_console()
    best = found.rows[0]
    table = Table(title=f"{len(found.fitting)} of {len(found.rows)} layouts fit on {best.recipe.world_size} × {gpu.name} "
                        f"({gpu.memory_gib:.1f} GiB, {gpu.peak_tflops:g} TFLOP/s); fastest first",
                  box=box.SIMPLE_HEAD if console.is_terminal else None, pad_edge=False)
    for name, justify in (("#", "right"), ("layout", "left"), ("mbs", "right"), ("recompute", "left"),
                          ("dist-opt", "left"), ("SP", "left"), ("tokens/s/GPU", "right"), ("MFU", "right"),
                          ("GiB/GPU (headroom)", "right"), (f"{recipe.train.iters:,} steps", "right"),
                          ("GPU-hours", "right"), ("why below the top", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for i, row in enumerate(found.rows[:top]):
        lay = row.layout
        table.add_row(str(i + 1), layout_text(lay), str(lay["micro_batch_size"]), lay["recompute"],
                      "yes" if lay["distributed_optimizer"] else "no", "yes" if lay["sequence_parallel"] else "no",
                      f"{row.tokens_per_second_per_gpu:,.0f}", f"{row.mfu:.1%}",
                      f"{row.memory.total:.1f} ({row.headroom_gib:+.1f})", _duration(row.train_hours()),
                      f"{row.train_hours() * row.recipe.world_size:,.0f}", why_slower(row, best))
    console.print(table)
    unfit = [r for r in found.rows if not r.fits]
    if unfit:
        over = min(unfit, key=lambda r: r.memory.total)
        console.print(f"{len(unfit)} layouts do not fit; the closest, {layout_text(over.layout)} micro-batch "
                      f"{over.layout['micro_batch_size']}, needs {over.memory.total:.1f} GiB ({-over.headroom_gib:.1f} over)")
    rank = own_layout_rank(found, recipe)
    if rank is not None:
        own = layout_of(recipe)
        console.print(f"the recipe's own layout ({layout_text(own)}, micro-batch {own['micro_batch_size']}, "
                      f"{own['recompute']}) ranks #{rank} of {len(found.rows)}")
    console.print("speed: calibrated from single-GPU benchmark runs (docs/gpu.md), not measured at this scale")


def _duration(hours: float) -> str:
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"
