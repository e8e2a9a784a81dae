"""Sliding-window attention (Mistral, Qwen2 with max_window_layers) and the Gemma 2 / Gemma 3 text
families against Hugging Face on tiny random models whose features are all on (windows of 5 over
16-token sequences, alternating local/global layers, soft-caps, sandwich norms, scaled embeddings,
q/k norms, a local RoPE base): logits at TP=1 and at TP=2 x PP=2 over 3 layers (uneven stages),
greedy generation through the KV cache past the window (generate's and megacli serve's),
HF -> megacli -> HF bitwise. Plus the recipe rules and the masks' definition."""

from __future__ import annotations

from pathlib import Path

import pytest

from megacli.recipe.base import RecipeError
from megacli.recipe.model import ModelSection
from tests import _convert_models as cm

TOL = 1e-4
NAMES = list(cm.WINDOW_MODELS)
NEW = 12


def _prompts():
    """Two random 9-token prompts: with 12 new tokens decoding runs well past the window (5)."""
    import torch

    return [torch.randint(1, cm.VOCAB, (9,), generator=torch.Generator().manual_seed(s)).tolist() for s in (5, 6)]


def _hf_greedy(model, prompts):
    import torch

    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                             eos_token_id=None, pad_token_id=0)
    return out[:, len(prompts[0]):].tolist()


def _without_window(model):
    """The same weights attending to the whole prefix (so the tests can tell the window is there)."""
    import copy

    import transformers

    config = copy.deepcopy(model.config)
    config.sliding_window = 4096  # longer than any test sequence
    plain = transformers.AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict())
    plain.config._attn_implementation = "eager"
    return plain.eval()


def _greedy(ckpt: Path, runtime, *, use_cache: bool):
    from megacli.data.tokenizers import load_tokenizer
    from megacli.inference import sampling
    from megacli.inference.generator import Generator
    from megacli.inference.runner import Model

    recipe = cm.one_process_generate_recipe(ckpt, max_new_tokens=NEW, stop_at_eod=False, use_cache=use_cache)
    tok = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path)
    gen = Generator(Model(recipe, runtime, vocab_size=recipe.model.vocab_size), tok, recipe.generate)
    contexts = []
    make = sampling.kv_cache
    sampling.kv_cache = lambda *a, **k: contexts.append(make(*a, **k)) or contexts[-1]
    try:
        tokens = [list(t) for t in gen._sample(_prompts(), None).tokens]
    finally:
        sampling.kv_cache = make
    rows = {n: kv[0].size(0) for n, kv in contexts[0].key_value_memory_dict.items()} if use_cache else None
    return tokens, rows


def _prepare(rank, world, root: str):
    import torch

    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    root = Path(root)
    toks = cm.tokens()
    out = {}
    for name in NAMES:
        d = root / name
        model = cm.build_hf(name, d / "hf", with_tokenizer=True)
        torch.save(cm.hf_logits(model, toks), d / "hf_logits.pt")
        out[name] = {**cm.round_trip(d, parallel=ParallelSection(), say=lambda *_: None),
                     "hf_greedy": _hf_greedy(model, _prompts()),
                     "full_logits": cm.max_diff(cm.hf_logits(_without_window(model), toks), cm.hf_logits(model, toks))}
    runtime = distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu"), seed=0)
    for name in NAMES:
        out[name]["tp1_logits"] = cm.max_diff(cm.megacli_logits(root / name / "mc", toks), torch.load(root / name / "hf_logits.pt"))
        out[name]["greedy"], out[name]["cache_rows"] = _greedy(root / name / "mc", runtime, use_cache=True)
        out[name]["greedy_no_cache"] = _greedy(root / name / "mc", runtime, use_cache=False)[0]
        out[name]["served"] = cm.served_greedy(root / name / "mc", runtime, _prompts(), NEW)
    distributed.teardown()
    return out


