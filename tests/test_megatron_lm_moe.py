"""Megatron-LM torch_dist checkpoints of mixture-of-experts GPT models, read and written (issue 18).

One spawned process, tiny models (hidden 32, 2 layers, 4 experts, top 2):

* written: a megacli run (2 steps) of a Qwen2-MoE-shaped GPT (gated shared expert, its second
  layer dense: --moe-layer-freq [1, 0]) exported as Megatron-LM checkpoints for both layer specs.
  Checked: the args (the MoE arguments), weights and optimizer state bitwise, the TE spec's extra
  state, the model section read back; megatron -> megacli (reshard) bitwise, optimizer included,
  and -> HF with the logits of the run's own HF export; and Megatron-Core's own GPTModel, built
  from the written args as Megatron-LM builds it (local spec, ``get_gpt_decoder_block_spec``),
  loads the local export (``dist_checkpointing.load``, missing keys fatal as in Megatron-LM) and
  gives those logits;
* read: a Mixtral whose checkpoint Megatron-Core itself saved from its local-spec GPTModel with
  --moe-layer-freq 1 (every layer MoE: the layers stacked under one key, the MoE pre-MLP norms
  under the local spec's ``mlp.linear_fc1.layer_norm_weight``), with Megatron-LM's common.pt.
  Converted to HF (the source's logits) and to megacli (bitwise); used directly: resharded to
  megacli (bitwise with the conversion, the modules' extra state per layer; the engine runs the
  output) and run by the engine (the source's logits);
* resumed: an all-MoE megacli run (4 steps, checkpoint at 2) saved at step 2 as Megatron-LM saves
  a run with --moe-layer-freq 1 (layers stacked, plain optimizer): `pretrain` resumed from it
  continues the run's steps 3-4 within 1e-5; reshard gives back the step-2 checkpoint bitwise,
  optimizer included.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch

from megacli.checkpoint.source import Source

from tests.conftest import losses

TOL = 1e-4
ITERATION = 10  # of the Megatron-Core-saved checkpoint
ITERS, VOCAB = 2, 262  # the megacli run's: 2 steps, byte tokenizer
# A Qwen2-MoE-shaped run: 4 experts (top 2) with a gated shared expert in layer 0, layer 1 dense.
RUN = [
    "data.mock=true", "tokenizer.type=byte", "model.num_layers=2", "model.hidden_size=32",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.seq_length=16",
    "model.activation=swiglu", "model.normalization=rmsnorm", "model.position_embedding=rope",
    "model.untie_embeddings=true", "model.add_bias_linear=false", "model.make_vocab_size_divisible_by=64",
    "model.moe.num_experts=4", "model.moe.router_topk=2", "model.moe.ffn_hidden_size=48", "model.moe.layer_freq=[1,0]",
    "model.moe.shared_expert_ffn_hidden_size=32", "model.moe.shared_expert_gate=true",
    f"train.iters={ITERS}", "train.micro_batch_size=1", "train.global_batch_size=2", "train.eval_interval=null",
    "train.precision=fp32", f"checkpoint.save_interval={ITERS}", "launch.nproc=1", "parallel.tensor=1",
    "parallel.pipeline=1",
]

# Every layer MoE (Megatron-LM's default --moe-layer-freq 1), 4 steps, a checkpoint at 2, the plain optimizer.
ALL_MOE = [*(x for x in RUN if not x.startswith(("model.moe.layer_freq", "train.iters", "checkpoint.save_interval"))),
           "model.moe.layer_freq=1", "train.iters=4", "checkpoint.save_interval=2", "parallel.distributed_optimizer=false",
           "train.log_interval=1"]


def _config(args: argparse.Namespace):
    """The TransformerConfig Megatron-LM builds from these args (the fields a tiny GPT uses)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None, kv_channels=args.kv_channels,
        ffn_hidden_size=args.ffn_hidden_size, normalization=args.normalization, layernorm_epsilon=args.layernorm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_layer_freq=args.moe_layer_freq, moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate, moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_dtype=args.moe_router_dtype, moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_score_function=args.moe_router_score_function, use_cpu_initialization=True,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)


