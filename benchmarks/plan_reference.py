"""`megacli plan` against outside references, printing the markdown tables of docs/planning.md:

- memory: Megatron-LM's own formula (megatron/training/theoretical_memory_usage.py of a Megatron-LM
  checkout, run as it is: ``--megatron-lm PATH``, e.g. a clone at tag core_v0.16.1) against megacli
  plan's fullest rank, on published configurations;
- published runs: where the published layout of Megatron-LM's README model table (H100, sequence
  4096, vocabulary 131,072) ranks among megacli plan's layouts for the same model, GPU count and
  batch, and the predicted against the published TFLOP/s per GPU.

    python benchmarks/plan_reference.py --megatron-lm ~/src/Megatron-LM     # both tables
    python benchmarks/plan_reference.py                                     # published runs only
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MB = 1024 * 1024
# Megatron-LM README (core_v0.16.1), images/model_table.png: H100 80GB, sequence 4096, vocabulary
# 131,072. (name, heads, hidden, layers, TP, PP, DP, GPUs, global batch, TFLOP/s per GPU, MFU)
README_RUNS = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8, 0.41),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9, 0.47),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1, 0.49),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6, 0.46),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7, 0.42),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5, 0.43),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8, 0.44),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4, 0.48),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9, 0.47),
]
# Korthikanti et al. 2022, Table 3 (sequence 2048, vocabulary 51,200, selective recompute + SP,
# micro-batch 1 (22B: 4)), and GPT-3 175B from Narayanan et al. 2021 (TP8 PP12, plain recompute off).
PAPER_CONFIGS = [  # (name, heads, hidden, layers, TP, PP, GPUs, global batch, micro-batch, recompute)
    ("22B (Korthikanti)", 64, 6144, 48, 8, 1, 8, 4, 4, "selective"),
    ("GPT-3 175B (Korthikanti)", 96, 12288, 96, 8, 8, 64, 64, 1, "selective"),
    ("530B (Korthikanti)", 128, 20480, 105, 8, 35, 280, 280, 1, "selective"),
    ("1T (Korthikanti)", 160, 25600, 128, 8, 64, 512, 512, 1, "selective"),
]


def gpt_recipe(heads, hidden, layers, *, seq, vocab, tp, pp, gpus, batch, micro, recompute="none", dist_opt=True):
    from megacli.recipe.jobs import load_job_recipe

    nproc, nnodes = (gpus, 1) if gpus <= 8 else (8, gpus // 8)
    sets = [f"model.num_attention_heads={heads}", f"model.hidden_size={hidden}", f"model.num_layers={layers}",
            f"model.ffn_hidden_size={4 * hidden}", f"model.seq_length={seq}", f"model.max_position_embeddings={seq}",
            f"model.vocab_size={vocab}", "model.make_vocab_size_divisible_by=128", f"parallel.tensor={tp}",
            f"parallel.pipeline={pp}", f"parallel.recompute={recompute}", f"parallel.distributed_optimizer={str(dist_opt).lower()}",
            f"train.global_batch_size={batch}", f"train.micro_batch_size={micro}", "train.precision=bf16",
            f"launch.nproc={nproc}", f"launch.nnodes={nnodes}", "launch.device=cuda", "tokenizer.type=none",
            "parallel.overlap_grad_reduce=true", f"parallel.overlap_param_gather={str(dist_opt).lower()}",
            "model.dropout=0.1"]  # GPT-3 and the Megatron papers train with hidden dropout 0.1
    return load_job_recipe("pretrain", ROOT / "recipes" / "gpt2_1.3b.yaml", sets)


def load_megatron_formula(checkout: Path):
    """megatron/training/theoretical_memory_usage.py of ``checkout``, imported on its own (its only
    import, ``.utils.print_rank_0``, given as print), so that no part of Megatron-LM's training
    package (and no torch) is needed to run it."""
    package = types.ModuleType("mlm_training")
    package.__path__ = []
    utils = types.ModuleType("mlm_training.utils")
    utils.print_rank_0 = lambda *a, **k: None
    sys.modules.update({"mlm_training": package, "mlm_training.utils": utils})
    path = checkout / "megatron" / "training" / "theoretical_memory_usage.py"
    spec = importlib.util.spec_from_file_location("mlm_training.theoretical_memory_usage", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def megatron_args(recipe, padded_vocab: int):
    m, p = recipe.model, recipe.parallel
    return argparse.Namespace(
        kv_channels=m.head_dim, num_attention_heads=m.num_attention_heads, hidden_size=m.hidden_size,
        group_query_attention=m.query_groups != m.num_attention_heads, num_query_groups=m.query_groups,
        num_experts=None, swiglu=m.gated, moe_shared_expert_intermediate_size=None, moe_layer_freq=1,
        num_layers=m.num_layers, moe_ffn_hidden_size=None, mtp_num_layers=None,
        normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm", multi_latent_attention=False,
        ffn_hidden_size=m.ffn_size, padded_vocab_size=padded_vocab, untie_embeddings_and_output_weights=m.untie_embeddings,
        pipeline_model_parallel_size=p.pipeline, tensor_model_parallel_size=p.tensor,
        use_distributed_optimizer=p.distributed_optimizer, data_parallel_size=recipe.data_parallel_size,
        seq_length=m.seq_length, micro_batch_size=recipe.train.micro_batch_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline, is_hybrid_model=False,
        sequence_parallel=p.sp_enabled, recompute_granularity=None if p.recompute == "none" else p.recompute)


def compare_memory(checkout: Path) -> None:
    from megacli import plan
    from megacli.recipe.model import padded_vocab_size

    formula = load_megatron_formula(checkout)
    print("| configuration | layout | Megatron-LM weights+optimizer MB | megacli MB | diff | Megatron-LM activations MB | megacli MB | diff |")
    print("|---|---|---|---|---|---|---|---|")
    configs = [(name, gpt_recipe(h_, hid, l, seq=2048, vocab=51200, tp=tp, pp=pp, gpus=g, batch=b, micro=mb,
                                 recompute=rc, dist_opt=False)) for name, h_, hid, l, tp, pp, g, b, mb, rc in PAPER_CONFIGS]
    configs += [(f"README {row[0]}", gpt_recipe(*row[1:4], seq=4096, vocab=131072, tp=row[4], pp=row[5], gpus=row[7],
                                                batch=row[8], micro=1, recompute="selective")) for row in README_RUNS]
    for name, recipe in configs:
        vocab = recipe.model.vocab_size
        padded = padded_vocab_size(vocab, divisible_by=recipe.model.make_vocab_size_divisible_by, tensor_parallel=recipe.parallel.tensor)
        args = megatron_args(recipe, padded)
        theirs_state = formula.compute_weight_and_optimizer_memory(args) / MB
        act_fn = formula.compute_activation_memory if args.sequence_parallel and args.recompute_granularity == "selective" \
            else formula.compute_activation_memory_without_sp
        theirs_act = act_fn(args, num_microbatches=recipe.num_microbatches) / MB
        counts = plan.count_params(recipe, vocab)
        first = plan.stage_memory(recipe, counts, vocab, 0, device="cuda")  # Megatron-LM's formula: the first stage
        ours_state = (first.weights_gib + first.grads_gib + first.optimizer_gib) * 1024
        ours_act = (first.activations_gib + first.logits_gib) * 1024
        p = recipe.parallel
        layout = f"TP{p.tensor} PP{p.pipeline} DP{recipe.data_parallel_size} mbs {recipe.train.micro_batch_size}" \
                 f"{' dist-opt' if p.distributed_optimizer else ''}"
        print(f"| {name} | {layout} | {theirs_state:,.0f} | {ours_state:,.0f} | {ours_state / theirs_state - 1:+.1%} "
              f"| {theirs_act:,.0f} | {ours_act:,.0f} | {ours_act / theirs_act - 1:+.1%} |")


def published_runs() -> None:
    from megacli.planner import layout_of, plan_layouts
    from megacli.planner.gpus import GPUS

    gpu = GPUS["h100-80gb"]
    print("| model | GPUs | published layout | its rank | predicted TFLOP/s/GPU (its layout) | published | ratio "
          "| megacli's top layout | predicted TFLOP/s/GPU (top) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops, mfu in README_RUNS:
        recipe = gpt_recipe(heads, hidden, layers, seq=4096, vocab=131072, tp=tp, pp=pp, gpus=gpus, batch=batch, micro=1)
        found = plan_layouts(recipe, 131072, gpus=gpus, gpu=gpu, gpus_per_node=8)
        matching = [(i, r) for i, r in enumerate(found.rows) if r.fits and (r.layout["tensor"], r.layout["pipeline"],
                    r.layout["data"], r.layout["virtual_pipeline"], r.layout["context"]) == (tp, pp, dp, None, 1)]
        top = found.rows[0]
        top_text = _short(layout_of(top.recipe))
        top_tflops = top.time.model_flops / top.time.seconds / gpus / 1e12
        if not matching:
            print(f"| {name} | {gpus} | TP{tp} PP{pp} DP{dp} | does not fit | – | {tflops} | – | {top_text} | {top_tflops:.0f} |")
            continue
        rank, row = matching[0]
        ours = row.time.model_flops / row.time.seconds / gpus / 1e12
        print(f"| {name} | {gpus} | TP{tp} PP{pp} DP{dp} | #{rank + 1} of {len(found.fitting)} ({_short(row.layout, full=False)}) "
              f"| {ours:.0f} | {tflops} | {ours / tflops:.2f} | {top_text} | {top_tflops:.0f} |")


def _short(layout: dict, full: bool = True) -> str:
    from megacli.planner.advice import layout_text

    extra = f"mbs {layout['micro_batch_size']}, {layout['recompute']}" + (", dist-opt" if layout["distributed_optimizer"] else "")
    return f"{layout_text(layout)}, {extra}" if full else extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout (tag core_v0.16.1) for the memory table")
    args = ap.parse_args()
    if args.megatron_lm:
        compare_memory(args.megatron_lm)
        print()
    published_runs()


if __name__ == "__main__":
    main()
