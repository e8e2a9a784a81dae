"""--dry-run: the resolved recipe, the layout, parameters and memory per rank, as rich tables."""

from __future__ import annotations


def vocab_size_of(recipe) -> tuple[int, str]:
    """The model's vocabulary (before padding) and where it comes from."""
    from megacli.plan import model_vocab_size

    if recipe.model.vocab_size:
        return recipe.model.vocab_size, "model.vocab_size"
    try:
        from megacli.data.tokenizers import load_tokenizer

        tokenizer = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path)
    except Exception as exc:  # a dry run should still print the rest
        return 50257, f"assumed (tokenizer not loadable: {exc})"
    vocab = model_vocab_size(recipe, tokenizer)
    added = vocab - tokenizer.vocab_size
    return vocab, "tokenizer" + (f" + {added} sentinels" if added else "")


def run_device(recipe) -> str:
    """The device a run of this recipe gets here: launch.device, auto resolved as the launcher does."""
    if recipe.launch.device != "auto":
        return recipe.launch.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def print_recipe(recipe, console) -> None:
    """The resolved recipe as block YAML: highlighted on a terminal, plain and never cut otherwise."""
    from rich.syntax import Syntax

    from megacli.recipe.base import dump

    text = dump(recipe)
    if console.is_terminal:
        console.print(Syntax(text, "yaml", theme="ansi_dark", background_color="default", word_wrap=True))
    else:
        console.file.write(text)


def print_plan(recipe) -> None:
    from rich.table import Table

    from megacli import plan
    from megacli.cli.common import output_console
    from megacli.recipe.model import padded_vocab_size

    console = output_console()
    print_recipe(recipe, console)
    p, m, t = recipe.parallel, recipe.model, recipe.train
    vocab, vocab_src = vocab_size_of(recipe)
    device = run_device(recipe)
    kernel = plan.attention_kernel(recipe, device=device)
    counts, mem = plan.estimate(recipe, vocab, device=device)
    total = counts.total

    layout = Table(title="layout", show_header=False)
    layout.add_row("world size", f"TP {p.tensor} × PP {p.pipeline} × CP {p.context} × DP {recipe.data_parallel_size} = {recipe.world_size}")
    sp = "on" if p.sp_enabled else "off"
    layout.add_row("sequence parallelism", sp + (f" (auto: TP {p.tensor})" if p.sequence_parallel == "auto" else ""))
    layout.add_row("layers per pipeline stage", _stages(recipe))
    layout.add_row("micro-batches per step", f"{recipe.num_microbatches} = global {t.global_batch_size} / (micro {t.micro_batch_size} × DP {recipe.data_parallel_size})")
    pairs = " × 2 (a preference pair's two sequences)" if recipe.preference is not None else ""
    layout.add_row("tokens per step", f"{recipe.tokens_per_step:,} = {t.global_batch_size} × {m.seq_length}{pairs}")
    layout.add_row("vocabulary", f"{vocab:,} ({vocab_src}) → padded {padded_vocab_size(vocab, divisible_by=m.make_vocab_size_divisible_by, tensor_parallel=p.tensor):,}")
    if m.moe is not None:
        layout.add_row("experts", f"{m.moe.num_experts} per MoE layer × {counts.moe_layers} MoE layers, top-{m.moe.router_topk}; "
                                  f"expert layers: ETP {recipe.expert_tensor_size} × EP {p.expert} × expert-DP "
                                  f"{recipe.expert_data_parallel_size} per pipeline stage")
        layout.add_row("parameters (model)", f"{total:,} ({counts.active:,} active per token)")
    else:
        layout.add_row("parameters (model)", f"{total:,}")
    layout.add_row(f"parameters per rank (stage {mem.stage}, the busiest)", f"{mem.params:,}")
    layout.add_row("attention kernel", f"{kernel} on {device}: {plan.ATTENTION_KERNELS[kernel]}")
    o = recipe.optim
    warmup = o.warmup_steps(t.iters)
    source = "optim.warmup_iters" if o.warmup_iters is not None else (
        f"optim.warmup_fraction {o.warmup_fraction:g} of {o.decay_horizon(t.iters):,}" if o.warmup_fraction else "none given")
    layout.add_row("learning-rate warmup", f"{warmup:,} steps ({source}), then {o.decay_style} decay")
    layout.add_row("training FLOPs per step", f"{plan.flops_per_token(recipe, counts.active) * recipe.tokens_per_step:.3e}")
    console.print(layout)

    w, g, o = plan.bytes_per_param(t.precision, bf16_grads=t.grad_reduce_in_bf16)
    memory = Table(title=f"memory per rank (pipeline stage {mem.stage} of {p.pipeline}, the busiest; {t.precision})")
    memory.add_column("what")
    memory.add_column("GiB", justify="right")
    memory.add_column("how")
    memory.add_row("weights", f"{mem.weights_gib:.3f}", f"{w} B/param")
    memory.add_row("gradients", f"{mem.grads_gib:.3f}", f"{g} B/param")
    dp = recipe.data_parallel_size
    memory.add_row("optimizer (Adam + fp32 master)" if t.precision != "fp32" else "optimizer (Adam)",
                   f"{mem.optimizer_gib:.3f}",
                   f"{o}/{dp} B/param (distributed optimizer)" if p.distributed_optimizer else f"{o} B/param")
    memory.add_row("  without distributed optimizer", f"{mem.optimizer_gib_without_dist_opt:.3f}", f"{o} B/param")
    memory.add_row("  with distributed optimizer", f"{mem.optimizer_gib_with_dist_opt:.3f}",
                   f"{o}/{dp} B/param" + (f" ({o}/{recipe.expert_data_parallel_size} for experts)" if m.moe else ""))
    per = 24 + plan.unsplit_activation_factor(recipe, device=device)
    masks = "" if m.dropout > 0 else ", no dropout masks"
    scores = f"sbh({per}+5as/h{masks})" if kernel == "math" else f"sbh·{per} ({kernel} attention stores no 5as/h scores{masks})"
    memory.add_row("activations", f"{mem.activations_gib:.3f}",
                   f"{scores} per layer, {_act_form(recipe, device)}, × in-flight layers")
    logits_how = "8·s·b·V/t (fp32 softmax, then gradient, + a masked copy)" if t.precision == "fp32" else \
        "6·s·b·V/t (16-bit logits + fp32 softmax)"
    memory.add_row("logits at the loss", f"{mem.logits_gib:.3f}", logits_how if p.pipeline == 1 else
                   f"{logits_how}, on the last stage only" if mem.stage == p.pipeline - 1 else "on the last stage only")
    if recipe.preference is not None:
        memory.add_row("reference model", f"{mem.reference_gib:.3f}", _reference_how(recipe.preference, w))
    memory.add_row("total", f"{mem.total_gib:.3f}", "")
    console.print(memory)


