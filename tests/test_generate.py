"""`megacli generate` against Hugging Face `generate` on tiny random models converted with
`megacli convert` (GPT-2: learned positions, tied head; Llama: RoPE, GQA, SwiGLU).

One spawned process builds and converts the models, computes the Hugging Face references
(prompt by prompt, unpadded) and runs our decoder at TP=1 PP=1 on the same prompts as one
left-padded batch; four gloo processes repeat the decoding at TP=2 PP=2. Tokens must be equal:
greedy and beam search (with and without a stop token inside the beams). Plus the pure decoding
functions against Hugging Face's logits processors, scoring against Hugging Face's
log-likelihood, and the command line (output file, errors)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from megacli.checkpoint.source import Source


PROMPTS = ["the quick brown", "lazy dog jumps over the", "fox", "over the lazy dog the quick brown fox"]
NEW = 10
NAMES = ["gpt2", "llama_tied_gqa"]
# Beam search: HF's defaults (early_stopping False) with a length penalty, and the same with a stop
# token these random models emit often, so hypotheses finish inside the beams.
BEAM_CASES = {"beam": dict(num_beams=3, length_penalty=1.3), "beam_stop": dict(num_beams=4, length_penalty=0.5)}
SCORE_TEXTS = ["the quick brown fox jumps over the lazy dog", "dog fox the"]


def _frequent_token(model, ids) -> int:
    """The model's first greedy choice after the first prompt: as a stop token (with a length
    penalty below 1, which favours short hypotheses) it really ends some beams."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=1, pad_token_id=0)
    return int(out[0, -1])


def _hf_references(model, tok) -> dict:
    ref = {"greedy": [], "beam": [], "beam_stop": [], "score": []}
    enc = [tok.encode(p) for p in PROMPTS]
    stop = _frequent_token(model, enc[0])
    ref["stop_token"] = stop
    for ids in enc:
        x = torch.tensor([ids])
        with torch.no_grad():
            greedy = model.generate(x, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
            ref["greedy"].append(greedy[0, len(ids):].tolist())
            for case, kw in BEAM_CASES.items():
                eos = stop if case == "beam_stop" else None
                out = model.generate(x, do_sample=False, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0, **kw)
                gen = out[0, len(ids):].tolist()
                if eos is not None and eos in gen:
                    gen = gen[: gen.index(eos) + 1]  # after the stop token HF pads
                ref[case].append(gen)
    for text in SCORE_TEXTS:
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        ref["score"].append(float(logp.gather(1, ids[0, 1:, None]).sum()))
    return ref


def _decode_all(root: Path, stops: dict) -> dict:
    """Our decoder on every model and case, under the current process group (any TP/PP)."""
    from megacli.data.tokenizers import load_tokenizer
    from megacli.inference.generator import Generator
    from megacli.inference.runner import Model
    from megacli.recipe import base
    from megacli.recipe.generate import GenerateRecipe

    from megacli.engine import distributed

    world = int(os.environ["WORLD_SIZE"])
    tp, pp = (2, 2) if world == 4 else (1, 1)
    out = {}
    runtime = None
    for name in NAMES:
        ckpt = root / name / "mc"
        raw = base.read_yaml(ckpt / "iter_0000000" / "recipe.yaml")
        raw["parallel"].update(tensor=tp, pipeline=pp, sequence_parallel=False)
        raw["launch"].update(nproc=world, device="cpu")
        raw["train"]["global_batch_size"] = raw["train"]["micro_batch_size"]
        model = None
        results = {}
        for case, extra in {"greedy": {}, "greedy_no_cache": {"use_cache": False}, **BEAM_CASES,
                            "sample": {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 7},
                            "sample_again": {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 7},
                            "sample_no_cache": {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 7, "use_cache": False},
                            "sample_seed8": {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "seed": 8}}.items():
            gen_cfg = {"checkpoint": str(ckpt), "max_new_tokens": NEW, "stop_at_eod": False, **extra}
            if case == "beam_stop":
                gen_cfg["stop_tokens"] = [stops[name]]
            recipe = base.validate(GenerateRecipe, {**raw, "generate": gen_cfg}, "test")
            if runtime is None:  # one process group for both models
                runtime = distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=0)
            if model is None:
                tok = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path)
                model = Model(recipe, runtime, vocab_size=recipe.model.vocab_size)
            gen = Generator(model, tok, recipe.generate)
            seen = []  # the positions the output layer computes logits for, forward by forward
            hook = model.net.output_layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].size(0))) \
                if case == "greedy" and model.last else None
            results[case] = [c.tokens for c in gen.run_batch(PROMPTS)]
            if hook is not None:
                hook.remove()
            if case == "greedy":
                results["lean_vs_megatron"] = _lean_and_megatron_logits(model, tok.encode(PROMPTS[1]))
                if world == 1:
                    results["moved"] = _moved_and_alone_logits(model, tok.encode(PROMPTS[2]), tok.encode(PROMPTS[3]))
                results["output_positions"] = seen
                results["score"] = [r["logprob"] for r in gen.score(SCORE_TEXTS)["per_text"]]
                results["greedy_alone"] = [gen.run_batch([p])[0].tokens for p in PROMPTS]  # no padding, no mask
        out[name] = results
    distributed.teardown()
    return out


