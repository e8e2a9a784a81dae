"""What to tell someone whose GPU count no layout can use: why, and the GPU counts that work."""

from __future__ import annotations

SEARCH_LIMIT = 16384
"""Most GPUs the search for a count that fits looks at."""


def _counts(gpus_per_node: int, start: int, stop: int):
    """GPU counts a job can have, ascending: 1..gpus_per_node, then whole nodes."""
    for n in range(max(1, start), stop + 1):
        if n <= gpus_per_node or n % gpus_per_node == 0:
            yield n


def first_fitting_count(recipe, vocab_size: int, *, start: int, stop: int, gpu, gpus_per_node: int, constants):
    """The smallest GPU count in [start, stop] with a layout that fits, and that plan (or None, None)."""
    from megacli.planner import plan_layouts

    for n in _counts(gpus_per_node, start, stop):
        found = plan_layouts(recipe, vocab_size, gpus=n, gpu=gpu, gpus_per_node=gpus_per_node, constants=constants)
        if found.fitting:
            return n, found
    return None, None


def why_none(found, gpus: int, gpu) -> str:
    """Why no layout of ``found`` (a Plan for ``gpus`` GPUs) can run."""
    if not found.rows:
        reasons = sorted(found.rejected.items(), key=lambda kv: -kv[1])[:2]
        said = "; ".join(f"{field}: {reason}" for (field, reason), _ in reasons) or "no candidate layout"
        return f"no layout of this model uses {gpus} GPUs ({said})"
    least = min(found.rows, key=lambda r: r.memory.total)
    return (f"none of the {len(found.rows)} layouts for {gpus} GPUs fits in {gpu.name}'s {gpu.memory_gib:.1f} GiB: "
            f"the smallest needs {least.memory.total:.1f} GiB per GPU ({layout_text(least.layout)})")


def layout_text(layout: dict) -> str:
    """TP2 PP4 VP2 CP1 EP1 DP8, the short spelling of a layout."""
    parts = [f"TP{layout['tensor']}", f"PP{layout['pipeline']}"]
    if layout["virtual_pipeline"]:
        parts.append(f"VP{layout['virtual_pipeline']}")
    parts += [f"CP{layout['context']}", f"EP{layout['expert']}", f"DP{layout['data']}"]
    return " ".join(parts)


def no_layout_message(recipe, vocab_size: int, found, *, gpus: int, gpu, gpus_per_node: int, constants) -> str:
    """The message for a GPU count without a layout that fits: why, the smallest count that fits and
    the next one above ``gpus``."""
    why = why_none(found, gpus, gpu)
    smallest, plan = first_fitting_count(recipe, vocab_size, start=1, stop=min(SEARCH_LIMIT, max(gpus * 16, 64)),
                                         gpu=gpu, gpus_per_node=gpus_per_node, constants=constants)
    if smallest is None:
        return f"{why}; no GPU count up to {min(SEARCH_LIMIT, max(gpus * 16, 64))} fits either: a larger GPU (--gpu) or a smaller model"
    best = plan.fitting[0]
    text = (f"{why}. The smallest GPU count that fits is {smallest} ({layout_text(best.layout)}, "
            f"{best.memory.total:.1f} GiB per GPU)")
    if smallest < gpus:
        above, _ = first_fitting_count(recipe, vocab_size, start=gpus + 1, stop=min(SEARCH_LIMIT, gpus * 4),
                                       gpu=gpu, gpus_per_node=gpus_per_node, constants=constants)
        if above is not None:
            text += f"; the next count above {gpus} that works is {above}"
    return text
