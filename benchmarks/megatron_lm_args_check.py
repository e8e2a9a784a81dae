"""By hand, beside the project: megacli's Megatron-LM ``args`` against Megatron-LM's own ``parse_args``.

    python benchmarks/megatron_lm_args_check.py MEGATRON_LM_CHECKOUT

1. ``parse_args`` with no options: every field name and default against
   megacli.checkpoint.megatron_lm_args.PARSE_ARGS_DEFAULTS;
2. ``parse_args`` + ``validate_args`` for a small GPT given on the command line, against
   ``megatron_args`` of the same model as a megacli recipe: field names, and the values of every
   field (a difference is printed with both values).
"""

from __future__ import annotations

import os
import sys
import types

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16", "--max-position-embeddings", "16",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "0.003", "--min-lr", "0.0003", "--lr-decay-style", "cosine",
        "--weight-decay", "0.1", "--adam-beta2", "0.95", "--make-vocab-size-divisible-by", "64",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "262", "--mock-data", "--ckpt-format", "torch_dist",
        "--transformer-impl", "local", "--seed", "1234"]
RECIPE = ["data.mock=true", "tokenizer.type=byte", "model.num_layers=2", "model.hidden_size=32",
          "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.seq_length=16",
          "model.activation=swiglu", "model.normalization=rmsnorm", "model.position_embedding=rope",
          "model.untie_embeddings=true", "model.add_bias_linear=false", "model.make_vocab_size_divisible_by=64",
          "train.iters=2", "train.micro_batch_size=1", "train.global_batch_size=2", "optim.lr=0.003",
          "optim.min_lr=0.0003", "optim.decay_style=cosine", "optim.weight_decay=0.1", "optim.adam_beta2=0.95",
          "train.seed=1234"]


def main() -> None:
    checkout = sys.argv[1]
    sys.path.insert(0, checkout)
    stub = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    stub.enable_batch_invariant_mode = lambda *a, **k: None  # triton kernels a CPU-only torch cannot import
    sys.modules[stub.__name__] = stub
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    import contextlib
    import io

    from megatron.training.arguments import parse_args, validate_args

    from megacli.checkpoint.megatron_lm_args import PARSE_ARGS_DEFAULTS, megatron_args
    from megacli.recipe.base import apply_overrides, validate
    from megacli.recipe.pretrain import TrainingRecipe

    sys.argv = ["pretrain_gpt.py"]
    defaults = vars(parse_args())
    theirs = {k: getattr(v, "name", v) for k, v in defaults.items()}
    print(f"1. parse_args defines {len(theirs)} fields, megacli's table {len(PARSE_ARGS_DEFAULTS)}")
    print(f"   only in Megatron-LM: {sorted(set(theirs) - set(PARSE_ARGS_DEFAULTS))}")
    print(f"   only in megacli: {sorted(set(PARSE_ARGS_DEFAULTS) - set(theirs))}")
    print(f"   defaults that differ: { {k: (PARSE_ARGS_DEFAULTS[k], theirs[k]) for k in theirs if k in PARSE_ARGS_DEFAULTS and PARSE_ARGS_DEFAULTS[k] != theirs[k]} }")

    sys.argv = ["pretrain_gpt.py", *ARGV]
    args = parse_args()
    with contextlib.redirect_stdout(io.StringIO()):
        validate_args(args, {})
    mlm = vars(args)
    recipe = validate(TrainingRecipe, apply_overrides({}, RECIPE), "check recipe")
    ours = vars(megatron_args(recipe, padded_vocab_size=320, vocab_size=262, transformer_impl="local"))
    print(f"2. after validate_args: Megatron-LM {len(mlm)} fields, megacli {len(ours)}")
    print(f"   only in Megatron-LM: {sorted(set(mlm) - set(ours))}")
    print(f"   only in megacli (set by training, not by parse/validate): {sorted(set(ours) - set(mlm))}")
    differ = {k: (ours[k], mlm[k]) for k in mlm if k in ours and ours[k] != mlm[k]}
    print(f"   values that differ (megacli, Megatron-LM): {len(differ)}")
    for k, (a, b) in sorted(differ.items()):
        print(f"     {k}: {a!r} vs {b!r}")


if __name__ == "__main__":
    main()
