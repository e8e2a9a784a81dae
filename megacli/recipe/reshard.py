"""The reshard recipe: a checkpoint, the layout to move it to, and where the result goes.

    reshard:
      source: runs/big/checkpoints          # or .../iter_0001000, or a Megatron-LM checkpoint
      output: runs/big/checkpoints_tp1pp1
      tensor: 1
      pipeline: 1
      verify: true
      target_set: [train.micro_batch_size=2]   # edits to the written recipe.yaml

Fields left null keep the source's value.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import PositiveInt, field_validator

from megacli.recipe.base import Section, parse_override


class ReshardSection(Section):
    source: str
    """Checkpoint to read: a megacli checkpoint directory (its `latest` is used) or an iteration
    directory, or a Megatron-LM legacy (torch format) checkpoint."""
    output: str
    """Checkpoint directory to create (`latest` + iter_NNNNNNN/); resume from it with
    checkpoint.resume=OUTPUT."""
    tensor: Optional[PositiveInt] = None
    """Target tensor-parallel size; null = the source's."""
    pipeline: Optional[PositiveInt] = None
    """Target pipeline-parallel size; null = the source's."""
    virtual_pipeline: Optional[PositiveInt] = None
    """Target model chunks per pipeline stage (1 = no interleaving); null = the source's when the
    pipeline size is unchanged, else none."""
    data_parallel: Optional[PositiveInt] = None
    """Target data-parallel size (the written launch.nproc is TP × PP × CP × DP); null = the source's."""
    distributed_optimizer: Optional[bool] = None
    """Write the optimizer state for the distributed optimizer (true) or the standard one (false);
    null = as the source."""
    sequence_parallel: Optional[bool] = None
    """parallel.sequence_parallel of the written recipe; null = the source's (off at TP 1)."""
    format: Literal["torch_dist", "legacy", "megatron"] = "torch_dist"
    """Output format: torch_dist (megacli's), legacy (Megatron-LM's --ckpt-format torch:
    iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt) or megatron (Megatron-LM's --ckpt-format
    torch_dist: latest_checkpointed_iteration.txt, iter_NNNNNNN/ with its common.pt and args)."""
    spec: Literal["te", "local"] = "te"
    """format megatron or legacy: the Megatron-LM layer spec the checkpoint is for (te:
    --transformer-impl transformer_engine, Transformer Engine's extra state; local:
    --transformer-impl local; a legacy checkpoint also takes that spec's key names and parameter order)."""
    target_set: list[str] = []
    """Edits to the written recipe.yaml, as --set dotted.key=value (for example
    train.micro_batch_size=2 when the new data-parallel size needs it)."""
    overwrite: bool = False
    """Replace an existing output that is a checkpoint and holds nothing else (only once the new
    checkpoint is complete). Any other directory, one holding the source, and the working
    directory are never replaced."""
    verify: bool = False
    """Before publishing, reassemble every global tensor of the output and compare checksums with the source."""
    progress: bool = True
    """Show a progress bar over tensors."""
    trust_pickle: bool = False
    """Unpickle any object the source holds (by default only tensors and known-safe types: a pickle
    can run code, so only for checkpoints you trust)."""

    @field_validator("target_set")
    @classmethod
    def _overrides(cls, v: list[str]) -> list[str]:
        for text in v:
            parse_override(text)
        return v


class ReshardRecipe(Section):
    """What `megacli reshard` runs."""

    reshard: ReshardSection
    """Source, target layout and output."""
