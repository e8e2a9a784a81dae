"""Text generation and scoring with a trained GPT: prefill + one-token steps over Megatron-Core's
static inference context (the KV cache), tensor- and pipeline-parallel, on CUDA or the CPU backend.

Megatron-Core's text-generation controller pins CUDA (a CUDA torch.Generator, CUDA graphs), so
the loop is ours: every step, the first pipeline stage embeds the tokens, hidden states travel
stage to stage by point-to-point sends, the last stage gathers vocab-parallel logits over TP and
broadcasts them down its pipeline group. Every rank then holds the same logits and makes the
same choice (engine.decoding), so only token ids need to agree, never a second broadcast.

Prompts of different lengths are left-padded: pads are masked out as keys, their positions
(learned embeddings) start at each prompt's first real token; RoPE and ALiBi depend on
relative positions only, so a left-padded prompt scores as it does alone.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megacli.backend.cpu import device_rewriting_paused
from megacli.engine import decoding, distributed
from megacli.errors import UserError


@dataclass
class Completion:
    prompt: str
    text: str
    tokens: list[int]
    logprobs: list[float] | None = None
    prompt_tokens: list[int] = field(default_factory=list)


class Model:
    """One GPT replica split over this rank's TP/PP group, stepped token by token."""

    def __init__(self, recipe, runtime, *, vocab_size: int):
        from megatron.core import parallel_state as ps

        from megacli.engine import checkpoint
        from megacli.engine.inference import lean_layers, lean_linears
        from megacli.engine.models import build_model, transformer_config, unwrap

        g = recipe.generate
        ckpt = checkpoint.find_checkpoint(g.checkpoint) if g.checkpoint else None
        if ckpt is None:
            raise UserError(f"generate.checkpoint = {g.checkpoint!r}: no checkpoint there (a directory with `latest` "
                            f"or an iter_* directory)")
        self.recipe, self.device = recipe, runtime.device
        m = recipe.model
        self.config = transformer_config(model=m, parallel=recipe.parallel, precision=recipe.train.precision,
                                         on_cuda=runtime.is_cuda)
        self.vocab_size = vocab_size  # as training sized it: model.vocab_size, else the tokenizer's
        chunks = build_model(recipe=recipe, config=self.config, vocab_size=self.vocab_size)
        chunks = [c.to(runtime.device) for c in chunks]
        checkpoint.load(ckpt=ckpt, chunks=chunks, optimizer=None, scheduler=None, load_optimizer=False,
                        trust_pickle=recipe.checkpoint.trust_pickle)
        self.net = unwrap(chunks[0]).eval()
        lean_linears(self.net)
        lean_layers(self.net)
        self.dtype = self.config.params_dtype
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.prev_rank, self.next_rank = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
        self.last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.checkpoint = ckpt

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, context,
                *, all_positions: bool = False) -> torch.Tensor:
        """Logits [b, vocab] of the last position (all_positions: [b, s, vocab]) on every rank."""
        import torch.distributed as dist

        b, s = tokens.shape
        if not self.first:
            hidden = torch.empty(s, b, self.config.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(hidden, src=self.prev_rank)
            self.net.set_input_tensor(hidden)
        if context is not None:
            context.materialize_only_last_token_logits = not all_positions
        with device_rewriting_paused():
            out = self.net(tokens, positions, mask, inference_context=context, runtime_gather_output=True)
        if not self.last:
            dist.send(out.contiguous(), dst=self.next_rank)
            shape = (b, s if all_positions else 1, self.vocab_size)
            logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        else:
            logits = out[..., : self.vocab_size].float().contiguous()  # gathered over TP by the output layer
            if not all_positions:
                logits = logits[:, -1:]
        if self.pp_size > 1:
            dist.broadcast(logits, src=self.last_rank, group=self.pp_group)
        return logits if all_positions else logits[:, -1]


def _positions_and_masks(lengths: list[int], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding to `width`: position ids (0 at each prompt's first token) and the key mask
    [b, width] (True = pad)."""
    pads = torch.tensor([width - n for n in lengths], device=device)
    cols = torch.arange(width, device=device)
    pad_mask = cols[None, :] < pads[:, None]
    positions = (cols[None, :] - pads[:, None]).clamp(min=0)
    return positions, pad_mask


def _prefill_mask(pad_mask: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s], True = masked: pads are never keys, except for themselves (a fully masked
    row would turn a pad's output into NaN, and NaN values poison the real rows' sums)."""
    s = pad_mask.size(1)
    mask = pad_mask[:, None, None, :].expand(-1, 1, s, s).clone()
    mask &= ~torch.eye(s, dtype=torch.bool, device=pad_mask.device)
    return mask


def _step_mask(pad_mask: torch.Tensor, upto: int) -> torch.Tensor | None:
    """Decode-step mask [b, 1, 1, upto] (True = pad key), or None when nothing is padded (the
    attention then needs no mask at all, which is faster)."""
    return pad_mask[:, None, None, :upto] if pad_mask.any() else None


def _full_mask(pad_mask: torch.Tensor, upto: int) -> torch.Tensor | None:
    """Prefill (or cache-less) mask over the first `upto` positions, or None without padding
    (plain causal attention)."""
    return _prefill_mask(pad_mask[:, :upto]) if pad_mask.any() else None


class Generator:
    """Decode batches of prompts with one Model."""

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

    def context(self, batch: int, length: int):
        from megacli.engine.inference import DecodeContext

        return DecodeContext(batch, length) if self.g.use_cache else None

    def run_batch(self, prompts: list[str], on_token=None) -> list[Completion]:
        encoded = [self.encode(p) for p in prompts]
        for p, ids in zip(prompts, encoded):
            self._check_length(p, len(ids))
        if self.g.num_beams > 1:
            outs = self._beam(encoded)
            return [self._completion(p, ids, out, None) for p, ids, out in zip(prompts, encoded, outs)]
        outs, logps = self._sample(encoded, on_token)
        return [self._completion(p, ids, out, lp) for p, ids, out, lp in zip(prompts, encoded, outs, logps)]

    def _completion(self, prompt, ids, out, logprobs) -> Completion:
        body = out[:-1] if out and out[-1] in self.stop_ids else out
        text = self.tok.decode(body)
        for s in self.g.stop_strings:
            if s in text:
                text = text[: text.index(s)]
        return Completion(prompt=prompt, text=text, tokens=out, prompt_tokens=ids,
                          logprobs=logprobs if self.g.logprobs else None)

    # ------------------------------------------------------------ greedy and sampling

    def _sample(self, encoded: list[list[int]], on_token) -> tuple[list[list[int]], list[list[float]]]:
        g, device = self.g, self.model.device
        b, width = len(encoded), max(map(len, encoded))
        total = width + g.max_new_tokens
        tokens = torch.zeros(b, total, dtype=torch.long, device=device)
        for i, ids in enumerate(encoded):
            tokens[i, width - len(ids) : width] = torch.tensor(ids)
        positions, pad_mask = _positions_and_masks([len(x) for x in encoded], width, device)
        pad_mask = torch.nn.functional.pad(pad_mask, (0, g.max_new_tokens))
        positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(g.max_new_tokens, device=device)], 1)
        ctx = self.context(b, total)
        logits = self.model.forward(tokens[:, :width], positions[:, :width], _full_mask(pad_mask, width), ctx)
        generated = [[] for _ in range(b)]
        logprobs = [[] for _ in range(b)]
        done = torch.zeros(b, dtype=torch.bool)
        top_p = g.top_p
        for t in range(g.max_new_tokens):
            cur = width + t
            scores = decoding.repetition_penalty(logits, tokens[:, :cur], g.repetition_penalty)
            nxt = decoding.choose(scores, temperature=g.temperature, top_k=g.top_k, top_p=top_p, generator=self.sampler)
            top_p = decoding.decayed_top_p(top_p, g.top_p_decay, g.top_p_bound)
            lp = torch.log_softmax(logits.float(), -1).gather(1, nxt[:, None]).squeeze(1)
            tokens[:, cur] = nxt
            for i in range(b):
                if done[i]:
                    continue
                generated[i].append(int(nxt[i]))
                logprobs[i].append(float(lp[i]))
                if int(nxt[i]) in self.stop_ids or self._hit_stop_string(generated[i]):
                    done[i] = True
            if on_token is not None:
                on_token(generated)
            if done.all() or t + 1 == g.max_new_tokens:
                break
            if ctx is not None:
                ctx.sequence_len_offset = cur
                ctx.enable_decode_mode()
                logits = self.model.forward(tokens[:, cur : cur + 1], positions[:, cur : cur + 1],
                                            _step_mask(pad_mask, cur + 1), ctx)
            else:
                logits = self.model.forward(tokens[:, : cur + 1], positions[:, : cur + 1],
                                            _full_mask(pad_mask, cur + 1), None)
        return generated, logprobs

    def _hit_stop_string(self, generated: list[int]) -> bool:
        if not self.g.stop_strings:
            return False
        text = self.tok.decode(generated)
        return any(s in text for s in self.g.stop_strings)

    # ------------------------------------------------------------ beam search

    def _beam(self, encoded: list[list[int]]) -> list[list[int]]:
        if self.g.stop_strings:
            raise UserError("generate.stop_strings are for sampling and greedy decoding; beam search stops at stop tokens")
        g, device, beams = self.g, self.model.device, self.g.num_beams
        b, width = len(encoded), max(map(len, encoded))
        rows = [ids for ids in encoded for _ in range(beams)]  # each prompt repeated for its beams
        total = width + g.max_new_tokens
        tokens = torch.zeros(len(rows), total, dtype=torch.long, device=device)
        for i, ids in enumerate(rows):
            tokens[i, width - len(ids) : width] = torch.tensor(ids)
        positions, pad_mask = _positions_and_masks([len(x) for x in rows], width, device)
        pad_mask = torch.nn.functional.pad(pad_mask, (0, g.max_new_tokens))
        positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(g.max_new_tokens, device=device)], 1)
        ctx = self.context(len(rows), total)
        first = self.model.forward(tokens[:, :width], positions[:, :width], _full_mask(pad_mask, width), ctx)
        state = {"cur": width, "tokens": tokens}

        def step(last: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
            cur = state["cur"]
            state["tokens"] = state["tokens"][parents]
            state["tokens"][:, cur] = last
            if ctx is not None:
                ctx.swap_key_value_dict(parents)
                ctx.sequence_len_offset = cur
                ctx.enable_decode_mode()
                out = self.model.forward(state["tokens"][:, cur : cur + 1], positions[:, cur : cur + 1],
                                         _step_mask(pad_mask, cur + 1), ctx)
            else:
                out = self.model.forward(state["tokens"][:, : cur + 1], positions[:, : cur + 1],
                                         _full_mask(pad_mask, cur + 1), None)
            state["cur"] = cur + 1
            return out

        result = decoding.beam_search(step, first, batch=b, num_beams=beams, max_new_tokens=g.max_new_tokens,
                                      stop_ids=self.stop_ids, length_penalty=g.length_penalty)
        return result.tokens

    # ------------------------------------------------------------ scoring

    def score(self, texts: list[str]) -> dict:
        """Sum of token log-likelihoods (each token given the ones before it) and perplexity."""
        total_lp, total_n = 0.0, 0
        per_text = []
        for start in range(0, len(texts), self.g.batch_size):
            batch = texts[start : start + self.g.batch_size]
            ids = [self.encode(t) for t in batch]
            for lp, n in self._loglik(ids, [1] * len(ids)):
                per_text.append({"logprob": lp, "tokens": n, "perplexity": math.exp(-lp / n) if n else float("nan")})
                total_lp, total_n = total_lp + lp, total_n + n
        return {"texts": len(texts), "tokens": total_n, "logprob": total_lp,
                "perplexity": math.exp(-total_lp / total_n) if total_n else float("nan"), "per_text": per_text}

    def _windows(self, ids: list[int]) -> list[tuple[list[int], int]]:
        """Texts longer than the context are scored in windows of max_positions tokens; each
        window scores only the tokens the previous one did not."""
        size = self.max_positions
        if len(ids) <= size:
            return [(ids, 1)]
        out, scored = [(ids[:size], 1)], size
        while scored < len(ids):
            end = min(scored + size // 2, len(ids))
            window = ids[max(0, end - size) : end]
            out.append((window, len(window) - (end - scored)))
            scored = end
        return out

    def _loglik(self, encoded: list[list[int]], first_scored: list[int]) -> list[tuple[float, int]]:
        """Per sequence: (sum of log p(token_i | tokens_<i) for i >= first_scored, count)."""
        results = []
        for ids, first in zip(encoded, first_scored):
            lp_sum, n = 0.0, 0
            for window, start in self._windows(ids) if first == 1 else [(ids, first)]:
                t = torch.tensor([window], device=self.model.device)
                pos = torch.arange(len(window), device=self.model.device)[None]
                logits = self.model.forward(t, pos, None, None, all_positions=True)[0]
                logp = torch.log_softmax(logits[:-1].float(), -1).gather(1, t[0, 1:, None]).squeeze(1)
                lp_sum += float(logp[start - 1 :].sum())
                n += len(window) - start
            results.append((lp_sum, n))
        return results

    def cloze(self, texts: list[str]) -> dict:
        """LAMBADA-style: the last word must come out of greedy decoding of its tokens given the
        context (every target token is the argmax), as Megatron-LM's zero-shot evaluation."""
        correct = 0
        for text in texts:
            context, _, last = text.rstrip().rpartition(" ")
            if not context:
                raise UserError(f"cloze text {text[:40]!r} has no context before its last word")
            ctx_ids, full = self.encode(context), self.encode(context + " " + last)
            t = torch.tensor([full], device=self.model.device)
            pos = torch.arange(len(full), device=self.model.device)[None]
            logits = self.model.forward(t, pos, None, None, all_positions=True)[0]
            targets = t[0, len(ctx_ids) :]
            predicted = logits[len(ctx_ids) - 1 : -1].argmax(-1)
            correct += bool((predicted == targets).all())
        return {"texts": len(texts), "correct": correct, "accuracy": correct / len(texts) if texts else float("nan")}


# ---------------------------------------------------------------- T5


class Seq2Seq:
    """A T5 replica (tensor parallel; Megatron-Core has no T5 pipelining): the encoder runs once
    per batch, the decoder over the whole target prefix at each step (no KV cache: T5's decoder
    inputs here are short, and its relative position biases are computed per length)."""

    def __init__(self, recipe, runtime, *, vocab_size: int, bos: int | None):
        from megacli.engine import checkpoint
        from megacli.engine.models import build_model, transformer_config, unwrap

        ckpt = checkpoint.find_checkpoint(recipe.generate.checkpoint) if recipe.generate.checkpoint else None
        if ckpt is None:
            raise UserError(f"generate.checkpoint = {recipe.generate.checkpoint!r}: no checkpoint there")
        m = recipe.model
        config = transformer_config(model=m, parallel=recipe.parallel, precision=recipe.train.precision,
                                    on_cuda=runtime.is_cuda)
        chunks = [c.to(runtime.device) for c in build_model(recipe=recipe, config=config, vocab_size=vocab_size)]
        checkpoint.load(ckpt=ckpt, chunks=chunks, optimizer=None, scheduler=None, load_optimizer=False,
                        trust_pickle=recipe.checkpoint.trust_pickle)
        self.net, self.device, self.vocab_size = unwrap(chunks[0]).eval(), runtime.device, vocab_size
        self.recipe = recipe
        self.decoder_start = self._decoder_start(ckpt, bos)

    def _decoder_start(self, ckpt, bos: int | None) -> int:
        from megacli.checkpoint.layout import carried_hf_config

        start = self.recipe.generate.decoder_start_token
        if start is None:
            start = (carried_hf_config(ckpt, self.recipe) or {}).get("decoder_start_token_id", bos)
        if start is None:
            raise UserError("the tokenizer has no BOS token to start the T5 decoder with; set generate.decoder_start_token")
        if not 0 <= start < self.vocab_size:
            raise UserError(f"generate.decoder_start_token = {start} is outside the vocabulary (0..{self.vocab_size - 1})")
        return int(start)

    @torch.no_grad()
    def encode(self, enc: torch.Tensor, enc_pad: torch.Tensor) -> torch.Tensor:
        with device_rewriting_paused():
            return self.net(enc, None, enc_pad, None, None, output_encoder_hidden_only=True)

    @torch.no_grad()
    def logits(self, enc, enc_hidden, enc_pad, dec) -> torch.Tensor:
        """[b, vocab] for the next decoder token, gathered over TP."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        with device_rewriting_paused():
            out = self.net(enc, dec, enc_pad, None, enc_pad, encoder_hidden_states=enc_hidden)
        return gather_from_tensor_model_parallel_region(out[:, -1:].contiguous())[:, -1, : self.vocab_size].float()


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

    def _sample(self, encoded: list[list[int]], on_token) -> tuple[list[list[int]], list[list[float]]]:
        g, device = self.g, self.model.device
        b, width = len(encoded), max(map(len, encoded))
        pad = self.tok.pad if self.tok.pad is not None else 0
        enc = torch.full((b, width), pad, dtype=torch.long, device=device)
        for i, ids in enumerate(encoded):
            enc[i, : len(ids)] = torch.tensor(ids)
        lengths = torch.tensor([len(x) for x in encoded], device=device)
        enc_pad = (torch.arange(width, device=device)[None, :] >= lengths[:, None])[:, None, None, :]
        hidden = self.model.encode(enc, enc_pad)
        dec = torch.full((b, 1), self.model.decoder_start, dtype=torch.long, device=device)
        generated, logprobs = [[] for _ in range(b)], [[] for _ in range(b)]
        done = torch.zeros(b, dtype=torch.bool)
        top_p = g.top_p
        for _ in range(g.max_new_tokens):
            logits = self.model.logits(enc, hidden, enc_pad, dec)
            scores = decoding.repetition_penalty(logits, dec, g.repetition_penalty)
            nxt = decoding.choose(scores, temperature=g.temperature, top_k=g.top_k, top_p=top_p, generator=self.sampler)
            top_p = decoding.decayed_top_p(top_p, g.top_p_decay, g.top_p_bound)
            lp = torch.log_softmax(logits, -1).gather(1, nxt[:, None]).squeeze(1)
            dec = torch.cat([dec, nxt[:, None]], 1)
            for i in range(b):
                if not done[i]:
                    generated[i].append(int(nxt[i]))
                    logprobs[i].append(float(lp[i]))
                    done[i] = int(nxt[i]) in self.stop_ids or self._hit_stop_string(generated[i])
            if on_token is not None:
                on_token(generated)
            if done.all():
                break
        return generated, logprobs


# ---------------------------------------------------------------- the job


def read_texts(path: str, key: str) -> list[str]:
    """JSONL (one object per line with `key`) or plain text (one item per line); errors name the line."""
    from megacli.data.jsonl import iter_lines

    items = []
    for where, item in iter_lines(path, plain_text=True):
        if isinstance(item, str):
            items.append(item)
        elif isinstance(item, dict) and isinstance(item.get(key), str):
            items.append(item[key])
        else:
            raise UserError(f"{where}: no string field {key!r}")
    return items


def build_generator(recipe, runtime) -> Generator:
    """The recipe's tokenizer and model (the vocabulary sized as training sized it)."""
    from megacli.data.tokenizers import load_tokenizer
    from megacli.plan import model_vocab_size

    tok = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path, vocab_size=recipe.model.vocab_size)
    vocab = model_vocab_size(recipe, tok)  # T5: with the sentinels its training appended
    if recipe.model.arch == "t5":
        return Seq2SeqGenerator(Seq2Seq(recipe, runtime, vocab_size=vocab, bos=tok.bos), tok, recipe.generate)
    return Generator(Model(recipe, runtime, vocab_size=vocab), tok, recipe.generate)


def run(recipe) -> None:
    runtime = distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=recipe.generate.seed)
    try:
        _run(recipe, runtime)
    finally:
        distributed.teardown()


