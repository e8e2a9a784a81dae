"""Megatron-LM torch_dist checkpoints written by megacli (issue 18, writing; issue 17 item 20).

One real megacli run (2 steps of a tiny Llama-shaped GPT, in one process) gives a checkpoint with
optimizer, scheduler and RNG state; one spawned process then exports it as Megatron-LM
checkpoints (TE and local spec; TP2 x PP2), reads them back and converts them. What Megatron-LM
core_v0.16.1's own ``load_checkpoint`` does with them was checked by hand
(benchmarks/megatron_lm_load_check.py); here the layout it needs is asserted field by field.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from megacli.checkpoint.source import Source

from tests.conftest import pretrain

ROOT = Path(__file__).resolve().parent.parent
ITERATION, GBS, VOCAB = 2, 2, 262  # megacli's byte tokenizer: 256 bytes and its special tokens
# It is written as Megatron-LM's NullTokenizer, whose --vocab-size excludes the end-of-document id it appends:
# args.vocab_size = VOCAB - 1.
RUN = [
    "data.mock=true", "tokenizer.type=byte", "model.num_layers=2", "model.hidden_size=32",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.seq_length=16",
    "model.activation=swiglu", "model.normalization=rmsnorm", "model.position_embedding=rope",
    "model.untie_embeddings=true", "model.add_bias_linear=false", "model.make_vocab_size_divisible_by=64",
    f"train.iters={ITERATION}", "train.micro_batch_size=1", f"train.global_batch_size={GBS}", "train.eval_interval=null",
    "train.precision=fp32", f"checkpoint.save_interval={ITERATION}", "launch.nproc=1", "parallel.tensor=1",
    "parallel.pipeline=1",
]


def recipe(**model):
    """A validated training recipe (Llama-shaped unless ``model`` says otherwise)."""
    from megacli.recipe.base import apply_overrides, validate
    from megacli.recipe.pretrain import TrainingRecipe

    raw = apply_overrides({}, [s for s in RUN if not s.startswith(("launch.", "checkpoint."))]
                          + [f"model.{k}={v}" for k, v in model.items()])
    return validate(TrainingRecipe, raw, "test recipe")


# ---------------------------------------------------------------- args (single process)


def test_args_hold_every_field_parse_args_defines_with_the_recipes_values():
    import torch

    from megacli.checkpoint.megatron_lm.args_namespace import megatron_args, namespace_fields
    from megacli.checkpoint.megatron_lm.args import parse_args_defaults

    args = vars(megatron_args(recipe(), iteration=7, consumed_samples=14, padded_vocab_size=320, vocab_size=VOCAB,
                              transformer_impl="local"))
    assert set(args) == namespace_fields()
    assert len(args) > 650
    # what Megatron-LM's loaders and checkpoint converters read
    want = dict(num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                kv_channels=8, ffn_hidden_size=64, seq_length=16, max_position_embeddings=16,
                position_embedding_type="rope", add_position_embedding=True, normalization="RMSNorm", swiglu=True,
                squared_relu=False, openai_gelu=False, add_bias_linear=False, add_qkv_bias=False, bias_gelu_fusion=False,
                untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=64, padded_vocab_size=320,
                vocab_size=VOCAB - 1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1,
                use_distributed_optimizer=False, ckpt_format="torch_dist", use_dist_ckpt=True, bf16=False, fp16=False,
                params_dtype=torch.float32, iteration=7, consumed_train_samples=14, transformer_impl="local",
                micro_batch_size=1, global_batch_size=GBS, apply_residual_connection_post_layernorm=False,
                rotary_interleaved=False, layernorm_zero_centered_gamma=False, num_experts=None)
    if "use_legacy_models" in parse_args_defaults():  # removed after core_v0.16.1
        want["use_legacy_models"] = False
    assert {k: args[k] for k in want} == want
    gpt2 = vars(megatron_args(recipe(activation="gelu", normalization="layernorm", position_embedding="learned",
                                     add_bias_linear="true", untie_embeddings="false", num_query_groups="null")))
    assert (gpt2["bias_gelu_fusion"], gpt2["add_qkv_bias"], gpt2["swiglu"], gpt2["group_query_attention"],
            gpt2["position_embedding_type"], gpt2["normalization"]) == (False, True, False, False, "learned_absolute",
                                                                        "LayerNorm")
    assert gpt2["apply_rope_fusion"] is False and args["apply_rope_fusion"] is True


def test_args_carry_what_validate_args_derives_from_the_precision():
    """validate_args: bf16 accumulates and all-reduces gradients in fp32; fp16's dynamic loss scaling
    turns the NaN check off (benchmarks/megatron_lm_args_check.py compares all three with it)."""
    import torch

    from megacli.checkpoint.megatron_lm.args_namespace import megatron_args
    from megacli.recipe.base import apply_overrides, validate
    from megacli.recipe.pretrain import TrainingRecipe

    got = {}
    for precision in ("bf16", "fp16", "fp32"):
        raw = apply_overrides({}, [s for s in RUN if not s.startswith(("launch.", "checkpoint.", "train.precision"))]
                              + [f"train.precision={precision}"])
        a = megatron_args(validate(TrainingRecipe, raw, "test recipe"), vocab_size=VOCAB)
        got[precision] = (a.bf16, a.fp16, a.params_dtype, a.accumulate_allreduce_grads_in_fp32,
                          a.check_for_nan_in_loss_and_grad)
    assert got == {"bf16": (True, False, torch.bfloat16, True, True), "fp16": (False, True, torch.float16, False, False),
                   "fp32": (False, False, torch.float32, False, True)}


@pytest.mark.parametrize("changes", [{}, dict(activation="gelu", normalization="layernorm", position_embedding="learned",
                                              add_bias_linear="true", untie_embeddings="false", num_query_groups="null",
                                              rotary_base=10000),
                                     {"moe.num_experts": 8, "moe.router_topk": 4, "moe.layer_freq": 2,
                                      "moe.router_score_function": "sigmoid", "moe.router_expert_bias": "true",
                                      "moe.router_num_groups": 4, "moe.router_group_topk": 2,
                                      "moe.router_topk_scaling_factor": 2.5, "moe.capacity_factor": 1.5,
                                      "moe.drop_policy": "position", "moe.pad_to_capacity": "true",
                                      "moe.router_dtype": "fp64", "moe.dispatcher": "allgather", "moe.grouped_gemm": "false",
                                      "moe.aux_loss_coeff": 0.0, "moe.shared_expert_ffn_hidden_size": 32}])
def test_args_map_back_to_the_recipe(changes):
    """recipe -> args (megatron_lm.args) -> model section (megatron_lm.args, read back): the same model."""
    from megacli.checkpoint.megatron_lm.args import model_section_from_args
    from megacli.checkpoint.megatron_lm.args_namespace import megatron_args
    from megacli.recipe.model import ModelSection

    r = recipe(**changes)
    back = ModelSection(**model_section_from_args(megatron_args(r, vocab_size=VOCAB), VOCAB))
    same = ("num_layers", "hidden_size", "num_attention_heads", "query_groups", "head_dim", "ffn_size", "seq_length",
            "max_positions", "position_embedding", "rotary_base", "rotary_percent", "normalization", "norm_epsilon",
            "activation", "add_bias_linear", "qk_layernorm", "untie_embeddings", "dropout", "attention_dropout",
            "init_method_std", "make_vocab_size_divisible_by")
    assert {f: getattr(back, f) for f in same} == {f: getattr(r.model, f) for f in same}
    # a qkv bias either way: Megatron-LM's validate_args sets add_qkv_bias with add_bias_linear
    assert (back.add_qkv_bias or back.add_bias_linear) == (r.model.add_qkv_bias or r.model.add_bias_linear)
    assert back.vocab_size == VOCAB
    if r.model.moe is not None:  # the same experts; an integer layer_freq is written as its pattern, the
        # expert width (default: model.ffn_hidden_size) as its value
        differ = {"layer_freq", "ffn_hidden_size"}
        assert back.moe.model_dump(exclude=differ) == r.model.moe.model_dump(exclude=differ)
        assert back.moe_layers() == r.model.moe_layers() == [1, 0]
        assert back.expert_ffn_size == r.model.expert_ffn_size
    else:
        assert back.moe is None


def test_flag_table_page_is_the_mapping():
    """The docs' flag table (docs/megatron-lm/flags.md) is FLAGS row for row, and each row's option can be a real one: a switch
    whose field parse_args defaults to True is set by an option that turns it off (marked "(off)").
    That every spelling is an option of core_v0.16.1's parser setting that field with that sign is
    checked against a checkout by benchmarks/megatron_lm_args_check.py."""
    from megacli.checkpoint.megatron_lm.args import FLAGS, parse_args_defaults, flag_table

    text = (ROOT / "docs" / "megatron-lm" / "flags.md").read_text(encoding="utf-8")
    table = text.split("| Megatron-LM | recipe |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    rows = [tuple(cell.strip() for cell in line.strip("|").split(" | ")) for line in table.splitlines()]
    assert rows == flag_table()
    assert len({f.option for f in FLAGS}) == len(FLAGS)
    for f in FLAGS:
        default = parse_args_defaults()[f.arg]
        if f.from_environment:
            assert re.fullmatch(r"[A-Z_]+", f.option) and not f.off, f
            continue
        assert re.fullmatch(r"--[a-z0-9]+(-[a-z0-9]+)*", f.option), f
        if isinstance(default, bool):  # a switch: store_true for a False default, store_false for a True one
            assert f.off == default, f"{f.option}: parse_args' default of {f.arg} is {default}, so the option " \
                                     f"{'turns it off' if default else 'turns it on'}"
        else:
            assert not f.off, f
    assert "--world-size" not in [f.option for f in FLAGS]


def test_models_megatron_lm_args_cannot_describe_are_refused():
    from megacli.checkpoint.megatron_lm.args_namespace import megatron_args
    from megacli.errors import UserError

    with pytest.raises(UserError, match="model.activation geglu"):
        megatron_args(recipe(activation="geglu"))
    with pytest.raises(UserError, match="model.rope_scaling"):
        megatron_args(recipe(**{"rope_scaling.type": "linear", "rope_scaling.factor": 2.0}))


@pytest.mark.parametrize("activation, bias, fused", [("gelu", "true", False), ("gelu", "false", False),
                                                    ("gelu_tanh", "true", True), ("squared_relu", "true", False)])
def test_gelu_is_what_megatron_core_computes_both_ways(activation, bias, fused):
    """Megatron-Core 0.16.1's MLP computes GeLU exactly, except in its fused bias-GeLU (--add-bias-linear
    with bias_gelu_fusion, on by default), which is the tanh approximation and refuses other
    activations; --openai-gelu does not reach its models. Written: the fusion only for gelu_tanh with
    biases; read: the fusion with biases is gelu_tanh."""
    from megacli.checkpoint.megatron_lm.args import model_section_from_args
    from megacli.checkpoint.megatron_lm.args_namespace import megatron_args, unsupported

    args = megatron_args(recipe(activation=activation, add_bias_linear=bias), vocab_size=VOCAB)
    assert args.bias_gelu_fusion is fused
    assert model_section_from_args(args, VOCAB)["activation"] == activation
    # a Megatron-LM GPT-2-style run: biases, gelu, the fusion left on (its default) or turned off
    run = argparse.Namespace(**{**vars(megatron_args(recipe(activation="gelu", add_bias_linear="true"), vocab_size=VOCAB)),
                                "bias_gelu_fusion": True})
    assert model_section_from_args(run, VOCAB)["activation"] == "gelu_tanh"
    run.add_bias_linear = False  # validate_args turns the fusion off without biases; exact either way
    assert model_section_from_args(run, VOCAB)["activation"] == "gelu"
    assert [p for p in unsupported(recipe(activation="gelu_tanh", add_bias_linear="false"))
            if p.startswith("model.activation gelu_tanh without model.add_bias_linear")]


LLAMA3_1 = {"rope_scaling.type": "llama3", "rope_scaling.factor": 8.0, "rope_scaling.low_freq_factor": 1.0,
            "rope_scaling.high_freq_factor": 4.0, "rope_scaling.original_max_positions": 8192}
FEATURES = {
    "zero_centered_gamma": dict(norm_zero_centered_gamma="true"),
    "llama3_1_rope_scaling": LLAMA3_1,
    "window_everywhere": dict(sliding_window=5),
    "window_skip_freq": dict(num_layers=4, sliding_window=3, sliding_window_layers=2),
    "window_per_layer": dict(sliding_window=1, sliding_window_layers="[0,1]"),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_model_features_map_to_args_and_back(feature):
    """recipe -> args -> recipe for each feature Megatron-LM core_v0.16.1 has arguments for."""
    from megacli.checkpoint.megatron_lm.args import model_section_from_args
    from megacli.checkpoint.megatron_lm.args_namespace import megatron_args
    from megacli.recipe.model import ModelSection

    r = recipe(**FEATURES[feature])
    args = megatron_args(r, vocab_size=VOCAB)
    back = ModelSection(**model_section_from_args(args, VOCAB))
    fields = ("num_layers", "norm_zero_centered_gamma", "rope_scaling", "sliding_window", "sliding_window_layers")
    assert {f: getattr(back, f) for f in fields} == {f: getattr(r.model, f) for f in fields}
    assert back.window_layers() == r.model.window_layers()
    want = {"zero_centered_gamma": dict(layernorm_zero_centered_gamma=True),
            "llama3_1_rope_scaling": dict(use_rope_scaling=True, rope_scaling_factor=8.0),
            "window_everywhere": dict(window_size=(4, 0), window_attn_skip_freq=None),
            "window_skip_freq": dict(window_size=(2, 0), window_attn_skip_freq=2),
            "window_per_layer": dict(window_size=(0, 0), window_attn_skip_freq=[0, 1])}[feature]
    assert {k: getattr(args, k) for k in want} == want
    plain = vars(megatron_args(recipe(), vocab_size=VOCAB))
    assert (plain["layernorm_zero_centered_gamma"], plain["use_rope_scaling"], plain["window_size"]) == (False, False, None)


@pytest.mark.parametrize("changes, named", [
    (dict(LLAMA3_1, **{"rope_scaling.factor": 32.0}), "model.rope_scaling"),  # Llama 3.2's factor
    (dict(LLAMA3_1, **{"rope_scaling.original_max_positions": 4096}), "model.rope_scaling"),
    ({"rope_scaling.type": "yarn", "rope_scaling.factor": 4.0}, "model.rope_scaling"),
    (dict(softmax_scale=0.5), "model.softmax_scale (TransformerConfig.softmax_scale has no command-line argument)"),
    (dict(qk_layernorm="true", qk_norm_scope="projection"), "model.qk_norm_scope"),
    (dict(norm_placement="sandwich"), "model.norm_placement"),
    (dict(attention_softcap=50.0), "model.attention_softcap"),
    (dict(final_logit_softcap=30.0), "model.final_logit_softcap"),
    (dict(scale_embeddings="true"), "model.scale_embeddings"),
    (dict(sliding_window=4, rotary_base_local=100.0), "model.rotary_base_local"),
])
def test_features_megatron_lm_has_no_argument_for_are_refused_named(changes, named):
    from megacli.checkpoint.megatron_lm.args_namespace import megatron_args, unsupported
    from megacli.errors import UserError

    r = recipe(**changes)
    assert [p for p in unsupported(r) if p.startswith(named)], unsupported(r)
    with pytest.raises(UserError, match=re.escape(named)):
        megatron_args(r)


def _export_features(rank, world, root: str):
    """HF models with Megatron-LM-expressible features -> megacli -> Megatron-LM (te) -> megacli and HF."""
    import torch

    from megacli.checkpoint.layout import find_checkpoint, iter_name
    from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint
    from megacli.checkpoint.safe_pickle import torch_load
    from megacli.convert import convert
    from megacli.convert.megatron_io import CheckpointReader
    from megacli.recipe.reshard import ReshardSection
    from megacli.reshard import reshard
    from tests import _convert_models as cm

    root = Path(root)
    say = lambda *_: None  # noqa: E731
    toks = cm.tokens()
    out = {}
    for name in ("mistral_window_llama3_1", "qwen2_window"):
        d = root / name
        ref = cm.hf_logits(cm.build_hf(name, d / "hf"), toks)
        convert(Source(d / "hf"), d / "mc", say=say)
        src = find_checkpoint(d / "mc")
        reshard(ReshardSection(source=str(src), output=str(d / "mlm"), format="megatron", spec="te", progress=False))
        args = torch_load(d / "mlm" / iter_name(0) / "common.pt", trust=False, name="common.pt")["args"]
        r = out[name] = {"args": {k: getattr(args, k) for k in ("window_size", "window_attn_skip_freq",
                                                                "use_rope_scaling", "rope_scaling_factor")}}
        r["model"] = (MegatronLMCheckpoint(Source(d / "mlm")).recipe()["model"], cm.load_hf(d / "hf").config.to_dict())
        original = {k: t for g in CheckpointReader(Source(src)).groups() for k, t in g.items()}
        convert(Source(d / "mlm"), d / "back", to="megacli", say=say)
        back = {k: t for g in CheckpointReader(Source(find_checkpoint(d / "back"))).groups() for k, t in g.items()}
        r["same_keys"] = sorted(back) == sorted(original)
        r["differ"] = [k for k in original if k in back and not torch.equal(back[k], original[k])]
        r["recipes"] = [_features(c["model"]) for c in (MegatronLMCheckpoint(Source(d / "mlm")).recipe(), _recipe(find_checkpoint(d / "back")),
                                  _recipe(src))]
        convert(Source(d / "mlm"), d / "hf_back", to="hf", say=say)
        r["logits"] = cm.max_diff(cm.hf_logits(cm.load_hf(d / "hf_back"), toks), ref)
        torch.save(ref, d / "hf_logits.pt")
    # megacli's engine runs the model read back from Megatron-LM (window and RoPE scaling from its args)
    from megacli.engine import distributed
    from megacli.recipe.sections import LaunchSection, ParallelSection

    distributed.setup(parallel=ParallelSection(), launch=LaunchSection(device="cpu"), seed=0)
    for name, r in out.items():
        d = root / name
        r["engine_logits"] = cm.max_diff(cm.megacli_logits(find_checkpoint(d / "back"), toks),
                                         torch.load(d / "hf_logits.pt"))
    return out


def _features(model: dict) -> dict:
    from megacli.recipe.model import ModelSection

    m = ModelSection(**model)
    return {"sliding_window": m.sliding_window, "sliding_window_layers": m.sliding_window_layers,
            "norm_zero_centered_gamma": m.norm_zero_centered_gamma,
            "rope_scaling": m.rope_scaling and {k: v for k, v in m.rope_scaling.model_dump().items() if v is not None}}


def _recipe(ckpt):
    from megacli.checkpoint.layout import read_recipe

    return read_recipe(ckpt)


def test_features_survive_megacli_to_megatron_lm_and_back(tmp_path):
    """A sliding-window Mistral with Llama 3.1 RoPE scaling and a Qwen2 windowing only some layers:
    written as Megatron-LM checkpoints with --window-size / --use-rope-scaling, read back bitwise,
    and converted to HF with the source model's logits."""
    from tests._dist import spawn

    out = spawn(_export_features, 1, str(tmp_path), timeout=900)[0]
    mistral, qwen = out["mistral_window_llama3_1"], out["qwen2_window"]
    assert mistral["args"] == {"window_size": (4, 0), "window_attn_skip_freq": None, "use_rope_scaling": True,
                               "rope_scaling_factor": 8.0}
    assert qwen["args"] == {"window_size": (4, 0), "window_attn_skip_freq": [0, 1, 1], "use_rope_scaling": False,
                            "rope_scaling_factor": 8.0}
    for r in (mistral, qwen):
        assert r["same_keys"] and r["differ"] == []
        assert r["recipes"][0] == r["recipes"][1] == r["recipes"][2], r["recipes"]
        assert r["logits"] < 1e-4 and r["engine_logits"] < 1e-4, (r["logits"], r["engine_logits"])
    assert mistral["recipes"][0]["rope_scaling"]["factor"] == 8.0 and mistral["recipes"][0]["sliding_window"] == 5


