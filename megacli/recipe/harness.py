"""What an lm-evaluation-harness run needs, shared by `megacli eval` (recipe.eval) and by
training, which runs the same tasks on its own model at each train.eval_interval."""

from __future__ import annotations

from typing import Optional

from pydantic import NonNegativeInt, PositiveInt, model_validator

from megacli.recipe.base import RecipeError, Section, Seed


class HarnessSection(Section):
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
    trust_task_code: bool = False
    """Allow include_path's task YAMLs to run Python (``!function``, or a metric Hugging Face evaluate
    would load) and render task templates outside Jinja's sandbox; without it such a task is refused
    before anything is imported, and a template reaching Python internals is stopped. Only for task
    files you trust."""
    max_gen_toks: PositiveInt = 256
    """generate_until tasks: tokens to generate at most when the task does not say."""
    add_bos: bool = False
    """Put the tokenizer's BOS token in front of every context (as Hugging Face tokenizers that
    add it themselves, e.g. Llama's, do under the harness's hf backend)."""
    seed: Seed = 1234
    """Seed of the harness's few-shot sampling and of sampled generation."""

    @model_validator(mode="after")
    def _check(self):
        if not self.tasks:
            raise RecipeError("eval.tasks", self.tasks, "no tasks: name at least one lm-evaluation-harness task")
        return self


class TrainingEvalSection(HarnessSection):
    """`pretrain`/`finetune`: harness tasks run on the model being trained at each
    train.eval_interval (and at the end), rank 0 driving the harness and every rank running the
    model in its training layout; each metric goes to metrics.jsonl and the loggers as
    eval/<task>/<metric> (a filter other than the harness's `none` as <metric>,<filter>), equal to
    `megacli eval` on the checkpoint saved at that step. Standard errors are not computed."""
