"""The serving recipe: a checkpoint's recipe (model, tokenizer, layout) plus how to serve it over
HTTP (`megacli serve CKPT` adds a `serve:` section from its flags). How to decode by default (BOS,
stop tokens) comes from the `generate:` section, as for `megacli generate`."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, PositiveInt, model_validator

from megacli.recipe.base import RecipeError, Section
from megacli.recipe.generate import GenerateRecipe

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ServeSection(Section):
    checkpoint: Optional[str] = None
    """Checkpoint to serve (a directory with `latest`, or one iter_* directory)."""
    host: str = "127.0.0.1"
    """Address to bind. Any address other than loopback needs an API key (see api_key_env)."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port (0: any free port, printed at start)."""
    api_key_env: str = "MEGACLI_API_KEY"
    """Environment variable holding the API key clients must send (Authorization: Bearer KEY). The
    key itself is never part of a recipe; `--api-key` sets this variable for the server."""
    model_name: Optional[str] = None
    """The model's name in the API (`model` of requests). Default: the checkpoint directory's name."""
    max_batch: PositiveInt = 16
    """Sequences decoded together (KV-cache slots); more requests wait in the queue."""
    max_queue: PositiveInt = 64
    """Sequences waiting for a slot at most; beyond that requests get 503 with Retry-After (a request
    with more sequences than this, 400)."""
    max_tokens: PositiveInt = 16
    """Tokens generated when a completions request does not say (OpenAI's default); chat requests
    default to what the context leaves."""
    cache_length: Optional[PositiveInt] = None
    """KV-cache columns per slot (at least the model's context). Default: twice the context, so
    the cache is compacted at most once per context's worth of steps."""
    prefill_tokens: PositiveInt = 2048
    """Prompt tokens (padded to the longest prompt of a group) prefilled between two decoding steps
    at most; a longer prompt is prefilled in parts of this size over as many steps."""
    prefix_cache: bool = True
    """Reuse the KV cache of prompt prefixes seen before (in blocks of prefix_block tokens)."""
    prefix_block: PositiveInt = 16
    """Tokens per prefix-cache block: a prefix is reused in whole blocks."""
    prefix_cache_blocks: PositiveInt = 512
    """Blocks kept at most (the least recently used are dropped); each holds prefix_block tokens'
    keys and values for every layer."""
    shutdown_timeout: float = Field(30.0, ge=0)
    """On SIGTERM: seconds to finish the requests in flight before exiting."""


class ServeRecipe(GenerateRecipe):
    """A model recipe plus `serve:`; the model is loaded from generate.checkpoint, as for `generate`."""

    serve: ServeSection = ServeSection()
    """Where and how to serve."""

    @model_validator(mode="after")
    def _check_serving(self):
        if self.model.arch != "gpt":
            raise RecipeError("model.arch", self.model.arch, "megacli serve runs GPT-family (decoder-only) checkpoints")
        s = self.serve
        if s.cache_length is not None and s.cache_length < self.model.max_positions:
            raise RecipeError("serve.cache_length", s.cache_length,
                              f"shorter than the model's context ({self.model.max_positions} positions)")
        return self
