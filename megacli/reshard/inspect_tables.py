"""`megacli reshard inspect`: what a checkpoint holds (megacli.checkpoint.contents), as tables."""

from __future__ import annotations

from megacli.checkpoint.megacli_checkpoint import Layout, split_optimizer_key
from megacli.errors import UserError


def render(info: dict, console) -> None:
    from rich.table import Table

    from megacli.recipe.sections import sequence_parallel_on
    from megacli.checkpoint.space import size_text

    m = (info.get("recipe") or {}).get("model") or {}
    t = (info.get("recipe") or {}).get("train") or {}
    p = (info.get("recipe") or {}).get("parallel") or {}
    title = f"checkpoint {info['path']}"
    head = Table(title=title, show_header=False, title_justify="left", min_width=len(title))  # the path on one line
    head.add_row("format", info["format"])
    head.add_row("layout", f"{info['layout_text']}  (world size {info['world_size']})")
    head.add_row("iteration", f"{info['iteration']}  ({info['consumed_samples']} samples consumed)")
    opt = {"distributed": f"distributed optimizer ({info.get('optimizer_format') or 'fully_reshardable'})",
           "standard": "standard optimizer", None: "none (weights only)"}[info["optimizer"]]
    head.add_row("optimizer state", opt + (f", scheduler at step {info['scheduler_steps']}" if info.get("scheduler_steps") is not None else ""))
    rng = info["objects"]["rng_state"]
    head.add_row("RNG state", f"{len(rng)} rank(s)" if rng else "none")
    if m:
        head.add_row("model", f"{m.get('arch', 'gpt')}: {m.get('num_layers')} layers, hidden {m.get('hidden_size')}, "
                     f"{m.get('num_attention_heads')} heads, ffn {m.get('ffn_hidden_size')}, {m.get('activation')}, "
                     f"seq {m.get('seq_length')}")
    if t:
        head.add_row("training", f"precision {t.get('precision')}, global batch {t.get('global_batch_size')}, "
                     f"micro batch {t.get('micro_batch_size')}, {t.get('iters')} iters"
                     + (", sequence parallel" if sequence_parallel_on(p.get("sequence_parallel", False), tensor=p.get("tensor", 1)) else ""))
    if info.get("resharded_from"):
        rf = info["resharded_from"]
        head.add_row("resharded from", f"{rf.get('path')} ({_layout_text(rf.get('layout') or {})})")
    head.add_row("files", f"{len(info['files'])} shard file(s), {size_text(info['total_bytes'])} of tensors")
    console.print(head)

    # One row per model tensor; its optimizer state (same global shape and split) in a column.
    rows = [r for r in info["tensors"] if r["kind"] == "model"]
    by_name = {r["name"]: r for r in rows}
    states: dict[str, list[str]] = {}
    extra = []
    for r in info["tensors"]:
        if r["kind"] != "optimizer":
            continue
        state, base = split_optimizer_key(r["name"])
        model = by_name.get(base)
        if model is None or model["shape"] != r["shape"] or model["split"] != r["split"]:
            extra.append(r)
            continue
        states.setdefault(base, []).append(state if r["dtype"] == model["dtype"] else f"{state} ({r['dtype']})")
    order = {"param": 0, "fp32_param": 1, "exp_avg": 2, "exp_avg_sq": 3}
    for names in states.values():
        names.sort(key=lambda n: (order.get(n.split(" ")[0], 9), n))
    n_opt = sum(1 for r in info["tensors"] if r["kind"] == "optimizer")
    table = Table(title=f"{len(rows)} model tensors, {n_opt} optimizer-state tensors (global shapes)", title_justify="left")
    table.add_column("tensor", overflow="fold", ratio=3)
    table.add_column("shape", justify="right", no_wrap=True)
    table.add_column("dtype", no_wrap=True)
    table.add_column("stored as", ratio=1)
    table.add_column("optimizer state", ratio=1)
    table.add_column("size", justify="right", no_wrap=True)
    for r in rows + extra:
        opt_size = sum(x["bytes"] for x in info["tensors"] if x["kind"] == "optimizer" and split_optimizer_key(x["name"])[1] == r["name"]
                       and x not in extra) if r["kind"] == "model" else 0
        table.add_row(r["name"], "×".join(map(str, r["shape"])) or "()", r["dtype"],
                      f"{r['chunks']} chunk{'s' if r['chunks'] != 1 else ''}: {r['split']}",
                      ", ".join(states.get(r["name"], [])) or ("-" if r["kind"] == "model" else "(optimizer)"),
                      size_text(r["bytes"] + opt_size))
    console.print(table)
    if "not_mapped" in info:  # a Megatron-LM checkpoint: the recipe its args map to, and what they do not
        _render_args_recipe(info, console)
    other = info["objects"]["other"]
    if other:
        console.print(f"{len(other)} other sharded object(s) (per-layer extra state), copied as stored", highlight=False)


def _render_args_recipe(info: dict, console) -> None:
    import yaml

    if info["recipe"] is not None:
        console.print("recipe (from the run's args):", highlight=False)
        console.print(yaml.safe_dump(info["recipe"], sort_keys=False).rstrip(), highlight=False, markup=False)
    for item in info["not_mapped"]:
        console.print(f"not mapped: {item}", highlight=False, markup=False)


def _layout_text(layout: dict) -> str:
    try:
        return str(Layout.from_meta(layout))
    except (TypeError, ValueError):
        raise UserError(f"unreadable layout {layout!r}") from None
