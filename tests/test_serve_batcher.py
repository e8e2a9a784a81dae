"""megacli serve's batching loop and sampling without a model: a stand-in for the KV-cache slots
answers fixed logits, so that failures can be put where a real model would put them."""

from __future__ import annotations

import threading

import pytest
import torch

from megacli.inference import sampling
from megacli.inference.serve.batcher import Batcher, Metrics, QueueFull, Sampling, Sequence, TooBig

VOCAB = 10


class Slots:
    """Next-token logits that favour token (last token + 1) % VOCAB; ``fail_at`` makes ``step`` raise."""

    def __init__(self, fail_at: int | None = None, random: bool = False):
        self.fail_at, self.random, self.steps, self.shifts = fail_at, random, 0, 0
        self.admitted = []  # prompts per prefill
        self.calls = []  # ("admit", prompt lengths, partial) and ("step", slots), in order

    def logits(self, last: int) -> torch.Tensor:
        if self.random:  # a fixed random row per last token
            return torch.randn(VOCAB, generator=torch.Generator().manual_seed(last)) * 2
        row = torch.linspace(-3.0, 0.0, VOCAB)
        return row.roll((last + 1) % VOCAB - (VOCAB - 1))

    def admit(self, slots, prompts, *, all_logits=False, partial=None):
        self.admitted.append(len(prompts))
        self.calls.append(("admit", [len(ids) for ids in prompts], partial))
        return [self.logits(ids[-1]) for ids in prompts]

    def step(self, tokens):
        self.steps += 1
        self.calls.append(("step", sorted(tokens)))
        if self.steps == self.fail_at:
            raise RuntimeError("the model broke")
        rows = torch.zeros(max(tokens) + 1, VOCAB)  # row s for slot s, as megacli's Slots
        for s, t in tokens.items():
            rows[s] = self.logits(t)
        return rows

    def cached_tokens(self, ids):
        return 0

    def release(self, slot):
        pass

    def ping(self):
        pass


class Lockstep:
    def __init__(self, work):
        self.work = work

    def call(self, name, *args, **kwargs):
        return getattr(self.work, name)(*args, **kwargs)

    def ask(self, name, *args):
        return getattr(self.work, name)(*args)


class Chars:
    """Token i is the letter 'a' + i; decoding token 7 raises."""

    @staticmethod
    def decode(ids):
        if 7 in ids:
            raise ValueError("cannot decode token 7")
        return "".join(chr(97 + i) for i in ids)


class Letters:
    @staticmethod
    def decode(ids):
        return "".join(chr(97 + i) for i in ids)


def _batcher(slots: Slots, *, max_queue: int = 64, fatal=None, tok=Chars, prefill_tokens: int = 2048) -> Batcher:
    return Batcher(Lockstep(slots), tok, max_batch=4, max_queue=max_queue, stop_ids=set(), metrics=Metrics(slots),
                   on_fatal=fatal or (lambda: None), prefill_tokens=prefill_tokens)


def _sequence(first: int, max_tokens: int, **sampling_args) -> tuple[Sequence, list]:
    events = []
    seq = Sequence(ids=[first], params=Sampling(max_tokens=max_tokens, **sampling_args),
                   emit=lambda kind, value: events.append((kind, value)))
    return seq, events


def _run(batcher: Batcher) -> threading.Thread:
    thread = threading.Thread(target=batcher.run, daemon=True)
    thread.start()
    return thread


