"""The OpenAI API's request bodies (the parameters megacli serve takes), as pydantic models. Fields
OpenAI has and megacli does not act on are accepted when they change nothing and refused (400)
when they would."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[int] = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    """An extension: sample among the k most likely tokens (0 = all)."""
    n: int = Field(1, ge=1, le=16)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**63 - 1)
    """A 64-bit integer, as OpenAI's."""
    stream: bool = False
    stream_options: Optional[dict] = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    response_format: Optional[dict] = None
    """{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}."""
    logit_bias: Optional[dict[str, float]] = None
    """Token id (as a string) -> a bias from -100 to 100 added to its logit."""

    @model_validator(mode="after")
    def _checked(self):
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or not -100 <= value <= 100:
                raise ValueError(f"logit_bias: {key!r}: {value}: keys are token ids, values from -100 to 100")
        stops = self.stop_list()
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop: at most 4 non-empty strings")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _completion_only(self):
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of is not supported by megacli serve")
        if self.suffix:
            raise ValueError("suffix is not supported by megacli serve")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """Each prompt: a string, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list] = None
    functions: Optional[list] = None

    @model_validator(mode="after")
    def _chat_only(self):
        if self.tools or self.functions:
            raise ValueError("tools and functions are not supported by megacli serve")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