def _lean_and_megatron_logits(model, ids: list[int], steps: int = 3) -> dict:
    """The logits of a prefill and ``steps`` greedy steps through megacli serve's cache, run with
    the decode-time forwards (megacli.inference.lean) and with Megatron-Core's own; and the kinds
    of module that had a decode-time forward."""
    from megacli.inference.serve.slots import Slots

    lean = {m: m.__dict__.pop("forward") for m in model.net.modules() if "forward" in m.__dict__}
    runs = {}
    try:
        for name in ("megatron", "lean"):
            if name == "lean":
                for m, forward in lean.items():
                    m.forward = forward
            slots = Slots(model, max_batch=2, capacity=32)
            logits = [slots.admit([1], [ids])[0]]
            for _ in range(steps):
                logits.append(slots.step({1: int(logits[-1].argmax())})[1])
            runs[name] = torch.stack(logits)
    finally:
        for m, forward in lean.items():
            m.forward = forward
    return {**runs, "kinds": sorted({type(m).__name__ for m in lean})}


def _moved_and_alone_logits(model, short: list[int], long: list[int]) -> dict:
    """Greedy logits of two prompts decoded together through megacli serve's cache, and of each
    decoded alone. The long prompt joins two steps after the short one, so the cached columns move
    right; it leaves two steps later, and the short one decodes on until the clock reaches the end
    of the cache, so they move left."""
    from megacli.inference.serve.slots import Slots

    capacity = len(long) + 6
    slots = Slots(model, max_batch=2, capacity=capacity)
    together = {0: [slots.admit([0], [short])[0]]}
    for _ in range(2):
        together[0].append(slots.step({0: int(together[0][-1].argmax())})[0])
    assert len(long) > slots.clock
    together[1] = [slots.admit([1], [long])[0]]
    for _ in range(2):
        logits = slots.step({s: int(together[s][-1].argmax()) for s in (0, 1)})
        for s in (0, 1):
            together[s].append(logits[s])
    slots.release(1)
    while slots.shifts < 2 and len(together[0]) < 4 * capacity:
        together[0].append(slots.step({0: int(together[0][-1].argmax())})[0])
    for _ in range(2):  # after the move left
        together[0].append(slots.step({0: int(together[0][-1].argmax())})[0])
    shifts = slots.shifts

    def alone(ids: list[int], steps: int) -> torch.Tensor:
        slots = Slots(model, max_batch=2, capacity=4 * capacity)
        logits = [slots.admit([0], [ids])[0]]
        for _ in range(steps):
            logits.append(slots.step({0: int(logits[-1].argmax())})[0])
        assert slots.shifts == 0
        return torch.stack(logits)

    return {"shifts": shifts,
            **{f"{name}_together": torch.stack(together[s]) for s, name in ((0, "short"), (1, "long"))},
            **{f"{name}_alone": alone(ids, len(together[s]) - 1)
               for s, name, ids in ((0, "short", short), (1, "long", long))}}