def _mcore_gpt(args: argparse.Namespace):
    """Megatron-Core's GPTModel for the args, local spec (Megatron-LM's gpt_builder for a MoE run)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megacli.engine.models.moe import _define_absent_te_gemm

    _define_absent_te_gemm()
    model_parallel_cuda_manual_seed(0)
    config = _config(args)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                                                     normalization=args.normalization),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights).eval()


def _logits(model, toks, vocab: int):
    with torch.no_grad():
        pos = torch.arange(toks.shape[1]).unsqueeze(0).expand_as(toks)
        return model(toks, pos, None)[..., :vocab].float()


def _mixtral_args():
    """What Megatron-LM's args hold for a Mixtral-shaped run of tests/_convert_models' mixtral."""
    from tests.test_megatron_lm import llama_args

    return llama_args(kv_channels=8, ffn_hidden_size=48, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                      world_size=1, padded_vocab_size=384, layernorm_epsilon=1e-5, tokenizer_type="NullTokenizer",
                      vocab_size=299, tokenizer_model=None, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                      moe_layer_freq=1, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
                      moe_router_pre_softmax=False, moe_router_dtype=None, moe_token_dispatcher_type="alltoall",
                      moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                      moe_router_score_function="softmax", moe_grouped_gemm=False, expert_model_parallel_size=1,
                      expert_tensor_parallel_size=1)


_EXPERT = re.compile(r"^(?P<stem>decoder\.layers\.\d+\.mlp\.experts\.)experts\.(?P<rest>linear_fc[12]\.weight)$")


def _megatron_core_saves(mc: Path, it_dir: Path, args) -> dict:
    """Megatron-Core's local-spec GPTModel holding the megacli checkpoint ``mc``'s weights, saved with
    its own dist_checkpointing at ``it_dir`` (Megatron-LM's content metadata); returns its state."""
    from megatron.core import dist_checkpointing

    from megacli.convert.megatron_io import CheckpointReader

    model = _mcore_gpt(args)
    state = model.state_dict()
    for group in CheckpointReader(Source(mc)).groups():
        for key, t in group.items():
            m = _EXPERT.match(key)
            if m:
                for e in range(t.shape[0]):
                    state[f"{m['stem']}local_experts.{e}.{m['rest']}"] = t[e]
                continue
            key = key.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
            assert key in state, key
            state[key] = t
    model.load_state_dict(state, strict=True)
    it_dir.mkdir(parents=True)
    dist_checkpointing.save(model.sharded_state_dict(metadata={"singleton_local_shards": False}), str(it_dir))
    return model


def _moe(rank, world, root: str):
    from typer.testing import CliRunner

    from megacli.checkpoint.layout import TRACKER, find_checkpoint, iter_name, read_recipe
    from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint
    from megacli.checkpoint.safe_pickle import allow_checked_globals, torch_load
    from megacli.checkpoint.torch_dist import TorchDistReader
    from megacli.cli import _register, app
    from megacli.convert import convert
    from megacli.convert.megatron_io import CheckpointReader, megatron_process
    from megacli.errors import UserError
    from megacli.recipe.reshard import ReshardSection
    from megacli.reshard import reshard
    from tests import _convert_models as cm

    root, toks, say, out = Path(root), cm.tokens(), (lambda *_: None), {}
    _register()
    _save_stacked(root)

    def canonical(path):
        return {k: t for g in CheckpointReader(Source(find_checkpoint(path))).groups() for k, t in g.items()}

    # ---- written: the run's Qwen2-MoE-shaped checkpoint -> Megatron-LM (te, local) -> megacli / HF / Megatron-Core
    src = find_checkpoint(root / "run" / "checkpoints")
    convert(Source(src.parent), root / "hf", to="hf", say=say)
    run_toks = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = cm.hf_logits(cm.load_hf(root / "hf"), run_toks)
    source = TorchDistReader(Source(src))
    for spec in ("te", "local"):
        dst = root / f"mlm_{spec}"
        reshard(ReshardSection(source=str(src), output=str(dst), format="megatron", spec=spec, progress=False))
        it_dir = dst / iter_name(ITERS)
        written = TorchDistReader(Source(it_dir))
        args = torch_load(it_dir / "common.pt", trust=False, name="common.pt")["args"]
        r = out[spec] = {"args": {k: getattr(args, k) for k in (
            "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
            "moe_shared_expert_gate", "moe_router_pre_softmax", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
            "moe_router_dtype", "moe_token_dispatcher_type", "moe_grouped_gemm", "expert_model_parallel_size",
            "expert_tensor_parallel_size", "ffn_hidden_size")}}
        # model and optimizer state; the local spec stores a MoE layer's pre-MLP norm under its fused name
        renamed = {k.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_") if spec == "local" else k: k
                   for k in source.tensors}
        r["optimizer_tensors"] = sum(k.startswith("optimizer.") for k in renamed)
        r["same_keys"] = sorted(written.tensors) == sorted(renamed)
        r["differ"] = [k for k, s in renamed.items() if not torch.equal(written.read(k), source.read(s))]
        r["moe_extra"] = sorted(k for k in written.objects if "pre_mlp_layernorm._extra_state" in k)
        r["moe_section"] = (MegatronLMCheckpoint(Source(dst)).recipe()["model"]["moe"], read_recipe(src)["model"]["moe"])
        reshard(ReshardSection(source=str(dst), output=str(root / f"back_{spec}"), progress=False))
        back = TorchDistReader(Source(find_checkpoint(root / f"back_{spec}")))
        r["back_keys"] = sorted(back.tensors) == sorted(source.tensors)
        r["back_differ"] = [k for k in source.tensors if not torch.equal(back.read(k), source.read(k))]
        convert(Source(dst), root / f"hf_{spec}", to="hf", say=say)
        r["hf_logits"] = cm.max_diff(cm.hf_logits(cm.load_hf(root / f"hf_{spec}"), run_toks), ref)
    inspected = CliRunner().invoke(app, ["reshard", "inspect", str(root / "mlm_te")])
    out["inspect"] = [inspected.exit_code, inspected.output]

    from megatron.core import dist_checkpointing

    with megatron_process():
        args = torch_load(root / "mlm_local" / iter_name(ITERS) / "common.pt", trust=False, name="common.pt")["args"]
        model = _mcore_gpt(args)
        with allow_checked_globals():  # common.pt holds Megatron-LM's args (Megatron-LM loads it unrestricted)
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata={"singleton_local_shards": False})},
                                             str(root / "mlm_local" / iter_name(ITERS)))
        model.load_state_dict(loaded["model"], strict=True)
        out["mcore_logits"] = cm.max_diff(_logits(model, run_toks, VOCAB), ref)

    # ---- read: Mixtral saved by Megatron-Core (local spec, --moe-layer-freq 1: layers stacked)
    mix_ref = cm.hf_logits(cm.build_hf("mixtral", root / "hf_mix"), toks)
    convert(Source(root / "hf_mix"), root / "mc_mix", say=say)
    margs = _mixtral_args()
    mlm = root / "mlm_mix"
    with megatron_process():
        model = _megatron_core_saves(find_checkpoint(root / "mc_mix"), mlm / iter_name(ITERATION), margs)
        out["mix_mcore_logits"] = cm.max_diff(_logits(model, toks, cm.VOCAB), mix_ref)
    torch.save({"args": margs, "checkpoint_version": 3.0, "iteration": ITERATION, "num_floating_point_operations_so_far": 0},
               mlm / iter_name(ITERATION) / "common.pt")
    (mlm / TRACKER).write_text(str(ITERATION))
    stored = TorchDistReader(Source(mlm / iter_name(ITERATION))).tensors
    out["mix_stored"] = {k: tuple(v.shape) for k, v in stored.items() if "mlp" in k}
    out["mix_recipe"] = MegatronLMCheckpoint(Source(mlm)).recipe()
    convert(Source(mlm), root / "hf_mix2", to="hf", say=say)
    out["mix_hf_logits"] = cm.max_diff(cm.hf_logits(cm.load_hf(root / "hf_mix2"), toks), mix_ref)
    convert(Source(mlm), root / "mc_mix2", to="megacli", say=say)
    want, got = canonical(root / "mc_mix"), canonical(root / "mc_mix2")
    out["mix_back"] = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    reshard(ReshardSection(source=str(mlm), output=str(root / "mix_resharded"), progress=False))
    got = canonical(root / "mix_resharded")
    out["mix_resharded"] = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    out["mix_resharded_extra"] = sorted(k for k in TorchDistReader(Source(find_checkpoint(root / "mix_resharded"))).objects
                                        if k.startswith("decoder.layers.1.") and "_extra_state" in k)
    with megatron_process():
        out["mix_engine_logits"] = cm.max_diff(cm.megacli_logits(mlm, toks)[..., :cm.VOCAB], mix_ref)
        out["mix_resharded_logits"] = cm.max_diff(cm.megacli_logits(root / "mix_resharded", toks)[..., :cm.VOCAB], mix_ref)

    # ---- resumed: the all-MoE run's step 2, saved by Megatron-LM with its layers stacked
    stacked = root / "mlm_all"
    out["all_stored"] = sorted(k for k in TorchDistReader(Source(stacked / iter_name(2))).tensors if "router" in k)
    reshard(ReshardSection(source=str(stacked), output=str(root / "all_back"), progress=False))
    src, back = TorchDistReader(Source(find_checkpoint(root / "all" / "checkpoints" / iter_name(2)))), \
        TorchDistReader(Source(find_checkpoint(root / "all_back")))
    out["all_back_keys"] = sorted(back.tensors) == sorted(src.tensors)
    out["all_back_optimizer"] = sum(k.startswith("optimizer.") for k in back.tensors)
    out["all_back_differ"] = [k for k in src.tensors if not torch.equal(back.read(k), src.read(k))]
    return out