def _logits_tp2_pp2(rank, world, root: str):
    import torch

    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    distributed.setup(parallel=ParallelSection(tensor=2, pipeline=2, first_stage_layers=1),
                      launch=LaunchSection(nproc=4, device="cpu"), seed=0)
    out = {}
    for name in NAMES:
        got = cm.megacli_logits(Path(root) / name / "mc", cm.tokens(), overrides=("parallel.first_stage_layers=1",))
        out[name] = None if got is None else cm.max_diff(got, torch.load(Path(root) / name / "hf_logits.pt"))
    distributed.teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("window")
    return root, spawn(_prepare, 1, str(root), timeout=1200)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bitwise_with_the_same_config(converted, name):
    r = converted[1][name]
    assert r["same_keys"] and r["bitwise"]
    src, back = r["config"]
    assert src == back and src["architectures"] == [cm.ARCHITECTURES[cm.WINDOW_MODELS[name][0]]]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_hugging_face_at_tp1(converted, name):
    r = converted[1][name]
    assert r["tp1_logits"] < TOL
    assert r["full_logits"] > 100 * TOL, "the window changes the logits of these sequences"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_past_the_window_equals_hugging_face(converted, name):
    r = converted[1][name]
    assert r["greedy"] == r["hf_greedy"]
    assert r["greedy_no_cache"] == r["hf_greedy"]
    # the windowed layers' caches hold the last sliding_window - 1 keys, the global ones every position
    m = ModelSection(**_recipe_model(converted[0] / name / "mc"))
    want = {i + 1: m.sliding_window - 1 if w else 9 + NEW for i, w in enumerate(m.window_layers())}
    assert r["cache_rows"] == want


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_serving_past_the_window_equals_hugging_face(converted, name):
    """megacli serve's cache, whose rows start at different columns and move, windows each
    sequence as Hugging Face does."""
    r = converted[1][name]
    assert r["served"]["tokens"] == r["hf_greedy"]
    assert r["served"]["shifts"] >= 1


def _recipe_model(ckpt: Path) -> dict:
    import yaml

    return yaml.safe_load((ckpt / "iter_0000000" / "recipe.yaml").read_text())["model"]


@pytest.mark.slow
def test_logits_equal_hugging_face_at_tp2_pp2(converted):
    from tests._dist import spawn

    ranks = spawn(_logits_tp2_pp2, 4, str(converted[0]), timeout=900)
    results = [r for r in ranks if any(d is not None for d in r.values())]  # the last stage's first TP rank
    assert len(results) == 1
    assert all(d < TOL for d in results[0].values()), results[0]


def test_the_window_is_hugging_faces():
    """Query i sees keys i - w + 1 .. i (transformers' sliding_window_overlay and causal mask), for a
    square (training) and a bottom-right (decoding) block, and the keys no query sees are dropped."""
    import torch
    from transformers.masking_utils import sliding_window_causal_mask_function

    from megacli.engine.models.attention import _sdpa_mask

    w, n = 3, 8
    ref = sliding_window_causal_mask_function(w)
    t = torch.tensor
    want = torch.tensor([[bool(ref(t(0), t(0), t(i), t(j))) for j in range(n)] for i in range(n)])
    got, is_causal = _sdpa_mask(n, n, True, None, None, torch.float32, "cpu", window=w - 1)
    assert not is_causal and torch.equal(got, want)
    last, _ = _sdpa_mask(2, n, True, None, None, torch.float32, "cpu", window=w - 1)
    assert torch.equal(last, want[-2:])


def test_window_attention_drops_the_keys_no_query_sees():
    """Decoding one token against a long cache equals attending over the last w keys only, with
    and without a soft-cap; without the window the answer differs."""
    from types import SimpleNamespace

    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megacli.engine.models.attention import CoreAttention

    group = SimpleNamespace(size=lambda: 1, rank=lambda: 0)

    def core(window, softcap=None):
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                                   window_size=window, attention_dropout=0.0)
        return CoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(tp=group, cp=group),
                             softcap=softcap)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, 1, h, 8, generator=g) for s, h in ((1, 4), (10, 2), (10, 2)))
    for cap in (None, 0.5):
        windowed, full = core((3, 0), cap), core(None, cap)
        assert torch.allclose(windowed(q, k, v, None), full(q, k[-4:], v[-4:], None), atol=1e-6)
        assert not torch.allclose(windowed(q, k, v, None), full(q, k, v, None), atol=1e-3)