def _prepare(rank, world, root: str):
    from transformers import AutoTokenizer

    from megacli.convert import convert
    from tests import _convert_models as cm

    root = Path(root)
    refs = {}
    for name in NAMES:
        model = cm.build_hf(name, root / name / "hf", with_tokenizer=True)
        convert(Source(root / name / "hf"), root / name / "mc", say=lambda *_: None)
        refs[name] = _hf_references(model, AutoTokenizer.from_pretrained(root / name / "hf"))
    ours = _decode_all(root, {n: refs[n]["stop_token"] for n in NAMES})
    return refs, ours


def _decode_tp2_pp2(rank, world, root: str, stops: dict):
    return _decode_all(Path(root), stops)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("generate")
    refs, ours = spawn(_prepare, 1, str(root), timeout=1800)[0]
    return root, refs, ours


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_tp1_greedy_and_beam_search_equal_hugging_face(generated, name):
    _, refs, ours = generated
    ref, got = refs[name], ours[name]
    assert got["greedy"] == ref["greedy"]
    assert got["greedy_alone"] == ref["greedy"], "a prompt decodes alone as in a left-padded batch"
    assert got["greedy_no_cache"] == ref["greedy"], "the KV cache changes nothing"
    assert got["beam"] == ref["beam"]
    assert got["beam_stop"] == ref["beam_stop"]
    assert any(len(t) < NEW for t in ref["beam_stop"]), "the stop token ends some beam"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_decode_time_forwards_equal_megatron_core_bit_for_bit(generated, name):
    got = generated[2][name]["lean_vs_megatron"]
    assert {"CachedRotarySelfAttention", "MLP", "TransformerLayer", "ColumnParallelLinear",
            "RowParallelLinear"} <= set(got["kinds"]), got["kinds"]
    assert torch.equal(got["lean"], got["megatron"])


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_moving_the_cache_columns_changes_no_sequence(generated, name):
    """megacli serve's cache moves every sequence's columns right when a longer prompt joins and
    left when the clock reaches its end: each sequence's logits stay those it gets alone."""
    got = generated[2][name]["moved"]
    assert got["shifts"] == 2, "one move right, one move left"
    for which in ("short", "long"):
        torch.testing.assert_close(got[f"{which}_together"], got[f"{which}_alone"], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_decoding_computes_logits_of_the_last_position_only(generated, name):
    seen = generated[2][name]["output_positions"]
    assert seen == [1] * NEW, "the prefill as the steps after it: the output layer sees the last position alone"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_sampling_is_reproducible_and_the_cache_changes_nothing(generated, name):
    got = generated[2][name]
    assert got["sample"] == got["sample_again"] == got["sample_no_cache"]
    assert got["sample"] != got["sample_seed8"]
    assert got["sample"] != got["greedy"]
    assert all(len(t) == NEW for t in got["sample"])


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_scores_equal_hugging_face_log_likelihood(generated, name):
    _, refs, ours = generated
    for got, want in zip(ours[name]["score"], refs[name]["score"]):
        assert abs(got - want) <= 1e-4 * abs(want), (got, want)


@pytest.mark.slow
def test_tp2_pp2_decodes_as_hugging_face(generated):
    from tests._dist import spawn

    root, refs, _ = generated
    stops = {n: refs[n]["stop_token"] for n in NAMES}
    results = spawn(_decode_tp2_pp2, 4, str(root), stops, timeout=1200)
    for rank, ours in enumerate(results):  # every rank decided the same tokens
        for name in NAMES:
            for case in ("greedy", "beam", "beam_stop"):
                assert ours[name][case] == refs[name][case], (rank, name, case)
            assert ours[name]["sample"] == results[0][name]["sample"]
            assert torch.equal(ours[name]["lean_vs_megatron"]["lean"], ours[name]["lean_vs_megatron"]["megatron"])


# ---------------------------------------------------------------- the command line


def _megacli(*args):
    """`megacli generate ARGS` in this process (its one worker too)."""
    from tests.conftest import megacli_here

    return megacli_here("generate", *args)


@pytest.mark.slow
def test_cli_writes_jsonl_and_scores(generated, tmp_path):
    root, refs, _ = generated
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[1:]))
    out = tmp_path / "out.jsonl"
    res = _megacli("--checkpoint", root / "gpt2" / "mc", "--prompt", PROMPTS[0], "--prompts", prompts, "-n", NEW,
                   "--output", out, "--logprobs", "--set", "generate.stop_at_eod=false", "--set", f"run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["tokens"] for r in records] == refs["gpt2"]["greedy"]
    assert all(len(r["logprobs"]) == NEW and all(lp <= 0 for lp in r["logprobs"]) for r in records)
    assert PROMPTS[0] in res.stdout and records[0]["text"] in res.stdout

    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in SCORE_TEXTS))
    res = _megacli("--checkpoint", root / "gpt2" / "mc", "--score", texts, "--output", tmp_path / "score.json",
                   "--set", f"run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((tmp_path / "score.json").read_text())
    want = sum(refs["gpt2"]["score"])
    assert abs(report["logprob"] - want) <= 1e-4 * abs(want)
    assert report["perplexity"] == pytest.approx(math.exp(-want / report["tokens"]), rel=1e-4)
    assert "perplexity" in res.stdout


@pytest.mark.slow
def test_cli_errors(generated, tmp_path):
    root = generated[0]
    ckpt = root / "gpt2" / "mc"
    res = _megacli("--checkpoint", ckpt, "--prompt", "x", "--num-beams", "2", "--temperature", "0.7")
    assert res.returncode == 2 and "cannot be combined with sampling" in res.stderr, res.stderr
    res = _megacli("--checkpoint", tmp_path, "--prompt", "x")
    assert res.returncode == 2 and "not a megacli checkpoint" in res.stderr, res.stderr
    res = _megacli("--checkpoint", ckpt, "--prompt", "the quick brown fox " * 20, "-n", 8, "--set", f"run.dir={tmp_path}")
    assert res.returncode == 2 and "exceeds the model's context of 64" in res.stderr, res.stderr


# ---------------------------------------------------------------- decoding functions


def test_filters_and_penalty_equal_hugging_face_processors():
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from megacli.inference import sampling

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    seen = torch.randint(0, 50, (4, 7), generator=g)
    for k in (1, 5, 49):
        assert torch.equal(sampling.top_k_filter(logits, k), TopKLogitsWarper(k)(seen, logits.clone()))
    for p in (0.1, 0.5, 0.9):
        ours = sampling.top_p_filter(logits, p)
        theirs = TopPLogitsWarper(p)(seen, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), p
    assert torch.allclose(sampling.repetition_penalty(logits, seen, 1.3), RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone()))
    assert sampling.decayed_top_p(0.9, 0.5, 0.3) == 0.45 and sampling.decayed_top_p(0.4, 0.5, 0.3) == 0.3
    a = sampling.choose(logits, temperature=1.0, top_k=10, top_p=0.9, generator=torch.Generator().manual_seed(3))
    b = sampling.choose(logits, temperature=1.0, top_k=10, top_p=0.9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert torch.equal(sampling.choose(logits, temperature=0, top_k=0, top_p=0, generator=None), logits.argmax(-1))


def test_vocabulary_mismatch_is_named():
    from megacli.inference.generator import Generator
    from megacli.errors import UserError
    from megacli.recipe.generate import GenerateSection

    class Tok:
        eod, bos = None, None

        def encode(self, text):
            return [5, 400]

    class Small:
        vocab_size = 300
        recipe = type("R", (), {"model": type("M", (), {"max_positions": 64})()})()

    with pytest.raises(UserError, match="tokenizer gives id 400 but the checkpoint's vocabulary has 300"):
        Generator(Small(), Tok(), GenerateSection()).encode("x")
