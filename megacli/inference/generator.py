"""Text in, text out: a tokenizer and a loaded model (``runner``), decoding batches of prompts
greedily, by sampling (``sampling``) or by beam search (``beam``), or scoring texts (``scoring``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megacli.errors import UserError
from megacli.inference import beam, sampling, scoring
from megacli.inference.runner import Model, Seq2Seq


@dataclass
class Completion:
    prompt: str
    text: str
    tokens: list[int]
    logprobs: list[float] | None = None
    prompt_tokens: list[int] = field(default_factory=list)


class Generator:
    """Decode batches of prompts with one GPT Model."""

    def __init__(self, model: Model, tokenizer, gen):
        self.model, self.tok, self.g = model, tokenizer, gen
        self.stop_ids = set(gen.stop_tokens) | ({tokenizer.eod} if gen.stop_at_eod and tokenizer.eod is not None else set())
        self.sampler = torch.Generator().manual_seed(gen.seed)
        self.max_positions = model.recipe.model.max_positions

    def encode(self, prompt: str) -> list[int]:
        ids = self.tok.encode(prompt)
        if self.g.add_bos:
            if self.tok.bos is None:
                raise UserError("generate.add_bos: the tokenizer has no BOS token")
            ids = [self.tok.bos] + ids
        if not ids:
            raise UserError(f"prompt {prompt!r} encodes to no tokens")
        bad = [i for i in ids if i >= self.model.vocab_size]
        if bad:
            raise UserError(f"the tokenizer gives id {max(bad)} but the checkpoint's vocabulary has {self.model.vocab_size} "
                            f"entries: the tokenizer and the checkpoint do not match")
        return ids

    def _check_length(self, prompt: str, n: int) -> None:
        if n + self.g.max_new_tokens > self.max_positions:
            raise UserError(f"prompt {prompt[:40]!r}… has {n} tokens; with max_new_tokens = {self.g.max_new_tokens} it "
                            f"exceeds the model's context of {self.max_positions} positions (shorten it or lower "
                            f"--max-new-tokens)")

    def run_batch(self, prompts: list[str], on_token=None) -> list[Completion]:
        encoded = [self.encode(p) for p in prompts]
        for p, ids in zip(prompts, encoded):
            self._check_length(p, len(ids))
        if self.g.num_beams > 1:
            outs = self._beam(encoded)
            return [self._completion(p, ids, out, None) for p, ids, out in zip(prompts, encoded, outs)]
        picks = self._sample(encoded, on_token)
        return [self._completion(p, ids, out, lp) for p, ids, out, lp in zip(prompts, encoded, picks.tokens, picks.logprobs)]

    def _completion(self, prompt, ids, out, logprobs) -> Completion:
        body = out[:-1] if out and out[-1] in self.stop_ids else out
        text = self.tok.decode(body)
        for s in self.g.stop_strings:
            if s in text:
                text = text[: text.index(s)]
        return Completion(prompt=prompt, text=text, tokens=out, prompt_tokens=ids,
                          logprobs=logprobs if self.g.logprobs else None)

    def _picks(self, batch: int) -> sampling.Picks:
        return sampling.Picks(self.g, batch, sampler=self.sampler, stop_ids=self.stop_ids,
                              stopped_by_text=self._hit_stop_string)

    def _sample(self, encoded: list[list[int]], on_token) -> sampling.Picks:
        return sampling.sample(self.model, encoded, self._picks(len(encoded)), max_new_tokens=self.g.max_new_tokens,
                               use_cache=self.g.use_cache, on_token=on_token)

    def _hit_stop_string(self, generated: list[int]) -> bool:
        if not self.g.stop_strings:
            return False
        text = self.tok.decode(generated)
        return any(s in text for s in self.g.stop_strings)

    def _beam(self, encoded: list[list[int]]) -> list[list[int]]:
        if self.g.stop_strings:
            raise UserError("generate.stop_strings are for sampling and greedy decoding; beam search stops at stop tokens")
        g = self.g
        return beam.beam_generate(self.model, encoded, num_beams=g.num_beams, max_new_tokens=g.max_new_tokens,
                                  stop_ids=self.stop_ids, length_penalty=g.length_penalty, use_cache=g.use_cache)

    def score(self, texts: list[str]) -> dict:
        """Sum of token log-likelihoods (each token given the ones before it) and perplexity."""
        return scoring.score(self.model, [self.encode(t) for t in texts], context=self.max_positions)

    def cloze(self, texts: list[str]) -> dict:
        """LAMBADA-style last-word accuracy (see scoring.cloze)."""
        return scoring.cloze(self.model, texts, self.encode)


class Seq2SeqGenerator(Generator):
    """Greedy or sampled T5 generation: prompts go to the encoder, the decoder starts from
    generate.decoder_start_token (see its default)."""

    def _check_length(self, prompt: str, n: int) -> None:
        m = self.model.recipe.model
        if n > m.seq_length:
            raise UserError(f"prompt {prompt[:40]!r}… has {n} tokens; the encoder takes {m.seq_length}")
        if self.g.max_new_tokens + 1 > m.dec_seq_length:
            raise UserError(f"max_new_tokens = {self.g.max_new_tokens} exceeds the decoder's {m.dec_seq_length - 1} positions")

    def _beam(self, encoded):
        raise UserError("beam search is available for GPT models; T5 generation is greedy or sampled")

    def _sample(self, encoded: list[list[int]], on_token) -> sampling.Picks:
        pad = self.tok.pad if self.tok.pad is not None else 0
        return sampling.sample_seq2seq(self.model, encoded, self._picks(len(encoded)),
                                       max_new_tokens=self.g.max_new_tokens, pad=pad, on_token=on_token)


def build_generator(recipe, runtime) -> Generator:
    """The recipe's tokenizer and model (the vocabulary sized as training sized it)."""
    from megacli.data.tokenizers import load_tokenizer
    from megacli.plan import model_vocab_size

    tok = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path, vocab_size=recipe.model.vocab_size)
    vocab = model_vocab_size(recipe, tok)  # T5: with the sentinels its training appended
    if recipe.model.arch == "t5":
        return Seq2SeqGenerator(Seq2Seq(recipe, runtime, vocab_size=vocab, bos=tok.bos), tok, recipe.generate)
    return Generator(Model(recipe, runtime, vocab_size=vocab), tok, recipe.generate)