# ---------------------------------------------------------------- export (one run, one spawned process)


def _export(rank, world, root: str):
    """The run's checkpoint -> Megatron-LM (te, local, TP2xPP2 te; legacy) -> read back and converted."""
    import torch

    from megacli.checkpoint.layout import TRACKER, find_checkpoint, iter_name
    from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint
    from megacli.checkpoint.safe_pickle import torch_load
    from megacli.checkpoint.torch_dist import TorchDistReader
    from megacli.convert import convert
    from megacli.convert.megatron_io import CheckpointReader
    from megacli.recipe.reshard import ReshardSection
    from megacli.reshard import reshard
    from tests import _convert_models as cm

    root = Path(root)
    src = find_checkpoint(root / "run" / "checkpoints")
    source = TorchDistReader(Source(src))
    out: dict = {}
    for name, spec, tp, pp in (("te", "te", 1, 1), ("local", "local", 1, 1), ("te22", "te", 2, 2)):
        dst = root / f"mlm_{name}"
        reshard(ReshardSection(source=str(src), output=str(dst), format="megatron", spec=spec, tensor=tp, pipeline=pp,
                               progress=False))
        it_dir = dst / iter_name(ITERATION)
        r = out[name] = {"tracker": (dst / TRACKER).read_text(), "files": sorted(p.name for p in it_dir.iterdir()),
                         "root": sorted(p.name for p in dst.iterdir())}
        written = TorchDistReader(Source(it_dir))
        common = torch_load(it_dir / "common.pt", trust=False, name="common.pt")  # megacli's restricted unpickler
        args = common["args"]
        r["common"] = {k: v for k, v in common.items() if k not in ("args", "optimizer")}
        r["args"] = {k: getattr(args, k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                   "transformer_impl", "iteration", "consumed_train_samples",
                                                   "padded_vocab_size", "vocab_size", "ckpt_format")}
        r["optimizer_common"] = common["optimizer"] == source.common()["optimizer"]
        r["same_tensors"] = sorted(written.tensors) == sorted(source.tensors)
        r["differ"] = [k for k in source.tensors if not torch.equal(written.read(k), source.read(k))]
        extra = [k for k in written.objects if "_extra_state" in k]
        r["extra_keys"] = sorted(extra)
        r["extra_values"] = {repr(written.read_object(k)) for k in extra}
        rng = [k for k in written.objects if k.startswith("rng_state")]
        r["rng_keys"] = sorted(rng)
        state = written.read_object(rng[0])
        r["rng_layout"] = [type(state).__name__, len(state), type(state[0]).__name__, len(state[0]),
                           sorted(state[0][0])]
        ours = source.read_object("rng_state/shard_0.0_1.1")[0]
        r["rng_torch_kept"] = torch.equal(state[0][0]["torch_rng_state"], ours["torch"])
        # megacli's Megatron-LM reader: the run's model back from the args
        r["recipe_model"] = MegatronLMCheckpoint(Source(dst)).recipe()["model"]

    say = lambda *_: None  # noqa: E731
    original = {k: t for g in CheckpointReader(Source(src)).groups() for k, t in g.items()}
    for spec in ("te", "local"):
        convert(Source(root / f"mlm_{spec}"), root / f"back_{spec}", to="megacli", say=say)
        back = {k: t for g in CheckpointReader(Source(find_checkpoint(root / f"back_{spec}"))).groups() for k, t in g.items()}
        out[spec]["back_keys"] = sorted(back) == sorted(original)
        out[spec]["back_differ"] = [k for k in original if not torch.equal(back[k], original[k])]
    toks = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    convert(Source(src.parent), root / "hf_src", to="hf", say=say)
    ref = cm.hf_logits(cm.load_hf(root / "hf_src"), toks)
    for spec in ("te", "local"):
        convert(Source(root / f"mlm_{spec}"), root / f"hf_{spec}", to="hf", say=say)
        out[spec]["logits"] = cm.max_diff(cm.hf_logits(cm.load_hf(root / f"hf_{spec}"), toks), ref)

    # The command line: HF -> Megatron-LM (weights only, through a staging megacli checkpoint); a
    # refused option writes nothing.
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()
    run = CliRunner().invoke(app, ["convert", str(root / "hf_src"), str(root / "from_hf"), "--to", "megatron"])
    out["cli"] = [run.exit_code, run.output, sorted(p.name for p in root.iterdir() if p.name.startswith("."))]
    if run.exit_code == 0:
        common = torch_load(root / "from_hf" / "iter_0000000" / "common.pt", trust=False, name="common.pt")
        out["cli"].append(sorted(common))
        hf = {k: t for g in CheckpointReader(Source(root / "from_hf" / "iter_0000000"),
                                              rename=lambda k, _: None if "_extra_state" in k else k).groups()
              for k, t in g.items()}
        # HF holds the real vocabulary rows only (the padding rows are new zeros)
        rows = lambda k, t: t[:VOCAB] if k.startswith(("embedding.", "output_layer.")) else t  # noqa: E731
        out["cli"].append([k for k in original if not torch.equal(rows(k, hf[k]), rows(k, original[k]))])
    bad = CliRunner().invoke(app, ["convert", str(src.parent), str(root / "bad"), "--to", "megatron", "--dtype", "bf16"])
    out["cli_refused"] = [bad.exit_code, bad.output, (root / "bad").exists()]

    # The legacy export carries the same full argument set (one shared function).
    reshard(ReshardSection(source=str(src), output=str(root / "legacy"), format="legacy", progress=False))
    legacy = torch_load(root / "legacy" / iter_name(ITERATION) / "mp_rank_00" / "model_optim_rng.pt", trust=False,
                        name="legacy")
    out["legacy_args"] = sorted(vars(legacy["args"]))
    # ... and megacli's legacy import reads it back: the same model section and weights.
    reshard(ReshardSection(source=str(root / "legacy"), output=str(root / "legacy_back"), progress=False))
    from megacli.checkpoint.layout import read_recipe

    back_dir = find_checkpoint(root / "legacy_back")
    out["legacy_model"] = (read_recipe(back_dir)["model"], read_recipe(src)["model"])
    again = TorchDistReader(Source(back_dir))
    out["legacy_differ"] = [k for k in source.tensors if not k.startswith("optimizer.")
                            and not torch.equal(again.read(k), source.read(k))]

    # --spec local: a plain state_dict() of Megatron-Core's local-spec model (its own norm modules),
    # compared with one built here; read back with its optimizer state.
    reshard(ReshardSection(source=str(src), output=str(root / "legacy_local"), format="legacy", spec="local",
                           progress=False))
    local = torch_load(root / "legacy_local" / iter_name(ITERATION) / "mp_rank_00" / "model_optim_rng.pt",
                       trust=False, name="legacy local")
    out["legacy_local"] = {"keys": list(local["model"]), "transformer_impl": local["args"].transformer_impl,
                           "extra": {repr(v) for k, v in local["model"].items() if k.endswith("._extra_state")},
                           "shapes": {k: tuple(v.shape) for k, v in local["model"].items() if torch.is_tensor(v)},
                           "reference": _local_spec_state(local["args"].padded_vocab_size)}
    reshard(ReshardSection(source=str(root / "legacy_local"), output=str(root / "legacy_local_back"), progress=False))
    again = TorchDistReader(Source(find_checkpoint(root / "legacy_local_back")))
    out["legacy_local"]["same_tensors"] = sorted(again.tensors) == sorted(source.tensors)
    out["legacy_local"]["differ"] = [k for k in source.tensors if not torch.equal(again.read(k), source.read(k))]
    return out


