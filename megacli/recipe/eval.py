"""The evaluation recipe: a checkpoint's recipe (model, tokenizer, layout) plus which
lm-evaluation-harness tasks to run on it.

`megacli eval CHECKPOINT --tasks a,b` reads the checkpoint's recipe.yaml and adds an `eval:`
section from the command-line flags (and `generate.checkpoint`, which the inference runner loads).
"""

from __future__ import annotations

from typing import Optional

from pydantic import NonNegativeInt, PositiveInt, model_validator

from megacli.recipe.base import RecipeError, Section
from megacli.recipe.generate import GenerateRecipe


class EvalSection(Section):
    checkpoint: Optional[str] = None
    """Checkpoint to evaluate (a directory with `latest`, or one iter_* directory)."""
    tasks: list[str] = []
    """lm-evaluation-harness task (or group) names."""
    num_fewshot: Optional[NonNegativeInt] = None
    """Few-shot examples per prompt (default: each task's own)."""
    limit: Optional[PositiveInt] = None
    """Evaluate at most this many documents per task."""
    batch_size: PositiveInt = 8
    """Requests run through the model together."""
    include_path: Optional[str] = None
    """Directory of the harness's custom task YAMLs (with their local data files)."""
    max_gen_toks: PositiveInt = 256
    """generate_until tasks: tokens to generate at most when the task does not say."""
    output: Optional[str] = None
    """Write the harness's results JSON here (with per-task seconds and tokens/s)."""
    log_samples: bool = False
    """Also write every document's requests and the model's answers into the results JSON."""
    add_bos: bool = False
    """Put the tokenizer's BOS token in front of every context (as Hugging Face tokenizers that
    add it themselves, e.g. Llama's, do under the harness's hf backend)."""
    bootstrap_iters: NonNegativeInt = 100000
    """Bootstrap resamples for the standard errors of metrics without a closed form (0 = none)."""
    seed: int = 1234
    """Seed of the harness's few-shot sampling and of sampled generation."""

    @model_validator(mode="after")
    def _check(self):
        if not self.tasks:
            raise RecipeError("eval.tasks", self.tasks, "no tasks: name at least one lm-evaluation-harness task")
        return self


class EvalRecipe(GenerateRecipe):
    """A model recipe plus `eval:`; the model is loaded from generate.checkpoint, as for `generate`."""

    eval: EvalSection
    """Which harness tasks to run, and how."""

    @model_validator(mode="after")
    def _check_eval_layout(self):
        if self.model.arch != "gpt":
            raise RecipeError("model.arch", self.model.arch, "megacli eval runs GPT-family (decoder-only) checkpoints")
        return self
