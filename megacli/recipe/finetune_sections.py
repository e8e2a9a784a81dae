"""The recipe sections only `megacli finetune` reads: instruction (SFT) data, preference pairs and
their objective, and LoRA adapters."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, PositiveFloat, PositiveInt, field_validator

from megacli.recipe.base import Section
from megacli.recipe.data_sections import check_set_names


class HeldOutData(Section):
    """JSONL training data with a validation file, named validation sets or a held-out share."""

    train: str
    """Training JSONL file."""
    valid: Union[str, dict[str, str], None] = None
    """Validation JSONL file (val_loss); null = hold out valid_fraction of the training file. A map
    name -> JSONL file gives named validation sets instead, one val_loss/<name> and val_ppl/<name>
    each (over train.eval_iters global batches, or the whole set when it holds fewer), and val_loss
    then comes from the held-out valid_fraction. Names are identifiers (letters, digits, _)."""
    valid_fraction: float = Field(0.05, ge=0, lt=1)
    """Share of the training records held out for validation when valid is not a single file."""

    @field_validator("valid")
    @classmethod
    def _valid_names(cls, valid):
        if isinstance(valid, dict):
            check_set_names(valid)
        return valid

    @property
    def valid_file(self) -> str | None:
        """The one validation file, when valid names one (not a map of named sets)."""
        return self.valid if isinstance(self.valid, str) else None

    @property
    def named_valid(self) -> dict[str, str]:
        """The named validation sets, name -> JSONL file (none unless valid is a map)."""
        return dict(self.valid) if isinstance(self.valid, dict) else {}


class SFTSection(HeldOutData):
    """Instruction data for `megacli finetune` (JSONL): {"prompt", "response"} or {"messages": [...]}."""

    template: Literal["auto", "tokenizer", "chatml", "plain"] = "auto"
    """How records become text: the tokenizer's chat template (auto: when it has one, else plain),
    chatml (<|im_start|>role ... <|im_end|>), or plain (the texts one after the other)."""
    packing: bool = True
    """Pack several examples into one sequence (attention and positions restart per example); false pads each."""
    too_long: Literal["truncate", "drop"] = "truncate"
    """What to do with an example longer than model.seq_length + 1 tokens."""

class PreferenceSection(HeldOutData):
    """Preference tuning for `megacli finetune`: pairs in TRL's format, {"prompt", "chosen",
    "rejected"} as strings or as lists of chat messages (JSONL, or a local Hugging Face dataset
    directory saved with save_to_disk), and the objective. Only completion tokens are scored."""

    template: Literal["auto", "tokenizer", "chatml", "plain"] = "auto"
    """How chat messages become text (as sft.template); plain strings are used as they are."""
    loss: Literal["dpo", "ipo", "simpo"] = "dpo"
    """dpo: -log sigmoid(beta·Δ) of the log-ratio margin Δ (Rafailov et al.), with label_smoothing
    the conservative cDPO; ipo: (Δ/len - 1/(2·beta))² with log-ratios averaged over completion
    tokens (TRL's definition); simpo: no reference model, length-normalised rewards beta·mean
    log-prob and the margin gamma (TRL's CPOTrainer loss_type simpo)."""
    beta: PositiveFloat = 0.1
    """Strength of the implicit KL penalty (dpo, ipo: TRL's beta; simpo: its reward scale)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """dpo and simpo: the assumed share of flipped labels (cDPO); 0 = the plain sigmoid loss."""
    gamma: float = 0.5
    """simpo: the target reward margin (TRL's simpo_gamma)."""
    reference: Literal["copy", "precompute", "base"] = "copy"
    """dpo/ipo's reference model: copy (a frozen second copy of the starting weights in the same
    layout), precompute (the reference log-probabilities of every pair computed once before training
    and cached under run.dir: one model in memory while training), base (LoRA: the base weights
    with the adapters switched off). Unused by simpo."""
    max_prompt_length: Optional[PositiveInt] = None
    """Prompts longer than this keep their last max_prompt_length tokens; null = no limit."""
    max_length: Optional[PositiveInt] = None
    """Prompt + completion longer than this keep their first max_length tokens (TRL's keep_start);
    a pair whose prompt alone fills it is dropped. null = model.seq_length + 1."""


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class LoRASection(Section):
    """Low-rank adapters (LoRA) for finetuning: each target linear layer W gets trainable A (rank ×
    in) and B (out × rank), the layer computes W·x + (alpha / rank)·B·A·dropout(x); the base
    weights stay frozen and only the adapters are trained and saved."""

    rank: PositiveInt = 8
    """Adapter rank r."""
    alpha: PositiveFloat = 16.0
    """Scaling numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (training only)."""
    targets: list[Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]] = list(LORA_TARGETS)
    """Which linear layers of every transformer layer get adapters: linear_qkv (attention input),
    linear_proj (attention output), linear_fc1 and linear_fc2 (MLP)."""

    @field_validator("targets")
    @classmethod
    def _some_targets(cls, targets):
        if not targets:
            raise ValueError(f"name at least one of {', '.join(LORA_TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError("a target is named twice")
        return targets
