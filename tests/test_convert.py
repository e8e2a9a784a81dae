"""`megacli convert`: the tensor transforms and tables on their own, then tiny random HF models
(GPT-2, Llama tied and untied with GQA, Mistral, Qwen2) converted HF -> megacli -> HF with the
same logits as HF (1e-4 max-abs, fp32) at TP=1 PP=1 and TP=2 PP=2, bitwise round trips, and
Megatron-LM legacy checkpoints (TP=2 PP=2 Megatron-Core keys, TP=2 legacy-model keys) -> HF and
-> megacli.

The conversions run in one spawned process (module fixture), the TP=2 PP=2 check in four gloo
processes; the command line runs in this process, its refusals in a process of their own."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from megacli.checkpoint.source import Source

from tests import _convert_models as cm
from tests._convert_models import MODELS
from tests.conftest import megacli, megacli_here

TOL = 1e-4


# ---------------------------------------------------------------- transforms and tables (no Megatron)


def test_qkv_interleave_is_megatron_grouped_order():
    from megacli.convert.mapping import interleave_qkv, split_qkv

    heads, groups, d = 4, 2, 3
    q = torch.arange(heads * d).float().unsqueeze(1) + 100  # rows 100.. = q heads 0-3
    k = torch.arange(groups * d).float().unsqueeze(1) + 200
    v = torch.arange(groups * d).float().unsqueeze(1) + 300
    fused = interleave_qkv(q, k, v, groups=groups).squeeze(1).tolist()
    # group 0: q heads 0,1 | k head 0 | v head 0; group 1: q heads 2,3 | k head 1 | v head 1
    expect = [*range(100, 106), *range(200, 203), *range(300, 303), *range(106, 112), *range(203, 206), *range(303, 306)]
    assert fused == expect
    for back, orig in zip(split_qkv(interleave_qkv(q, k, v, groups=groups), groups=groups, heads=heads), (q, k, v)):
        assert torch.equal(back, orig)
    bias = torch.randn(heads * d + 2 * groups * d)
    assert torch.equal(interleave_qkv(*split_qkv(bias, groups=groups, heads=heads), groups=groups), bias)


def test_gpt2_conv1d_qkv_gate_up_and_transpose_round_trip():
    from megacli.convert.mapping import fused_qkv, gate_up, transposed

    c_attn = torch.randn(8, 24)  # Conv1D [in=8, out=3·8], 4 heads of 2
    to_m, to_hf = fused_qkv(heads=4, conv1d=True)
    fused = to_m(c_attn)
    assert fused.shape == (24, 8)
    q, k, v = c_attn.t().chunk(3)
    assert torch.equal(fused[:6], torch.cat([q[:2], k[:2], v[:2]]))  # head 0: its q, k, v rows
    assert torch.equal(to_hf(fused)[0], c_attn)
    g, u = torch.randn(6, 4), torch.randn(6, 4)
    to_m, to_hf = gate_up()
    assert all(torch.equal(a, b) for a, b in zip(to_hf(to_m(g, u)), (g, u)))
    to_m, to_hf = transposed()
    assert torch.equal(to_hf(to_m(c_attn))[0], c_attn)


def test_vocab_rows_pad_trim_and_errors():
    from megacli.convert.mapping import fit_vocab_rows
    from megacli.errors import UserError

    t = torch.randn(300, 4)
    padded = fit_vocab_rows(t, rows=512, vocab_size=300, key="k")
    assert padded.shape == (512, 4) and torch.equal(padded[:300], t) and not padded[300:].any()
    assert torch.equal(fit_vocab_rows(padded, rows=300, vocab_size=300, key="k"), t)
    with pytest.raises(UserError, match="300 vocabulary rows but the vocabulary has 400"):
        fit_vocab_rows(t, rows=512, vocab_size=400, key="k")


def test_unsupported_architecture_names_the_supported_ones():
    from megacli.convert import families
    from megacli.errors import UserError

    with pytest.raises(UserError) as err:
        families.for_hf_config({"architectures": ["FalconForCausalLM"]})
    msg = str(err.value)
    assert "FalconForCausalLM" in msg and all(a in msg for a in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM"))


def test_llama_family_refuses_what_megatron_cannot_express():
    from megacli.convert.families import llama
    from megacli.errors import UserError

    base = dict(architectures=["LlamaForCausalLM"], hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                intermediate_size=64, max_position_embeddings=64, vocab_size=100)
    assert llama.model_section(base)["rotary_base"] == 10000.0
    assert llama.model_section({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})["rotary_base"] == 5e5
    with pytest.raises(UserError, match="RoPE scaling 'longrope'.*linear, llama3, yarn and plain RoPE convert"):
        llama.model_section({**base, "rope_scaling": {"rope_type": "longrope", "factor": 8.0}})
    with pytest.raises(UserError, match="attention_bias = True with mlp_bias = False"):
        llama.model_section({**base, "attention_bias": True})
    qwen = llama.model_section({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen["add_qkv_bias"] and not qwen["add_bias_linear"]


def test_shape_mismatch_names_key_shapes_and_cause():
    from megacli.convert.megatron_io import shape_mismatch

    msg = str(shape_mismatch("decoder.layers.0.self_attention.linear_qkv.weight", (64, 32), (128, 32), "the source"))
    assert "linear_qkv.weight" in msg and "[64, 32]" in msg and "[128, 32]" in msg and "TP=2" in msg
    msg = str(shape_mismatch("embedding.word_embeddings.weight", (384, 32), (512, 32), "the source"))
    assert "vocabulary" in msg


def test_canonical_and_legacy_key_names():
    from megacli.checkpoint.megatron_lm.legacy_reader import canonical_name
    from megacli.convert.megatron_io import unstacked_key

    assert unstacked_key("decoder.layers.3.input_layernorm.weight", "decoder.layers.self_attention.linear_qkv.layer_norm_weight") \
        == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert unstacked_key("decoder.final_layernorm.weight", "decoder.final_layernorm.weight") == "decoder.final_layernorm.weight"
    assert canonical_name("language_model.encoder.layers.2.input_norm.weight") == "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight"
    assert canonical_name("language_model.encoder.layers.2.mlp.dense_4h_to_h.bias") == "decoder.layers.2.mlp.linear_fc2.bias"
    assert canonical_name("decoder.layers.1.pre_mlp_layernorm.weight") == "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    assert canonical_name("decoder.layers.1.self_attention.linear_qkv.weight") == "decoder.layers.1.self_attention.linear_qkv.weight"
    assert canonical_name("decoder.layers.1.mlp.linear_fc1._extra_state") is None


def test_legacy_files_load_safely_and_refuse_arbitrary_code(tmp_path):
    import numpy as np

    from megacli.checkpoint.safe_pickle import torch_load
    from megacli.errors import UserError
    from tests._convert_models import NotAllowListed

    ok = tmp_path / "ok.pt"
    torch.save({"args": argparse.Namespace(num_layers=2), "rng": np.random.get_state(), "w": torch.ones(2)}, ok)
    assert torch_load(ok, trust=False, name=ok, mmap=True)["args"].num_layers == 2
    bad = tmp_path / "bad.pt"
    torch.save({"args": argparse.Namespace(thing=NotAllowListed())}, bad)
    with pytest.raises(UserError) as err:
        torch_load(bad, trust=False, name=bad, mmap=True)
    assert "tests._convert_models.NotAllowListed" in str(err.value) and "--trust-pickle" in str(err.value)
    assert torch_load(bad, trust=True, name=bad, mmap=True)["args"].thing.value == 1


# ---------------------------------------------------------------- conversions (one spawned process)


def _prepare(rank, world, root: str):
    """Build the tiny HF models, convert them both ways (and via legacy checkpoints), and measure
    everything a test asserts. Runs in a fresh process: conversions enable the CPU backend."""
    from safetensors.torch import load_file

    from megacli.convert import convert
    from megacli.convert.structure import structure
    from megacli.recipe.sections import ParallelSection
    from tests import _convert_models as cm

    root = Path(root)
    toks = cm.tokens()
    out: dict = {"logs": []}
    say = out["logs"].append
    tp2pp2 = ParallelSection(tensor=2, pipeline=2)
    for name in MODELS:
        d = root / name
        model = cm.build_hf(name, d / "hf", with_tokenizer=name == "gpt2")
        ref = cm.hf_logits(model, toks)
        torch.save(ref, d / "hf_logits.pt")
        out[name] = {**cm.round_trip(d, parallel=tp2pp2, say=say),
                     "export_logits": cm.max_diff(cm.hf_logits(cm.load_hf(d / "hf2"), toks), ref)}
    # bf16 both ways, and an export in many small shards.
    d = root / "llama_untied_gqa"
    convert(Source(d / "hf"), d / "mc_bf16", dtype="bf16", say=say)
    convert(Source(d / "mc_bf16"), d / "hf_bf16", say=say)
    a, b = load_file(d / "hf" / "model.safetensors"), load_file(d / "hf_bf16" / "model.safetensors")
    out["bf16_round_trip"] = all(b[k].dtype == torch.bfloat16 and torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)
    convert(Source(d / "mc"), d / "hf_sharded", max_shard_size="20KB", say=say)
    out["shards"] = sorted(p.name for p in (d / "hf_sharded").glob("*.safetensors"))
    out["sharded_logits"] = cm.max_diff(cm.hf_logits(cm.load_hf(d / "hf_sharded"), toks), torch.load(d / "hf_logits.pt"))

    # Megatron-LM legacy checkpoints -> HF (logits) and -> megacli.
    legacy_cases = {"legacy_mcore": ("llama_untied_gqa", 2, 2, "mcore"), "legacy_model_gpt2": ("gpt2", 2, 1, "legacy"),
                    "legacy_tied_qwen": ("llama_tied_gqa", 1, 2, "mcore")}
    for case, (name, tp, pp, style) in legacy_cases.items():
        d = root / case
        cm.write_legacy(root / name / "hf", d / "ckpt", tp=tp, pp=pp, style=style)
        convert(Source(d / "ckpt"), d / "hf", to="hf", say=say)
        out[case] = {"hf_logits": cm.max_diff(cm.hf_logits(cm.load_hf(d / "hf"), toks), torch.load(root / name / "hf_logits.pt"))}
    convert(Source(root / "legacy_mcore" / "ckpt"), root / "legacy_mcore" / "mc", say=say)
    out["structure"] = {fmt: list(structure(Source(p))) for fmt, p in
                        (("hf", root / "qwen2" / "hf"), ("megacli", root / "qwen2" / "mc"), ("legacy", root / "legacy_mcore" / "ckpt"))}

    # The converted checkpoints through the engine at TP=1 PP=1 (prepared for TP=2 PP=2: other padding).
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection

    distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu"), seed=0)
    for name in MODELS:
        out[name]["tp1_logits"] = cm.max_diff(cm.megacli_logits(root / name / "mc", toks), torch.load(root / name / "hf_logits.pt"))
    out["legacy_mcore"]["tp1_logits"] = cm.max_diff(cm.megacli_logits(root / "legacy_mcore" / "mc", toks),
                                                  torch.load(root / "llama_untied_gqa" / "hf_logits.pt"))
    distributed.teardown()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("convert")
    return root, spawn(_prepare, 1, str(root), timeout=1800)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_megacli_hf_round_trip_is_bitwise_with_the_same_config(converted, name):
    _, out = converted
    r = out[name]
    assert r["same_keys"] and r["bitwise"], out["logs"]
    src, back = r["config"]
    assert src == back
    assert r["export_logits"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_megacli_logits_match_hf_at_tp1_pp1(converted, name):
    _, out = converted
    assert out[name]["tp1_logits"] < TOL, out[name]


@pytest.mark.slow
def test_converted_checkpoint_layout_and_recipe(converted):
    import yaml

    root, _ = converted
    ck = root / "gpt2" / "mc"
    assert (ck / "latest").read_text().strip() == "iter_0000000"
    meta = json.loads((ck / "iter_0000000" / "megacli.json").read_text())
    assert meta["has_optimizer"] is False and meta["format"] == "torch_dist" and meta["converted_from"]["architecture"] == "GPT2LMHeadModel"
    assert meta["layout"] == {"tensor": 1, "pipeline": 1, "virtual_pipeline": None, "data": 1, "context": 1}
    from megacli.checkpoint import manifest

    assert manifest.verify(ck).startswith("manifest: OK")  # checked before a load, as a training save's
    recipe = yaml.safe_load((ck / "iter_0000000" / "recipe.yaml").read_text())
    assert recipe["parallel"]["tensor"] == 2 and recipe["parallel"]["pipeline"] == 2 and recipe["launch"]["nproc"] == 4
    assert recipe["model"]["activation"] == "gelu_tanh" and recipe["model"]["position_embedding"] == "learned"
    assert recipe["tokenizer"] == {"type": "huggingface", "path": "../hf"}  # the files it carries, named relatively
    assert recipe["checkpoint"]["resume"] == str(ck.resolve()) and recipe["checkpoint"]["load_optimizer"] is False
    from megacli.checkpoint.layout import read_recipe
    from megacli.data.tokenizers import load_tokenizer

    carried = read_recipe(ck / "iter_0000000")["tokenizer"]["path"]
    assert carried == str(ck.absolute() / "hf") and load_tokenizer(type="huggingface", path=carried).vocab_size <= 300
    assert (root / "gpt2" / "hf2" / "tokenizer.json").is_file() and (root / "gpt2" / "hf2" / "generation_config.json").is_file()
    llama = yaml.safe_load((root / "qwen2" / "mc" / "iter_0000000" / "recipe.yaml").read_text())["model"]
    assert llama["add_qkv_bias"] and llama["num_query_groups"] == 2 and llama["rotary_base"] == 5000.0


@pytest.mark.slow
def test_bf16_and_sharded_export(converted):
    root, out = converted
    assert out["bf16_round_trip"]
    assert len(out["shards"]) > 2 and out["shards"][0].endswith(f"-of-{len(out['shards']):05d}.safetensors")
    index = json.loads((root / "llama_untied_gqa" / "hf_sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(out["shards"])
    assert out["sharded_logits"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["legacy_mcore", "legacy_model_gpt2", "legacy_tied_qwen"])
def test_legacy_checkpoint_to_hf_gives_the_same_logits(converted, case):
    _, out = converted
    assert out[case]["hf_logits"] < TOL, out[case]


@pytest.mark.slow
def test_legacy_checkpoint_to_megacli(converted):
    root, out = converted
    assert out["legacy_mcore"]["tp1_logits"] < TOL
    meta = json.loads((root / "legacy_mcore" / "mc" / "iter_0000010" / "megacli.json").read_text())
    assert meta["converted_from"]["layout"] == {"tensor": 2, "pipeline": 2, "virtual_pipeline": 1}


@pytest.mark.slow
def test_print_structure_of_each_format(converted):
    _, out = converted
    s = out["structure"]
    assert "Qwen2ForCausalLM" in s["hf"][0] and any("model.layers.1.self_attn.q_proj.bias  [32]  float32" in r for r in s["hf"])
    assert any("decoder.layers.self_attention.linear_qkv.weight  [2, 64, 32]  float32" in r for r in s["megacli"])
    assert "TP=2 PP=2" in s["legacy"][0] and any(r.startswith("iter_0000010/mp_rank_01_001/") for r in s["legacy"])


# ---------------------------------------------------------------- TP=2 PP=2 (four gloo processes)


def _logits_tp2_pp2(rank, world, root: str):
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection
    from tests import _convert_models as cm

    root = Path(root)
    distributed.setup(parallel=ParallelSection(tensor=2, pipeline=2), launch=LaunchSection(nproc=4, device="cpu"), seed=0)
    toks = cm.tokens()
    out = {name: cm.megacli_logits(root / name / "mc", toks) for name in MODELS}
    out["legacy_mcore"] = cm.megacli_logits(root / "legacy_mcore" / "mc", toks)
    distributed.teardown()
    return out


@pytest.mark.slow
def test_megacli_logits_match_hf_at_tp2_pp2(converted):
    from tests._dist import spawn

    root, _ = converted
    results = spawn(_logits_tp2_pp2, 4, str(root))
    last = [r for r in results if r["gpt2"] is not None]
    assert len(last) == 1, "exactly one rank (last stage, TP rank 0) reports logits"
    for name in MODELS:
        ref = torch.load(root / name / "hf_logits.pt")
        assert cm.max_diff(last[0][name], ref) < TOL, name
    assert cm.max_diff(last[0]["legacy_mcore"], torch.load(root / "llama_untied_gqa" / "hf_logits.pt")) < TOL


# ---------------------------------------------------------------- the command line


@pytest.mark.slow
def test_cli_one_off_convert_and_print_structure(converted, tmp_path):
    import yaml

    root, _ = converted
    dst = tmp_path / "mc"
    out = megacli_here("convert", str(root / "mistral" / "hf"), str(dst), "--tensor", "2", "--pipeline", "2", "--dtype", "bf16")
    assert out.returncode == 0, out.stderr
    recipe = yaml.safe_load((dst / "iter_0000000" / "recipe.yaml").read_text())
    assert recipe["train"]["precision"] == "bf16" and recipe["parallel"]["tensor"] == 2
    out = megacli_here("convert", str(dst), "--print-structure")
    assert out.returncode == 0 and "decoder.layers.mlp.linear_fc1.weight  [2, 128, 32]  bfloat16" in out.stdout, out.stderr


@pytest.mark.slow
def test_pretrain_starts_from_a_converted_checkpoint(converted, tmp_path):
    """The converted checkpoint's own recipe runs `megacli pretrain` in the layout it was prepared
    for (TP=2 PP=2, four processes), starting from the converted weights at iteration 0."""
    root, _ = converted
    ck = root / "llama_tied_gqa" / "mc"
    sets = ["train.iters=2", "train.eval_interval=null", "train.log_interval=1", "model.seq_length=16",
            "train.global_batch_size=2", f"run.dir={tmp_path / 'run'}"]
    out = megacli("pretrain", str(ck / "iter_0000000" / "recipe.yaml"), *[x for s in sets for x in ("--set", s)])
    assert out.returncode == 0, out.stderr[-3000:]
    said = "".join(out.stdout.split())  # the console wraps long lines
    assert f"resumedfrom{ck.resolve() / 'iter_0000000'}atiteration0" in said, out.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2] and all(0 < x < 20 for x in losses)


def test_convert_recipe_and_one_off_arguments(tmp_path):
    from megacli.cli.convert import _load_recipe
    from megacli.recipe.base import RecipeErrors

    r = _load_recipe(["src", "dst"], ["parallel.tensor=2", "convert.dtype=bf16"])
    assert (r.convert.source, r.convert.destination, r.parallel.tensor, r.convert.dtype) == ("src", "dst", 2, "bf16")
    recipe = tmp_path / "convert.yaml"
    recipe.write_text("convert:\n  source: a\n  destination: b\n  max_shard_size: 500MB\nparallel:\n  pipeline: 2\n")
    r = _load_recipe([str(recipe)], ["convert.to=hf"])
    assert r.convert.to == "hf" and r.parallel.pipeline == 2 and r.convert.max_shard_size == "500MB"
    with pytest.raises(RecipeErrors, match="max_shard_size"):
        _load_recipe(["a", "b"], ["convert.max_shard_size=lots"])
    with pytest.raises(RecipeErrors, match="convert.to"):
        _load_recipe(["a", "b"], ["convert.to=onnx"])



def test_trust_pickle_flag_reaches_the_recipe_as_the_flags_value(tmp_path):
    from megacli.cli.convert import _load_recipe

    assert _load_recipe(["src", "dst"], [], trusted=True).convert.trust_pickle is True
    assert _load_recipe(["src", "dst"], []).convert.trust_pickle is False
    recipe = tmp_path / "convert.yaml"
    recipe.write_text("convert:\n  source: a\n  destination: b\n")
    assert _load_recipe([str(recipe)], [], trusted=True).convert.trust_pickle is True
    assert _load_recipe([str(recipe)], ["convert.trust_pickle=false"], trusted=True).convert.trust_pickle is False


def test_converted_recipe_for_a_target_layout(tmp_path):
    from megacli.convert.families import llama
    from megacli.convert.run import converted_recipe
    from megacli.recipe.base import RecipeErrors
    from megacli.recipe.sections import ParallelSection

    model = llama.model_section(dict(architectures=["MistralForCausalLM"], hidden_size=64, num_attention_heads=8,
                                     num_key_value_heads=4, num_hidden_layers=4, intermediate_size=128,
                                     max_position_embeddings=256, vocab_size=1000))
    r = converted_recipe(model=model, parallel=ParallelSection(tensor=2, pipeline=2, virtual_pipeline=2), precision="bf16",
                         tokenizer={"type": "null"}, resume=tmp_path)
    assert r.launch.nproc == 4 and r.num_microbatches % 2 == 0 and r.train.precision == "bf16"
    assert r.checkpoint.resume == str(tmp_path) and not r.checkpoint.load_optimizer
    with pytest.raises(RecipeErrors, match="parallel.tensor = 8: must divide model.num_query_groups = 4"):
        converted_recipe(model=model, parallel=ParallelSection(tensor=8), precision="fp32", tokenizer={"type": "null"},
                         resume=tmp_path)


def test_cli_errors_are_one_message(tmp_path):
    hf = tmp_path / "falcon"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    out = megacli("convert", str(hf), str(tmp_path / "out"))  # a process of its own: no traceback on its stderr
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "FalconForCausalLM" in out.stderr and "LlamaForCausalLM" in out.stderr
    out = megacli("convert", str(tmp_path / "missing"), str(tmp_path / "out"))
    assert out.returncode == 2 and "no such file or directory" in out.stderr
    assert not (tmp_path / "out").exists()