def _save_stacked(root: Path) -> None:
    """The all-MoE run's step-2 checkpoint, in a live trainer whose config holds --moe-layer-freq 1 as
    Megatron-LM's does (an int: Megatron-Core stacks the layers), saved as Megatron-LM saves it."""
    from megacli.checkpoint.layout import find_checkpoint, iter_name
    from megacli.checkpoint.megatron_lm.args_namespace import megatron_args
    from megacli.engine import checkpoint, distributed
    from megacli.engine.loop import build_trainer
    from megacli.engine.models.common import unwrap
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe
    from tests.test_megatron_lm_resume import save_as_megatron_lm

    found = find_checkpoint(root / "all" / "checkpoints" / iter_name(2))
    recipe = load(TrainingRecipe, found / "recipe.yaml", [f"run.dir={root / 'w'}", "checkpoint.dir=null"])
    with distributed.running(parallel=recipe.parallel, launch=recipe.launch, seed=recipe.train.seed) as runtime:
        trainer, _ = build_trainer(recipe, runtime)
        checkpoint.load(source=Source(found), chunks=trainer.chunks, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                        load_optimizer=True)
        args = megatron_args(recipe, iteration=2, consumed_samples=2 * recipe.train.global_batch_size,
                             vocab_size=VOCAB)
        args.moe_layer_freq = 1
        unwrap(trainer.chunks[0]).config.moe_layer_freq = 1
        save_as_megatron_lm(trainer, recipe, root / "mlm_all", iteration=2, spec="te", sharding=None, args=args)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from tests._dist import spawn

    from tests.test_megatron_lm_write import pretrain_in_process

    root = tmp_path_factory.mktemp("megatron_lm_moe")
    pretrain_in_process(RUN, root / "run")
    pretrain_in_process(ALL_MOE, root / "all")
    out = spawn(_moe, 1, str(root), timeout=1800)[0]
    pretrain_in_process([*ALL_MOE, f"checkpoint.resume={root / 'mlm_all'}"], root / "resumed")
    out["all_losses"] = [losses(root / name) for name in ("all", "resumed")]
    return out


