"""The conversions: Hugging Face ⇄ megacli, Megatron-LM (torch_dist or legacy) -> Hugging Face or megacli.

A converted megacli checkpoint directory:

    DST/latest, DST/iter_NNNNNNN/   weights-only torch_dist checkpoint + recipe.yaml + megacli.json
    DST/hf/                         the source's config.json, generation_config.json and tokenizer
                                    files (the recipe's tokenizer.path names them relatively, ../hf;
                                    export reads the config)

Everything is written into a sibling ``.DST.partial`` directory and renamed into place at the end,
so a failed conversion leaves no half-written destination.
"""

from __future__ import annotations

import contextlib
import math
import shutil
from pathlib import Path
from typing import Callable, Iterable

from megacli.checkpoint.layout import HF_DIR, LATEST, META, TRACKER, carried_hf_dir, from_iteration, iter_name
from megacli.checkpoint.replace import check_replaceable
from megacli.checkpoint.source import Source
from megacli.convert import hf_io
from megacli.checkpoint.hf_config import read_config
from megacli.errors import UserError
from megacli.precision import DTYPES, params_dtype, precision_of
from megacli.recipe.stages import pick_split

FORMATS = ("hf", "megacli", "megatron-lm", "legacy")
CARRIED_REF = Path(from_iteration())  # how a converted checkpoint's recipe.yaml names DST/hf (megacli.checkpoint.carried)
PRECISIONS = tuple(DTYPES)
_HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

Say = Callable[[str], None]


def resolve_source(source: Source) -> Source:
    """What a conversion reads, recognised (megacli.checkpoint.source), its recipe read for a megacli checkpoint."""
    path = source.path
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    if source.kind is None:
        raise UserError(f"{path}: not a Hugging Face model directory (config.json), a megacli checkpoint ({META} or "
                        f"{LATEST}) or a Megatron-LM checkpoint ({TRACKER}, an iter_* directory with .metadata and "
                        f"common.pt or metadata.json, or mp_rank_* directories)")
    if source.kind == "megacli":
        source.recipe  # noqa: B018 - a bad recipe.yaml is refused before anything is written
    return source


