"""The generation recipe: a trained model's recipe (model, tokenizer, layout) plus how to decode.

`megacli generate --checkpoint DIR` reads DIR's recipe.yaml and adds a `generate:` section from
the command-line flags, so the model is described once, where it was trained or converted.
"""

from __future__ import annotations

from typing import ClassVar, Optional

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from megacli.recipe.base import RecipeError, Section, Seed
from megacli.recipe.pretrain import TrainingRecipe


class GenerateSection(Section):
    checkpoint: Optional[str] = None
    """Checkpoint to load (a directory with `latest`, or one iter_* directory)."""
    prompts: list[str] = []
    """Prompts to complete."""
    prompts_file: Optional[str] = None
    """JSONL with a `prompt` field per line, or plain text with one prompt per line."""
    chat: bool = False
    """Each prompt is a user's message: the text completed is the conversation rendered by the chat
    template of the checkpoint's tokenizer (for a finetuned model, the template it was trained with),
    the assistant's turn started."""
    output: Optional[str] = None
    """Write one JSON object per prompt here (prompt, text, tokens, and logprobs when asked)."""
    max_new_tokens: PositiveInt = 64
    """Tokens to generate at most per prompt."""
    temperature: float = Field(0.0, ge=0)
    """0 = greedy; above 0, sample from softmax(logits / temperature)."""
    top_k: NonNegativeInt = 0
    """Sampling: keep the k most likely tokens (0 = all)."""
    top_p: float = Field(0.0, ge=0, le=1)
    """Sampling: keep the smallest set of tokens whose probability reaches top_p (0 = off)."""
    top_p_decay: float = Field(0.0, ge=0, le=1)
    """After each generated token, top_p *= top_p_decay (0 = keep top_p), as Megatron-LM."""
    top_p_bound: float = Field(0.0, ge=0, le=1)
    """Lower bound for a decaying top_p."""
    repetition_penalty: float = Field(1.0, gt=0)
    """Divide the positive logits (multiply the negative ones) of tokens already in the sequence by this."""
    num_beams: PositiveInt = 1
    """Beam search with this many beams (1 = no beam search)."""
    length_penalty: float = 1.0
    """Beam search: a finished beam scores sum(logprobs) / generated_length ** length_penalty."""
    add_bos: bool = False
    """Put the tokenizer's BOS token in front of every prompt."""
    decoder_start_token: Optional[int] = None
    """t5: the decoder's first input token. Default: decoder_start_token_id of the Hugging Face
    config a converted checkpoint carries, else the tokenizer's BOS (as Megatron's T5 pretraining)."""
    stop_at_eod: bool = True
    """Stop a sequence at the tokenizer's end-of-document token."""
    stop_tokens: list[int] = []
    """More token ids that end a sequence."""
    stop_strings: list[str] = []
    """Strings that end a sequence (the text is cut before them)."""
    seed: Seed = 1234
    """Seed for sampling (the same seed gives the same text)."""
    batch_size: PositiveInt = 8
    """Prompts decoded together."""
    logprobs: bool = False
    """Also write each generated token's log-probability."""
    use_cache: bool = True
    """Keep keys and values of past tokens (KV cache); off recomputes the whole sequence each step."""
    score: Optional[str] = None
    """Instead of generating: per-token log-likelihood and perplexity of this text or JSONL (`text`) file."""
    cloze: Optional[str] = None
    """Instead of generating: LAMBADA-style last-word accuracy on this JSONL (`text`) file."""
    stream: bool = True
    """Print text to the terminal as it is generated (batch of one prompt at a time on screen)."""

    @model_validator(mode="after")
    def _check(self):
        if self.num_beams > 1 and self.temperature > 0:
            raise RecipeError("generate.num_beams", self.num_beams,
                              f"beam search is deterministic; it cannot be combined with sampling "
                              f"(generate.temperature = {self.temperature}); set one of them back")
        if self.top_p_bound > self.top_p > 0:
            raise RecipeError("generate.top_p_bound", self.top_p_bound, f"above generate.top_p = {self.top_p}")
        if self.temperature == 0 and (self.top_k or self.top_p):
            raise RecipeError("generate.temperature", 0.0,
                              "top_k / top_p filter a sampling distribution; greedy decoding (temperature 0) "
                              "ignores them: set a temperature above 0")
        if self.score and self.cloze:
            raise RecipeError("generate.score", self.score, "score and cloze are separate runs: give one")
        return self


class GenerateRecipe(TrainingRecipe):
    """A model recipe plus `generate:`; data/optim/train sections come along from the checkpoint
    and are not used."""

    generate: GenerateSection = GenerateSection()
    """How to decode (or score)."""

    trains: ClassVar[bool] = False

    @model_validator(mode="after")
    def _check_generation_layout(self):
        p = self.parallel
        if self.world_size != p.tensor * p.pipeline:
            raise RecipeError("launch.nproc", self.launch.nproc,
                              f"generation runs one model replica: launch.nproc must be tensor × pipeline = "
                              f"{p.tensor * p.pipeline}")
        if p.virtual_pipeline not in (None, 1):
            raise RecipeError("parallel.virtual_pipeline", p.virtual_pipeline, "generation runs without interleaving")
        if p.context != 1:
            raise RecipeError("parallel.context", p.context, "generation runs without context parallelism")
        if self.model.arch == "bert":
            raise RecipeError("model.arch", "bert", "BERT is an encoder: nothing to generate (use gpt or t5)")
        return self
