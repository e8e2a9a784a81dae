"""train.fp8 on CPU through torchao's emulation (train.fp8_emulate: the same casts to float8, the
products in fp32): a tiny bf16 GPT trained 50 steps in FP8 stays within TOLERANCE of the bf16 run,
TP2 × PP2 (SP, distributed optimizer) in FP8 gives the single process's FP8 losses, a checkpoint trained in FP8 resumes
with FP8 off; which linears stay bf16 and the refusals. The CUDA runs (no emulation) are in
tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from megacli.engine import fp8
from megacli.recipe.jobs import load_job_recipe
from tests._gpu import FP8_GPT
from tests.conftest import assert_close, layout, losses, megacli_here, pretrain, sets_args

EMULATED = ["train.fp8_emulate=true"]
TOLERANCE = fp8.LOSS_TOLERANCE  # |loss(FP8) - loss(bf16)| / loss(bf16), at every one of the 50 steps
LAYOUT_REL = 1e-4  # tests/test_pretrain.py's: another layout, another order of floating-point sums
SAVED_AT = 25


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bf16") / "run"
    pretrain(run_dir, [*FP8_GPT, *layout()])
    return losses(run_dir)


@pytest.fixture(scope="module")
def tensorwise_run(tmp_path_factory):
    """50 FP8 steps, a checkpoint at SAVED_AT: (losses, start-of-run output, checkpoint directory)."""
    tmp = tmp_path_factory.mktemp("tensorwise")
    sets = [*FP8_GPT, *layout(), *EMULATED, "train.fp8=tensorwise", f"checkpoint.dir={tmp / 'ck'}",
            f"checkpoint.save_interval={SAVED_AT}"]
    out = pretrain(tmp / "run", sets)
    return losses(tmp / "run"), " ".join(out.stdout.split()), tmp / "ck"


def test_fifty_fp8_steps_stay_within_the_tolerance_of_bf16(bf16_run, tensorwise_run):
    fp8_losses, stdout, _ = tensorwise_run
    assert sorted(fp8_losses) == sorted(bf16_run) == list(range(1, 51))
    assert_close(fp8_losses, bf16_run, range(1, 51), TOLERANCE)
    assert fp8_losses[1] != bf16_run[1], "step 1's forward already runs the FP8 products"
    assert fp8_losses[50] < fp8_losses[1] - 1.0, fp8_losses
    assert ("train.fp8 = tensorwise: torchao 0.18.0 float8 (emulated in higher precision) in 8 of 9 parallel linears "
            "on this rank (linear_fc1, linear_fc2, linear_proj, linear_qkv); bf16 by rule: output_layer: the output "
            "layer") in stdout, stdout[-2000:]


def test_a_checkpoint_trained_in_fp8_resumes_with_fp8_off(tensorwise_run, tmp_path):
    """Master weights and optimizer state are a bf16 run's: FP8 off at the resume continues the FP8
    run's curve (its next steps differ only by the FP8 rounding of their products)."""
    fp8_losses, _, ck = tensorwise_run
    pretrain(tmp_path / "resumed", [*FP8_GPT, *layout(), "train.fp8=none", "train.exit_after_iters=3",
                                    f"checkpoint.resume={ck / f'iter_{SAVED_AT:07d}'}", f"checkpoint.dir={tmp_path / 'ck'}"])
    resumed = losses(tmp_path / "resumed")
    assert sorted(resumed) == [SAVED_AT + 1, SAVED_AT + 2, SAVED_AT + 3]
    assert_close(resumed, fp8_losses, sorted(resumed), TOLERANCE)


@pytest.mark.slow
def test_tp2_pp2_sp_in_fp8_gives_the_single_process_fp8_losses(tmp_path):
    """With sequence parallelism and the distributed optimizer. rowwise scales are powers of two, so a shard's FP8 values are the whole tensor's whichever
    rank's maximum set its scale: the layouts differ only in the order of sums. (tensorwise scales
    each rank's shard by its own maximum: docs/gpu.md.)"""
    short = ["train.iters=4", *EMULATED, "train.fp8=rowwise"]
    pretrain(tmp_path / "tp1", [*FP8_GPT, *layout(), *short])
    pretrain(tmp_path / "tp2pp2", [*FP8_GPT, *layout(tp=2, pp=2, sp=True, dist_opt=True), *short])
    assert_close(losses(tmp_path / "tp2pp2"), losses(tmp_path / "tp1"), range(1, 5), LAYOUT_REL)