def _reference_how(pref, weight_bytes: int) -> str:
    if pref.loss == "simpo":
        return "none (simpo needs no reference model)"
    return {"copy": f"a frozen copy of the weights, {weight_bytes} B/param; micro-batches hold 2 sequences per pair",
            "precompute": "none while training (scored once before, cached under run.dir)",
            "base": "none (the LoRA model with its adapters switched off)"}[pref.reference]


def _stages(recipe) -> str:
    """Layers of each pipeline stage as a list, with the model chunks under interleaving."""
    p = recipe.parallel
    counts = recipe.layers_per_stage
    text = "[" + ", ".join(map(str, counts)) + "]"
    if p.first_stage_layers is not None or p.last_stage_layers is not None:
        text += " (uneven: " + ", ".join(f"parallel.{name} = {n}" for name, n in (
            ("first_stage_layers", p.first_stage_layers), ("last_stage_layers", p.last_stage_layers)) if n is not None) + ")"
    if p.virtual_pipeline:
        text += f"; {p.virtual_pipeline} chunks per stage of [" + ", ".join(str(n // p.virtual_pipeline) for n in counts) + "] layers"
    return text


def _act_form(recipe, device: str) -> str:
    from megacli.plan import unsplit_activation_factor

    p = recipe.parallel
    if p.recompute == "full":
        return "full recompute: 2sbh" + ("/t" if p.sp_enabled else "")
    if p.sp_enabled:
        return "TP+SP: /t" + (" selective recompute: no 5as/h term" if p.recompute == "selective" else "")
    if p.tensor > 1:
        return f"TP: sbh({unsplit_activation_factor(recipe, device=device)}+24/t+5as/(ht))" + (" selective: no 5as/h term" if p.recompute == "selective" else "")
    return "no parallelism" + (", selective recompute: no 5as/h term" if p.recompute == "selective" else "")
