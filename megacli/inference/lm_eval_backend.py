"""lm-evaluation-harness on a megacli ``runner.Model``: ``Work`` is the token-level work (score
batches, decode batches) that every rank of the TP/PP layout runs in lockstep (``lockstep.Lockstep``
sends rank 0's calls to the other ranks), and ``MegacliLM`` is the harness's model interface on rank 0,
tokenizing, batching and truncating requests as the harness's own Hugging Face backend does, so
the two give the same numbers on the same model.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from megacli.errors import UserError
from megacli.inference import sampling
from megacli.inference.lockstep import Lockstep
from megacli.inference.runner import left_padded


class Work:
    """What every rank computes for one batch; the results are the same on every rank."""

    def __init__(self, model, tokenizer, *, seed: int):
        self.model, self.tok = model, tokenizer
        self.sampler = torch.Generator().manual_seed(seed)

    def score(self, inputs: list[list[int]], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """(sum of log p, whether greedy decoding gives it) of each continuation: the tokens that
        end ``inputs`` shifted by one (``inputs`` is context + continuation without its last token)."""
        batch = left_padded(inputs, max_new_tokens=0, device=self.model.device)
        logits = self.model.all_logits(batch)
        out = []
        for i, cont in enumerate(continuations):
            rows = torch.log_softmax(logits[i, batch.width - len(cont) :], dim=-1)
            target = torch.tensor(cont, device=rows.device)
            out.append((float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())))
        return out

    def generate(self, encoded: list[list[int]], *, until: list[str], max_new_tokens: int, temperature: float,
                 top_k: int, top_p: float) -> list[list[int]]:
        """Generated tokens per prompt, up to a stop string, the end-of-document token or
        max_new_tokens (greedy at temperature 0)."""
        from megacli.recipe.generate import GenerateSection

        decoding = GenerateSection(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        stop_ids = {self.tok.eod}

        def stopped_by_text(tokens: list[int]) -> bool:
            text = self.tok.decode(tokens)
            return any(s in text for s in until)

        picks = sampling.Picks(decoding, len(encoded), sampler=self.sampler, stop_ids=stop_ids,
                               stopped_by_text=stopped_by_text)
        sampling.sample(self.model, encoded, picks, max_new_tokens=max_new_tokens, use_cache=True)
        return [t[:-1] if t and t[-1] in stop_ids else t for t in picks.tokens]


class TaskTiming:
    """Seconds and model tokens (tokens run through the model, generated ones included) per task."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.tokens: dict[str, int] = defaultdict(int)

    def report(self) -> dict:
        return {task: {"seconds": round(self.seconds[task], 3), "tokens": self.tokens[task],
                       "tokens_per_second": round(self.tokens[task] / self.seconds[task], 1) if self.seconds[task] else None}
                for task in self.seconds}


class MegacliLM(TemplateLM):
    """The harness's LM interface on rank 0 (the harness sees one process: rank 0 of 1)."""

    def __init__(self, lockstep: Lockstep, tokenizer, *, max_length: int, batch_size: int, max_gen_toks: int,
                 add_bos: bool):
        super().__init__()
        self.lockstep, self.tok = lockstep, tokenizer
        self._max_length, self._batch_size, self._max_gen_toks, self.add_bos = max_length, batch_size, max_gen_toks, add_bos
        self.timing = TaskTiming()
        self._tokens = 0  # model tokens of the requests running now

    # ---------------------------------------------------------------- tokenizer

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos if self.tok.bos is not None else self.tok.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        ids = self.tok.encode(string)
        with_bos = self.add_bos if add_special_tokens is None else add_special_tokens
        if with_bos and self.tok.bos is not None and ids[:1] != [self.tok.bos]:
            ids = [self.tok.bos] + ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(tokens)

    # ---------------------------------------------------------------- request types

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._per_task(requests, lambda group: super(MegacliLM, self).loglikelihood(group, disable_tqdm=True))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return self._per_task(requests, self._rolling)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return self._per_task(requests, self._generate)

    def _per_task(self, requests, run) -> list:
        """``run`` on each task's requests in turn, timed; results in the requests' order."""
        by_task: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            by_task[req.task_name].append(i)
        out: list = [None] * len(requests)
        for task, indices in by_task.items():
            self._tokens, start = 0, time.perf_counter()
            for i, result in zip(indices, run([requests[i] for i in indices])):
                out[i] = result
            self.timing.seconds[task] += time.perf_counter() - start
            self.timing.tokens[task] += self._tokens
        return out

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        """Inputs cut to the model's context from the left, as the harness's hf backend does;
        batches of similar lengths (longest first)."""
        def longest_first(req):
            whole = req[1] + req[2]
            return -len(whole), tuple(whole)

        order = Collator(requests, sort_fn=longest_first)
        results = []
        for chunk in order.get_batched(n=self._batch_size):
            inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in chunk]
            continuations = [cont for _, _, cont in chunk]
            self._tokens += sum(map(len, inputs))
            results.extend(self.lockstep.call("score", inputs, continuations))
        return order.get_original(results)

    def _rolling(self, requests) -> list[float]:
        """Perplexity requests: disjoint windows of the model's context (the harness's own windows)."""
        windows, owners = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            for ctx, cont in map(harness_utils.make_disjoint_window, harness_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, ctx, cont))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def _generate(self, requests) -> list[str]:
        eos = self.tok.decode([self.eot_token_id])
        order = Collator([req.args for req in requests], sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
                         group_by="gen_kwargs", group_fn=lambda a: a[1])
        results = []
        for chunk in order.get_batched(n=self._batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(dict(all_kwargs[0]), self._max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            if max_new >= self.max_length:
                raise UserError(f"a task asks for max_gen_toks = {max_new} new tokens, but the model's context is "
                                f"{self.max_length} tokens")
            encoded = [self.tok_encode(c, left_truncate_len=self.max_length - max_new) for c in contexts]
            sampled = kwargs.get("do_sample", False)
            generated = self.lockstep.call("generate", encoded, until=until, max_new_tokens=max_new,
                                           temperature=float(kwargs.get("temperature", 0.0)) if sampled else 0.0,
                                           top_k=int(kwargs.get("top_k") or 0) if sampled else 0,
                                           top_p=float(kwargs.get("top_p") or 0.0) if sampled else 0.0)
            self._tokens += sum(map(len, encoded)) + sum(map(len, generated))
            results.extend(postprocess_generated_text(generation=self.tok.decode(g), stop=until, think_end_token=None)
                           for g in generated)
        return order.get_original(results)
