"""Which transformer layers each pipeline stage holds: the one rule, as Megatron-Core 0.16.1
splits them (transformer_block.get_num_layers_to_build, transformer_layer.get_transformer_layer_offset).

Without uneven stages every stage holds num_layers / pipeline layers. With
``first_stage_layers`` and/or ``last_stage_layers`` those stages hold exactly that many and the
other ("middle") stages share the rest evenly. With virtual pipeline stages each stage's layers
are cut into ``virtual_pipeline`` equal chunks, and the model runs chunk 0 of every stage, then
chunk 1 of every stage, and so on.
"""

from __future__ import annotations

from typing import Optional


def split_problem(num_layers: int, pipeline: int, virtual_pipeline: Optional[int] = None,
                  first: Optional[int] = None, last: Optional[int] = None, *,
                  hint: bool = True) -> Optional[tuple[str, object, str]]:
    """Why Megatron-Core cannot split ``num_layers`` this way: (field, value, cause with the
    arithmetic and, with ``hint``, a split that works), or None when it can."""
    vp = virtual_pipeline or 1
    suggest = (lambda: "; " + _hint(num_layers, pipeline, virtual_pipeline)) if hint else (lambda: "")
    if first is None and last is None:
        stages = pipeline * vp
        if num_layers % stages:
            what = f"parallel.pipeline × parallel.virtual_pipeline = {pipeline} × {vp}" if virtual_pipeline \
                else "parallel.pipeline"
            return ("model.num_layers", num_layers,
                    f"must be divisible by {what} = {stages} ({num_layers} % {stages} = {num_layers % stages})"
                    + suggest())
        return None
    field, value = ("parallel.first_stage_layers", first) if first is not None else ("parallel.last_stage_layers", last)
    if pipeline < 2:
        return field, value, "uneven stages need parallel.pipeline >= 2"
    for name, n in (("parallel.first_stage_layers", first), ("parallel.last_stage_layers", last)):
        if n is not None and n % vp:
            return name, n, f"must be divisible by parallel.virtual_pipeline = {vp} (each stage's layers are cut into {vp} chunks)"
    given = [n for n in (first, last) if n is not None]
    middle_stages = pipeline - len(given)
    middle = num_layers - sum(given)
    spent = " + ".join(str(n) for n in given)
    if middle < 0 or (middle == 0) != (middle_stages == 0):
        return (field, value, f"model.num_layers = {num_layers} with parallel.pipeline = {pipeline}: {spent} layers on the "
                f"uneven stage{'s' if len(given) > 1 else ''} leave {middle} for {middle_stages} other stage"
                f"{'s' if middle_stages != 1 else ''}" + suggest())
    if virtual_pipeline and not middle_stages:
        # Megatron-Core 0.16.1 divides by the number of middle stages in its interleaved layer offsets.
        return (field, value, f"with parallel.virtual_pipeline, Megatron-Core needs a stage besides the first and last: "
                f"give only one of parallel.first_stage_layers and parallel.last_stage_layers, or parallel.pipeline >= 3")
    per = middle_stages * vp
    if middle_stages and middle % per:
        what = f"the {middle_stages} other stages × parallel.virtual_pipeline {vp}" if virtual_pipeline \
            else f"the {middle_stages} other stage{'s' if middle_stages != 1 else ''}"
        return (field, value, f"model.num_layers = {num_layers} - {spent} = {middle} layers must divide evenly over "
                f"{what} ({middle} % {per} = {middle % per})" + suggest())
    return None


def stage_layer_counts(num_layers: int, pipeline: int, first: Optional[int] = None, last: Optional[int] = None) -> list[int]:
    """Layers of each pipeline stage (a split split_problem accepts)."""
    given = [n for n in (first, last) if n is not None]
    middle_stages = pipeline - len(given)
    per = (num_layers - sum(given)) // middle_stages if middle_stages else 0
    counts = [per] * pipeline
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def chunk_layers(num_layers: int, pipeline: int, virtual_pipeline: Optional[int] = None,
                 first: Optional[int] = None, last: Optional[int] = None) -> list[list[range]]:
    """[stage][virtual chunk] -> the global layer numbers that chunk holds."""
    vp = virtual_pipeline or 1
    per_chunk = [n // vp for n in stage_layer_counts(num_layers, pipeline, first, last)]
    out: list[list[range]] = [[] for _ in range(pipeline)]
    start = 0
    for _ in range(vp):
        for stage, n in enumerate(per_chunk):
            out[stage].append(range(start, start + n))
            start += n
    return out


def stage_of_layer(layer: int, num_layers: int, pipeline: int, virtual_pipeline: Optional[int] = None,
                   first: Optional[int] = None, last: Optional[int] = None) -> int:
    """The pipeline stage holding global layer ``layer``."""
    for stage, chunks in enumerate(chunk_layers(num_layers, pipeline, virtual_pipeline, first, last)):
        if any(layer in r for r in chunks):
            return stage
    raise ValueError(f"layer {layer} is not among the {num_layers} layers")


def pick_split(num_layers: int, pipeline: int, virtual_pipeline: Optional[int] = None) -> Optional[tuple[Optional[int], Optional[int]]]:
    """(first_stage_layers, last_stage_layers) for a split Megatron-Core accepts: (None, None)
    when the layers divide evenly, else the split whose busiest stage holds the fewest layers,
    preferring one uneven stage, and lighter first then last stages (they also hold the
    embedding and the output layer). None when there is none."""
    if split_problem(num_layers, pipeline, virtual_pipeline, hint=False) is None:
        return None, None
    options = [None, *range(1, num_layers + 1)]
    best = None
    for first in options:
        for last in options:
            if (first is None and last is None) or split_problem(num_layers, pipeline, virtual_pipeline, first, last, hint=False):
                continue
            counts = stage_layer_counts(num_layers, pipeline, first, last)
            key = (max(counts), (first is not None) + (last is not None), counts[0], counts[-1], first is None)
            if best is None or key < best[0]:
                best = key, (first, last)
    return best[1] if best else None


def _hint(num_layers: int, pipeline: int, virtual_pipeline: Optional[int]) -> str:
    """What to set instead: a working uneven split, spelled out."""
    split = pick_split(num_layers, pipeline, virtual_pipeline) if pipeline > 1 else None
    if split == (None, None):
        return (f"or leave parallel.first_stage_layers and parallel.last_stage_layers null "
                f"(an even split of {num_layers // pipeline} per stage)")
    if not split:
        return "choose another parallel.pipeline" + (" or parallel.virtual_pipeline" if virtual_pipeline else "")
    first, last = split
    counts = stage_layer_counts(num_layers, pipeline, first, last)
    fields = " and ".join(f"parallel.{name} = {n}" for name, n in (("first_stage_layers", first), ("last_stage_layers", last))
                          if n is not None)
    return f"give uneven stages, e.g. {fields} (stages of {', '.join(map(str, counts))} layers)"
