"""What differs between the Megatron-Core releases megacli runs on: 0.16.1 (Python 3.11 and older)
and 0.19.x (Python 3.12 and newer, which every release from 0.17 on requires). Each difference is one
name here, saying what changed and since which release; the rest of megacli asks these names, never
the version. Nothing here imports torch or Megatron-Core at import time (the CLI asks before a run)."""

from __future__ import annotations

import contextlib
import logging
import sys

from megacli.core_release import core_since, core_version  # noqa: F401 (asked here and by callers)
from megacli.errors import UserError

MUON_SINCE = "0.19"  # Megatron-Core's own Muon (TensorParallelMuon over NVIDIA's emerging-optimizers)
GPT_MODEL_DEPRECATED_SINCE = "0.19"  # GPTModel logs a deprecation warning in favour of HybridModel
CP_BATCH_SPLIT_TAKES_GROUP_SINCE = "0.18"  # get_batch_on_this_cp_rank: is_hybrid_cp required, cp_group not defaulted
COMMON_STATE_INSIDE_TORCH_DIST_SINCE = "0.19"  # the non-sharded state saved in the shards, not common.pt
LEGACY_GROUPED_GEMM_FLAG_REMOVED_SINCE = "0.17"  # TransformerConfig.moe_use_legacy_grouped_gemm
GROUPED_MLP_REMOVED_SINCE = "0.19"  # experts.GroupedMLP (the grouped_gemm package); TE's TEGroupedMLP remains
MOE_METRICS_TRACKER_SINCE = "0.19"  # the aux-loss tracker is an object; the legacy dict is a fresh view
NVRX_ASYNC_SAVE_DEFAULT_SINCE = "0.17"  # async dist_checkpointing saves default to NVIDIA Resiliency Extension's writer
INFERENCE_CONFIG_SINCE = "0.17"  # an inference context's options (materialize_only_last_token_logits) in its .config
INFERENCE_MODE_FLAG_SINCE = "0.18"  # GPTModel's inference paths follow the process-wide InferenceMode, not a given context


def async_save_kwargs() -> dict:
    """dist_checkpointing.save's arguments for an async save with Megatron-Core's own writer: since
    0.17 the default is NVIDIA Resiliency Extension's (async_strategy="nvrx"), which megacli does
    not install; 0.16 has only its own and no such argument."""
    return {"async_strategy": "mcore"} if core_since(NVRX_ASYNC_SAVE_DEFAULT_SINCE) else {}


def last_token_logits_only(context, only: bool) -> None:
    """Whether a GPTModel forward with this inference context computes the logits of the last
    position alone (the output layer then sees only that position). Since 0.17 the flag is an
    option of the context's InferenceConfig (``context.config``); 0.16 has it on the context."""
    owner = context.config if core_since(INFERENCE_CONFIG_SINCE) else context
    owner.materialize_only_last_token_logits = only


def inference_forward(context):
    """A context manager around one forward of a GPTModel given ``context`` (an inference context,
    or None: then nothing to do). Until 0.18 GPTModel takes its inference paths (among them the
    logits of the last position alone) whenever it is given a context in eval mode; since 0.18 only
    while Megatron-Core's process-wide InferenceMode is set, which its own inference engines set
    and megacli's decoding loop sets here for the forward."""
    if context is None or not core_since(INFERENCE_MODE_FLAG_SINCE):
        return contextlib.nullcontext()
    from megatron.core.inference.utils import InferenceMode

    return InferenceMode.active()


def batch_on_this_cp_rank(batch: dict) -> dict:
    """This context-parallel rank's two chunks of each sequence (Megatron's load-balanced split).
    Since 0.18 get_batch_on_this_cp_rank requires is_hybrid_cp and takes the context-parallel group
    as an argument, where a missing one means the whole world; 0.16 reads the group itself."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if not core_since(CP_BATCH_SPLIT_TAKES_GROUP_SINCE):
        return get_batch_on_this_cp_rank(batch)
    from megatron.core import parallel_state

    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())


def write_common_file(sharded_state: dict, checkpoint_dir) -> None:
    """Since 0.19 dist_checkpointing.save stores the common (non-sharded) part of a state - iteration,
    optimizer param groups, scheduler - as one object inside the torch_dist shards; 0.16 reads it only
    from common.pt, and 0.19 still reads common.pt first when there is one. Under 0.19 rank 0 writes
    common.pt as 0.16's save does (the same dictionary), so a checkpoint either release writes loads
    under both."""
    if not core_since(COMMON_STATE_INSIDE_TORCH_DIST_SINCE):
        return
    import torch
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

    if torch.distributed.get_rank() == 0:
        _, persistent = extract_nonpersistent(sharded_state)
        _, common = extract_sharded_base(persistent)
        torch.save(common, f"{checkpoint_dir}/{COMMON_STATE_FNAME}")


def common_state_load_kwargs(reader) -> dict:
    """dist_checkpointing.load's arguments for the torch_dist checkpoint ``reader`` reads
    (megacli.checkpoint.torch_dist.TorchDistReader). Since 0.19 load finds the common state in
    common.pt or, without one, inside the shards; 0.16 reads only common.pt, so for a checkpoint
    0.19 saved it is given a common strategy that returns the state read from the shards."""
    if core_since(COMMON_STATE_INSIDE_TORCH_DIST_SINCE) or not reader.common_in_shards:
        return {}
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class CommonFromShards(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return reader.common()

    return {"common_strategy": CommonFromShards()}


def legacy_grouped_gemm_flag(grouped: bool) -> dict:
    """TransformerConfig's choice of GroupedMLP for grouped-GEMM experts: a flag until 0.17 removed it."""
    return {} if core_since(LEGACY_GROUPED_GEMM_FLAG_REMOVED_SINCE) else {"moe_use_legacy_grouped_gemm": grouped}


def has_grouped_mlp() -> bool:
    """Whether Megatron-Core has GroupedMLP (grouped-GEMM experts without Transformer Engine):
    removed in 0.19, where megacli's experts are SequentialMLP."""
    return not core_since(GROUPED_MLP_REMOVED_SINCE)


def forget_moe_metrics() -> None:
    """Drop Megatron-Core's per-layer MoE metrics (sized by a run's layer count, holding its process
    groups) so that the next run in this process starts clean. Since 0.19 they live in an
    MoEMetricsTracker, whose legacy dict view is a copy: the tracker itself is dropped."""
    if core_since(MOE_METRICS_TRACKER_SINCE):
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()
        return
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def check_optimizer_available(optim) -> None:
    """Refuse (exit 2) an optimizer this environment's Megatron-Core does not have."""
    if optim.optimizer == "muon" and not core_since(MUON_SINCE):
        python = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise UserError(f"optim.optimizer = 'muon' needs Megatron-Core {MUON_SINCE} or newer, which installs on "
                        f"Python 3.12 and newer; this environment has Megatron-Core {core_version()} on Python "
                        f"{python} (use optim.optimizer: adam, or install megacli under Python 3.12)")


class _DropGptModelDeprecation(logging.Filter):
    def filter(self, record) -> bool:
        return "GPTModel IS DEPRECATED" not in record.getMessage()


def quiet_gpt_model_deprecation() -> None:
    """Since 0.19 GPTModel logs, on every build, that it is deprecated in favour of HybridModel
    (docs/layout.md says what moving would take). megacli builds GPTModel on purpose: the warning
    never reaches the user. Idempotent."""
    if not core_since(GPT_MODEL_DEPRECATED_SINCE):
        return
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    if not any(isinstance(f, _DropGptModelDeprecation) for f in logger.filters):
        logger.addFilter(_DropGptModelDeprecation())
