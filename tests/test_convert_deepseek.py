"""`megacli convert` for DeepSeek-V3 and DeepSeek-V2-Lite (multi-latent attention, MoE with shared
experts after a dense layer, V3's sigmoid group-limited routing with its expert bias, V2's greedy
softmax routing, yarn RoPE), tiny random models built from config dicts. Checked against Hugging
Face in fp32 on CPU: logits at TP=1, greedy generation (with and without the KV cache), HF ->
megacli -> HF bitwise with the same config.json, and multi-token-prediction layers dropped on import
with a note. Plus the configs that cannot convert."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megacli.checkpoint.source import Source
from megacli.errors import UserError
from tests import _convert_models as cm

TOL = 1e-4
NAMES = list(cm.DEEPSEEK_MODELS)
NEW = 8


def _tokens():
    import torch

    return torch.randint(0, cm.VOCAB, (2, 32), generator=torch.Generator().manual_seed(4))


def _prompts():
    import torch

    return [torch.randint(0, cm.VOCAB, (20,), generator=torch.Generator().manual_seed(s)).tolist() for s in (5, 6)]


def _hf_greedy(model, prompts):
    import torch

    ids = torch.tensor(prompts)
    with torch.no_grad():  # an explicit mask: token 0 in a prompt is not padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                             eos_token_id=None, pad_token_id=0)
    return out[:, len(prompts[0]):].tolist()


def _greedy(ckpt: Path, runtime, *, use_cache: bool):
    from megacli.data.tokenizers import load_tokenizer
    from megacli.inference.generator import Generator
    from megacli.inference.runner import Model

    recipe = cm.one_process_generate_recipe(ckpt, max_new_tokens=NEW, stop_at_eod=False, use_cache=use_cache)
    tok = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path)
    gen = Generator(Model(recipe, runtime, vocab_size=recipe.model.vocab_size), tok, recipe.generate)
    return [list(t) for t in gen._sample(_prompts(), None).tokens]  # token prompts: no text round trip


def _add_mtp_layer(src: Path, dst: Path) -> list[str]:
    """A copy of a V3 directory with one multi-token-prediction layer (layer 2, as DeepSeek-V3 stores
    its layer 61) in its weights and config; returns the added tensor names."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    added = {}
    for key, t in weights.items():
        if key.startswith("model.layers.1."):
            added[key.replace("model.layers.1.", "model.layers.2.")] = t.clone()
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        added[f"model.layers.2.{name}"] = torch.ones(4)
    save_file({**weights, **added}, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    return sorted(added)


def _params(ckpt: Path) -> tuple[int, int]:
    """(parameters of the built model, the dry-run's count) for a converted checkpoint's recipe."""
    from megacli.engine.models import build_model
    from megacli.engine.models.config import transformer_config
    from megacli.plan import count_params
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    recipe = load(TrainingRecipe, ckpt / "iter_0000000" / "recipe.yaml", ["launch.nproc=1", "train.global_batch_size=8"])
    config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="fp32", on_cuda=False)
    chunks = build_model(recipe=recipe, config=config, vocab_size=recipe.model.vocab_size)
    built = sum(p.numel() for c in chunks for p in c.parameters())
    return built, count_params(recipe, recipe.model.vocab_size).total