def convert(source: Source, dst: str | Path, *, to: str | None = None, parallel=None, dtype: str | None = None,
            max_shard_size: str | int = "2GB", say: Say = print) -> Path:
    """Convert ``source`` (format detected) to ``to`` (default: megacli for HF and Megatron-LM sources, hf
    for megacli checkpoints) under ``dst``. ``parallel`` (a ParallelSection) is the layout a megacli
    checkpoint is prepared for. Returns ``dst``."""
    from megacli.recipe.sections import ParallelSection

    src, dst = source.path.expanduser(), Path(dst).expanduser()
    source = resolve_source(source.at(src))
    fmt = source.kind
    to = to or ("hf" if fmt == "megacli" else "megacli")
    if to not in ("hf", "megacli"):
        raise UserError(f"--to {to!r}: expected hf or megacli (Megatron-LM checkpoints are written through reshard: "
                        f"`megacli convert SRC DST --to megatron`)")
    if to == fmt and source.lora_base is None:
        hint = " (to change a megacli checkpoint's layout, just load it under the new one)" if fmt == "megacli" else ""
        raise UserError(f"{src} is already a {fmt} checkpoint{hint}")
    if dtype is not None and dtype not in PRECISIONS:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(PRECISIONS)}")
    parallel = parallel or ParallelSection()
    hf_io.parse_size(max_shard_size)  # fail on a bad size before any work
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UserError(f"{dst} exists and is not empty; choose a new or empty directory")
    check_replaceable(dst, reads=[src])  # an empty one may still be the working directory
    final = dst.resolve()
    work = final.parent / f".{final.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    made = [d for d in (final.parent, *final.parent.parents) if not d.exists()]  # removed again on failure
    work.mkdir(parents=True)
    try:
        if fmt == "hf":
            _hf_to_megacli(source, work, final, parallel=parallel, dtype=dtype, say=say)
        elif fmt == "megacli" and to == "megacli":
            _merge_lora(source, work, final, parallel=parallel, dtype=dtype, say=say)
        elif fmt == "megacli":
            _megacli_to_hf(source, work, dtype=dtype, max_shard_size=max_shard_size, say=say)
        else:
            if fmt == "legacy":
                from megacli.checkpoint.megatron_lm.legacy_reader import LegacyCheckpoint

                legacy, label = LegacyCheckpoint(source), "Megatron-LM legacy"
            else:
                from megacli.convert.megatron_io import MegatronLMWeights

                legacy, label = MegatronLMWeights(source), "Megatron-LM torch_dist"
            if to == "hf":
                _legacy_to_hf(legacy, work, dtype=dtype, max_shard_size=max_shard_size, say=say, label=label)
            else:
                _legacy_to_megacli(legacy, work, final, parallel=parallel, dtype=dtype, say=say, label=label)
        if dst.exists():
            dst.rmdir()
        work.replace(final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    return final


# ---------------------------------------------------------------- into megacli


def converted_recipe(*, model: dict, parallel, precision: str, tokenizer: dict, resume: Path):
    """The recipe a converted checkpoint carries: the model, its target layout, the tokenizer, and
    a checkpoint section that starts from these weights (no optimizer state)."""
    from megacli.recipe.base import validate
    from megacli.recipe.pretrain import TrainingRecipe

    pp = parallel.pipeline
    layout = parallel.model_dump()
    if parallel.first_stage_layers is None and parallel.last_stage_layers is None and model.get("num_layers"):
        # layers that do not split evenly over PP: a split Megatron-Core accepts (pipeline_split says which)
        first, last = pick_split(model["num_layers"], pp, parallel.virtual_pipeline) or (None, None)
        layout.update(first_stage_layers=first, last_stage_layers=last)
    if model.get("moe") and parallel.tensor > 1:
        layout["sequence_parallel"] = True  # Megatron-Core's MoE layers need it under tensor parallelism
    raw = {
        "model": model,
        "parallel": layout,
        "launch": {"nproc": parallel.tensor * pp * parallel.context},
        "tokenizer": tokenizer,
        # One sequence per micro-batch; a global batch the interleaved schedule accepts at this PP.
        "train": {"precision": precision, "micro_batch_size": 1, "global_batch_size": pp * math.ceil(8 / pp)},
        "checkpoint": {"resume": str(resume), "load_optimizer": False},
    }
    if model["arch"] != "gpt":  # no mock data for BERT/T5: name the dataset to set before training
        raw["data"] = {"path": "SET/data.path/TO/A/PREFIX_text_sentence"}
    else:
        raw["data"] = {"mock": True}
    return validate(TrainingRecipe, raw, "the converted checkpoint's recipe")


def pipeline_split(recipe, *, asked) -> str:
    """The written recipe's layers per pipeline stage, and why when convert chose an uneven split."""
    p, n = recipe.parallel, recipe.model.num_layers
    text = f"layers per pipeline stage: {recipe.layers_per_stage}"
    picked = (p.first_stage_layers, p.last_stage_layers)
    if (asked.first_stage_layers, asked.last_stage_layers) == (None, None) and picked != (None, None):
        chosen = " and ".join(f"parallel.{name} = {v}" for name, v in zip(("first_stage_layers", "last_stage_layers"), picked)
                              if v is not None)
        text += (f" ({n} layers do not split evenly over PP={p.pipeline}; chose {chosen} in recipe.yaml, "
                 f"--set parallel.first_stage_layers=N / last_stage_layers=N picks another)")
    return text


def tokenizer_section(folder: Path, copied: list[str]) -> dict:
    """The recipe's tokenizer for a Hugging Face directory holding the ``copied`` tokenizer files."""
    if "tokenizer.json" in copied:
        return {"type": "huggingface", "path": str(folder)}
    if "tokenizer.model" in copied:
        return {"type": "sentencepiece", "path": str(folder / "tokenizer.model")}
    return {"type": "none"}


def _hf_to_megacli(source: Source, work: Path, final: Path, *, parallel, dtype: str | None,
                   say: Say) -> None:
    from megacli.checkpoint.writer import write_checkpoint

    src = source.path
    hf_dir = work / HF_DIR
    hf_dir.mkdir()
    shutil.copy2(src / hf_io.CONFIG, hf_dir / hf_io.CONFIG)
    if (src / hf_io.GENERATION_CONFIG).is_file():
        shutil.copy2(src / hf_io.GENERATION_CONFIG, hf_dir / hf_io.GENERATION_CONFIG)
    copied = hf_io.copy_tokenizer_files(src, hf_dir)
    tokenizer = tokenizer_section(CARRIED_REF, copied)
    plan, arch = hf_plan(source, parallel=parallel, dtype=dtype, tokenizer=tokenizer, resume=final, say=say)
    ckpt = write_checkpoint(plan, work, iter_name(0), with_manifest=True)
    p = plan.recipe.parallel
    say(f"{arch} -> megacli checkpoint {final / ckpt.name} ({plan.recipe.train.precision}; prepared for TP={p.tensor} "
        f"PP={p.pipeline}{f' VPP={p.virtual_pipeline}' if p.virtual_pipeline else ''}; loads under any layout)")
    say(pipeline_split(plan.recipe, asked=parallel))
    say(f"tokenizer: {tokenizer['type']}" + (f" ({', '.join(copied)})" if copied else " (the source has no tokenizer files)"))


def hf_plan(source: Source, *, parallel, dtype: str | None, tokenizer: dict, resume: Path, say: Say,
            per_rank_chunks: bool = False):
    """The checkpoint Plan of a Hugging Face model's weights (converted lazily, as the writer asks)
    under the recipe a conversion writes (``tokenizer``: its section; ``resume``: where the
    checkpoint will be), and the model's architecture. ``per_rank_chunks``: see weights_plan."""
    from megacli.convert import families
    from megacli.convert.mapping import unconsumed
    from megacli.convert.weights_plan import weights_plan

    src = source.path
    config = read_config(src / hf_io.CONFIG)
    family, arch = families.for_hf_config(config)
    model = family.model_section(config)
    for note in getattr(family, "import_notes", lambda _config: [])(config):
        say(f"note: {note}")
    weights = hf_io.HFWeights(source)
    precision = dtype or precision_of(weights.dtype())
    target = params_dtype(precision)
    recipe = converted_recipe(model=model, parallel=parallel, precision=precision, tokenizer=tokenizer, resume=resume)
    table = family.table(recipe.model)
    by_name = {table.normalize_hf(k): k for k in weights.keys()}

    def check_keys(megatron_keys: list[str]) -> None:
        needed = {h for k in megatron_keys for h in table.hf_keys_for(k)}
        missing = sorted(needed - set(by_name))
        if missing:
            raise UserError(f"{src}: tensors the {arch} mapping needs are missing: {', '.join(missing[:8])}"
                            f"{' ...' if len(missing) > 8 else ''} (config.json and the weights disagree?)")
        extra = unconsumed(by_name, needed, table)
        if extra:
            raise UserError(f"{src}: tensors no rule maps: {', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''} "
                            f"(a feature of this checkpoint the Megatron model does not have)")

    def fetch(key: str):
        return table.to_megatron(key, lambda name: weights.get(by_name[name])).to(target)

    plan = weights_plan(recipe=recipe, fetch=fetch, vocab_size=recipe.model.vocab_size, iteration=0,
                        check_keys=check_keys, per_rank_chunks=per_rank_chunks,
                        extra_meta={"converted_from": {"format": "hf", "path": str(src.resolve()), "architecture": arch}})
    return plan, arch


def hf_tokenizer_section(src: Path) -> dict:
    """The recipe's tokenizer for the tokenizer files of an HF directory, read where they are."""
    return tokenizer_section(src, [name for name in hf_io.TOKENIZER_FILES if (src / name).is_file()])


def _legacy_to_megacli(legacy, work: Path, final: Path, *, parallel, dtype: str | None, say: Say, label: str) -> None:
    """A Megatron-LM checkpoint (``legacy``: a LegacyCheckpoint or MegatronLMCheckpoint) -> megacli."""
    from megacli.checkpoint.writer import write_checkpoint
    from megacli.convert.weights_plan import weights_plan

    model = legacy.model_section()
    precision = dtype or precision_of(legacy.dtype())
    target = params_dtype(precision)
    hf_dir = work / HF_DIR
    copied = hf_io.copy_tokenizer_files(legacy.tokenizer_dir(), hf_dir) if legacy.tokenizer_dir() else []
    tokenizer = tokenizer_section(CARRIED_REF, copied)
    if legacy.wordpiece_vocab() is not None:
        hf_dir.mkdir(exist_ok=True)
        shutil.copy2(legacy.wordpiece_vocab(), hf_dir / "vocab.txt")
        copied, tokenizer = ["vocab.txt"], {"type": "wordpiece", "path": str(CARRIED_REF / "vocab.txt")}
    recipe = converted_recipe(model=model, parallel=parallel, precision=precision, tokenizer=tokenizer, resume=final)

    def check_keys(megatron_keys: list[str]) -> None:
        stored = set(legacy.canonical_keys())
        missing, extra = sorted(set(megatron_keys) - stored), sorted(stored - set(megatron_keys))
        if missing or extra:
            raise UserError(f"{legacy.it_dir}: the weights do not match the model its args describe"
                            + (f"; missing {', '.join(missing[:6])}" if missing else "")
                            + (f"; unexpected {', '.join(extra[:6])}" if extra else ""))

    plan = weights_plan(recipe=recipe, iteration=legacy.iteration, vocab_size=model["vocab_size"],
                        fetch=lambda key: legacy.get(key).to(target), check_keys=check_keys,
                        extra_meta={"converted_from": {"format": label.lower(), "path": str(legacy.root.resolve()),
                                                       "layout": {"tensor": legacy.tp, "pipeline": legacy.pp,
                                                                  "virtual_pipeline": legacy.vp}}})
    ckpt = write_checkpoint(plan, work, iter_name(legacy.iteration), with_manifest=True)
    say(f"{label} {model['arch'].upper()} checkpoint (TP={legacy.tp} PP={legacy.pp}, iteration "
        f"{legacy.iteration}) -> megacli checkpoint {final / ckpt.name} ({precision}; tokenizer: {tokenizer['type']})")
    say(pipeline_split(recipe, asked=parallel))


# ---------------------------------------------------------------- into Hugging Face


def _megacli_to_hf(source: Source, work: Path, *, dtype: str | None, max_shard_size,
                   say: Say) -> None:
    from megacli.convert.megatron_io import megatron_process

    ckpt, recipe = source.ckpt, source.recipe
    reader_of, what = _weights_of(source)
    carried = carried_hf_dir(ckpt, recipe.tokenizer.path)
    vocab, tokenizer = _vocab_of(ckpt, recipe)
    tok_files = carried if carried is not None else _tokenizer_source(recipe)
    with megatron_process():
        _export_hf(reader_of(), recipe.model, work, vocab=vocab, carried=carried, tokenizer=tokenizer,
                   tokenizer_src=tok_files, dtype=dtype, max_shard_size=max_shard_size, say=say, what=what)
    sp = Path(recipe.tokenizer.path or "")
    if recipe.tokenizer.type == "sentencepiece" and sp.is_file() and not (work / "tokenizer.model").exists():
        shutil.copy2(sp, work / "tokenizer.model")  # the name HF's SentencePiece tokenizers look for


def _weights_of(source: Source):
    """A reader of the checkpoint's full weights (made inside megatron_process()), and its description:
    a LoRA run's adapters are merged into its base weights."""
    from megacli.convert.megatron_io import CheckpointReader, MergedLoRA

    ckpt, base, recipe = source.ckpt, source.lora_base, source.recipe
    if base is None:
        return (lambda: CheckpointReader(source.at(ckpt))), f"megacli checkpoint {ckpt}"
    if recipe.lora is None:
        raise UserError(f"{ckpt} holds LoRA adapters but its recipe.yaml has no lora section (rank and alpha)")
    scale = recipe.lora.alpha / recipe.lora.rank
    return ((lambda: MergedLoRA(source.at(ckpt), base=base, scale=scale)),
            f"LoRA checkpoint {ckpt} merged into {base}")


def _vocab_of(ckpt: Path, recipe) -> tuple[int, object]:
    """The vocabulary size training used (model.vocab_size, else the tokenizer's; T5: with the
    sentinels training appended) and the tokenizer (None when there is none to load)."""
    vocab = recipe.model.vocab_size
    tokenizer = None
    if recipe.tokenizer.type != "none" and (recipe.tokenizer.path or recipe.tokenizer.type == "byte"):
        from megacli.data.tokenizers import load_tokenizer

        try:
            tokenizer = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path)
        except UserError as exc:
            if vocab is None:
                raise UserError(f"{ckpt / 'recipe.yaml'}: needs the tokenizer for the vocabulary size: {exc}") from None
    if vocab is None:
        from megacli.plan import model_vocab_size

        vocab = model_vocab_size(recipe, tokenizer)
    return vocab, tokenizer


