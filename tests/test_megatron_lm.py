"""Megatron-LM's own torch_dist checkpoints (issue 18, reading): detected everywhere a checkpoint is
taken, its args mapped to a recipe, both layer-spec spellings read, converted to HF (same logits)
and to megacli (same tensors).

The test checkpoints are megacli's own torch_dist save of a tiny Llama-shaped GPT (SwiGLU, GQA,
RoPE, untied), resharded to TP=2 × PP=2 chunks, then laid out as Megatron-LM's
megatron/training/checkpointing.py writes it: the tracker file, ``common.pt`` with the run's
``args`` Namespace, ``checkpoint_version`` 3.0, ``iteration`` and ``opt_param_scheduler``, no
megacli files; the Transformer Engine variant with ``_extra_state`` objects, the local one with
unfused norm names (a local-spec model saved without Megatron-Core's key map)."""

from __future__ import annotations

import argparse
import dataclasses
import io
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from megacli.checkpoint.layout import TRACKER, iter_name
from megacli.checkpoint.megatron_lm.dist_reader import canonical_key
from megacli.checkpoint.megatron_lm.keys import LOCAL_NAMES
from megacli.checkpoint.source import Source

TOL = 1e-4
ITERATION = 10
_LOCAL_NAMES = {f"layers.{fused}": f"layers.{local}" for fused, local in LOCAL_NAMES.items()}


def _local_name(key: str) -> str:
    """A fused (Transformer Engine) norm key under the local spec's unfused name (decoder or encoder stack)."""
    stack, _, rest = key.partition(".")
    return f"{stack}.{_LOCAL_NAMES[rest]}" if rest in _LOCAL_NAMES else key


def llama_args(**changes) -> argparse.Namespace:
    """The model-defining fields Megatron-LM's parse_args sets, for tests/_convert_models' llama_untied_gqa."""
    from megatron.core.transformer.enums import AttnBackend

    fields = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, group_query_attention=True,
                  num_query_groups=2, kv_channels=16, max_position_embeddings=64, seq_length=64,
                  position_embedding_type="rope", rotary_base=5000, rotary_percent=1.0, normalization="RMSNorm",
                  norm_epsilon=1e-5, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
                  untie_embeddings_and_output_weights=True, vocab_size=300, padded_vocab_size=512,
                  make_vocab_size_divisible_by=128, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                  virtual_pipeline_model_parallel_size=None, tokenizer_type="HuggingFaceTokenizer",
                  tokenizer_model="/nonexistent/llama-tokenizer", bf16=False, fp16=False, params_dtype=torch.float32,
                  micro_batch_size=1, global_batch_size=8, train_iters=100, lr=3e-4, min_lr=3e-5,
                  lr_decay_style="cosine", use_distributed_optimizer=False, hidden_dropout=0.0, attention_dropout=0.0,
                  attention_backend=AttnBackend.auto, num_experts=None, data_parallel_size=1, world_size=4)
    fields.update(changes)
    return argparse.Namespace(**fields)


