"""The CPU backend runs Megatron-Core's real parallel code paths on gloo, and gets the same numbers.

Every test spawns gloo worker processes (tests/_dist.py); each worker calls
``megacli.backend.cpu.enable()`` first. The model is a tiny Megatron-Core ``GPTModel`` built from
the local layer spec with ``megacli.engine.models.layers.Norm`` in place of torch's LayerNorm (which
refuses sequence parallelism), fp32, no dropout except in the recompute test. Runs that must
start from identical weights in different layouts give every parameter a value derived from its
global name (``_init_by_name``); the others use Megatron's own init after ``seed_all``.
Workers return numpy arrays, never tensors (a tensor would travel as a handle into the worker's
shared memory, which is gone once the worker exits).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from tests._dist import spawn

SEED = 1234
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 128, 64, 4, 4, 32
MBS, NUM_MB = 2, 4  # micro-batch size and micro-batches per step
LR = 1e-3


# ---------------------------------------------------------------------------------------------
# helpers run inside the workers


def _setup(tp: int, pp: int, vpp: int | None = None):
    """Enable the CPU backend, join the gloo group, initialise Megatron's parallel state and RNG."""
    from megacli.backend import cpu

    cpu.enable()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    _parallel(tp, pp, vpp)


def _parallel(tp: int, pp: int, vpp: int | None = None):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megacli.backend import cpu

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)
    cpu.seed_all(SEED)
    model_parallel_cuda_manual_seed(SEED)


def _config(tp: int, pp: int, vpp: int | None = None, **over):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=4 * HIDDEN,
              hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
              params_dtype=torch.float32, pipeline_dtype=torch.float32,
              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
              virtual_pipeline_model_parallel_size=vpp, normalization="LayerNorm")
    kw.update(over)
    return TransformerConfig(**kw)


def _build(config, vp_stage: int | None = None):
    """GPTModel (tied embeddings) from the local spec with megacli's Norm for every norm."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megacli.engine.models.layers import Norm

    layer = get_gpt_layer_local_spec()
    layer.submodules.input_layernorm = Norm
    layer.submodules.pre_mlp_layernorm = Norm
    block = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                       layer_norm=Norm)
    return GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=SEQ,
                    pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                    post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                    share_embeddings_and_output_weights=True, vp_stage=vp_stage)


def _global_names(model) -> dict:
    """local parameter name -> name in an unsplit TP1/PP1 model (global layer index; the last stage's
    copy of the tied embedding is the embedding)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layer_of = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, TransformerLayer):
            layer_of[mname + "."] = f"decoder.layers.{mod.layer_number - 1}."
    out = {}
    for name, _ in model.named_parameters():
        g = name
        for local, glob in layer_of.items():
            if name.startswith(local):
                g = glob + name[len(local):]
                break
        if g == "output_layer.weight" and model.share_embeddings_and_output_weights:
            g = "embedding.word_embeddings.weight"
        out[name] = g
    return out