def _merge_lora(source: Source, work: Path, final: Path, *, parallel, dtype: str | None,
                say: Say) -> None:
    """A LoRA run's checkpoint -> a full megacli checkpoint (adapters merged into the base weights),
    with the tokenizer files and HF config the run used."""
    from megacli.checkpoint.writer import write_checkpoint
    from megacli.convert.megatron_io import megatron_process
    from megacli.convert.weights_plan import weights_plan

    ckpt, recipe = source.ckpt, source.recipe
    reader_of, what = _weights_of(source)
    vocab, _ = _vocab_of(ckpt, recipe)
    with megatron_process():  # the merged weights held once, as an import holds them
        reader = reader_of()
        precision = dtype or precision_of(reader.dtype())
        tensors = {k: t for group in reader.groups() for k, t in group.items()}
    tokenizer = recipe.tokenizer.model_dump()
    hf = carried_hf_dir(ckpt, recipe.tokenizer.path)
    if hf is not None:
        for name in (hf_io.CONFIG, hf_io.GENERATION_CONFIG):
            if (hf / name).is_file():
                (work / HF_DIR).mkdir(exist_ok=True)
                shutil.copy2(hf / name, work / HF_DIR / name)
        copied = hf_io.copy_tokenizer_files(hf, work / HF_DIR)
        if copied:
            tokenizer = tokenizer_section(CARRIED_REF, copied)
    out = converted_recipe(model={**recipe.model.model_dump(), "vocab_size": vocab}, parallel=parallel, precision=precision,
                           tokenizer=tokenizer, resume=final)
    target = params_dtype(precision)
    plan = weights_plan(recipe=out, iteration=0, fetch=lambda key: tensors.pop(key).to(target), vocab_size=vocab,
                        extra_meta={"converted_from": {"format": "megacli lora", "path": str(ckpt.resolve())}})
    written = write_checkpoint(plan, work, iter_name(0), with_manifest=True)
    say(f"{what} -> megacli checkpoint {final / written.name} ({precision})")


