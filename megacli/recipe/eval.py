"""The evaluation recipe: a checkpoint's recipe (model, tokenizer, layout) plus which
lm-evaluation-harness tasks to run on it.

`megacli eval CHECKPOINT --tasks a,b` reads the checkpoint's recipe.yaml and adds an `eval:`
section from the command-line flags (and `generate.checkpoint`, which the inference runner loads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pydantic import NonNegativeInt, field_validator, model_validator

from megacli.recipe.base import RecipeError
from megacli.recipe.generate import GenerateRecipe
from megacli.recipe.harness import HarnessSection


class EvalSection(HarnessSection):
    checkpoint: Optional[str] = None
    """Checkpoint to evaluate (a directory with `latest`, or one iter_* directory)."""
    output: Optional[str] = None
    """Write the harness's results JSON here (with per-task seconds and tokens/s)."""
    log_samples: bool = False
    """Also write every document's requests and the model's answers into the results JSON."""
    bootstrap_iters: NonNegativeInt = 100000
    """Bootstrap resamples for the standard errors of metrics without a closed form (0 = none)."""

    @field_validator("output")
    @classmethod
    def _output_is_a_file(cls, v: Optional[str]) -> Optional[str]:
        """Checked here, before any model loads: the results are written only after the whole run."""
        if v is None:
            return v
        path = Path(v)
        if path.is_dir():
            raise ValueError(f"is a directory; give a file path, such as {path / 'results.json'}")
        parent = next((p for p in path.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise ValueError(f"{parent} is a file, not a directory")
        return v


class EvalRecipe(GenerateRecipe):
    """A model recipe plus `eval:`; the model is loaded from generate.checkpoint, as for `generate`."""

    eval: EvalSection
    """Which harness tasks to run, and how."""

    @model_validator(mode="after")
    def _check_eval_layout(self):
        if self.model.arch == "t5":
            raise RecipeError("model.arch", "t5", "megacli eval runs GPT-family (decoder-only) checkpoints; for T5 "
                              "the harness's log-likelihood tasks need target scoring under an encoder input, which "
                              "the T5 decoder here does not provide, and its generate_until tasks need its seq2seq "
                              "prompt handling (EOS-ended encoder inputs, the decoder start token) reproduced: use "
                              "`megacli generate` for T5 text, or `megacli convert` to Hugging Face and the harness's "
                              "hf backend")
        if self.model.arch != "gpt":
            raise RecipeError("model.arch", self.model.arch, "megacli eval runs GPT-family (decoder-only) checkpoints")
        return self
