"""By hand, beside the project: megacli's Megatron-LM ``args`` against Megatron-LM's own ``parse_args``.

    python benchmarks/megatron_lm_args_check.py MEGATRON_LM_CHECKOUT [--write-defaults]

The checkout is core_v0.16.1 (run with Megatron-Core 0.16) or core_v0.19.x (Megatron-Core 0.19);
megacli's table is then that release's (megacli.checkpoint.megatron_lm.args.parse_args_defaults).
``--write-defaults`` first writes, from the checkout, megacli/checkpoint/megatron_lm/defaults.json
(a core_v0.16.1 checkout: every field ``parse_args`` defines with its default, enums by member name),
or the checkout's release's entry of defaults_since.json (a later one: the fields it removed, its new
and changed defaults), then checks.

1. ``parse_args`` with no options: every field name and default against
   megacli.checkpoint.megatron_lm.args.parse_args_defaults();
2. ``parse_args`` + ``validate_args`` for a small GPT given on the command line (bf16, fp16, fp32), against
   ``megatron_args`` of the same model as a megacli recipe: field names, and the values of every
   field (a difference is printed with both values);
3. every row of FLAGS (the docs' flag table, docs/megatron-lm/flags.md): its spelling is an option
   string of the parser ``parse_args`` builds, the option's ``dest`` is the row's field, a switch
   stores True, or False for a row marked ``off`` (and parsing the option alone gives that value),
   a value option takes a value; the row read from the environment (WORLD_SIZE) is read by
   ``parse_args``; then every ``--option`` the "Coming from Megatron-LM" pages (docs/megatron-lm/)
   name that the parser lacks;
4. megacli preprocess's Megatron-LM spellings (megacli/cli/megatron_spellings.py) against
   tools/preprocess_data.py's parser: the options it accepts and the tokenizer types it maps are
   the checkout's, and which of the options it refuses by name the checkout has.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import types
from pathlib import Path

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
        "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16", "--max-position-embeddings", "16",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "2", "--lr", "0.003", "--min-lr", "0.0003", "--lr-decay-style", "cosine",
        "--weight-decay", "0.1", "--adam-beta2", "0.95", "--make-vocab-size-divisible-by", "64",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "261", "--mock-data", "--ckpt-format", "torch_dist",
        "--transformer-impl", "local", "--seed", "1234",
        # megacli's defaults where they are not Megatron-LM's (NullTokenizer adds its end-of-document id: 262)
        "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16", "--eval-interval", "100", "--eval-iters", "10",
        "--initial-loss-scale", "65536", "--log-interval", "10", "--lr-decay-iters", "2", "--split", "969,30,1"]
RECIPE = ["data.mock=true", "tokenizer.type=byte", "model.num_layers=2", "model.hidden_size=32",
          "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.seq_length=16",
          "model.activation=swiglu", "model.normalization=rmsnorm", "model.position_embedding=rope",
          "model.untie_embeddings=true", "model.add_bias_linear=false", "model.make_vocab_size_divisible_by=64",
          "train.iters=2", "train.micro_batch_size=1", "train.global_batch_size=2", "optim.lr=0.003",
          "optim.min_lr=0.0003", "optim.decay_style=cosine", "optim.weight_decay=0.1", "optim.adam_beta2=0.95",
          "train.seed=1234"]


def main() -> None:
    from megatron_lm_checkout import checkout_release

    checkout = sys.argv[1]
    release = checkout_release(checkout)
    print(f"checkout: Megatron-LM {release}")
    write_defaults = "--write-defaults" in sys.argv[2:]
    sys.path.insert(0, checkout)
    stub = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    stub.enable_batch_invariant_mode = lambda *a, **k: None  # triton kernels a CPU-only torch cannot import
    sys.modules[stub.__name__] = stub
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    import contextlib
    import io

    from megatron.training.arguments import parse_args, validate_args

    from megacli.checkpoint.megatron_lm.args import parse_args_defaults
    from megacli.checkpoint.megatron_lm.args_namespace import megatron_args
    from megacli.recipe.base import apply_overrides, validate
    from megacli.recipe.pretrain import TrainingRecipe

    sys.argv = ["pretrain_gpt.py"]
    defaults = vars(parse_args())
    theirs = {k: getattr(v, "name", v) for k, v in defaults.items()}
    if write_defaults:
        write_defaults_file(release, theirs)
    print(f"1. parse_args defines {len(theirs)} fields, megacli's table {len(parse_args_defaults())}")
    print(f"   only in Megatron-LM: {sorted(set(theirs) - set(parse_args_defaults()))}")
    print(f"   only in megacli: {sorted(set(parse_args_defaults()) - set(theirs))}")
    print(f"   defaults that differ: { {k: (parse_args_defaults()[k], theirs[k]) for k in theirs if k in parse_args_defaults() and parse_args_defaults()[k] != theirs[k]} }")

    for precision in ("bf16", "fp16", "fp32"):
        argv = [a for a in ARGV if a != "--bf16"] + ([f"--{precision}"] if precision != "fp32" else [])
        sys.argv = ["pretrain_gpt.py", *argv]
        args = parse_args()
        with contextlib.redirect_stdout(io.StringIO()):
            validate_args(args, {})
        mlm = vars(args)
        recipe = validate(TrainingRecipe, apply_overrides({}, [*RECIPE, f"train.precision={precision}"]), "check recipe")
        ours = vars(megatron_args(recipe, padded_vocab_size=320, vocab_size=262, transformer_impl="local"))
        print(f"2. {precision}, after validate_args: Megatron-LM {len(mlm)} fields, megacli {len(ours)}")
        print(f"   only in Megatron-LM: {sorted(set(mlm) - set(ours))}")
        print(f"   only in megacli (set by training, not by parse/validate): {sorted(set(ours) - set(mlm))}")
        differ = {k: (ours[k], mlm[k]) for k in mlm if k in ours and ours[k] != mlm[k]}
        print(f"   values that differ (megacli, Megatron-LM; padded_vocab_size is set by training): {len(differ)}")
        for k, (a, b) in sorted(differ.items()):
            print(f"     {k}: {a!r} vs {b!r}")

    check_flags(parse_args, release)
    check_preprocess_spellings(checkout, release)


def write_defaults_file(release: str, theirs: dict) -> None:
    import json

    from megacli.checkpoint.megatron_lm import args as megatron_lm_args

    minor = release.rsplit(".", 1)[0]
    if minor == megatron_lm_args.DEFAULTS_RELEASE:
        path, text = megatron_lm_args._DEFAULTS_FILE, theirs
    else:
        base = json.loads(megatron_lm_args._DEFAULTS_FILE.read_text())
        path = megatron_lm_args._DEFAULTS_SINCE_FILE
        text = json.loads(path.read_text())
        text[minor] = {"removed": sorted(set(base) - set(theirs)),
                       "defaults": {k: v for k, v in theirs.items() if k not in base or base[k] != v}}
    path.write_text(json.dumps(text, indent=1, sort_keys=True) + "\n")
    megatron_lm_args.parse_args_defaults.cache_clear()
    print(f"wrote {path}")


def _switch(action) -> bool | None:
    """True / False for a store_true / store_false option, None for one that takes a value."""
    if isinstance(action, argparse._StoreTrueAction):
        return True
    if isinstance(action, argparse._StoreFalseAction):
        return False
    return None


def check_flags(parse_args, release: str) -> None:
    from megatron.training.arguments import add_megatron_arguments

    from megacli.checkpoint.megatron_lm.args import FLAGS

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    options = {o: a for a in parser._actions for o in a.option_strings}
    bad = []
    for f in FLAGS:
        if f.from_environment:
            os.environ[f.option], saved = "3", os.environ.get(f.option)
            sys.argv = ["pretrain_gpt.py"]
            got = getattr(parse_args(), f.arg)
            os.environ[f.option] = saved
            if got != 3:
                bad.append(f"{f.option}: parse_args does not read {f.arg} from it ({got!r})")
            continue
        action = options.get(f.option)
        if action is None:
            bad.append(f"{f.option}: no such option")
            continue
        if action.dest != f.arg:
            bad.append(f"{f.option}: sets {action.dest}, the row names {f.arg}")
        switch, want = _switch(action), not f.off
        if switch is None:
            if f.off or action.nargs == 0:
                bad.append(f"{f.option}: {type(action).__name__}, the row implies a switch")
            continue
        if switch != want:
            bad.append(f"{f.option}: stores {switch}, the row implies {want}")
        sys.argv = ["pretrain_gpt.py", f.option]
        if getattr(parse_args(), f.arg) is not want:
            bad.append(f"{f.option}: parse_args gives {f.arg}={not want}")
    switches = sum(1 for f in FLAGS if not f.from_environment and _switch(options.get(f.option)) is not None)
    print(f"3. FLAGS: {len(FLAGS)} rows ({switches} switches, "
          f"{sum(f.off for f in FLAGS)} of them off, {sum(f.from_environment for f in FLAGS)} from the environment)")
    print(f"   rows that are not Megatron-LM {release}'s option for their field: {len(bad)}")
    for line in bad:
        print(f"     {line}")
    pages = sorted((Path(__file__).resolve().parent.parent / "docs" / "megatron-lm").glob("*.md"))
    text = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    named = sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)) - set(options))
    print(f"   --options the Coming from Megatron-LM pages name that Megatron-LM {release}'s parser lacks (megacli's own): {named}")


def check_preprocess_spellings(checkout: str, release: str) -> None:
    import importlib.util

    from megacli.cli import _register, app
    from megacli.cli.megatron_spellings import MEGATRON_ONLY, MEGATRON_TOKENIZERS, NOT_THE_SAME, lacking_in

    class Built(Exception):
        pass

    def capture(self, *a, **k):
        raise Built(self)

    spec = importlib.util.spec_from_file_location("preprocess_data", os.path.join(checkout, "tools", "preprocess_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    real, argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_args, capture
    try:
        module.get_args()
    except Built as built:
        parser = built.args[0]
    finally:
        argparse.ArgumentParser.parse_args = real
    options = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}
    types_ = next(a for a in parser._actions if a.dest == "tokenizer_type").choices

    import typer

    _register()
    group = typer.main.get_command(app).commands["preprocess"]
    ours = {o for p in group.commands["run"].params for o in p.opts if o.startswith("--")}
    print(f"4. preprocess_data.py: {len(options)} options; megacli preprocess {len(ours)}")
    print(f"   megacli options spelled as Megatron-LM's: {sorted(ours & set(options))}")
    print(f"   Megatron-LM's options megacli neither has nor refuses by name: "
          f"{sorted(set(options) - ours - set(MEGATRON_ONLY) - {'--help'})}")
    print(f"   refused by name, Megatron-LM {release} has them: {sorted(set(MEGATRON_ONLY) & set(options))}")
    lacking = set(MEGATRON_ONLY) - set(options)
    print(f"   refused by name, Megatron-LM {release} lacks them: {sorted(lacking)}; "
          f"the refusal says so for exactly these: {lacking == lacking_in(release)}")
    named = set(MEGATRON_TOKENIZERS) | set(NOT_THE_SAME)
    print(f"   tokenizer types megacli names that Megatron-LM {release} lacks: {sorted(named - set(types_))}")
    print(f"   Megatron-LM {release}'s tokenizer types megacli does not name (refused as unknown): {sorted(set(types_) - named)}")


if __name__ == "__main__":
    main()