def _run(recipe, runtime) -> None:
    g = recipe.generate
    if recipe.model.arch == "t5" and (g.score or g.cloze):
        raise UserError("--score and --cloze are for GPT models (T5's likelihood depends on what the encoder is given)")
    gen = build_generator(recipe, runtime)
    tok = gen.tok
    speaker = runtime.rank == 0
    if g.score or g.cloze:
        texts = read_texts(g.score or g.cloze, "text")
        result = gen.score(texts) if g.score else gen.cloze(texts)
        if speaker:
            _report_scores(result, g)
        return
    prompts = list(g.prompts) + (read_texts(g.prompts_file, "prompt") if g.prompts_file else [])
    if not prompts:
        raise UserError("no prompts: give --prompt TEXT, --prompts FILE or generate.prompts")
    out_file = open(g.output, "w", encoding="utf-8") if (g.output and speaker) else None
    try:
        for start in range(0, len(prompts), g.batch_size):
            batch = prompts[start : start + g.batch_size]
            stream = _Stream(tok, batch[0]) if (speaker and g.stream and len(batch) == 1 and g.num_beams == 1) else None
            results = gen.run_batch(batch, on_token=stream)
            if speaker:
                for r in results:
                    if stream is not None:
                        stream.finish(r.text)
                    else:
                        print(f"\n>>> {r.prompt}\n{r.text}", flush=True)
                    if out_file is not None:
                        record = {"prompt": r.prompt, "text": r.text, "tokens": r.tokens}
                        if r.logprobs is not None:
                            record["logprobs"] = r.logprobs
                        out_file.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if out_file is not None:
            out_file.close()


class _Stream:
    """Print a single prompt's text as its tokens arrive."""

    def __init__(self, tok, prompt: str):
        self.tok, self.shown = tok, ""
        print(f"\n>>> {prompt}", flush=True)

    def __call__(self, generated: list[list[int]]) -> None:
        text = self.tok.decode(generated[0])
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown) :])
            sys.stdout.flush()
            self.shown = text

    def finish(self, text: str) -> None:
        if not text.startswith(self.shown):
            sys.stdout.write("\n" + text)
        print(flush=True)


def _report_scores(result: dict, g) -> None:
    if "perplexity" in result:
        print(f"{result['texts']} texts, {result['tokens']} scored tokens: log-likelihood {result['logprob']:.4f}, "
              f"perplexity {result['perplexity']:.4f}", flush=True)
    else:
        print(f"cloze accuracy {result['accuracy']:.4f} ({result['correct']}/{result['texts']})", flush=True)
    if g.output:
        Path(g.output).write_text(json.dumps(result, indent=2) + "\n")