@pytest.mark.parametrize("spec", ["te", "local"])
def test_moe_written_as_megatron_lm(moe, spec):
    r = moe[spec]
    assert r["args"] == dict(
        num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=[1, 0],
        moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True, moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, expert_model_parallel_size=1,
        expert_tensor_parallel_size=1, ffn_hidden_size=64)
    assert r["optimizer_tensors"] > 0 and r["same_keys"] and r["differ"] == []  # weights and Adam moments, bitwise
    # the TE spec's MoE layer has its own TENorm before the experts (layer 0 only: layer 1 is dense)
    assert r["moe_extra"] == (["decoder.layers.0.pre_mlp_layernorm._extra_state/shard_0_1"] if spec == "te" else [])
    got, want = r["moe_section"]
    assert got == want
    assert r["back_keys"] and r["back_differ"] == []  # megatron -> megacli (reshard): weights and optimizer, bitwise
    assert r["hf_logits"] < TOL, r["hf_logits"]


def test_megatron_cores_own_model_loads_the_export(moe):
    assert moe["mcore_logits"] < TOL, moe["mcore_logits"]


def test_reshard_inspect_prints_the_moe_recipe(moe):
    code, text = moe["inspect"]
    assert code == 0, text
    assert "num_experts: 4" in text and "shared_expert_ffn_hidden_size: 32" in text and "layer_freq:" in text