def _init_by_name(model) -> None:
    """Give every parameter a value that depends only on SEED and its global name, so any TP/PP
    layout of the same model starts from the same weights: draw the full tensor, keep this rank's
    TP slice (Megatron's TP layouts are contiguous chunks of the full tensor along partition_dim)."""
    import torch
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    names = _global_names(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(SEED * 100_003 + zlib.crc32(names[name].encode()))
            split = getattr(p, "tensor_model_parallel", False)
            shape = list(p.shape)
            if split:
                shape[p.partition_dim] *= tp
            full = torch.randn(shape, generator=g)
            if "layernorm" in name and name.endswith("weight"):
                full = 1.0 + 0.1 * full
            else:
                full = 0.05 * full
            p.copy_(full.chunk(tp, p.partition_dim)[rank] if split else full)


def _full_params(model, wanted=None) -> dict:
    """global name -> full (TP-gathered) tensor, for this rank's stage."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, g in _global_names(model).items():
        if wanted is not None and g not in wanted:
            continue
        param = dict(model.named_parameters())[name]
        t = param.detach()
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=param.partition_dim)
        out[g] = _np(t)
    return out


def _np(t):
    """A tensor as a numpy copy: workers return values by pickle (a tensor would be passed as a
    shared-memory handle that dies with the worker process)."""
    return t.detach().cpu().numpy().copy()


def _batches(seed: int, n: int) -> list:
    """n micro-batches of random tokens (the same for every rank that passes the same seed)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        out.append({"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(),
                    "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous()})
    return out


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func


def _wrap(config, modules, distributed_optimizer: bool):
    """Megatron DDP around each chunk, an Adam optimizer over all, finalize_model_grads hooked."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer)
    chunks = [DistributedDataParallel(config, ddp_config, m) for m in modules]
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=1.0,
                        use_distributed_optimizer=distributed_optimizer, params_dtype=config.params_dtype),
        chunks)
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, opt


def _train(chunks, opt, steps: int, data_seed: int) -> list:
    """`steps` optimizer steps of NUM_MB micro-batches through get_forward_backward_func(); returns
    the mean micro-batch loss of each step (on ranks of the last stage; [] elsewhere)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fwd_bwd = get_forward_backward_func()
    losses = []
    for step in range(steps):
        for c in chunks:
            c.zero_grad_buffer()
        opt.zero_grad()
        data = _batches(data_seed, NUM_MB)  # the same batch every step: the loss must go down
        its = [iter(data) for _ in chunks] if len(chunks) > 1 else iter(data)
        out = fwd_bwd(forward_step_func=_forward_step, data_iterator=its, model=chunks if len(chunks) > 1 else chunks[0],
                      num_microbatches=NUM_MB, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        ok, _, _ = opt.step()
        assert ok, "optimizer step skipped"
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            losses.append(torch.stack([o["loss"] for o in out]).mean().item())
    return losses


# ---------------------------------------------------------------------------------------------
# workers

STEPS = 3
CKPT_NAMES = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
              "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.1.mlp.linear_fc1.bias",
              "decoder.layers.3.mlp.linear_fc2.weight", "decoder.layers.2.input_layernorm.weight",
              "decoder.final_layernorm.weight")


def _w_pipeline(rank, world_size, tp, pp, vpp, over):
    _setup(tp, pp, vpp)
    return _pipeline(tp, pp, vpp, over)


def _pipeline(tp, pp, vpp, over) -> dict:
    """Train STEPS steps from name-derived weights (identical for every layout); return the losses."""
    from megatron.core import parallel_state as ps

    config = _config(tp, pp, vpp, **over)
    modules = []
    for vp in [None] if vpp is None else range(vpp):
        m = _build(config, vp_stage=vp)
        _init_by_name(m)
        modules.append(m)
    chunks, opt = _wrap(config, modules, distributed_optimizer=False)
    losses = _train(chunks, opt, STEPS, data_seed=SEED)
    return {"losses": losses, "last_stage": ps.is_pipeline_last_stage(ignore_virtual=True)}


def _w_tp_dp(rank, world_size, ckpt_path):
    _setup(tp=2, pp=1)
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    config = _config(2, 1)
    model = _build(config)
    chunks, opt = _wrap(config, [model], distributed_optimizer=True)
    dp_rank = ps.get_data_parallel_rank()
    losses = _train(chunks, opt, STEPS + 1, data_seed=SEED + 1000 * (dp_rank + 1))
    # the step loss averaged over the data-parallel replicas
    t = torch.tensor(losses)
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    # the trained weights, saved for test_dist_checkpoint_tp2dp2_to_tp1pp2 (torch_dist format)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_path)
    return {"losses": (t / ps.get_data_parallel_world_size()).tolist(),
            "tp_rank": ps.get_tensor_model_parallel_rank(), "dp_rank": dp_rank,
            "params": {n: _np(p) for n, p in model.named_parameters()},
            "full": _full_params(model, CKPT_NAMES)}


def _fwd_bwd_once(**over) -> dict:
    """Seed, build with Megatron's own init (use_cpu_initialization), wrap in DDP, run one
    forward/backward of NUM_MB micro-batches (the schedule ends with finalize_model_grads);
    return the weights as built, the loss and every main_grad."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megacli.backend import cpu

    cpu.seed_all(SEED)
    model_parallel_cuda_manual_seed(SEED)
    config = _config(2, 1, **over)
    model = _build(config)
    weights = {n: _np(p) for n, p in model.named_parameters()}
    (chunk,), _ = _wrap(config, [model], distributed_optimizer=False)
    out = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(_batches(SEED, NUM_MB)),
                                      model=chunk, num_microbatches=NUM_MB, seq_length=SEQ, micro_batch_size=MBS)
    return {"weights": weights, "loss": torch.stack([o["loss"] for o in out]).mean().item(),
            "grads": {n: _np(p.main_grad) for n, p in model.named_parameters()},
            "norm_sp_flag": model.decoder.final_layernorm.weight.sequence_parallel}


def _w_two(rank, world_size):
    """The 2-process runs: TP2 (sequence parallelism, activation recompute, the model-parallel
    RNG), then the same processes re-initialised as PP2 x VPP2 (interleaved schedule)."""
    _setup(tp=2, pp=1)
    import torch
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from megacli.backend import cpu

    res = {"sp": {sp: _fwd_bwd_once(sequence_parallel=sp) for sp in (False, True)}}
    dropout = dict(hidden_dropout=0.1, attention_dropout=0.1)
    res["recompute"] = {
        "none": _fwd_bwd_once(**dropout),
        "full": _fwd_bwd_once(**dropout, recompute_granularity="full", recompute_method="uniform",
                              recompute_num_layers=1),
        "selective": _fwd_bwd_once(**dropout, recompute_granularity="selective"),
    }
    cpu.seed_all(SEED)
    model_parallel_cuda_manual_seed(SEED)
    start = torch.get_rng_state()
    outside = torch.rand(4)  # the default (data-parallel) stream
    torch.set_rng_state(start)
    with get_cuda_rng_tracker().fork():  # the model-parallel stream: seeded per TP rank
        inside1 = torch.rand(4)
    after = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        inside2 = torch.rand(4)
    res["rng"] = {k: _np(v) for k, v in dict(outside=outside, inside1=inside1, after=after, inside2=inside2).items()}
    # an all-gather into tensors of unequal sizes (rank r sends 5 + 3r numbers), as NCCL does it
    gathered = [torch.empty(5), torch.empty(2, 4)]
    torch.distributed.all_gather(gathered, torch.arange(5.0 + 3 * rank) + 10 * rank)
    res["unequal_gather"] = [_np(t) for t in gathered]

    # PP=2 interleaved needs unbatched p2p (Megatron's rule: with batch_p2p_comm the two ranks post
    # two sends to each other in one batch and the receives pair them up the wrong way round)
    _parallel(tp=1, pp=2, vpp=2)
    res["interleaved"] = _pipeline(1, 2, 2, dict(overlap_p2p_comm=True, batch_p2p_comm=False))
    return res


def _w_ckpt_load(rank, world_size, path):
    _setup(tp=1, pp=2)
    import torch
    from megatron.core import dist_checkpointing

    model = _build(_config(1, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = dist_checkpointing.load(model.sharded_state_dict(), path)
    model.load_state_dict(state)
    return _full_params(model, CKPT_NAMES)


# ---------------------------------------------------------------------------------------------
# tests


@pytest.fixture(scope="module")
def single_process_losses():
    """The unsplit model (TP1 PP1, one process, no pipelining schedule) from the same weights and data."""
    (res,) = spawn(_w_pipeline, 1, 1, 1, None, {})
    assert len(res["losses"]) == STEPS
    return res["losses"]


def _last_stage_losses(results) -> list:
    last = [r["losses"] for r in results if r["last_stage"]]
    assert last and all(x == last[0] for x in last)  # every TP rank of the last stage agrees
    return last[0]


@pytest.mark.slow
def test_tp2_pp2_1f1b_matches_single_process(single_process_losses):
    ref = single_process_losses
    losses = _last_stage_losses(spawn(_w_pipeline, 4, 2, 2, None, {}))
    assert losses[0] == pytest.approx(ref[0], rel=1e-5)
    # and the next steps (DDP grads, tied-embedding grad all-reduce, Adam) stay together
    assert losses == pytest.approx(ref, rel=1e-5)
    assert losses[-1] < losses[0]  # the same batch every step: it is being learnt


@pytest.fixture(scope="module")
def tp2dp2(tmp_path_factory):
    """One TP2 x DP2 run (4 processes) shared by the optimizer and the checkpoint test: it trains
    with the distributed optimizer, then saves the trained model with dist_checkpointing."""
    path = tmp_path_factory.mktemp("tp2dp2") / "ckpt"
    path.mkdir()
    return str(path), spawn(_w_tp_dp, 4, str(path))


@pytest.mark.slow
def test_tp2_dp2_distributed_optimizer(tp2dp2):
    _, res = tp2dp2
    losses = res[0]["losses"]
    assert all(r["losses"] == pytest.approx(losses, rel=1e-6) for r in res)
    assert losses[-1] < losses[0], losses
    for tp_rank in (0, 1):
        a, b = [r for r in res if r["tp_rank"] == tp_rank]
        assert a["dp_rank"] != b["dp_rank"]
        for name, t in a["params"].items():
            assert np.array_equal(t, b["params"][name]), f"{name} differs across data-parallel replicas"
    # and the replicas did train: parameters moved away from their initial values
    assert not np.array_equal(res[0]["params"]["decoder.final_layernorm.weight"], np.ones(HIDDEN, np.float32))


@pytest.mark.slow
def test_dist_checkpoint_tp2dp2_to_tp1pp2(tp2dp2):
    path, res = tp2dp2
    saved = res[0]["full"]  # TP-gathered on the saving side; every rank holds the same values
    assert set(saved) == set(CKPT_NAMES)
    for r in res[1:]:
        for name, t in saved.items():
            assert np.array_equal(r["full"][name], t), name
    loaded = spawn(_w_ckpt_load, 2, path)  # fresh processes, TP1 x PP2
    # both stages hold the tied embedding (stage 1 as its output layer): both copies are checked
    assert all("embedding.word_embeddings.weight" in r for r in loaded)
    assert set().union(*loaded) == set(CKPT_NAMES)
    for r in loaded:
        for name, t in r.items():
            assert np.array_equal(t, saved[name]), name


@pytest.fixture(scope="module")
def two():
    return spawn(_w_two, 2)


@pytest.mark.slow
def test_interleaved_pp2_vpp2_matches_single_process(two, single_process_losses):
    losses = _last_stage_losses([r["interleaved"] for r in two])
    assert losses == pytest.approx(single_process_losses, rel=1e-5)


@pytest.mark.slow
def test_sequence_parallel_matches_tp(two):
    for r in two:
        off, on = r["sp"][False], r["sp"][True]
        assert off["norm_sp_flag"] is False and on["norm_sp_flag"] is True
        for name, t in off["weights"].items():
            assert np.array_equal(t, on["weights"][name]), f"{name}: same seed built different weights"
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-5)
        # every gradient agrees to fp32 reduction-order noise (measured: <= 1.5e-8 absolute); the
        # norms' only because their grads are all-reduced over TP (each rank saw half the sequence)
        assert set(on["grads"]) == set(off["grads"])
        for name, g in off["grads"].items():
            np.testing.assert_allclose(on["grads"][name], g, rtol=1e-5, atol=1e-7, err_msg=name)
    # the replicated final-norm gradient is the same on both TP ranks
    a, b = (r["sp"][True]["grads"]["decoder.final_layernorm.weight"] for r in two)
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_recompute_with_dropout_and_rng_tracker(two):
    for r in two:
        base = r["recompute"]["none"]
        for kind in ("full", "selective"):
            rc = r["recompute"][kind]
            assert rc["loss"] == base["loss"], kind
            for name, g in base["grads"].items():  # the recomputed forward redrew the same dropout masks
                assert np.array_equal(rc["grads"][name], g), f"{kind} recompute: {name}"
        rng = r["rng"]
        assert np.array_equal(rng["after"], rng["outside"])  # leaving the fork restored the default stream
        assert not np.array_equal(rng["inside1"], rng["outside"])
        assert not np.array_equal(rng["inside2"], rng["inside1"])  # the forked stream advanced
    a, b = (r["rng"] for r in two)
    assert np.array_equal(a["outside"], b["outside"])  # default stream: same on TP ranks
    assert not np.array_equal(a["inside1"], b["inside1"])  # model-parallel stream: per TP rank


@pytest.mark.slow
def test_all_gather_of_unequal_sizes(two):
    want = [np.arange(5.0), (np.arange(8.0) + 10).reshape(2, 4)]
    for r in two:
        for got, expected in zip(r["unequal_gather"], want, strict=True):
            np.testing.assert_array_equal(got, expected)


def test_norm_matches_torch_norms():
    """Norm (in this process; no backend needed) computes torch's LayerNorm/RMSNorm, zero-centred
    gamma included, and flags its parameters for Megatron's sequence-parallel grad all-reduce."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megacli.engine.models.layers import Norm

    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0))
    gamma = 1.0 + 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(1))
    beta = 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(2))
    for normalization, ref_cls in (("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)):
        ref = ref_cls(16, eps=1e-6)
        with torch.no_grad():
            ref.weight.copy_(gamma)
            if normalization == "LayerNorm":
                ref.bias.copy_(beta)
        for zero_centered in (False, True):
            for sp in (False, True):
                config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                           normalization=normalization, layernorm_zero_centered_gamma=zero_centered,
                                           sequence_parallel=sp, tensor_model_parallel_size=2 if sp else 1)
                norm = Norm(config, 16, eps=1e-6)
                assert torch.equal(norm.weight, torch.zeros(16) if zero_centered else torch.ones(16))
                assert (norm.bias is not None) == (normalization == "LayerNorm")
                assert all(p.sequence_parallel is sp for p in norm.parameters())
                with torch.no_grad():
                    norm.weight.copy_(gamma - 1 if zero_centered else gamma)
                    if norm.bias is not None:
                        norm.bias.copy_(beta)
                torch.testing.assert_close(norm(x), ref(x), rtol=1e-6, atol=1e-6)


def test_enable_imports_megatron_without_dynamo_or_wandb_and_both_still_work():
    """enable() imports Megatron-Core with torch.compile as the identity and wandb hidden (import
    cost only, on CPU); afterwards torch.compile compiles again and wandb imports."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from megacli.backend import cpu\n"
            "cpu.enable()\n"
            "import megatron.core.fusions.fused_bias_gelu as f\n"
            "assert 'torch._dynamo' not in sys.modules and 'wandb' not in sys.modules, sorted(sys.modules)\n"
            "assert not hasattr(f.bias_gelu, '_torchdynamo_orig_callable')\n"
            "import wandb\n"
            "assert hasattr(torch.compile(lambda x: x), '_torchdynamo_orig_callable')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
