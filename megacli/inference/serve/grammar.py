"""Structured output for megacli serve (`response_format`): a JSON schema compiled by llguidance,
which gives, before each token, the tokens that keep the text a prefix of a valid answer; the
others get -inf. Refused (400) when the schema uses a feature llguidance does not enforce."""

from __future__ import annotations

import torch


class GrammarError(ValueError):
    """A response_format that cannot be enforced (the message names why)."""


class Grammars:
    """Compiles response_format objects for one tokenizer (a Hugging Face one, loaded at first use)."""

    def __init__(self, tokenizer_path: str | None, vocab_size: int):
        self.tokenizer_path, self.vocab_size = tokenizer_path, vocab_size
        self._tokenizer = None

    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(self.tokenizer_path)
            self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)
        return self._tokenizer

    def compile(self, response_format: dict | None) -> str | None:
        """The grammar of a response_format ({"type": "text" | "json_object" | "json_schema", ...}),
        None for text; a GrammarError naming what cannot be enforced."""
        kind = (response_format or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            schema = {"type": "object"}
        elif kind == "json_schema":
            schema = ((response_format or {}).get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise GrammarError("response_format.json_schema.schema: a JSON schema (an object) is required")
        else:
            raise GrammarError(f"response_format.type: {kind!r}; megacli serve takes text, json_object or json_schema")
        try:
            import llguidance
        except ImportError:
            raise GrammarError("response_format needs llguidance on the server: pip install 'megacli[serve]'") from None
        if self.tokenizer_path is None:
            raise GrammarError("response_format needs a Hugging Face tokenizer; this model has another kind")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        if not failed:
            matcher = llguidance.LLMatcher(self.tokenizer(), grammar)
            failed, messages = matcher.is_error(), [matcher.get_error()]
        if failed:
            raise GrammarError("response_format: megacli serve cannot enforce this JSON schema: " + "; ".join(messages))
        return grammar

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self.tokenizer(), grammar)


class Constraint:
    """One sequence's grammar state: ``allowed`` masks logits, ``accept`` advances by a chosen token."""

    def __init__(self, tokenizer, grammar: str):
        import llguidance
        import llguidance.torch

        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
        self.eos = tokenizer.eos_token

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [vocab] with -inf for every token the grammar does not allow next."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        masked = logits.float().clone()[None]
        llguidance.torch.apply_token_bitmask_inplace(masked, self.bitmask)
        return masked[0]

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def done(self) -> bool:
        """The answer is complete (the grammar took its end token, or allows nothing more)."""
        return self.matcher.is_stopped()
