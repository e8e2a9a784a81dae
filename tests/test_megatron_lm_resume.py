"""checkpoint.resume of Megatron-LM's own torch_dist checkpoints (issue 18): weights, optimizer
(distributed, dp_reshardable - Megatron-LM 0.16's default - and the plain optimizer), scheduler,
iteration, consumed samples and RNG state continue the run.

One chain of runs:

    A   megacli pretrain TP2 × PP2, distributed optimizer, 4 steps, a checkpoint at 2
    S   megacli reshard A@2 --no-distributed-optimizer (the same run's standard-optimizer state)
    W   a writer (4 ranks): A@2 and S loaded into live trainers, saved as Megatron-LM's
        megatron/training/checkpointing.py saves (its state-dict layout, content metadata, common
        state, RNG objects, scheduler in samples, tracker file): mlm_dist (Transformer Engine key
        names, dp_reshardable), mlm_plain (local-spec norm names, plain optimizer), mlm_full
        (fully_reshardable)
    B1  pretrain --set checkpoint.resume=mlm_dist        steps 3-4
    B2  pretrain --set checkpoint.resume=mlm_plain       steps 3-4

W saves with the installed Megatron-Core's dist_checkpointing, as Megatron-LM does: under 0.16 the
common state goes to common.pt, from 0.19 on inside the shards (no common.pt), so the two legs of
the suite read both layouts.

B1 and B2 must reproduce A's steps 3-4 (the run continued in the writer's layout) within 1e-5;
mlm_full resumes under TP1 × PP1 (one process) within 1e-4 relative (another layout); the refusals
(dp_reshardable state under another layout, a model or schedule other than the run's) name the field;
reshard and verify take all three directly.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest
import torch

from megacli.checkpoint.source import Source

from tests.conftest import pretrain_losses
from tests.test_megatron_lm import llama_args

TOL = 1e-5
TINY = [
    "data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null",
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.kv_channels=16", "model.ffn_hidden_size=64", "model.activation=swiglu", "model.normalization=rmsnorm",
    "model.position_embedding=rope", "model.rotary_base=5000", "model.untie_embeddings=true",
    "model.add_bias_linear=false", "model.seq_length=16", "model.make_vocab_size_divisible_by=128",
    "train.iters=4", "train.micro_batch_size=2", "train.global_batch_size=4", "train.log_interval=1",
    "train.eval_interval=null", "optim.warmup_iters=1", "optim.lr=1e-2", "train.precision=fp32",
]
LOCAL_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def layout(tp=2, pp=2, dist_opt=True):
    return [f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"parallel.distributed_optimizer={str(dist_opt).lower()}",
            f"launch.nproc={tp * pp}"]


def pretrain(run_dir: Path, overrides: list[str]) -> tuple[subprocess.CompletedProcess, dict[int, float]]:
    sets = [*TINY, *overrides]
    return pretrain_losses([x for s in sets for x in ("--set", s)], run_dir, in_process="launch.nproc=1" in overrides)


def megatron_lm_args(recipe, *, iteration: int, vocab: int) -> argparse.Namespace:
    """The args Megatron-LM's parse_args would hold for ``recipe``'s run (the fields megacli reads)."""
    t, o, p = recipe.train, recipe.optim, recipe.parallel
    return llama_args(
        seq_length=recipe.model.seq_length, max_position_embeddings=recipe.model.seq_length, vocab_size=vocab,
        padded_vocab_size=None, tokenizer_type="ByteTokenizer (megacli)", tokenizer_model=None,
        tensor_model_parallel_size=p.tensor, pipeline_model_parallel_size=p.pipeline, world_size=p.tensor * p.pipeline,
        data_parallel_size=1, micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
        train_iters=t.iters, lr=o.lr, min_lr=o.min_lr, lr_warmup_iters=o.warmup_iters, lr_decay_iters=None,
        lr_decay_style=o.decay_style, weight_decay=o.weight_decay, clip_grad=o.clip_grad, seed=t.seed,
        use_distributed_optimizer=p.distributed_optimizer, consumed_train_samples=iteration * t.global_batch_size,
        ckpt_format="torch_dist", expert_model_parallel_size=1, rampup_batch_size=None)


def save_as_megatron_lm(trainer, recipe, root: Path, *, iteration: int, spec: str, sharding: str | None,
                        args: argparse.Namespace | None = None) -> None:
    """What megatron/training/checkpointing.py's save_checkpoint writes (torch_dist), from a live trainer:
    generate_state_dict's entries, get_rng_state's sharded object, _build_sharded_state_dict_metadata's
    content metadata, the tracker file. ``args``: the run's (default: megatron_lm_args of the recipe)."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megacli.checkpoint.layout import TRACKER, iter_name
    from megacli.engine.models.common import unwrap

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if sharding is not None:
        metadata["distrib_optim_sharding_type"] = sharding
    gbs = recipe.train.global_batch_size
    args = args if args is not None else megatron_lm_args(recipe, iteration=iteration, vocab=trainer.vocab_size)
    state = {"args": args, "checkpoint_version": 3.0,
             "iteration": iteration}
    keys = ["model"] if len(trainer.chunks) == 1 else [f"model{i}" for i in range(len(trainer.chunks))]
    for key, chunk in zip(keys, trainer.chunks):
        state[key] = unwrap(chunk).sharded_state_dict(metadata=metadata)
        if spec == "local":  # a local-spec model saved without Megatron-Core's key map
            for sh in state[key].values():
                for fused, local in LOCAL_NAMES.items():
                    if hasattr(sh, "key") and sh.key.endswith(fused):
                        sh.key = sh.key[: -len(fused)] + local
    state["optimizer"] = trainer.optimizer.sharded_state_dict(state, metadata=metadata)
    sched = trainer.scheduler.state_dict()
    state["opt_param_scheduler"] = {k: (v * gbs if k in ("num_steps", "lr_warmup_steps", "lr_decay_steps",
                                                         "wd_incr_steps") else v) for k, v in sched.items()}
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
           "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    state["rng_state"] = ShardedObject("rng_state", [rng], (ps.get_pipeline_model_parallel_world_size(),
                                                             ps.get_tensor_model_parallel_world_size()),
                                       (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                                       replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    state["num_floating_point_operations_so_far"] = 0
    it_dir = root / iter_name(iteration)
    if dist.get_rank() == 0:
        it_dir.mkdir(parents=True)
    dist.barrier()
    content = {k: v for k, v in metadata.items() if k != "dp_cp_group"}
    dist_checkpointing.save(state, str(it_dir), content_metadata=content)
    if dist.get_rank() == 0:
        (root / TRACKER).write_text(str(iteration))
    dist.barrier()


def _write(rank, world, root: str):
    from megacli.engine import checkpoint, distributed
    from megacli.engine.loop import build_trainer
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    root = Path(root)
    made = {}
    for name, ckpt, dist_opt in (("dist", root / "ck_a" / "iter_0000002", True), ("plain", root / "std", False)):
        found = checkpoint.find_checkpoint(ckpt)
        made[name] = (load(TrainingRecipe, found / "recipe.yaml", [f"run.dir={root / 'w' / name}", "checkpoint.dir=null"]),
                      found)
    recipe = made["dist"][0]
    with distributed.running(parallel=recipe.parallel, launch=recipe.launch, seed=recipe.train.seed) as runtime:
        for name, (recipe, found) in made.items():
            trainer, _ = build_trainer(recipe, runtime)
            checkpoint.load(source=Source(found), chunks=trainer.chunks, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                            load_optimizer=True)
            if name == "dist":
                save_as_megatron_lm(trainer, recipe, root / "mlm_dist", iteration=2, spec="te", sharding="dp_reshardable")
                save_as_megatron_lm(trainer, recipe, root / "mlm_full", iteration=2, spec="te",
                                    sharding="fully_reshardable")
            else:
                save_as_megatron_lm(trainer, recipe, root / "mlm_plain", iteration=2, spec="local", sharding=None)
    return True


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    from tests._dist import spawn

    root = tmp_path_factory.mktemp("mlm_resume")
    out = {"root": root}
    res, out["A"] = pretrain(root / "run_a", layout() + [f"checkpoint.dir={root / 'ck_a'}", "checkpoint.save_interval=2"])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    from typer.testing import CliRunner

    from megacli.cli import _register, app

    _register()  # the reshard command in this process: no interpreter to start
    res = CliRunner().invoke(app, ["reshard", str(root / "ck_a" / "iter_0000002"), str(root / "std"),
                                   "--no-distributed-optimizer"])
    assert res.exit_code == 0, res.output
    spawn(_write, 4, str(root), timeout=900)
    for name, dist_opt in (("dist", True), ("plain", False)):
        res, out[name] = pretrain(root / f"run_{name}", layout(dist_opt=dist_opt)
                                  + [f"checkpoint.resume={root / f'mlm_{name}'}", f"checkpoint.dir={root / f'ck_{name}'}"])
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        out[f"{name}_log"] = res.stdout + res.stderr
    return out


@pytest.mark.parametrize("name", ["dist", "plain"])
def test_resumed_losses_continue_the_writers_run(chain, name):
    a, got = chain["A"], chain[name]
    assert sorted(got) == [3, 4], got
    for i in (3, 4):
        assert abs(got[i] - a[i]) <= TOL, (name, i, got[i], a[i])
    log = chain[f"{name}_log"]
    assert "at iteration 2" in log and "RNG re-seeded" not in log, log[-2000:]


def test_refusals_name_the_field(chain, tmp_path):
    from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint
    from megacli.engine.compat import check_resumable
    from megacli.checkpoint.megatron_lm.resume import _scheduler_state
    from megacli.engine.optim import build_scheduler
    from megacli.errors import UserError
    from megacli.recipe.base import load
    from megacli.recipe.pretrain import TrainingRecipe

    root = chain["root"]
    # dp_reshardable optimizer state under another tensor/pipeline layout: through the CLI, no traceback.
    res, _ = pretrain(tmp_path / "tp1", layout(tp=1, pp=1) + [f"checkpoint.resume={root / 'mlm_dist'}"])
    assert res.returncode == 2 and "dp_reshardable" in res.stderr and "parallel.tensor=2" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    it_dir = root / "mlm_full" / "iter_0000002"
    recipe = load(TrainingRecipe, root / "ck_a" / "iter_0000002" / "recipe.yaml")
    assert "model.padded_vocab_in_loss=true" in check_resumable(it_dir, recipe)
    # A model shape other than the run's args.
    wide = load(TrainingRecipe, root / "ck_a" / "iter_0000002" / "recipe.yaml", ["model.ffn_hidden_size=96"])
    with pytest.raises(UserError, match=r"model.ffn_hidden_size = 96 \(checkpoint: 64\)"):
        check_resumable(it_dir, wide)
    # A schedule other than the run's.
    src = MegatronLMCheckpoint(Source(it_dir))
    for sets, field in ((["optim.lr=3e-3"], "optim.lr"), (["train.iters=8"], "optim.decay_iters")):
        r = load(TrainingRecipe, root / "ck_a" / "iter_0000002" / "recipe.yaml", sets)
        opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=r.optim.lr)
        with pytest.raises(UserError, match=field):
            _scheduler_state(src, build_scheduler(opt, optim=r.optim, train_iters=r.train.iters))
    assert _scheduler_state(src, build_scheduler(opt, optim=recipe.optim, train_iters=recipe.train.iters))["num_steps"] == 2