def test_megatron_lm_moe_with_stacked_layers_is_read(moe):
    assert moe["mix_mcore_logits"] < TOL  # the fixture: Megatron-Core's model holds the HF weights
    stored = moe["mix_stored"]
    assert stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, 4, 96, 32)
    assert stored["decoder.layers.mlp.linear_fc1.layer_norm_weight"] == (2, 32)  # the local spec's name
    recipe = moe["mix_recipe"]
    m = recipe["model"]["moe"]
    assert (m["num_experts"], m["router_topk"], m["ffn_hidden_size"], m["layer_freq"], m["aux_loss_coeff"],
            m["router_dtype"], m["dispatcher"], m["grouped_gemm"]) == (4, 2, 48, 1, 0.01, None, "alltoall", False)
    assert (recipe["parallel"]["expert"], recipe["parallel"]["expert_tensor"]) == (1, None)
    assert moe["mix_hf_logits"] < TOL, moe["mix_hf_logits"]
    assert moe["mix_back"]
    assert moe["mix_resharded"]  # staged per layer, resharded to megacli: the conversion's tensors, bitwise
    # with the modules' extra state the model asks for, per layer (without it the engine cannot load it)
    assert moe["mix_resharded_extra"] == [
        *(f"decoder.layers.1.mlp.experts.experts.linear_fc{i}._extra_state/shard_{e}_4" for i in (1, 2) for e in range(4)),
        "decoder.layers.1.self_attention.linear_proj._extra_state/shard_0_1",
        "decoder.layers.1.self_attention.linear_qkv._extra_state/shard_0_1"]
    assert moe["mix_resharded_logits"] < TOL, moe["mix_resharded_logits"]
    assert moe["mix_engine_logits"] < TOL, moe["mix_engine_logits"]  # the engine loads it as stored


def test_megatron_lm_moe_with_stacked_layers_resumes_and_reshards(moe):
    assert moe["all_stored"] == ["decoder.layers.mlp.router.weight", "optimizer.state.exp_avg.decoder.layers.mlp.router.weight",
                                 "optimizer.state.exp_avg_sq.decoder.layers.mlp.router.weight"]
    run, resumed = moe["all_losses"]
    assert sorted(resumed) == [3, 4], resumed
    for i in (3, 4):
        assert abs(resumed[i] - run[i]) <= 1e-5, (i, resumed[i], run[i])
    assert moe["all_back_keys"] and moe["all_back_optimizer"] > 0 and moe["all_back_differ"] == []


def test_moe_arguments_megacli_cannot_express_are_named():
    from megacli.checkpoint.megatron_lm.args import model_section_from_args
    from megacli.errors import UserError

    args = _mixtral_args()
    assert model_section_from_args(args, 300)["moe"]["num_experts"] == 4
    for change, why in ((dict(moe_z_loss_coeff=1e-3), "z-loss"), (dict(moe_router_load_balancing_type="seq_aux_loss"),
                                                                     "seq_aux_loss"),
                        (dict(moe_input_jitter_eps=0.1), "jitter")):
        with pytest.raises(UserError, match=why):
            model_section_from_args(argparse.Namespace(**{**vars(args), **change}), 300)
