"""RoPE scaling (model.rope_scaling: llama3, linear, yarn) against Hugging Face on tiny random
Llamas whose 128 test positions reach past the scaled models' original context: logits, greedy
generation through the KV cache, and HF -> megacli -> HF. Plus the refusals (dynamic NTK)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megacli.errors import UserError
from megacli.recipe.base import RecipeError
from megacli.recipe.model import ModelSection
from tests import _convert_models as cm

TOL = 1e-4
NAMES = list(cm.ROPE_MODELS)
NEW = 12


def _tokens():
    import torch

    return torch.randint(0, cm.VOCAB, (2, 128), generator=torch.Generator().manual_seed(3))


def _prompts():
    """Three random 70-token prompts: decoding crosses the short original context (64)."""
    import torch

    return [torch.randint(0, cm.VOCAB, (70,), generator=torch.Generator().manual_seed(s)).tolist() for s in (5, 6, 7)]


def _hf_greedy(model, prompts):
    import torch

    ids = torch.tensor(prompts)
    with torch.no_grad():  # an explicit mask: token 0 in a prompt is not padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                             eos_token_id=None, pad_token_id=0)
    return out[:, len(prompts[0]):].tolist()


def _without_scaling(model):
    """The same weights under plain RoPE (to show the generation test can tell them apart)."""
    import transformers

    config = model.config
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    plain = transformers.AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict())
    return plain.eval()


def _greedy(root: Path, name: str, runtime):
    from megacli.data.tokenizers import load_tokenizer
    from megacli.inference.generator import Generator
    from megacli.inference.runner import Model

    ckpt = root / name / "mc"
    recipe = cm.one_process_generate_recipe(ckpt, max_new_tokens=NEW, stop_at_eod=False)
    tok = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path)
    gen = Generator(Model(recipe, runtime, vocab_size=recipe.model.vocab_size), tok, recipe.generate)
    return [list(t) for t in gen._sample(_prompts(), None).tokens]  # token prompts: no text round trip


def _prepare(rank, world, root: str):
    import torch

    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    root = Path(root)
    toks = _tokens()
    out = {}
    for name in NAMES:
        d = root / name
        model = cm.build_hf(name, d / "hf", with_tokenizer=True)
        torch.save(cm.hf_logits(model, toks), d / "hf_logits.pt")
        out[name] = {**cm.round_trip(d, parallel=ParallelSection(), say=lambda *_: None),
                     "hf_greedy": _hf_greedy(model, _prompts()), "plain_greedy": _hf_greedy(_without_scaling(model), _prompts())}
    runtime = distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu"), seed=0)
    for name in NAMES:
        out[name]["tp1_logits"] = cm.max_diff(cm.megacli_logits(root / name / "mc", toks), torch.load(root / name / "hf_logits.pt"))
        out[name]["greedy"] = _greedy(root, name, runtime)
        out[name]["served"] = cm.served_greedy(root / name / "mc", runtime, _prompts(), NEW)
    distributed.teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("rope")
    return root, spawn(_prepare, 1, str(root), timeout=1800)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bitwise_with_the_same_config(converted, name):
    r = converted[1][name]
    assert r["same_keys"] and r["bitwise"]
    src, back = r["config"]
    assert src == back
    assert src["rope_parameters"]["rope_type"] == cm.ROPE_MODELS[name][1]["rope_scaling"]["rope_type"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_hugging_face_at_tp1(converted, name):
    assert converted[1][name]["tp1_logits"] < TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_hugging_face(converted, name):
    r = converted[1][name]
    assert r["greedy"] == r["hf_greedy"]
    if name != "llama3_2":  # with an 8192-token original context the change is too small to flip a token here
        assert r["plain_greedy"] != r["hf_greedy"], "the scaling shows in the tokens"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_serving_equals_hugging_face(converted, name):
    """megacli serve's cache, whose rows start at different columns and move, rotates each
    sequence by its own positions through the scaled tables (and YaRN's mscale)."""
    r = converted[1][name]
    assert r["served"]["tokens"] == r["hf_greedy"]
    assert r["served"]["shifts"] >= 1


@pytest.mark.slow
def test_scaling_changes_the_model(converted):
    """The scaled models are not plain RoPE in disguise: dropping the scaling changes the logits."""
    import torch

    from megacli.engine.models.rope import inverse_frequencies

    for name in NAMES:
        m = ModelSection(**_recipe_model(converted[0] / name / "mc"))
        plain = inverse_frequencies(model=m.model_copy(update={"rope_scaling": None}))
        assert not torch.allclose(inverse_frequencies(model=m), plain), name


def _recipe_model(ckpt: Path) -> dict:
    import yaml

    return yaml.safe_load((ckpt / "iter_0000000" / "recipe.yaml").read_text())["model"]


def test_inverse_frequencies_equal_hugging_face():
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megacli.convert.families import llama
    from megacli.engine.models.rope import attention_factor, inverse_frequencies

    extra = {"yarn_deepseek": {"factor": 40.0, "original_max_position_embeddings": 64, "rope_type": "yarn",
                               "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16, "truncate": False}}
    for name, scaling in [*((n, k[1]["rope_scaling"]) for n, k in cm.ROPE_MODELS.items()), *extra.items()]:
        kwargs = dict(cm.LLAMA_LONG, rope_scaling=dict(scaling))
        config = transformers.LlamaConfig(**kwargs)
        ref, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
        m = ModelSection(**llama.model_section({**config.to_dict(), "architectures": ["LlamaForCausalLM"]}))
        assert torch.equal(inverse_frequencies(model=m), ref), name
        assert attention_factor(m.rope_scaling) == pytest.approx(ref_factor, rel=1e-12), name


def test_dynamic_and_misplaced_fields_are_refused():
    with pytest.raises(RecipeError, match="dynamic .NTK.*position-dependent"):
        ModelSection(position_embedding="rope", rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(RecipeError, match="model.rope_scaling.low_freq_factor.*not used by yarn"):
        ModelSection(position_embedding="rope", rope_scaling={"type": "yarn", "factor": 2.0, "low_freq_factor": 1.0})
    with pytest.raises(RecipeError, match="model.rope_scaling.original_max_positions.*llama3 scaling needs it"):
        ModelSection(position_embedding="rope", rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                              "high_freq_factor": 4.0})
    with pytest.raises(RecipeError, match="model.rope_scaling.*needs model.arch = gpt and model.position_embedding = rope"):
        ModelSection(rope_scaling={"type": "linear", "factor": 2.0})


def test_dynamic_hf_config_does_not_convert():
    from megacli.convert.families import llama

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
              "intermediate_size": 64, "vocab_size": 300, "max_position_embeddings": 256,
              "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(UserError, match="'dynamic' .NTK.*position-dependent"):
        llama.model_section(config)


def _logits_tp2(rank, world, root: str):
    import torch

    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    distributed.setup(parallel=ParallelSection(tensor=2), launch=LaunchSection(nproc=2, device="cpu"), seed=0)
    out = {}
    for name in ("llama3_short", "yarn"):
        got = cm.megacli_logits(Path(root) / name / "mc", _tokens())
        out[name] = None if got is None else cm.max_diff(got, torch.load(Path(root) / name / "hf_logits.pt"))
    distributed.teardown()
    return out


@pytest.mark.slow
def test_logits_equal_hugging_face_at_tp2(converted):
    from tests._dist import spawn

    reports = [r for r in spawn(_logits_tp2, 2, str(converted[0])) if r["yarn"] is not None]
    assert len(reports) == 1
    assert reports[0]["llama3_short"] < TOL and reports[0]["yarn"] < TOL, reports