def test_recipe_rules():
    with pytest.raises(RecipeError, match="model.sliding_window_layers.*needs model.sliding_window"):
        ModelSection(position_embedding="rope", sliding_window_layers=2)
    with pytest.raises(RecipeError, match="model.sliding_window_layers.*3 entries for model.num_layers = 2"):
        ModelSection(num_layers=2, sliding_window=4, sliding_window_layers=[1, 0, 1])
    with pytest.raises(RecipeError, match="model.rotary_base_local.*needs model.sliding_window"):
        ModelSection(position_embedding="rope", rotary_base_local=10000.0)
    with pytest.raises(RecipeError, match="model.final_logit_softcap.*gpt models, not bert"):
        ModelSection(arch="bert", final_logit_softcap=30.0)
    with pytest.raises(RecipeError, match="model.sliding_window_layers = 1: leaves no layer windowed"):
        ModelSection(num_layers=2, sliding_window=4, sliding_window_layers=1)
    m = ModelSection(num_layers=6, sliding_window=4, sliding_window_layers=3)
    assert m.window_layers() == [1, 1, 0, 1, 1, 0]
    assert ModelSection(num_layers=2, sliding_window=4).window_layers() == [1, 1]


GEMMA_TRAIN = [
    "model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=geglu",
    "model.add_bias_linear=false", "model.num_layers=3", "model.kv_channels=16", "model.num_query_groups=2",
    "model.qk_layernorm=true", "model.sliding_window=8", "model.sliding_window_layers=3", "model.rotary_base_local=100",
    "model.attention_softcap=2.0", "model.final_logit_softcap=5.0", "model.scale_embeddings=true",
    "model.norm_zero_centered_gamma=true", "model.norm_placement=sandwich",
]


@pytest.mark.slow
def test_a_gemma_model_trains(tmp_path):
    """Every Gemma feature on (windowed + global layers, local RoPE, soft-caps, sandwich norms, scaled
    embeddings, 1 + w norms, q/k norms): pretraining runs and the loss falls."""
    from tests.conftest import MOCK_GPT, layout, losses, pretrain

    pretrain(tmp_path / "gemma", MOCK_GPT + GEMMA_TRAIN + layout())
    got = losses(tmp_path / "gemma")
    assert got[6] < got[1] - 0.3, got


def test_context_parallelism_with_a_soft_cap_is_refused():
    from megacli.recipe.base import RecipeErrors, validate
    from megacli.recipe.pretrain import TrainingRecipe

    raw = {"data": {"mock": True}, "tokenizer": {"type": "byte"}, "launch": {"nproc": 2},
           "parallel": {"context": 2}, "train": {"global_batch_size": 8, "micro_batch_size": 4},
           "model": {"position_embedding": "rope", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                     "seq_length": 32, "sliding_window": 8, "attention_softcap": 50.0}}
    with pytest.raises(RecipeErrors, match="recipe.yaml: model.attention_softcap = 50.0: has no context-parallel ring"):
        validate(TrainingRecipe, raw, "recipe.yaml")
    del raw["model"]["attention_softcap"]
    assert validate(TrainingRecipe, raw, "recipe.yaml").model.sliding_window == 8  # the ring takes a window


def test_families_refuse_what_megatron_cannot_express():
    from megacli.convert.families import gemma, llama
    from megacli.errors import UserError

    base = dict(architectures=["Gemma2ForCausalLM"], hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                intermediate_size=64, max_position_embeddings=64, vocab_size=100, head_dim=16)
    assert gemma.model_section({**base, "sliding_window": 8})["sliding_window_layers"] == 2  # Gemma 2: every other layer
    with pytest.raises(UserError, match="attention_bias = true cannot be expressed"):
        gemma.model_section({**base, "attention_bias": True})
    with pytest.raises(UserError, match="hidden_activation 'gelu' is not supported"):
        gemma.model_section({**base, "hidden_activation": "gelu"})
    with pytest.raises(UserError, match="use_bidirectional_attention"):
        gemma.model_section({**base, "architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True})
    with pytest.raises(UserError, match="layer_types \\['chunked_attention'\\] are not supported"):
        gemma.model_section({**base, "layer_types": ["chunked_attention", "full_attention"]})
    # Qwen2 windows a suffix of its layers (max_window_layers); another pattern has no HF family
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "head_dim": None}
    m = ModelSection(**{**llama.model_section(qwen2),
                        "sliding_window": 4, "sliding_window_layers": [1, 0]})
    assert llama.architecture_for(m) is None and gemma.architecture_for(m) is None
    m = m.model_copy(update={"sliding_window_layers": [0, 1]})
    assert llama.architecture_for(m) == "Qwen2ForCausalLM"
    assert llama.hf_config(m, architecture="Qwen2ForCausalLM", vocab_size=100, base=None)["max_window_layers"] == 1