def _prepare(rank, world, root: str):
    import torch
    from safetensors.torch import load_file

    from megacli.convert import convert
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    root = Path(root)
    toks = _tokens()
    out = {}
    for name in NAMES:
        d = root / name
        model = cm.build_hf(name, d / "hf", with_tokenizer=True)
        torch.save(cm.hf_logits(model, toks), d / "hf_logits.pt")
        out[name] = {**cm.round_trip(d, parallel=ParallelSection()), "hf_greedy": _hf_greedy(model, _prompts())}
    for name in NAMES:  # as if trained from scratch: no Hugging Face config to carry
        d = root / name
        shutil.copytree(d / "mc", d / "mc_bare")
        shutil.rmtree(d / "mc_bare" / "hf")
        convert(Source(d / "mc_bare"), d / "hf3", say=lambda *_: None)
        out[name]["bare_export_logits"] = cm.max_diff(cm.hf_logits(cm.load_hf(d / "hf3"), toks),
                                                      torch.load(d / "hf_logits.pt"))
    # Multi-token prediction: dropped on import, with a note; the rest converts as before.
    d = root / "deepseek_v3"
    added = _add_mtp_layer(d / "hf", d / "hf_mtp")
    said = []
    convert(Source(d / "hf_mtp"), d / "mc_mtp", say=said.append)
    convert(Source(d / "mc_mtp"), d / "hf_mtp2", say=lambda *_: None)
    a, b = load_file(d / "hf_mtp" / "model.safetensors"), load_file(d / "hf_mtp2" / "model.safetensors")
    out["mtp"] = {"said": said, "added": added, "kept": sorted(set(a) - set(b)) == added and set(b) < set(a),
                  "bitwise": all(torch.equal(a[k], b[k]) for k in b),
                  "config": json.loads((d / "hf_mtp2" / "config.json").read_text())}
    runtime = distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu"), seed=0)
    for name in NAMES:
        out[name]["params"] = _params(root / name / "mc")
        ref = torch.load(root / name / "hf_logits.pt")
        out[name]["tp1_logits"] = cm.max_diff(cm.megacli_logits(root / name / "mc", toks), ref)
        out[name]["greedy"] = _greedy(root / name / "mc", runtime, use_cache=True)
        out[name]["greedy_no_cache"] = _greedy(root / name / "mc", runtime, use_cache=False)
    distributed.teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("deepseek")
    return root, spawn(_prepare, 1, str(root), timeout=1800)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_hugging_face_at_tp1(converted, name):
    _, out = converted
    assert out[name]["tp1_logits"] < TOL, out[name]["tp1_logits"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_dry_run_counts_the_parameters_megatron_builds(converted, name):
    _, out = converted
    built, counted = out[name]["params"]
    assert built == counted


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bitwise_with_the_same_config(converted, name):
    _, out = converted
    r = out[name]
    assert r["same_keys"] and r["bitwise"]
    src, back = r["config"]
    assert src == back
    assert r["bare_export_logits"] < TOL, r["bare_export_logits"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_hugging_face(converted, name):
    _, out = converted
    r = out[name]
    assert r["greedy"] == r["hf_greedy"]
    assert r["greedy_no_cache"] == r["hf_greedy"]


@pytest.mark.slow
def test_multi_token_prediction_layers_are_dropped_with_a_note(converted):
    _, out = converted
    r = out["mtp"]
    assert any("dropped 1 multi-token-prediction layer" in s and "model.layers.2" in s for s in r["said"]), r["said"]
    assert r["kept"] and r["bitwise"], r["added"]
    assert r["config"]["num_nextn_predict_layers"] == 0  # the export holds no such layer


def _config(name: str, **changes) -> dict:
    cls_name, kwargs = cm.DEEPSEEK_MODELS[name]
    return {**kwargs, "architectures": [cm.ARCHITECTURES[cls_name]], **changes}


@pytest.mark.parametrize("name, changes, message", [
    ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob = false"),
    ("deepseek_v3", {"topk_group": 1}, "topk_group = 1"),
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
    ("deepseek_v3", {"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, "dequantize it"),
    ("deepseek_v2_lite", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2_lite", {"attention_bias": True}, "attention_bias"),
])
def test_configs_megatron_cannot_express_are_refused(name, changes, message):
    from megacli.convert.families import deepseek

    with pytest.raises(UserError, match=message):
        deepseek.model_section(_config(name, **changes))


def test_recipe_refusals():
    from megacli.recipe.base import RecipeError
    from megacli.recipe.model import ModelSection

    from megacli.convert.families import deepseek

    section = deepseek.model_section(_config("deepseek_v3"))
    ModelSection(**section)  # valid as imported
    for changes, field in [({"num_query_groups": 2}, "model.num_query_groups"), ({"qk_layernorm": True}, "model.qk_layernorm"),
                           ({"position_embedding": "learned", "rope_scaling": None}, "model.mla"), ({"softmax_scale": 0.5}, "model.softmax_scale")]:
        with pytest.raises(RecipeError, match=field):
            ModelSection(**{**section, **changes})
    moe = section["moe"]
    for changes, field in [({"router_score_function": "softmax"}, "router_expert_bias"),
                           ({"router_group_topk": None}, "router_num_groups"),
                           ({"router_num_groups": 3}, "router_num_groups"),
                           ({"router_group_topk": 1, "router_topk": 4}, "router_group_topk")]:
        with pytest.raises(RecipeError, match=field):
            ModelSection(**{**section, "moe": {**moe, **changes}})

    from megacli.recipe.base import RecipeErrors, validate
    from megacli.recipe.pretrain import TrainingRecipe

    raw = {"model": section, "tokenizer": {"type": "none"}, "data": {"mock": True}, "checkpoint": {"pretrained": "/ckpt"}}
    with pytest.raises(RecipeErrors, match="lora.targets .* has no linear_qkv"):
        validate(TrainingRecipe, {**raw, "lora": {"rank": 4, "targets": ["linear_qkv", "linear_proj"]}}, "test")
    validate(TrainingRecipe, {**raw, "lora": {"rank": 4, "targets": ["linear_proj"]}}, "test")


def _logits_tp2_pp2_ep2(rank, world, root: str) -> dict:
    """On two processes, one layout after the other: TP=2 (with the sequence parallelism Megatron's
    MoE layers need), PP=2 (the dense layer on the first stage, the MoE layer on the second), EP=2."""
    from megatron.core import parallel_state as ps

    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    toks, out = _tokens(), {}
    distributed.setup(parallel=ParallelSection(tensor=2, sequence_parallel=True), launch=LaunchSection(device="cpu", nproc=2),
                      seed=0)
    layouts = [("tp2", dict(tensor_model_parallel_size=2), ("parallel.sequence_parallel=true",)),
               ("pp2", dict(pipeline_model_parallel_size=2), ()),
               ("ep2", dict(expert_model_parallel_size=2), ("parallel.expert=2", "launch.nproc=2"))]
    for label, sizes, overrides in layouts:
        if label != "tp2":
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(**sizes)
        for name in NAMES:
            out[(name, label)] = cm.megacli_logits(Path(root) / name / "mc", toks, overrides)
    distributed.teardown()
    return out


@pytest.mark.slow
def test_logits_equal_hugging_face_at_tp2_pp2_and_ep2(converted):
    import torch

    from tests._dist import spawn

    root, _ = converted
    first, second = spawn(_logits_tp2_pp2_ep2, 2, str(root), timeout=900)
    for name in NAMES:
        ref = torch.load(root / name / "hf_logits.pt")
        assert second[(name, "tp2")] is None and first[(name, "pp2")] is None  # TP rank 1, first stage: nothing
        assert cm.max_diff(first[(name, "tp2")], ref) < TOL, name
        assert cm.max_diff(second[(name, "pp2")], ref) < TOL, name
        for r in (first, second):  # EP=2 × DP=2: both ranks hold the whole output
            assert cm.max_diff(r[(name, "ep2")], ref) < TOL, name


# DeepSeek-V3's config.json as published (transformers 4 style: rope_scaling, scoring_func,
# topk_method; its fp8 quantization_config left out) and DeepSeek-V2-Lite's.
DEEPSEEK_V3_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
    intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_nextn_predict_layers=1,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, ep_size=1,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
    first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu", max_position_embeddings=163840,
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"},
    attention_bias=False, attention_dropout=0.0)
DEEPSEEK_V2_LITE_CONFIG = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
    num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0, kv_lora_rank=512,
    q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=1,
    topk_group=1, num_experts_per_tok=6, first_k_dense_replace=1, norm_topk_prob=False, scoring_func="softmax",
    aux_loss_alpha=0.001, hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                  "original_max_position_embeddings": 4096, "type": "yarn"},
    tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0)


@pytest.mark.parametrize("config, total, active", [(DEEPSEEK_V3_CONFIG, 671.0, 36.6), (DEEPSEEK_V2_LITE_CONFIG, 15.7, 2.5)])
def test_published_configs_map_and_count_as_published(config, total, active):
    """The published configs give recipes whose dry-run counts are DeepSeek's figures: billions of
    parameters in all (V3: 671B, its multi-token-prediction layer left out; V2-Lite: "16B", 15.7B
    by the weights) and per token without the input embedding (V3: "37B", 36.6B; V2-Lite: "2.4B", 2.45B)."""
    from megacli.convert.families import deepseek
    from megacli.plan import count_params
    from megacli.recipe.base import validate
    from megacli.recipe.pretrain import TrainingRecipe

    section = deepseek.model_section(config)
    recipe = validate(TrainingRecipe, {"model": section, "tokenizer": {"type": "none"}, "data": {"mock": True}}, "test")
    counts = count_params(recipe, config["vocab_size"])
    embedding = counts.embedding
    assert (round(counts.total / 1e9, 1), round((counts.active - embedding) / 1e9, 1)) == (total, active)
    assert deepseek.import_notes(config) == ([] if "num_nextn_predict_layers" not in config else [
        "dropped 1 multi-token-prediction layer(s) (num_nextn_predict_layers; model.layers.61.*): Hugging Face's "
        "DeepSeek models do not use them either"])


@pytest.mark.slow
def test_quantized_checkpoint_is_refused_by_the_cli(converted, tmp_path):
    """Exit code 2 and one message naming the cause; nothing written."""
    import subprocess
    import sys

    root, _ = converted
    src = tmp_path / "fp8"
    shutil.copytree(root / "deepseek_v3" / "hf", src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    (src / "config.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "megacli", "convert", str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    message = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2 and "Traceback" not in message, message
    assert "the checkpoint is quantized (fp8, e4m3); dequantize it to bf16 first" in message, message
    assert not (tmp_path / "out").exists()