def test_fp8_is_refused_off_fp8_hardware_and_outside_bf16(tmp_path):
    out = megacli_here("pretrain", *sets_args([*FP8_GPT, *layout(), "train.fp8=tensorwise", "train.iters=3",
                                               f"run.dir={tmp_path / 'cpu'}"]))
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    message = " ".join((out.stdout + out.stderr).split())
    assert "train.fp8 = 'tensorwise' needs a GPU with FP8 matrix units" in message and "this run is on cpu" in message
    assert "Traceback" not in message
    out = megacli_here("pretrain", *sets_args([*FP8_GPT, *layout(), *EMULATED, "train.fp8=rowwise", "train.precision=fp32",
                                               f"run.dir={tmp_path / 'fp32'}"]))
    assert out.returncode == 2 and "train.fp8 = 'rowwise': is for bf16 training" in " ".join(out.stdout.split() + out.stderr.split())


def test_what_stays_bf16_by_rule():
    def linear(shape, *, expert=False, trainable=True):
        return type("Linear", (), {"weight": torch.nn.Parameter(torch.empty(shape), requires_grad=trainable),
                                   "is_expert": expert})()

    assert fp8.kept_reason("decoder.layers.0.mlp.linear_fc1", linear((128, 64))) is None
    assert fp8.kept_reason("output_layer", linear((256, 64))) == "output"
    assert fp8.kept_reason("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1", linear((128, 64), expert=True)) == "expert"
    assert fp8.kept_reason("decoder.layers.0.self_attention.linear_qkv", linear((72, 64))) == "shape"
    assert fp8.kept_reason("decoder.layers.0.self_attention.linear_proj", linear((64, 40))) == "shape"
    assert fp8.kept_reason("decoder.layers.0.self_attention.linear_proj", linear((64, 64), trainable=False)) == "frozen"


def test_unaligned_token_counts_pad_the_products():
    """A micro-batch's tokens on a rank are the weight gradient's inner dimension: fixed-length
    batches whose count is a multiple of 16 need no padding; others (and instruction batches) do."""
    def aligned(*sets):  # one sequence a micro-batch
        return fp8.tokens_aligned(load_job_recipe("pretrain", None, [*FP8_GPT, "train.micro_batch_size=1", *sets]))

    assert aligned() and aligned("model.seq_length=48")
    assert not aligned("model.seq_length=40")
    assert not aligned(*layout(cp=4))  # 32 tokens over 4 context-parallel ranks: 8 a rank
    assert aligned(*layout(cp=2))
    assert fp8.torchao_config("tensorwise", emulate=True, pad_tokens=True).pad_inner_dim


def _sequence_parallel_column_linear(rank, world):
    """One column-parallel FP8 linear under sequence parallelism on 2 gloo ranks, and the same
    product on the whole sequence and weight in this process: whether the gathered sequence
    outlived the forward pass, and the gradients of both."""
    import weakref

    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    from megacli.backend import cpu

    cpu.enable()
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same tensors on both ranks
    sequence, weight, upstream = torch.randn(32, 2, 64), torch.randn(96, 64), torch.randn(32, 2, 96)
    config = fp8.torchao_config("rowwise", emulate=True)
    mm_config = fp8._mm_config(config)

    def run(inputs, weights, grads, **parallel):
        inputs, weights = inputs.clone().requires_grad_(), weights.clone().requires_grad_()
        out = fp8.fp8_linear(inputs, weights, None, False, False, config=config, mm_config=mm_config, plain=None,
                             **parallel)
        out.backward(grads)
        return inputs.grad, weights.grad

    whole = run(sequence, weight, upstream, sequence_parallel=False)
    gathered = []
    plain_gather = mappings.gather_from_sequence_parallel_region

    def gather(*args, **kwargs):
        out = plain_gather(*args, **kwargs)
        gathered.append(weakref.ref(out))
        return out

    mappings.gather_from_sequence_parallel_region = gather
    try:
        inputs = sequence.chunk(world)[rank].clone().requires_grad_()
        weights = weight.chunk(world)[rank].clone().requires_grad_()
        out = fp8.fp8_linear(inputs, weights, None, False, False, True, tp_group=dist.group.WORLD, config=config,
                             mm_config=mm_config, plain=None)
        outlived = gathered[0]() is not None
        out.backward(upstream.chunk(world, dim=-1)[rank])
    finally:
        mappings.gather_from_sequence_parallel_region = plain_gather
    return {"outlived": outlived, "input_grad": (inputs.grad, whole[0].chunk(world)[rank]),
            "weight_grad": (weights.grad, whole[1].chunk(world)[rank])}


def test_sequence_parallel_fp8_keeps_only_this_ranks_part_of_the_sequence():
    """Under sequence parallelism the backward pass gathers the sequence again, as Megatron's own
    linear does, so the forward keeps 1/TP of it; the gradients are the whole product's."""
    from tests._dist import spawn

    for got in spawn(_sequence_parallel_column_linear, 2):
        assert not got["outlived"], "the gathered sequence was kept for the backward pass"
        for name in ("input_grad", "weight_grad"):
            torch.testing.assert_close(*got[name], rtol=1e-5, atol=1e-5, msg=name)