def _tokenizer_source(recipe) -> Path | None:
    if recipe.tokenizer.type in ("huggingface", "sentencepiece") and recipe.tokenizer.path:
        p = Path(recipe.tokenizer.path)
        return p if p.is_dir() else p.parent
    return None


def _legacy_to_hf(legacy, work: Path, *, dtype: str | None, max_shard_size, say: Say, label: str) -> None:
    from megacli.data.tokenizers import load_tokenizer
    from megacli.recipe.model import ModelSection

    model = ModelSection(**legacy.model_section())
    tok_dir, wordpiece = legacy.tokenizer_dir(), legacy.wordpiece_vocab()
    tokenizer = None
    if tok_dir is not None:
        tokenizer = load_tokenizer(type="huggingface", path=str(tok_dir))
    elif wordpiece is not None:
        tokenizer = load_tokenizer(type="wordpiece", path=str(wordpiece))
    _export_hf(legacy, model, work, vocab=model.vocab_size, carried=None, tokenizer=tokenizer, tokenizer_src=tok_dir,
               dtype=dtype, max_shard_size=max_shard_size, say=say,
               what=f"{label} {model.arch.upper()} checkpoint {legacy.it_dir} (TP={legacy.tp} PP={legacy.pp})")
    if wordpiece is not None:  # Hugging Face's tokenizer files for the run's BERT vocabulary
        lower = legacy.args.tokenizer_type == "BertWordPieceLowerCase"
        hf_io.save_wordpiece_tokenizer(wordpiece, work, lower_case=lower)
        say(f"tokenizer: {wordpiece} -> BertTokenizerFast ({'lower case' if lower else 'cased'})")


