"""The reference model of preference tuning: where each pair's reference log-probabilities come from.

* copy: a frozen second model in the same layout, loaded from the starting checkpoint; each global
  batch is scored by it (forward only, through the same pipeline schedule) before the policy's step;
* base (LoRA): the policy itself with its adapters switched off, scored the same way;
* precompute: every pair of every set scored once before training by the starting weights, kept
  with the dataset and cached under run.dir/preference_cache (the file name holds a fingerprint of
  the starting weights, the model and the tokenized pairs).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megacli.engine.array_files import load_cached

def score_pairs(trainer, chunks, batches: list[dict]) -> list[torch.Tensor] | None:
    """Forward-only pass of ``chunks`` over the micro-batches: each micro-batch's summed completion
    log-probabilities [b, 2] on the last pipeline stage, None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megacli.engine.steps import scoring_forward_step
    from megacli.plan import rows_per_microbatch

    iterators = [iter(batches) for _ in chunks]
    with torch.no_grad():
        reports = get_forward_backward_func()(
            forward_step_func=scoring_forward_step(),
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(batches),
            seq_length=trainer.recipe.model.seq_length,
            micro_batch_size=rows_per_microbatch(trainer.recipe),
            forward_only=True,
        )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return [r["logps"] for r in reports]


def _scored_by_policy(trainer, batches: list[dict], *, adapters: bool) -> list[torch.Tensor] | None:
    from contextlib import nullcontext

    from megacli.engine.models.lora import adapters_off

    for c in trainer.chunks:
        c.eval()
    try:
        with nullcontext() if adapters else adapters_off(trainer.chunks):
            return score_pairs(trainer, trainer.chunks, batches)
    finally:
        for c in trainer.chunks:
            c.train()


@dataclass
class Reference:
    """Per-batch reference scoring (modes copy and base); precompute needs none."""

    mode: str
    chunks: list | None = None  # copy: the frozen reference model

    def attach(self, trainer, iterators: list) -> list:
        """Take the next global batch from each chunk's iterator, give every micro-batch its
        reference log-probabilities (``ref_logps``), and return iterators over those micro-batches."""
        taken = [[next(it) for _ in range(trainer.num_microbatches)] for it in iterators]
        if self.mode == "copy":
            logps = score_pairs(trainer, self.chunks, taken[0])
        else:
            logps = _scored_by_policy(trainer, taken[0], adapters=False)
        if logps is not None:
            for batches in taken:
                for batch, lp in zip(batches, logps):
                    batch["ref_logps"] = lp
        return [iter(b) for b in taken]


def build_reference_chunks(recipe, config, vocab_size: int, device, pretrained: Path | None) -> list:
    """A frozen model in the recipe's layout holding the starting weights (the checkpoint's, or the
    seeded initialisation without one), in eval mode."""
    from megacli.checkpoint.source import user_source
    from megacli.engine import checkpoint
    from megacli.engine.models import build_model
    from megacli.engine.models.init import init_weights

    m, t = recipe.model, recipe.train
    chunks = build_model(recipe=recipe, config=config, vocab_size=vocab_size)
    init_weights(chunks, seed=t.seed, std=m.init_method_std, num_layers=config.num_layers, gated=config.gated_linear_unit,
                 zero_centered_gamma=config.layernorm_zero_centered_gamma)
    chunks = [c.to(device) for c in chunks]
    if t.precision != "fp32":
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, c) for c in chunks]
    if pretrained is not None:
        ck = recipe.checkpoint
        checkpoint.load(source=user_source(pretrained, ck), chunks=chunks, optimizer=None, scheduler=None,
                        load_optimizer=False, verify=ck.verify)
    for c in chunks:
        c.requires_grad_(False)
        c.eval()
    return chunks


def fingerprint(recipe, pretrained: Path | None, dataset) -> str:
    """What the reference log-probabilities of ``dataset`` depend on: the starting weights (the
    checkpoint's path and its files' sizes and times, or the seed without one), the model and
    precision, and the tokenized pairs."""
    h = hashlib.sha256()
    if pretrained is not None:
        files = sorted((str(p.relative_to(pretrained)), p.stat().st_size, p.stat().st_mtime_ns)
                       for p in Path(pretrained).rglob("*") if p.is_file())
        start = {"checkpoint": str(Path(pretrained).resolve()), "files": files}
    else:
        start = {"seed": recipe.train.seed}
    settings = {"start": start, "model": recipe.model.model_dump(mode="json"), "precision": recipe.train.precision,
                "lora": recipe.lora.model_dump(mode="json") if recipe.lora else None}
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    h.update(dataset.samples.tobytes())
    return h.hexdigest()[:16]


def precompute(trainer, datasets: dict, *, pretrained: Path | None, fresh: bool, say) -> None:
    """Give every dataset its reference log-probabilities (``ref_logps``), from the cache under
    run.dir or computed now: by the policy when the run starts from the starting weights
    (``fresh``), else by a temporary copy of them, freed afterwards."""
    from megatron.core import parallel_state as ps

    from megacli.engine.distributed import is_reporting_rank

    recipe = trainer.recipe
    cache = Path(recipe.run.dir) / "preference_cache"
    paths = {name: cache / f"{name}-{fingerprint(recipe, pretrained, ds)}.npy" for name, ds in datasets.items()}
    cached = {name: load_cached(path, shape=(len(datasets[name]), 2), dtype=np.float64,
                                what=f"reference log-probabilities of the {len(datasets[name])} pairs of {name}")
              for name, path in paths.items() if os.path.lexists(path)}  # every rank refuses a bad cache alike
    missing = set(paths) - set(cached)
    torch.distributed.barrier()  # every rank has looked before any writes
    temporary = None
    if missing and not fresh:
        from megacli.engine.models.common import unwrap

        temporary = build_reference_chunks(recipe, unwrap(trainer.chunks[0]).config, trainer.vocab_size,
                                           trainer.runtime.device, pretrained)
    last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
    for name, ds in datasets.items():
        if name not in missing:
            if last_stage:
                ds.ref_logps = cached[name]
            say(f"reference log-probabilities of {name}: {paths[name]} (cached)")
            continue
        logps = _score_dataset(trainer, ds, temporary)
        if last_stage:
            ds.ref_logps = logps
            if is_reporting_rank():
                cache.mkdir(parents=True, exist_ok=True)
                tmp = paths[name].with_suffix(".tmp.npy")
                np.save(tmp, logps)
                tmp.replace(paths[name])
        say(f"reference log-probabilities of {name}: {len(ds)} pairs scored, cached in {paths[name]}")
    del temporary
    torch.distributed.barrier()


def _score_dataset(trainer, ds, chunks) -> np.ndarray | None:
    """Every pair of ``ds`` in order, in micro-batches (the last one wraps around to fill it)."""
    from megacli.engine.data import to_device

    mbs = trainer.recipe.train.micro_batch_size
    n = len(ds)
    batches = []
    for lo in range(0, n, mbs):
        samples = [ds[(lo + j) % n] for j in range(mbs)]
        batch = {k: torch.stack([torch.as_tensor(np.asarray(s[k])) for s in samples]) for k in samples[0]}
        batches.append(to_device(batch, trainer.runtime.device))
    if chunks is None:
        logps = _scored_by_policy(trainer, batches, adapters=True)
    else:
        logps = score_pairs(trainer, chunks, batches)
    if logps is None:
        return None
    return torch.cat(logps).double().cpu().numpy()[:n]