def _local_spec_state(padded_vocab: int) -> dict:
    """(key, shape or type) of Megatron-Core's own GPT model with the local layer spec, the run's size, TP = 1."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megacli.backend import cpu

    cpu.enable()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    try:
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                   ffn_hidden_size=64, normalization="RMSNorm", gated_linear_unit=True,
                                   activation_func=torch.nn.functional.silu, add_bias_linear=False,
                                   use_cpu_initialization=True)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=padded_vocab, max_sequence_length=16, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
        return [(k, tuple(v.shape) if torch.is_tensor(v) else repr(v)) for k, v in model.state_dict().items()]
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("megatron_lm_write")
    pretrain_in_process(RUN, root / "run")
    return root, spawn(_export, 1, str(root), timeout=1800)[0]


def pretrain_in_process(sets: list[str], run_dir: Path) -> None:
    """`megacli pretrain --set ...` (one worker, in the CLI's process) into run_dir, checkpoints in run_dir/checkpoints."""
    pretrain(run_dir, [*sets, f"checkpoint.dir={run_dir / 'checkpoints'}"])


@pytest.mark.parametrize("name", ["te", "local", "te22"])
def test_written_as_megatron_lm_lays_it_out(exported, name):
    _, out = exported
    r = out[name]
    assert r["tracker"] == str(ITERATION)
    assert r["root"] == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert r["files"] == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    common = r["common"]
    assert (common["checkpoint_version"], common["iteration"], common["num_floating_point_operations_so_far"]) == (3.0, 2, 0)
    assert common["opt_param_scheduler"]["num_steps"] == ITERATION * GBS  # Megatron-LM counts samples
    assert common["content_metadata"] == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    tp = 2 if name == "te22" else 1
    assert r["args"] == {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": tp,
                         "transformer_impl": "local" if name == "local" else "transformer_engine", "iteration": 2,
                         "consumed_train_samples": ITERATION * GBS, "padded_vocab_size": 64 * tp * -(-VOCAB // (64 * tp)),
                         "vocab_size": VOCAB - 1, "ckpt_format": "torch_dist"}
    assert r["optimizer_common"]
    assert r["rng_keys"] == [f"rng_state/shard_{p}.{t}_{tp}.{tp}" for p in range(tp) for t in range(tp)]
    assert r["rng_layout"] == ["list", 1, "list", 1, ["cuda_rng_state", "np_rng_state", "random_rng_state",
                                                      "rng_tracker_states", "torch_rng_state"]]
    modules = ["mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj", "self_attention.linear_qkv"]
    extra = sorted(f"decoder.layers.{m}._extra_state/shard_{i}_2" for m in modules for i in range(2))
    if name != "local":
        extra = sorted(extra + ["decoder.final_layernorm._extra_state/shard_0_1"])
    assert r["extra_keys"] == extra
    assert r["extra_values"] == ({"[None]"} if name == "local" else {"[tensor([], dtype=torch.uint8)]"})
    m = r["recipe_model"]
    assert (m["num_layers"], m["hidden_size"], m["num_query_groups"], m["activation"], m["normalization"],
            m["position_embedding"], m["untie_embeddings"], m["vocab_size"]) == (2, 32, 2, "swiglu", "rmsnorm", "rope",
                                                                                  True, VOCAB)


@pytest.mark.parametrize("name", ["te", "local"])
def test_weights_and_optimizer_bitwise_and_the_same_logits(exported, name):
    _, out = exported
    r = out[name]
    assert r["same_tensors"] and r["differ"] == []  # model and optimizer state, every tensor
    assert r["rng_torch_kept"]
    assert r["back_keys"] and r["back_differ"] == []  # megatron -> megacli
    assert r["logits"] == 0.0, r["logits"]


def test_the_legacy_export_carries_the_full_args_and_imports_back(exported):
    from megacli.checkpoint.megatron_lm.args_namespace import namespace_fields

    _, out = exported
    assert set(out["legacy_args"]) == namespace_fields()
    got, want = out["legacy_model"]
    fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "seq_length",
              "position_embedding", "normalization", "activation", "add_bias_linear", "untie_embeddings",
              "make_vocab_size_divisible_by")
    assert {f: got.get(f) for f in fields} == {f: want.get(f) for f in fields}
    assert out["legacy_differ"] == []


def test_the_legacy_export_for_the_local_spec_is_its_state_dict_and_imports_back(exported):
    _, out = exported
    r = out["legacy_local"]
    ref = r["reference"]
    assert r["keys"] == [k for k, _ in ref]  # names and parameter order (the optimizer's indices follow it)
    assert [(k, r["shapes"].get(k, "None")) for k in r["keys"]] == ref
    assert any(k.endswith(".input_layernorm.weight") for k in r["keys"])
    assert r["extra"] == {"None"} and r["transformer_impl"] == "local"
    assert r["same_tensors"] and r["differ"] == []  # weights and optimizer state, bitwise


def test_convert_to_megatron_from_the_command_line(exported):
    _, out = exported
    code, text, hidden, keys, differ = out["cli"]
    assert code == 0, text
    assert "weights only" in text and "--load" in text and hidden == []  # no staging directory left
    assert keys == ["args", "checkpoint_version", "content_metadata", "iteration", "num_floating_point_operations_so_far"]
    assert differ == []  # HF -> megacli -> Megatron-LM keeps the weights bitwise
    code, text, exists = out["cli_refused"]
    assert code == 2 and "--dtype" in text and not exists, text


def test_t5_megacli_to_megatron_lm_and_back_bitwise(tmp_path):
    """A megacli T5 (read from a Megatron-LM T5 layout) written as a Megatron-LM torch_dist checkpoint:
    the T5 args (encoder/decoder layers and lengths, relative positions, --vocab-extra-ids), the TE
    norms' extra state, and read back to megacli bitwise with the same recipe; a decoder deeper than
    the encoder (pretrain_t5.py builds both with --num-layers), the legacy export and the local spec
    for relative positions (Megatron-LM builds those with Transformer Engine only) are refused."""
    from megacli.checkpoint.layout import find_checkpoint, iter_name, read_recipe
    from types import SimpleNamespace

    from megacli.checkpoint.megatron_lm.args_namespace import unsupported
    from megacli.checkpoint.safe_pickle import torch_load
    from megacli.checkpoint.torch_dist import TorchDistReader
    from megacli.recipe.model import ModelSection
    from megacli.convert import convert
    from megacli.convert.megatron_io import CheckpointReader
    from megacli.errors import UserError
    from megacli.recipe.reshard import ReshardSection
    from megacli.reshard import reshard
    import torch

    from tests.test_megatron_lm import ITERATION as MLM_ITERATION, t5_args, t5_source, write_megatron_lm

    ck, _ = t5_source(tmp_path)
    convert(Source(write_megatron_lm(ck, tmp_path / "mlm", spec="te", args=t5_args())), tmp_path / "mc_read", to="megacli",
            say=lambda *_: None)
    src = find_checkpoint(tmp_path / "mc_read")
    reshard(ReshardSection(source=str(src), output=str(tmp_path / "out"), format="megatron", spec="te", progress=False))
    it_dir = tmp_path / "out" / iter_name(MLM_ITERATION)
    args = torch_load(it_dir / "common.pt", trust=False, name="common.pt")["args"]
    assert {k: getattr(args, k) for k in ("num_layers", "encoder_num_layers", "decoder_num_layers", "seq_length",
                                          "encoder_seq_length", "decoder_seq_length", "position_embedding_type",
                                          "vocab_extra_ids", "swiglu")} == \
        {"num_layers": 2, "encoder_num_layers": 2, "decoder_num_layers": 2, "seq_length": 32, "encoder_seq_length": 32,
         "decoder_seq_length": 16, "position_embedding_type": "relative", "vocab_extra_ids": 100, "swiglu": True}
    objects = set(TorchDistReader(Source(it_dir)).objects)
    assert {"encoder.final_layernorm._extra_state/shard_0_1", "decoder.final_layernorm._extra_state/shard_0_1",
            "decoder.layers.pre_cross_attn_layernorm._extra_state/shard_1_2"} <= objects, sorted(objects)
    convert(Source(tmp_path / "out"), tmp_path / "back", to="megacli", say=lambda *_: None)
    back_ck = find_checkpoint(tmp_path / "back")
    original = {k: t for g in CheckpointReader(Source(src)).groups() for k, t in g.items()}
    back = {k: t for g in CheckpointReader(Source(back_ck)).groups() for k, t in g.items()}
    assert sorted(back) == sorted(original) and [k for k in original if not torch.equal(back[k], original[k])] == []
    assert read_recipe(back_ck)["model"] == read_recipe(src)["model"]
    deeper = ModelSection(**{**read_recipe(src)["model"], "decoder_num_layers": 3})
    assert [p for p in unsupported(SimpleNamespace(model=deeper, lora=None)) if "model.decoder_num_layers 3" in p]
    with pytest.raises(UserError, match="a T5 model; the legacy"):
        reshard(ReshardSection(source=str(src), output=str(tmp_path / "legacy"), format="legacy", progress=False))
    # relative positions: Megatron-LM's validate_args refuses them with --transformer-impl local
    with pytest.raises(UserError, match="--spec local with model.position_embedding relative.*write --spec te"):
        reshard(ReshardSection(source=str(src), output=str(tmp_path / "local"), format="megatron", spec="local",
                               progress=False))
    assert not (tmp_path / "local").exists()