def test_sampling_is_finite_at_every_temperature_and_top_p():
    """1e-300 and 5e-324 sample the argmax, inf samples uniformly; -inf and NaN logits are never chosen."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    logits[1, 5:] = float("-inf")
    logits[0, 7] = float("nan")
    logits[2] = float("-inf")  # nothing left: any token, but no error
    for temperature in (5e-324, 1e-300, 1e-30, 0.7, 2.0, 1e30, 1e300, float("inf")):
        for top_p in (1e-12, 0.5, 1.0):
            for top_k in (0, 1, 3):
                got = sampling.choose(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=g)
                assert got[0] != 7 and got[1] < 5
                if temperature < 1e-20 or (temperature <= 2 and (top_k == 1 or top_p == 1e-12)):
                    assert got[1] == logits[1].argmax() and got[0] == logits[0].nan_to_num(-1e9).argmax()
    draws = sampling.choose(torch.tensor([[0.0, -50.0]]).expand(4000, 2), temperature=float("inf"), top_k=0, top_p=1.0,
                            generator=g)
    assert 1800 < int(draws.sum()) < 2200, "an infinite temperature samples uniformly"


def test_a_failure_in_one_request_fails_it_alone():
    """The sequence whose token cannot be decoded gets an error; the others finish; the loop runs on."""
    batcher = _batcher(Slots())
    thread = _run(batcher)
    broken, broken_events = _sequence(5, 4)  # 5 -> 6 -> 7: decoding 7 raises
    fine, fine_events = _sequence(0, 4)
    tiny, tiny_events = _sequence(1, 4, temperature=1e-300, seed=3)
    batcher.submit([broken, fine, tiny])
    batcher.stop()
    thread.join(10)
    assert not thread.is_alive() and batcher.error is None
    assert broken_events[-1][0] == "error" and "cannot decode token 7" in broken_events[-1][1]
    assert fine_events[-1] == ("end", "length") and fine.generated == [1, 2, 3, 4]
    assert tiny_events[-1] == ("end", "length") and tiny.generated == [2, 3, 4, 5], "1e-300 samples the argmax"


def test_a_failed_model_answers_everyone_and_stops_the_server():
    stopped = []
    batcher = _batcher(Slots(fail_at=2), fatal=lambda: stopped.append(True))
    thread = _run(batcher)
    seqs = [_sequence(i, 5) for i in range(3)]
    batcher.submit([s for s, _ in seqs])
    thread.join(10)
    assert not thread.is_alive() and isinstance(batcher.error, RuntimeError)
    assert stopped == [True], "the HTTP server is told to exit (the job then exits non-zero)"
    assert all(events[-1][0] == "error" and "the model broke" in events[-1][1] for _, events in seqs)


def test_a_request_bigger_than_the_queue_is_refused_and_a_full_queue_is_busy():
    batcher = _batcher(Slots(), max_queue=64)
    with pytest.raises(TooBig, match="at most 64"):
        batcher.submit([_sequence(0, 2)[0] for _ in range(65)])
    assert not batcher.waiting
    batcher.submit([_sequence(0, 2)[0] for _ in range(40)])
    with pytest.raises(QueueFull, match="40 requests are waiting"):
        batcher.submit([_sequence(0, 2)[0] for _ in range(30)])


def test_metrics_label_values_are_escaped():
    metrics = Metrics()
    metrics.requests[('/x"} 1\nforged_total 9\\', 404)] += 1
    text = metrics.text()
    assert "\nforged_total" not in text
    assert 'endpoint="/x\\"} 1\\nforged_total 9\\\\"' in text


def test_penalties_and_logit_bias_follow_openai_on_the_logits():
    """Greedy with presence/frequency penalties and logit_bias: each token is the argmax of the
    logits minus frequency x count minus presence x (count > 0) plus bias, computed here directly."""
    slots = Slots(random=True)
    cases = [(0.0, 0.0, {}), (1.5, 0.0, {}), (0.0, 0.7, {}), (-0.5, 1.2, {3: 2.5, 4: -100.0}), (2.0, 2.0, {1: 1.0})]
    batcher = _batcher(slots, tok=Letters)
    thread = _run(batcher)
    seqs = [_sequence(2, 12, presence_penalty=p, frequency_penalty=f, logit_bias=b)[0] for p, f, b in cases]
    batcher.submit(seqs)
    batcher.stop()
    thread.join(10)
    outputs = []
    for seq, (presence, frequency, bias) in zip(seqs, cases):
        want, last = [], 2
        for _ in range(12):
            row = slots.logits(last).tolist()
            scores = [row[j] - frequency * want.count(j) - presence * (j in want) + bias.get(j, 0.0) for j in range(VOCAB)]
            last = max(range(VOCAB), key=scores.__getitem__)
            want.append(last)
        assert seq.generated == want, (presence, frequency, bias)
        outputs.append(tuple(want))
    assert len(set(outputs)) == len(cases), "every setting changes the greedy tokens"
    assert 4 not in outputs[3]


def test_prompts_that_arrive_together_are_prefilled_together_within_the_budget():
    for budget, groups in ((2048, [4, 1, 1, 1]), (6, [2, 1, 1, 1, 1, 1])):
        slots = Slots()
        batcher = _batcher(slots, tok=Letters, prefill_tokens=budget)
        thread = _run(batcher)
        seqs = [_sequence(0, 2 + i)[0] for i in range(4)] + [_sequence(0, 1)[0] for _ in range(3)]
        for seq in seqs:
            seq.ids = [1, 2, 3]
        batcher.submit(seqs)
        batcher.stop()
        thread.join(10)
        assert slots.admitted == groups, budget
        assert [len(seq.generated) for seq in seqs] == [2, 3, 4, 5, 1, 1, 1]


def test_a_prompt_longer_than_the_budget_is_prefilled_in_parts_between_decoding_steps():
    """With a budget of 4 tokens, the 1-token prompt that arrived first takes 1 and a 10-token one
    the other 3; the rest goes in as 4 + 3 tokens, the first sequence decoding a token between every
    two parts; then both decode."""
    slots = Slots()
    batcher = _batcher(slots, tok=Letters, prefill_tokens=4)
    running, _ = _sequence(0, 8)
    long, _ = _sequence(0, 3)
    long.ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    batcher.submit([running, long])
    thread = _run(batcher)
    batcher.stop()
    thread.join(10)
    assert slots.calls[:8] == [("admit", [1], None), ("admit", [3], [True]), ("step", [0]), ("admit", [7], [True]),
                               ("step", [0]), ("admit", [10], [False]), ("step", [0, 1]), ("step", [0, 1])]
    assert long.generated == [2, 3, 4] and len(running.generated) == 8
    assert batcher.metrics.prefills == sum(call[0] == "admit" for call in slots.calls) == 4
