"""Rich output for `megacli reshard`: progress bars over tensors and the summary."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def progress_bars(enabled: bool = True):
    """Yields ``start(description, total) -> done(key)`` (or None when disabled), drawing one bar
    per phase (writing, verifying) on stderr."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console(stderr=True)
    if not console.is_terminal:  # logs and pipes get the summary line, not bar frames
        yield None
        return
    with Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("[dim]{task.fields[key]}", markup=True), console=console, transient=True) as prog:

        def start(description: str, total: int):
            task = prog.add_task(description, total=total, key="")

            def done(key: str) -> None:
                prog.update(task, advance=1, key=_short(key))

            return done

        yield start


def _short(key: str, width: int = 56) -> str:
    from rich.markup import escape

    return escape(key if len(key) <= width else "…" + key[-(width - 1):])


def print_result(result, console) -> None:
    from megacli.checkpoint.space import size_text

    console.print(f"{result.action} {result.source} ({result.source_layout}) → {result.iteration_dir} ({result.target_layout}): "
                  f"{result.tensors} tensors ({size_text(result.bytes)}) and {result.objects} objects in {result.seconds:.1f} s",
                  markup=False, soft_wrap=True)
    for note in result.notes:
        console.print(f"  {note}", markup=False, soft_wrap=True)
    if result.verified is not None:
        console.print(result.verified.line(), markup=False, soft_wrap=True)
    if result.format == "legacy":
        console.print(f"Megatron-LM: --load {result.output} --ckpt-format torch (with the layout's --tensor/--pipeline-model-parallel-size)",
                      markup=False, soft_wrap=True)
    elif result.format == "megatron":
        console.print(f"Megatron-LM: --load {result.output} --ckpt-format torch_dist (a megacli run resumes it with "
                      f"checkpoint.resume={result.output})", markup=False, soft_wrap=True)
    else:
        console.print(f"resume with: megacli pretrain {result.iteration_dir / 'recipe.yaml'} --set checkpoint.resume={result.output}",
                      markup=False, soft_wrap=True)