def write_megatron_lm(megacli_it_dir: Path, root: Path, *, spec: str, args: argparse.Namespace,
                      common_in_shards: bool = False) -> Path:
    """``megacli_it_dir``'s shards laid out as a Megatron-LM torch_dist checkpoint under ``root``; with
    ``common_in_shards`` as Megatron-Core 0.19 and newer save it: the common state a sharded object
    (a one-element list) and no common.pt, metadata.json naming the sharded backend only."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from megacli.checkpoint.torch_dist import COMMON_STATE_OBJECT

    it_dir = root / iter_name(ITERATION)
    shutil.copytree(megacli_it_dir, it_dir)
    for name in ("megacli.json", "recipe.yaml", "manifest.json"):
        (it_dir / name).unlink(missing_ok=True)
    with open(it_dir / ".metadata", "rb") as f:
        meta = pickle.load(f)
    if spec == "local":
        meta.state_dict_metadata = {_local_name(k): v for k, v in meta.state_dict_metadata.items()}
        meta.storage_data = {dataclasses.replace(i, fqn=_local_name(i.fqn)): v for i, v in meta.storage_data.items()}
    else:  # Transformer Engine's per-layer extra state (a BytesIO), one sharded object per layer, saved in a list
        buf = io.BytesIO()
        torch.save([io.BytesIO(b"fp8 metadata")], buf)
        data = buf.getvalue()
        (it_dir / "__9_0.distcp").write_bytes(data * 2)
        for layer in range(2):
            key = f"decoder.layers.self_attention.linear_qkv._extra_state/shard_{layer}_2"
            meta.state_dict_metadata[key] = BytesStorageMetadata()
            meta.storage_data[MetadataIndex(key)] = _StorageInfo("__9_0.distcp", layer * len(data), len(data))
    common = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "num_floating_point_operations_so_far": 0,
              "opt_param_scheduler": {"num_steps": ITERATION * 8, "max_lr": 3e-4}}
    if common_in_shards:
        (it_dir / "common.pt").unlink()  # megacli's own
        buf = io.BytesIO()
        torch.save([common], buf)
        (it_dir / "__9_1.distcp").write_bytes(buf.getvalue())
        meta.state_dict_metadata[COMMON_STATE_OBJECT] = BytesStorageMetadata()
        meta.storage_data[MetadataIndex(COMMON_STATE_OBJECT)] = _StorageInfo("__9_1.distcp", 0, len(buf.getvalue()))
        (it_dir / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    else:
        torch.save(common, it_dir / "common.pt")
    with open(it_dir / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    (root / TRACKER).write_text(str(ITERATION))
    return root


def test_key_names_of_both_specs():
    stored = {"decoder.layers.input_layernorm.weight", "decoder.layers.self_attention.linear_qkv.weight",
              "decoder.layers.pre_mlp_layernorm.weight", "decoder.layers.mlp.linear_fc1.weight"}
    assert canonical_key("decoder.layers.input_layernorm.weight", stored) == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert canonical_key("decoder.layers.pre_mlp_layernorm.weight", stored) == "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    assert canonical_key("decoder.layers.self_attention.linear_qkv.layer_norm_weight", stored) == \
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    moe = {"decoder.layers.pre_mlp_layernorm.weight", "decoder.layers.mlp.experts.linear_fc1.weight"}
    assert canonical_key("decoder.layers.pre_mlp_layernorm.weight", moe) == "decoder.layers.pre_mlp_layernorm.weight"
    assert canonical_key("decoder.layers.self_attention.linear_qkv._extra_state", stored) is None
    assert canonical_key("decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2", stored) is None


def test_feature_args_become_model_fields():
    """--apply-layernorm-1p (either field name), --use-rope-scaling, --window-size / --window-attn-skip-freq."""
    from megacli.checkpoint.megatron_lm.args import model_section_from_args
    from megacli.recipe.model import ModelSection

    def model(**changes):
        return ModelSection(**model_section_from_args(llama_args(**changes), 300))

    assert model(layernorm_zero_centered_gamma=True).norm_zero_centered_gamma
    assert model(apply_layernorm_1p=True).norm_zero_centered_gamma  # the field's name before core_r0.8
    assert not model().norm_zero_centered_gamma
    s = model(use_rope_scaling=True, rope_scaling_factor=8.0).rope_scaling
    assert (s.type, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_positions) == ("llama3", 8, 1, 4, 8192)
    assert model(use_rope_scaling=False, rope_scaling_factor=8.0).rope_scaling is None
    m = model(window_size=(4, 0))
    assert (m.sliding_window, m.window_layers()) == (5, [1, 1])
    m = model(num_layers=4, window_size=(2, 0), window_attn_skip_freq=2)
    assert (m.sliding_window, m.window_layers()) == (3, [1, 0, 1, 0])
    m = model(window_size=(0, 0), window_attn_skip_freq=[0, 1])
    assert (m.sliding_window, m.window_layers()) == (1, [0, 1])
    assert model(window_size=(4, 0), window_attn_skip_freq=1).sliding_window is None  # no layer windowed


@pytest.mark.parametrize("changes, why", [
    (dict(use_rope_scaling=True, rope_scaling_factor=32.0), "does not pass --rope-scaling-factor"),
    (dict(window_size=(4, 2)), "only causal sliding windows"),
    (dict(window_size=(4, 0), window_attn_skip_freq=[1, 1, 0]), "3 entries for num_layers = 2"),
])
def test_feature_args_megacli_cannot_follow_are_refused(changes, why):
    from megacli.checkpoint.megatron_lm.args import model_section_from_args
    from megacli.errors import UserError

    with pytest.raises(UserError, match=re.escape(why)):
        model_section_from_args(llama_args(**changes), 300)


@pytest.mark.parametrize("changes, why", [
    (dict(multi_latent_attention=True), "multi-latent attention"), (dict(mtp_num_layers=1), "multi-token prediction"),
    (dict(quick_geglu=True), "quick_geglu"), (dict(qk_l2_norm=True), "qk_l2_norm"),
    (dict(attention_output_gate=True), "attention_output_gate"), (dict(no_rope_freq=4), "no_rope_freq"),
    (dict(softmax_type="off-by-one"), "softmax_type 'off-by-one'"),
])
def test_args_changing_the_model_beyond_megacli_are_named(changes, why):
    from types import SimpleNamespace

    from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint

    assert MegatronLMCheckpoint.unmapped(SimpleNamespace(args=llama_args())) == []
    problems = MegatronLMCheckpoint.unmapped(SimpleNamespace(args=llama_args(**changes)))
    assert len(problems) == 1 and why in problems[0], problems


def _prepare(rank, world, root: str):
    """HF Llama -> megacli -> TP2×PP2 reshard -> Megatron-LM layouts (te, local) -> HF and megacli."""
    from megacli.checkpoint.contents import inspect
    from megacli.checkpoint.layout import find_checkpoint, is_legacy_dir
    from megacli.checkpoint.source import locate
    from megacli.convert import convert
    from megacli.convert.megatron_io import CheckpointReader
    from megacli.recipe.reshard import ReshardSection
    from megacli.recipe.sections import ParallelSection
    from megacli.reshard.core import reshard
    from tests import _convert_models as cm

    root = Path(root)
    toks = cm.tokens()
    ref = cm.hf_logits(cm.build_hf("llama_untied_gqa", root / "hf"), toks)
    say = lambda *_: None  # noqa: E731
    convert(Source(root / "hf"), root / "mc", parallel=ParallelSection(tensor=2, pipeline=2), say=say)
    reshard(ReshardSection(source=str(root / "mc"), output=str(root / "mc22"), tensor=2, pipeline=2))
    mc22 = find_checkpoint(root / "mc22")
    original = {k: t for g in CheckpointReader(Source(mc22)).groups() for k, t in g.items()}
    out = {}
    for spec in ("te", "local"):
        src = write_megatron_lm(mc22, root / f"mlm_{spec}", spec=spec, args=llama_args())
        r = out[spec] = {"locate": [locate(src)[1], locate(src / iter_name(ITERATION))[1]], "legacy": is_legacy_dir(src)}
        convert(Source(src), root / f"hf_{spec}", to="hf", say=say)
        r["hf_logits"] = cm.max_diff(cm.hf_logits(cm.load_hf(root / f"hf_{spec}"), toks), ref)
        convert(Source(src), root / f"mc_{spec}", to="megacli", say=say)
        back = {k: t for g in CheckpointReader(Source(find_checkpoint(root / f"mc_{spec}"))).groups() for k, t in g.items()}
        r["same_keys"] = sorted(back) == sorted(original)
        # Vocabulary rows are padded for each checkpoint's own layout: the real 300 rows compared.
        r["bitwise"] = [k for k in original if k in back and not torch.equal(back[k][:300], original[k][:300])]
        info = inspect(Source(src))
        r["recipe"], r["not_mapped"], r["format"] = info["recipe"], info["not_mapped"], info["format"]
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("megatron_lm")
    return root, spawn(_prepare, 1, str(root), timeout=1800)[0]


@pytest.mark.parametrize("spec", ["te", "local"])
def test_detected_and_converted_to_hf_with_the_same_logits(converted, spec):
    _, out = converted
    r = out[spec]
    assert r["locate"] == ["megatron-lm", "megatron-lm"] and not r["legacy"]
    assert r["format"] == "megatron-lm torch_dist"
    assert r["hf_logits"] < TOL, r


@pytest.mark.parametrize("spec", ["te", "local"])
def test_converted_to_megacli_bitwise(converted, spec):
    _, out = converted
    assert out[spec]["same_keys"] and out[spec]["bitwise"] == []


def test_args_become_the_recipe(converted):
    _, out = converted
    recipe, not_mapped = out["te"]["recipe"], out["te"]["not_mapped"]
    m = recipe["model"]
    assert (m["num_layers"], m["hidden_size"], m["num_attention_heads"], m["num_query_groups"], m["kv_channels"],
            m["ffn_hidden_size"]) == (2, 32, 4, 2, 16, 64)
    assert (m["activation"], m["normalization"], m["position_embedding"], m["rotary_base"], m["untie_embeddings"],
            m["vocab_size"]) == ("swiglu", "rmsnorm", "rope", 5000.0, True, 300)
    assert (recipe["parallel"]["tensor"], recipe["parallel"]["pipeline"]) == (2, 2)
    assert recipe["tokenizer"]["type"] == "none"
    assert any("HuggingFaceTokenizer" in x and "/nonexistent/llama-tokenizer" in x for x in not_mapped), not_mapped


def test_cli_inspect_print_structure_and_refusals(converted, tmp_path):
    from tests.conftest import cli, megacli

    root, _ = converted
    src = root / "mlm_te"
    # (the commands that succeed run in this process; the refusals below in their own, which must print no traceback)
    out = cli("reshard", "inspect", src)
    assert out.exit_code == 0, out.output
    assert "megatron-lm torch_dist" in out.stdout and "recipe (from the run's args):" in out.stdout
    assert "num_query_groups: 2" in out.stdout and "not mapped: tokenizer HuggingFaceTokenizer" in out.stdout
    out = cli("convert", src, "--print-structure")
    assert out.exit_code == 0, out.output
    assert "Megatron-LM torch_dist checkpoint" in out.stdout
    assert "decoder.layers.self_attention.linear_qkv.weight  [2, 128, 32]  float32" in out.stdout

    # reshard reads it directly; verify compares every tensor with the source's.
    out = cli("reshard", src, tmp_path / "resharded", "--tensor", "1", "--pipeline", "1", "--verify")
    assert out.exit_code == 0 and "verify: OK" in out.stdout, out.output
    out = cli("reshard", "verify", root / "mlm_local", tmp_path / "resharded")
    assert out.exit_code == 0 and "verify: OK" in out.stdout, out.output

    # A run whose model megacli cannot express is named, not guessed; nothing is written.
    moe = tmp_path / "moe"
    shutil.copytree(src, moe)
    torch.save({"args": llama_args(num_experts=4, moe_router_load_balancing_type="sinkhorn"), "checkpoint_version": 3.0,
                "iteration": ITERATION}, moe / iter_name(ITERATION) / "common.pt")
    out = megacli("convert", str(moe), str(tmp_path / "hf_moe"), "--to", "hf")
    assert out.returncode == 2 and "'sinkhorn' is not supported" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "hf_moe").exists()
    # common.pt without args.
    torch.save({"checkpoint_version": 3.0, "iteration": ITERATION}, moe / iter_name(ITERATION) / "common.pt")
    out = megacli("convert", str(moe), str(tmp_path / "mc_noargs"))
    assert out.returncode == 2 and "has no 'args'" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "mc_noargs").exists()


def _pretrain(recipe: Path, run_dir: Path, pretrained: Path, resume: str = "none",
              extra: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, list[float]]:
    from tests.conftest import losses, pretrain

    sets = ["parallel.tensor=1", "parallel.pipeline=1", "launch.nproc=1", "train.iters=2", "train.eval_interval=null",
            "train.log_interval=1", "model.seq_length=16", "train.global_batch_size=2", f"checkpoint.resume={resume}",
            f"checkpoint.pretrained={pretrained}", *extra]
    out = pretrain(run_dir, sets, recipe=recipe, check=False)
    return out, (list(losses(run_dir).values()) if out.returncode == 0 else [])


def test_pretrained_weights_from_a_megatron_lm_checkpoint(converted, tmp_path):
    """checkpoint.pretrained takes a Megatron-LM checkpoint, with either spec's key names and with its
    common state in common.pt or inside the shards: the same losses as starting from the megacli
    checkpoint it holds the weights of."""
    from megacli.checkpoint.layout import find_checkpoint

    root, _ = converted
    recipe = root / "mc" / "iter_0000000" / "recipe.yaml"
    _, want = _pretrain(recipe, tmp_path / "from_megacli", root / "mc22")
    out, got = _pretrain(recipe, tmp_path / "from_megatron_lm", root / "mlm_te")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert len(want) == 2 and got == want
    out, got = _pretrain(recipe, tmp_path / "from_local", root / "mlm_local")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert got == want
    # The common state inside the shards (Megatron-Core 0.19's save), which 0.16's load does not look for.
    shards = write_megatron_lm(find_checkpoint(root / "mc22"), tmp_path / "mlm_shards", spec="te", args=llama_args(),
                               common_in_shards=True)
    out, got = _pretrain(recipe, tmp_path / "from_shards", shards)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert got == want
    # checkpoint.resume of a checkpoint saved without optimizer state: its weights, from iteration 0, said so.
    out, got = _pretrain(recipe, tmp_path / "resume", root / "mc22", resume=str(root / "mlm_te"),
                         extra=("checkpoint.load_optimizer=true",))
    assert out.returncode == 0 and "holds no optimizer state" in out.stdout + out.stderr, out.stderr[-2000:]
    assert got == want


def test_common_state_inside_the_shards_is_read(converted, tmp_path):
    """A checkpoint whose common state is inside the shards (no common.pt), as Megatron-LM saves under
    Megatron-Core 0.19 and newer, is read under either release: its args, reshard with --verify (and
    verified against the common.pt layout's source), convert to megacli (the same tensors);
    checkpoint.pretrained: test_pretrained_weights_from_a_megatron_lm_checkpoint."""
    from megacli.checkpoint.layout import find_checkpoint
    from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint
    from megacli.convert import convert
    from megacli.convert.megatron_io import CheckpointReader
    from tests.conftest import cli

    root, _ = converted
    src = write_megatron_lm(find_checkpoint(root / "mc22"), tmp_path / "mlm", spec="te", args=llama_args(),
                            common_in_shards=True)
    assert not (src / iter_name(ITERATION) / "common.pt").exists()
    read = MegatronLMCheckpoint(Source(src))
    assert (read.iteration, read.tp, read.pp, read.common["opt_param_scheduler"]["num_steps"]) == (ITERATION, 2, 2, 80)
    assert read.common_where.endswith("(common_state/shard_0_1)")
    assert "common_state/shard_0_1" not in read.reader.objects
    out = cli("reshard", "inspect", src)
    assert out.exit_code == 0 and "num_query_groups: 2" in out.stdout, out.output
    out = cli("reshard", src, tmp_path / "resharded", "--tensor", "1", "--pipeline", "1", "--verify")
    assert out.exit_code == 0 and "verify: OK" in out.stdout, out.output
    out = cli("reshard", "verify", root / "mlm_te", tmp_path / "resharded")
    assert out.exit_code == 0 and "verify: OK" in out.stdout, out.output
    convert(Source(src), tmp_path / "mc", to="megacli", say=lambda *_: None)
    got = {k: t for g in CheckpointReader(Source(find_checkpoint(tmp_path / "mc"))).groups() for k, t in g.items()}
    want = {k: t for g in CheckpointReader(Source(find_checkpoint(root / "mc_te"))).groups() for k, t in g.items()}
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_generate_from_a_megatron_lm_checkpoint(converted):
    """generate -c takes a Megatron-LM checkpoint: the model from its args (the tokenizer given)."""
    from tests.conftest import megacli_here, ok

    root, _ = converted
    ok(megacli_here("generate", "-c", root / "mlm_te", "-p", "the", "-n", "3", "--set", "tokenizer.type=byte",
                    "--set", f"run.dir={root / 'gen'}"))


def test_bert_from_megatron_lm_layout_converts_to_hf(tmp_path):
    """A Megatron-LM BERT (pre-norm, binary head) torch_dist checkpoint, Transformer Engine and local
    key names: converted to HF, the masked-LM and binary logits are the source model's (its
    WordPiece vocabulary's rows; Megatron-LM's tokenizer adds [BOS]/[EOS])."""
    import transformers

    from megacli.checkpoint.layout import find_checkpoint
    from megacli.checkpoint.torch_dist import TorchDistReader
    from megacli.convert import convert
    from tests import _convert_models as cm
    from tests.test_convert_bert import _build_hf, _hf_logits

    ref = _hf_logits(_build_hf(tmp_path / "hf", "MegatronBertForPreTraining"))
    convert(Source(tmp_path / "hf"), tmp_path / "mc", say=lambda *_: None)
    ck = find_checkpoint(tmp_path / "mc")
    args = argparse.Namespace(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=64, max_position_embeddings=64,
        position_embedding_type="learned_absolute", normalization="LayerNorm", norm_epsilon=1e-12, add_bias_linear=True,
        bert_binary_head=True, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        make_vocab_size_divisible_by=128, tokenizer_type="BertWordPieceLowerCase",
        vocab_file=str(tmp_path / "hf" / "vocab.txt"), hidden_dropout=0.1, attention_dropout=0.1)
    for spec in ("te", "local"):
        src = write_megatron_lm(ck, tmp_path / f"mlm_{spec}", spec=spec, args=args)
        stored = set(TorchDistReader(Source(src / iter_name(ITERATION))).tensors)
        assert ("encoder.layers.input_layernorm.bias" in stored) == (spec == "local"), sorted(stored)
        convert(Source(src), tmp_path / f"hf_{spec}", to="hf", say=lambda *_: None)
        got = _hf_logits(transformers.AutoModelForPreTraining.from_pretrained(tmp_path / f"hf_{spec}").eval())
        assert got[0].shape[-1] == ref[0].shape[-1] + 2
        assert [cm.max_diff(a[..., :b.shape[-1]], b) for a, b in zip(got, ref)] == [0.0, 0.0], spec


def t5_args(**changes) -> argparse.Namespace:
    """Megatron-LM pretrain_t5.py's model-defining args for a tiny T5 (RMSNorm, SwiGLU, no biases,
    relative positions, tied head; validate_args copies the encoder's sizes to num_layers/seq_length)."""
    fields = dict(num_layers=2, encoder_num_layers=2, decoder_num_layers=2, hidden_size=32, num_attention_heads=4,
                  kv_channels=8, ffn_hidden_size=64, seq_length=32, encoder_seq_length=32, decoder_seq_length=16,
                  max_position_embeddings=64, position_embedding_type="relative", relative_attention_num_buckets=32,
                  relative_attention_max_distance=128, normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True,
                  add_bias_linear=False, untie_embeddings_and_output_weights=False, vocab_size=300, vocab_extra_ids=100,
                  make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                  tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nonexistent/t5-tokenizer",
                  hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(changes)
    return argparse.Namespace(**fields)


def t5_source(root: Path):
    """A tiny HF T5 (SwiGLU, tied) -> megacli; returns (megacli iteration dir, HF logits of the model a
    Megatron-LM checkpoint of those tensors is: its attention scales by 1/sqrt(d_kv), HF's does not)."""
    import transformers

    from megacli.checkpoint.layout import find_checkpoint
    from megacli.convert import convert
    from tests.test_convert_t5 import COMMON, _batch

    config = transformers.T5Config(**COMMON, feed_forward_proj="gated-silu", tie_word_embeddings=False,
                                   architectures=["T5ForConditionalGeneration"])
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    hf = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "layer_norm" in name else p.normal_(0, 0.1)
        for stack in (hf.encoder, hf.decoder):
            stack.embed_tokens.weight.copy_(hf.shared.weight)
    hf.eval().save_pretrained(root / "hf")
    enc, dec, attend = _batch()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("SelfAttention.q.weight") or name.endswith("EncDecAttention.q.weight"):
                p.mul_(COMMON["d_kv"] ** -0.5)
        ref = hf(input_ids=enc, attention_mask=attend, decoder_input_ids=dec).logits.float()
    convert(Source(root / "hf"), root / "mc", say=lambda *_: None)
    return find_checkpoint(root / "mc"), ref


def test_t5_from_megatron_lm_layout_converts_to_hf_and_megacli(tmp_path):
    """A Megatron-LM T5 torch_dist checkpoint (Transformer Engine and local key names; attention scaled
    by 1/sqrt(head_dim), which Hugging Face's T5 carries in its query weights): converted to HF, the
    logits are the source model's; converted to megacli, the tensors are the stored ones; its args
    become a t5 recipe (decoder length, relative positions, sentinels); other relative buckets are refused."""
    import transformers

    from megacli.checkpoint.layout import find_checkpoint
    from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint
    from megacli.convert import convert
    from megacli.convert.megatron_io import CheckpointReader
    from megacli.errors import UserError
    from tests import _convert_models as cm
    from tests.test_convert_t5 import _batch

    ck, ref = t5_source(tmp_path)
    enc, dec, attend = _batch()
    original = {k: t for g in CheckpointReader(Source(ck)).groups() for k, t in g.items()}
    for spec in ("te", "local"):
        src = write_megatron_lm(ck, tmp_path / f"mlm_{spec}", spec=spec, args=t5_args())
        convert(Source(src), tmp_path / f"hf_{spec}", to="hf", say=lambda *_: None)
        got = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / f"hf_{spec}").eval()
        with torch.no_grad():
            logits = got(input_ids=enc, attention_mask=attend, decoder_input_ids=dec).logits.float()
        assert cm.max_diff(logits[..., :cm.VOCAB], ref[..., :cm.VOCAB]) < TOL, spec
        convert(Source(src), tmp_path / f"mc_{spec}", to="megacli", say=lambda *_: None)
        back = {k: t for g in CheckpointReader(Source(find_checkpoint(tmp_path / f"mc_{spec}"))).groups() for k, t in g.items()}
        assert sorted(back) == sorted(original), spec
        assert [k for k in original if not torch.equal(back[k][:cm.VOCAB], original[k][:cm.VOCAB])] == [], spec
    recipe = MegatronLMCheckpoint(Source(tmp_path / "mlm_te")).recipe()
    m = recipe["model"]
    assert (m["arch"], m["num_layers"], m["seq_length"], m["decoder_seq_length"], m["position_embedding"],
            m["activation"], m["add_bias_linear"], m.get("softmax_scale")) == ("t5", 2, 32, 16, "relative", "swiglu",
                                                                               False, None)
    assert "decoder_num_layers" not in m and recipe["masking"] == {"sentinel_tokens": 100}
    other = write_megatron_lm(ck, tmp_path / "mlm_buckets", spec="te", args=t5_args(relative_attention_num_buckets=64))
    with pytest.raises(UserError, match="relative_attention_num_buckets 64"):
        MegatronLMCheckpoint(Source(other)).model_section()
