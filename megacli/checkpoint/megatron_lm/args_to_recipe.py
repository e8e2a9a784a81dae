"""A Megatron-LM run's arguments (the ``args`` Namespace every checkpoint it writes carries) as a
megacli training recipe, the one a resharded run continues with (the model section: args.py); the
run's tokenizer and vocabulary; its scheduler counted in global batches."""

from __future__ import annotations

from pathlib import Path

from megacli.checkpoint.megatron_lm.args import arg
from megacli.errors import UserError


def tokenizer_dir(args) -> Path | None:
    """The run's Hugging Face tokenizer directory, when args name one that exists here."""
    if arg(args, "tokenizer_type") == "HuggingFaceTokenizer":
        p = Path(str(arg(args, "tokenizer_model", "")))
        if p.is_dir() and (p / "tokenizer.json").is_file():
            return p
    return None


def wordpiece_vocab(args) -> Path | None:
    """The run's BERT WordPiece vocab.txt (tokenizer_type BertWordPiece*), when it exists here."""
    if arg(args, "tokenizer_type") in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        p = Path(str(arg(args, "vocab_file", "")))
        if p.is_file():
            return p
    return None


def recipe_from_args(src) -> dict:
    """The raw training recipe of a legacy checkpoint (a LegacyCheckpoint), from its run's arguments."""
    a = src.args
    model = src.model_section()
    vocab = model.get("vocab_size")
    tok_dir = src.tokenizer_dir()
    tokenizer = {"type": "huggingface", "path": str(tok_dir)} if tok_dir else {"type": "none", "path": None}
    if not tok_dir:
        model["vocab_size"] = vocab
    gbs = int(arg(a, "global_batch_size", 1))
    mbs = int(arg(a, "micro_batch_size", 1))
    world = int(arg(a, "world_size", src.tp * src.pp))
    cp = int(arg(a, "context_parallel_size", 1))
    etp = arg(a, "expert_tensor_parallel_size")  # validate_args: the tensor-parallel size when not given
    train_iters = arg(a, "train_iters") or max(1, int(arg(a, "train_samples", gbs)) // gbs)
    warmup = arg(a, "lr_warmup_iters", 0) or 0
    if not warmup and arg(a, "lr_warmup_samples"):
        warmup = int(a.lr_warmup_samples) // gbs
    style = str(arg(a, "lr_decay_style", "linear"))
    data_path = arg(a, "data_path")
    if isinstance(data_path, (list, tuple)) and len(data_path) == 1:
        data = {"path": str(data_path[0]), "mock": False}
    elif isinstance(data_path, (list, tuple)) and len(data_path) > 1 and len(data_path) % 2 == 0:
        data = {"blend": [[float(data_path[i]), str(data_path[i + 1])] for i in range(0, len(data_path), 2)], "mock": False}
    else:
        data = {"mock": True}
    if arg(a, "split"):
        data["split"] = str(a.split).replace(" ", "")
    data.update(reset_position_ids=bool(arg(a, "reset_position_ids", False)), eod_mask_loss=bool(arg(a, "eod_mask_loss", False)))
    extra = {}
    if model["arch"] == "t5" and arg(a, "vocab_extra_ids", 0):  # the T5 span-masking sentinels
        extra["masking"] = {"sentinel_tokens": int(a.vocab_extra_ids)}
    return extra | {
        "model": model,
        "parallel": {"tensor": src.tp, "pipeline": src.pp, "virtual_pipeline": src.vp if src.vp > 1 else None,
                     "first_stage_layers": src.first_stage_layers, "last_stage_layers": src.last_stage_layers,
                     "sequence_parallel": bool(arg(a, "sequence_parallel", False)) and src.tp > 1, "context": cp,
                     "expert": int(arg(a, "expert_model_parallel_size", 1)),
                     "expert_tensor": int(etp) if etp is not None and int(etp) != src.tp else None,
                     "distributed_optimizer": False},
        "launch": {"nproc": world},
        "tokenizer": tokenizer,
        "data": data,
        "train": {"iters": int(train_iters), "micro_batch_size": mbs, "global_batch_size": gbs,
                  "seed": int(arg(a, "seed", 1234)),
                  "precision": "bf16" if arg(a, "bf16", False) else "fp16" if arg(a, "fp16", False) else "fp32",
                  # None: the run evaluated never (megacli writes train.eval_interval: null so)
                  "eval_interval": getattr(a, "eval_interval", 1000), "eval_iters": int(arg(a, "eval_iters", 10) or 10),
                  "log_interval": int(arg(a, "log_interval", 100) or 100)},
        "optim": {"optimizer": str(arg(a, "optimizer", "adam")), "lr": float(arg(a, "lr", 3e-4)),
                  "min_lr": float(arg(a, "min_lr", 0.0)), "warmup_iters": int(warmup),
                  "decay_style": {"WSD": "wsd", "inverse-square-root": "cosine"}.get(style, style),
                  "decay_iters": arg(a, "lr_decay_iters"), "weight_decay": float(arg(a, "weight_decay", 0.01)),
                  "clip_grad": float(arg(a, "clip_grad", 1.0)), "adam_beta1": float(arg(a, "adam_beta1", 0.9)),
                  "adam_beta2": float(arg(a, "adam_beta2", 0.999)), "adam_eps": float(arg(a, "adam_eps", 1e-8))},
        "checkpoint": {"save_interval": arg(a, "save_interval")},
    }


class ArgsDescribed:
    """What a checkpoint described by Megatron-LM's run arguments (``self.args``; legacy or torch_dist)
    says about its tokenizer and vocabulary. Subclasses give ``padded_vocab_rows()``."""

    def vocab_size(self) -> int:
        """The real vocabulary: args.vocab_size, else the tokenizer's, else the padded rows."""
        given = arg(self.args, "vocab_size")
        if given:  # Megatron-LM's NullTokenizer appends its end-of-document id to the --vocab-size ids
            return int(given) + (1 if arg(self.args, "tokenizer_type") == "NullTokenizer" else 0)
        from megacli.data.tokenizers import load_tokenizer

        tok = self.tokenizer_dir()
        if tok is not None:
            return load_tokenizer(type="huggingface", path=str(tok)).vocab_size
        vocab = self.wordpiece_vocab()
        if vocab is not None:  # with the [BOS]/[EOS] (and --vocab-extra-ids) Megatron's WordPiece tokenizer appends
            return load_tokenizer(type="wordpiece", path=str(vocab)).vocab_size + int(arg(self.args, "vocab_extra_ids", 0))
        return self.padded_vocab_rows()

    def tokenizer_dir(self) -> Path | None:
        return tokenizer_dir(self.args)

    def tokenizer_not_found(self) -> list[str]:
        """The run's tokenizer, when its files are not on this machine (a recipe cannot name them)."""
        tok = arg(self.args, "tokenizer_type")
        if not tok or self.tokenizer_dir() is not None or self.wordpiece_vocab() is not None:
            return []
        where = arg(self.args, "tokenizer_model") or arg(self.args, "vocab_file")
        return [f"tokenizer {tok}" + (f" ({where}: not found on this machine)" if where else "")
                + "; set tokenizer.type and tokenizer.path"]

    def wordpiece_vocab(self) -> Path | None:
        return wordpiece_vocab(self.args)


# Megatron-LM counts scheduler steps in samples, megacli in iterations (global batches).
SCHED_STEPS = ("num_steps", "lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "wsd_decay_steps")


def scale_scheduler(sched: dict, factor: float, where: str) -> dict:
    out = dict(sched)
    for k in SCHED_STEPS:
        v = out.get(k)
        if v is None:
            continue
        scaled = v * factor
        if abs(scaled - round(scaled)) > 1e-6:
            raise UserError(f"{where}: scheduler {k} = {v} is not a whole number of global batches")
        out[k] = int(round(scaled))
    return out