def test_reshard_carries_the_layout_free_optimizer_state(chain, tmp_path):
    """reshard (and verify) of Megatron-LM checkpoints: the plain optimizer's state and fully_reshardable
    state come along, and the RNG state (remapped to TP1 × PP1: the first stage's, TP rank 0's);
    dp_reshardable state does not, said so."""
    from typer.testing import CliRunner

    from megacli.checkpoint.torch_dist import TorchDistReader
    from megacli.cli import _register, app

    _register()
    root = chain["root"]
    for name, carried in (("plain", True), ("full", True), ("dist", False)):
        res = CliRunner().invoke(app, ["reshard", str(root / f"mlm_{name}"), str(tmp_path / name), "--tensor", "1",
                                       "--pipeline", "1", "--verify"], env={"COLUMNS": "200"})
        assert res.exit_code == 0 and "verify: OK" in res.output, res.output
        assert ("optimizer state not carried" in res.output) != carried and "RNG state not carried" not in res.output
        written = TorchDistReader(Source(tmp_path / name / "iter_0000002"))
        (rng,) = written.read_object("rng_state/shard_0.0_1.1")
        (saved,) = TorchDistReader(Source(root / f"mlm_{name}" / "iter_0000002")).read_object("rng_state/shard_0.0_2.2")[0]
        assert rng["random"] == saved["random_rng_state"] and torch.equal(rng["torch"], saved["torch_rng_state"])
        assert sorted(rng["tracker"]) == sorted(saved["rng_tracker_states"]) and all(
            torch.equal(rng["tracker"][k], saved["rng_tracker_states"][k]) for k in rng["tracker"])
        keys = written.tensors
        # the modules' extra state, which Megatron-Core's model asks for when the engine loads the output
        assert "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2" in written.objects, sorted(written.objects)
        assert any(k.startswith("optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.layer_norm_weight")
                   for k in keys) == carried, sorted(keys)[:5]
        res = CliRunner().invoke(app, ["reshard", "verify", str(root / f"mlm_{name}"), str(tmp_path / name)])
        assert res.exit_code == 0 and "verify: OK" in res.output, res.output


def test_fully_reshardable_state_resumes_under_another_layout(chain, tmp_path):
    """fully_reshardable optimizer state loads under TP1 × PP1 (one process); RNG is re-seeded, said so."""
    a = chain["A"]
    res, got = pretrain(tmp_path / "full_tp1", layout(tp=1, pp=1) + [f"checkpoint.resume={chain['root'] / 'mlm_full'}"])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "RNG re-seeded" in res.stdout + res.stderr
    for i in (3, 4):
        assert abs(got[i] - a[i]) <= 1e-4 * abs(a[i]), (i, got[i], a[i])
