"""Continuous batching on rank 0: requests wait in a bounded queue, join the running batch as
slots free up (prompts that arrive together prefilled together, and a prompt longer than the
prefill budget in parts, between decoding steps), and every decoding slot advances one token per
step (``slots.Slots``, run on every rank through ``lockstep.Lockstep``). Each sequence chooses its
own tokens (greedy, or sampled with its own seeded generator), so a request decodes as it would
alone. Results go back to the HTTP side through each sequence's ``emit`` callback, which must be
thread-safe: the loop runs in its own thread.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from megacli.inference import sampling


class QueueFull(Exception):
    """More requests are waiting than the server takes (answered 503 with Retry-After)."""


class TooBig(Exception):
    """A request with more sequences than the queue ever holds (answered 400)."""


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # alternatives per token (0 = the chosen token's log-probability alone)
    echo: bool = False  # also the prompt's tokens (with their log-probabilities when logprobs is set)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass
class Token:
    id: int
    logprob: float | None  # None: the prompt's first token
    top: dict[int, float] | None


@dataclass
class Sequence:
    """One choice of one request: its prompt, how to decode, and what it produced so far."""

    ids: list[int]
    params: Sampling
    emit: Callable[[str, object], None]  # ("token", Token) per token (prompt tokens first with echo), ("end", reason)
    cancelled: bool = False
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    text: "TextSoFar | None" = None
    constraint: object | None = None  # a grammar.Constraint (response_format), or None


class TextSoFar:
    """A sequence's text as `megacli generate` cuts it (after a stop token, before the first stop
    string), and the part safe to stream: a tail that could still become a stop string, or an
    incomplete UTF-8 character, is held back."""

    def __init__(self, tok, stop: list[str], stop_ids: set[int]):
        self.tok, self.stop, self.stop_ids = tok, stop, stop_ids
        self.sent = ""

    def text(self, generated: list[int]) -> tuple[str, bool]:
        """(text, whether a stop string ended it)."""
        body = generated[:-1] if generated and generated[-1] in self.stop_ids else generated
        text, hit = self.tok.decode(body), False
        for s in self.stop:
            if s in text:
                text, hit = text[: text.index(s)], True
        return text, hit

    def delta(self, text: str, final: bool) -> str:
        safe = text
        if not final:
            safe = safe.rstrip("\ufffd")
            for s in self.stop:
                for k in range(min(len(s) - 1, len(safe)), 0, -1):
                    if safe.endswith(s[:k]):
                        safe = safe[:-k]
                        break
        if not safe.startswith(self.sent) or len(safe) <= len(self.sent):
            return ""
        out, self.sent = safe[len(self.sent) :], safe
        return out


def label(value) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Counters and gauges for /metrics (read by the HTTP thread, written by both)."""

    def __init__(self, cache=None):
        self.cache = cache  # the Slots (for its shift count)
        self.cancelled = 0
        self.requests: dict[tuple[str, int], int] = collections.Counter()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.queue_length = 0
        self.batch_size = 0
        self.steps = 0
        self.prefills = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens) of recent steps

    def tokens_done(self, n: int) -> None:
        now = time.monotonic()
        self.generated_tokens += n
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - 10:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        recent = list(self._recent)
        if not recent:
            return 0.0
        span = max(time.monotonic() - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span

    def _prefix(self):
        return getattr(self.cache, "prefix", None)

    def text(self) -> str:
        """Prometheus' text exposition format."""
        lines = ["# HELP megacli_requests_total Requests answered, by endpoint and status.",
                 "# TYPE megacli_requests_total counter"]
        for (endpoint, status), n in sorted(self.requests.items()):
            lines.append(f'megacli_requests_total{{endpoint="{label(endpoint)}",status="{label(status)}"}} {n}')
        for name, kind, help_, value in (
                ("prompt_tokens_total", "counter", "Prompt tokens prefilled.", self.prompt_tokens),
                ("generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
                ("decode_steps_total", "counter", "Batched decoding steps run.", self.steps),
                ("prefills_total", "counter", "Prefill forwards run (prompts prefilled together count once; a prompt "
                 "prefilled in parts, once per part).", self.prefills),
                ("cancelled_total", "counter", "Sequences stopped early because their client went away.", self.cancelled),
                ("cache_shifts_total", "counter", "Times the KV cache's columns were moved to make room.",
                 self.cache.shifts if self.cache is not None else 0),
                ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens whose keys and values came from the prefix cache.",
                 self._prefix().hit_tokens if self._prefix() else 0),
                ("tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
                 round(self.tokens_per_second(), 3)),
                ("queue_length", "gauge", "Requests waiting for a slot.", self.queue_length),
                ("batch_size", "gauge", "Sequences in the running batch.", self.batch_size)):
            lines += [f"# HELP megacli_{name} {help_}", f"# TYPE megacli_{name} {kind}", f"megacli_{name} {value}"]
        return "\n".join(lines) + "\n"


def _wants_every_logit(seq: Sequence) -> bool:
    return seq.params.echo and seq.params.logprobs is not None


def _plain_greedy(seq: Sequence) -> bool:
    """Whether the sequence's next token is the argmax of the model's logits, as they come."""
    p = seq.params
    return (p.temperature == 0 and seq.constraint is None
            and not sampling.penalized(p.presence_penalty, p.frequency_penalty, p.logit_bias))


def _top(logp: torch.Tensor, k: int) -> dict[int, float]:
    values, ids = torch.topk(logp, k)
    return {int(i): float(v) for i, v in zip(ids, values)}


class Batcher:
    """The decoding loop: ``submit`` sequences from any thread; ``run`` in one thread until ``stop``."""

    def __init__(self, lockstep, tok, *, max_batch: int, max_queue: int, stop_ids: set[int], metrics: Metrics,
                 idle_seconds: float = 30.0, on_fatal: Callable[[], None] = lambda: None, prefill_tokens: int = 2048):
        self.lockstep, self.tok, self.idle_seconds, self.on_fatal = lockstep, tok, idle_seconds, on_fatal
        self.prefill_tokens = prefill_tokens
        self.max_batch, self.max_queue, self.stop_ids, self.metrics = max_batch, max_queue, stop_ids, metrics
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence, decoding
        self.prefilling: dict[int, tuple[Sequence, int]] = {}  # slot -> (sequence, prompt tokens prefilled so far)
        self.next_token: dict[int, int] = {}  # slot -> the token to feed at the next step
        self.wakeup = threading.Condition()
        self.stopping = False
        self.error: BaseException | None = None

    # ---------------------------------------------------------------- any thread

    def check_size(self, count: int) -> None:
        """TooBig unless ``count`` sequences fit in the queue at all."""
        if count > self.max_queue:
            raise TooBig(f"this request makes {count} sequences (prompts x n); the server takes at most "
                         f"{self.max_queue} at a time (serve.max_queue): split it")

    def submit(self, seqs: list[Sequence]) -> None:
        self.check_size(len(seqs))
        with self.wakeup:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) + len(seqs) > self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (at most {self.max_queue})")
            for s in seqs:
                ends = {s.constraint.eos} if s.constraint is not None and s.constraint.eos is not None else set()
                s.text = TextSoFar(self.tok, s.params.stop, self.stop_ids | ends)
                if s.params.temperature > 0:
                    s.generator = torch.Generator()
                    if s.params.seed is None:
                        s.generator.seed()
                    else:
                        s.generator.manual_seed(s.params.seed)
            self.waiting.extend(seqs)
            self.metrics.queue_length = len(self.waiting)
            self.wakeup.notify()

    def stop(self) -> None:
        """Finish what is running and waiting, then return from ``run``."""
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()

    def cancel_all(self) -> None:
        with self.wakeup:
            for seq in list(self.waiting) + self._admitted():
                seq.cancelled = True
            self.wakeup.notify()

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        with self.wakeup:
            self.wakeup.notify()

    def _admitted(self) -> list[Sequence]:
        return list(self.running.values()) + [seq for seq, _ in self.prefilling.values()]

    # ---------------------------------------------------------------- the loop's thread

    def run(self) -> None:
        try:
            while True:
                with self.wakeup:
                    while not (self.waiting or self.running or self.prefilling or self.stopping):
                        if not self.wakeup.wait(timeout=self.idle_seconds):
                            self.lockstep.call("ping")
                    if self.stopping and not (self.waiting or self.running or self.prefilling):
                        return
                self._drop_cancelled()
                self._admit()
                if self.running:
                    self._step()
        except BaseException as exc:  # the model failed: answer everyone, keep the reason, stop the server
            self.error = exc
            with self.wakeup:
                everyone = list(self.waiting) + self._admitted()
                self.waiting.clear()
                self.running.clear()
                self.prefilling.clear()
                self.stopping = True
            for seq in everyone:
                seq.emit("error", f"the model failed: {type(exc).__name__}: {exc}")
            self.on_fatal()
            raise

    def _drop_cancelled(self) -> None:
        with self.wakeup:
            kept = [s for s in self.waiting if not s.cancelled]
            self.waiting.clear()
            self.waiting.extend(kept)
        for slot, seq in [*self.running.items(), *((slot, seq) for slot, (seq, _) in self.prefilling.items())]:
            if seq.cancelled:
                self.metrics.cancelled += 1
                self._release(slot)

    def _admit(self) -> None:
        """Up to prefill_tokens (padded) prompt tokens per step: first the next part of each prompt
        being prefilled in parts, then waiting sequences into free slots, prefilled together in
        groups; a prompt longer than what is left of the budget is prefilled in parts over the next
        steps (unless it wants the logits of every prompt token); the rest wait."""
        budget = self.prefill_tokens
        for slot, (seq, done) in list(self.prefilling.items()):
            if budget <= 0:
                break
            budget -= self._prefill_part(slot, seq, done, budget)
        while len(self.running) + len(self.prefilling) < self.max_batch and budget > 0:
            group, width = self._group(budget)
            if not group:
                break
            seqs = [seq for _, seq in group]
            if len(group) == 1 and width > budget and not _wants_every_logit(seqs[0]):
                slot, seq = group[0]
                self.metrics.prompt_tokens += len(seq.ids)
                budget -= self._prefill_part(slot, seq, 0, budget)
                continue
            for slot, seq in group:
                self.running[slot] = seq
                self.metrics.prompt_tokens += len(seq.ids)
            logits = self._prefill([slot for slot, _ in group], [seq.ids for seq in seqs],
                                   all_logits=_wants_every_logit(seqs[0]))
            budget -= len(group) * width
            for (slot, seq), row in zip(group, logits):
                self._alone(slot, seq, self._first, slot, seq, row)
        self.metrics.batch_size = len(self.running)

    def _prefill(self, slots: list[int], prompts: list[list[int]], **options) -> list[torch.Tensor]:
        """One prefill forward on every rank (``Slots.admit``), counted."""
        logits = self.lockstep.call("admit", slots, prompts, **options)
        self.metrics.prefills += 1
        return logits

    def _to_compute(self, seq: Sequence) -> int:
        """The prompt tokens a prefill computes: those the prefix cache does not hold."""
        return len(seq.ids) - (0 if _wants_every_logit(seq) else self.lockstep.ask("cached_tokens", seq.ids))

    def _prefill_part(self, slot: int, seq: Sequence, done: int, budget: int) -> int:
        """The next ``budget`` tokens at most of a prompt prefilled in parts (``done`` of them are
        in the slot already, and the prefix cache may hold more); once the whole is in, the sequence
        decodes. Returns the tokens computed."""
        start = max(done, len(seq.ids) - self._to_compute(seq))
        end = min(len(seq.ids), start + budget)
        part = end < len(seq.ids)
        logits = self._prefill([slot], [seq.ids[:end]], partial=[part])
        if part:
            self.prefilling[slot] = (seq, end)
        else:
            self.prefilling.pop(slot, None)
            self.running[slot] = seq
            self._alone(slot, seq, self._first, slot, seq, logits[0])
        return end - start

    def _group(self, budget: int) -> tuple[list[tuple[int, Sequence]], int]:
        """The next waiting sequences to prefill together, with their slots: consecutive free slots
        from the lowest, while the padded prompts fit ``budget`` tokens; a sequence that wants the
        logits of every prompt token (echo with logprobs) goes alone. Also the group's width: the
        most prompt tokens one of them computes."""
        free = [s for s in range(self.max_batch) if s not in self.running and s not in self.prefilling]
        group: list[tuple[int, Sequence]] = []
        width = 0
        with self.wakeup:
            while self.waiting and len(group) < len(free) and free[len(group)] == free[0] + len(group):
                seq = self.waiting[0]
                wider = max(width, self._to_compute(seq))
                if group and (_wants_every_logit(seq) or _wants_every_logit(group[0][1])
                              or wider * (len(group) + 1) > budget):
                    break
                group.append((free[len(group)], self.waiting.popleft()))
                width = wider
            self.metrics.queue_length = len(self.waiting)
        return group, width

    def _first(self, slot: int, seq: Sequence, logits: torch.Tensor) -> None:
        p = seq.params
        if p.echo:
            self._echo(seq, logits)
            logits = logits[-1] if logits.dim() == 2 else logits
        if p.max_tokens == 0:
            self._finish(slot, "length")
        else:
            self._choose(slot, seq, logits)

    def _alone(self, slot: int, seq: Sequence, work, *args) -> None:
        """``work(*args)`` for one sequence: if it fails, that sequence's request fails, and only it."""
        try:
            work(*args)
        except Exception as exc:
            seq.emit("error", f"the request failed: {type(exc).__name__}: {exc}")
            if slot in self.running or slot in self.prefilling:
                self._release(slot)

    def _echo(self, seq: Sequence, logits: torch.Tensor) -> None:
        """The prompt's tokens, each with its log-probability given the ones before it."""
        k = seq.params.logprobs
        logp = torch.log_softmax(logits.float(), -1) if k is not None else None
        for i, t in enumerate(seq.ids):
            if logp is None or i == 0:
                seq.emit("token", Token(t, None, None))
            else:
                seq.emit("token", Token(t, float(logp[i - 1, t]), _top(logp[i - 1], k) if k else None))

    def _step(self) -> None:
        stepped = sorted(self.next_token)
        logits = self.lockstep.call("step", dict(self.next_token))
        self.metrics.steps += 1
        # every plain greedy choice of the step from one argmax, not one per sequence
        plain = [s for s in stepped if _plain_greedy(self.running[s])]
        greedy = dict(zip(plain, logits[plain].argmax(-1).tolist())) if plain else {}
        for slot in stepped:
            seq = self.running[slot]
            self._alone(slot, seq, self._choose, slot, seq, logits[slot], greedy.get(slot))
        self.metrics.batch_size = len(self.running)

    def _choose(self, slot: int, seq: Sequence, logits: torch.Tensor, greedy: int | None = None) -> None:
        """The sequence's next token from its next-token logits (``greedy``: their argmax, when
        already known)."""
        p = seq.params
        scores = sampling.openai_penalties(logits, seq.generated, presence=p.presence_penalty,
                                           frequency=p.frequency_penalty, bias=p.logit_bias)
        if seq.constraint is not None:
            scores = seq.constraint.allowed(scores)
        if greedy is not None:
            token = greedy
        elif p.temperature == 0:
            token = int(scores.argmax())
        else:
            token = int(sampling.choose(scores[None], temperature=p.temperature, top_k=p.top_k,
                                        top_p=p.top_p, generator=seq.generator)[0])
        logp = torch.log_softmax(logits.float(), -1) if p.logprobs is not None else None
        if seq.constraint is not None:
            seq.constraint.accept(token)
        seq.generated.append(token)
        self.metrics.tokens_done(1)
        seq.emit("token", Token(token, float(logp[token]) if logp is not None else None,
                                _top(logp, p.logprobs) if p.logprobs else None))
        text, hit_stop = seq.text.text(seq.generated)
        if token in seq.text.stop_ids or hit_stop or (seq.constraint is not None and seq.constraint.done()):
            self._finish(slot, "stop")
        elif len(seq.generated) == p.max_tokens:
            self._finish(slot, "length")
        else:
            self.next_token[slot] = token
            delta = seq.text.delta(text, final=False)
            if delta:
                seq.emit("text", delta)

    def _finish(self, slot: int, reason: str) -> None:
        seq = self.running[slot]
        text, _ = seq.text.text(seq.generated)
        delta = seq.text.delta(text, final=True)
        if delta:
            seq.emit("text", delta)
        seq.emit("end", reason)
        self._release(slot)

    def _release(self, slot: int) -> None:
        self.running.pop(slot, None)
        self.prefilling.pop(slot, None)
        self.next_token.pop(slot, None)
        self.lockstep.call("release", slot)