def _export_hf(source, model, work: Path, *, vocab: int, carried: Path | None, tokenizer, tokenizer_src: Path | None,
               dtype: str | None, max_shard_size, say: Say, what: str) -> None:
    """Write an HF directory from a source of canonical global tensors (``canonical_keys()``,
    ``groups(meta)``, ``dtype()``: a megacli or a legacy checkpoint): weights streamed tensor by
    tensor, then generation config, tokenizer files and config.json."""
    from megacli.checkpoint.sharding import is_vocab_key
    from megacli.convert import families
    from megacli.convert.mapping import fit_vocab_rows

    base = read_config(carried / hf_io.CONFIG) if carried is not None else None
    preferred = (base.get("architectures") or [None])[0] if base else None
    family, arch = families.for_model(model, preferred=preferred)
    table = family.table(model)
    precision = dtype or precision_of(source.dtype())
    target = params_dtype(precision)
    for key in source.canonical_keys():
        table.rule_for(key)  # every stored tensor has a rule, before anything is written

    def converted(meta: bool) -> Iterable:
        for group in source.groups(meta=meta):
            for key, t in group.items():
                if is_vocab_key(key):
                    t = fit_vocab_rows(t, rows=vocab, vocab_size=vocab, key=key)
                try:
                    pairs = table.to_hf(key, t)
                except RuntimeError as exc:  # a reshape that does not fit: the model section is wrong
                    raise UserError(f"cannot convert {key} of shape {list(t.shape)} for {arch} with "
                                    f"{model.num_attention_heads} heads / {model.query_groups} query groups: {exc}") from None
                for name, h in pairs:
                    yield name, h.to(target)

    # Plan the shards on meta tensors (shapes only), then stream the real tensors into them.
    planned = [(name, tuple(t.shape), t.dtype) for name, t in converted(meta=True)]
    files = hf_io.write_weights(work, planned, converted(meta=False), max_shard_size=max_shard_size)
    config = family.hf_config(model, architecture=arch, vocab_size=vocab, base=base)
    dtype_key = "dtype" if base and "dtype" in base and "torch_dtype" not in base else "torch_dtype"
    config[dtype_key] = _HF_DTYPE_NAMES[precision]
    if base is None:  # explicit, so the HF class defaults (GPT-2's 50256) never point outside the vocabulary
        specials = (tokenizer.bos, tokenizer.eod, tokenizer.pad) if tokenizer is not None else (None, None, None)
        for field, value in zip(("bos_token_id", "eos_token_id", "pad_token_id"), specials):
            config.setdefault(field, value)
    hf_io.write_json(work / hf_io.GENERATION_CONFIG, _generation_config(carried, config))
    copied = hf_io.copy_tokenizer_files(tokenizer_src, work) if tokenizer_src is not None else []
    hf_io.write_json(work / hf_io.CONFIG, config)
    say(f"{what} -> {arch} ({precision}, {len([f for f in files if f.endswith('.safetensors')])} safetensors shard(s)"
        f"{', tokenizer: ' + ', '.join(copied) if copied else ', no tokenizer files'})")


def _generation_config(carried: Path | None, config: dict) -> dict:
    if carried is not None and (carried / hf_io.GENERATION_CONFIG).is_file():
        return hf_io.read_json(carried / hf_io.GENERATION_CONFIG)
    out: dict = {"_from_model_config": True}
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(field) is not None:
            out[field] = config[field]
    return out
