"""Acceptance on one CUDA GPU with NCCL (world size 1); every test here is skipped without CUDA.

Training goes through the real launcher (`megacli pretrain --set launch.device=cuda ...`) and is
read back from metrics.jsonl, as tests/test_pretrain.py does on CPU: GPT in bf16 and fp16 (the loss
falls; with train.deterministic two identical runs log bitwise-identical losses and gradient norms
for 20 steps), selective and full recompute, a mixture of experts (EP=1; Megatron's GroupedMLP too
when the grouped_gemm package is installed), BERT and T5, resuming. Then a converted Hugging Face
model decoded on the GPU (greedy tokens equal Hugging Face's on the same GPU, with and without the KV
cache), the shipped GPT-2 recipes' peak CUDA memory against the `--dry-run` estimate, and train.fp8
on the GPU's FP8 matrix units against the bf16 curve (tests/test_fp8.py emulates it on CPU).

The helpers (overrides, runs, metrics, comparisons) are in tests/_gpu.py; tests/test_determinism.py
runs the bitwise check on the CPU backend."""

from __future__ import annotations

import pytest
import torch

from megacli.checkpoint.source import Source

from tests import _gpu
from tests._gpu import FP8_GPT, TINY_GPT, assert_bitwise, assert_loss_falls, on_device, pretrain
from tests.conftest import assert_close, steps
from tests.test_bert_t5 import BERT, T5, common, data  # noqa: F401  (data: the WordPiece corpus fixture)
from tests.test_moe import MOE

ONE_GPU = ["parallel.tensor=1", "parallel.pipeline=1", "parallel.sequence_parallel=false", "launch.nproc=1"]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpt_run(tmp_path, name: str, precision: str, extra: list[str] = (), deterministic: bool = True) -> dict[int, dict]:
    run_dir = tmp_path / name
    pretrain(run_dir, [*TINY_GPT, *on_device("cuda", precision, deterministic=deterministic), *extra])
    return steps(run_dir)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return gpt_run(tmp_path_factory.mktemp("bf16"), "run", "bf16")


# ------------------------------------------------------------------ GPT training


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpt_loss_falls_and_a_second_run_is_bitwise_identical(precision, bf16, tmp_path):
    first = bf16 if precision == "bf16" else gpt_run(tmp_path, "first", precision)
    assert sorted(first) == list(range(1, 21))
    assert_loss_falls(first, by=0.3)
    from megacli.engine.metrics import peak_flops

    known_gpu = peak_flops(torch.device("cuda", 0)) is not None  # H100/H200 and the other listed GPUs report MFU
    assert all(r["memory_gib"] > 0 and r["tokens_per_s"] > 0 and ("mfu" in r) == known_gpu for r in first.values()), first[1]
    if precision == "fp16":
        assert all("loss_scale" in r for r in first.values())
    assert_bitwise(gpt_run(tmp_path, "second", precision), first)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_plain_runs_losses(recompute, bf16, tmp_path):
    """Recompute replays the same forward: step 1 is the same number, and the curve stays on the
    plain run's (bf16 rounding of the updates may differ in the last bits later)."""
    ours = gpt_run(tmp_path, recompute, "bf16", [f"parallel.recompute={recompute}"])
    assert ours[1]["loss"] == bf16[1]["loss"]
    assert_close(ours, bf16, range(2, 21), rel=5e-3)
    assert_loss_falls(ours, by=0.3)


def test_resume_reproduces_uninterrupted_run(bf16, tmp_path):
    ck = tmp_path / "ck"
    gpt_run(tmp_path, "part", "bf16", [f"checkpoint.dir={ck}", "train.exit_after_iters=10"])
    assert (ck / "latest").read_text().strip() == "iter_0000010"
    resumed = gpt_run(tmp_path, "part", "bf16", [f"checkpoint.dir={ck}"])  # the same run.dir: steps 1-10, then 11-20
    assert (ck / "latest").read_text().strip() == "iter_0000020"
    assert_close(resumed, bf16, range(1, 21), rel=1e-6)


# ------------------------------------------------------------------ kernel options (issue 20's faster layer path)


KERNEL_NAMES = {"flash": "flash", "cudnn": "cuDNN", "efficient": "efficient"}


@pytest.mark.parametrize("option", ["train.compile=true", "optim.fused=false", "train.grad_reduce_in_bf16=true", "train.attention_backend=flash",
                                    "train.attention_backend=cudnn", "train.attention_backend=efficient",
                                    "train.cuda_graphs=layers", "train.cuda_graphs=full",
                                    "train.compile=true train.cuda_graphs=layers"])
def test_kernel_options_stay_on_the_plain_curve(option, bf16, tmp_path):
    """Each option trains the plain run's curve: bf16 rounding differs (a fused kernel rounds once
    where the eager ops round after each op; bf16 gradient sums round each micro-batch's sum), by
    about 2^-8 relative per rounding, so 1e-2 on the loss; an attention backend is the kernel the
    start line names (the SDPA kernels need non-deterministic mode). CUDA graphs replay the same
    kernels: steps after the capture stay on the curve too. Options separated by a space run together."""
    kernel = option.startswith("train.attention_backend")
    run_dir = tmp_path / "opt"
    out = pretrain(run_dir, [*TINY_GPT, *on_device("cuda", "bf16", deterministic=not kernel), *option.split()])
    if kernel:
        choice = option.split("=")[1]
        assert f"attention: SDPA {KERNEL_NAMES[choice]} kernel on CUDA (train.attention_backend = {choice})" in " ".join(
            out.stdout.split()), out.stdout[-3000:]
    ours = steps(run_dir)
    assert_close(ours, bf16, range(1, 21), rel=1e-2)
    assert_loss_falls(ours, by=0.3)


# ------------------------------------------------------------------ FP8 (train.fp8: torchao float8 on FP8 matrix units)


@pytest.fixture(scope="module")
def fp8_bf16(tmp_path_factory):
    """train.fp8's tiny GPT in plain bf16 on the GPU: the curve the FP8 runs are held to."""
    run_dir = tmp_path_factory.mktemp("fp8_bf16") / "run"
    pretrain(run_dir, [*FP8_GPT, *on_device("cuda", "bf16"), *ONE_GPU])
    return steps(run_dir)


@pytest.mark.parametrize("option", ["train.fp8=tensorwise", "train.fp8=rowwise", "train.fp8=tensorwise train.compile=true",
                                    "train.fp8=tensorwise train.compile=true train.cuda_graphs=layers"])
def test_fp8_stays_within_the_emulated_tolerance_of_bf16(option, fp8_bf16, tmp_path):
    """The FP8 matrix units (torch._scaled_mm; no emulation) train the bf16 curve within the
    tolerance derived from the CPU emulation (tests/test_fp8.py), alone, compiled, and compiled
    with each layer replayed as a CUDA graph; the start line names the FP8 path."""
    from megacli.engine.fp8 import LOSS_TOLERANCE

    run_dir = tmp_path / "fp8"
    out = pretrain(run_dir, [*FP8_GPT, *on_device("cuda", "bf16"), *ONE_GPU, *option.split()])
    assert "float8 (FP8 matrix units) in 8 of 9 parallel linears" in " ".join(out.stdout.split()), out.stdout[-3000:]
    ours = steps(run_dir)
    assert ours[1]["loss"] != fp8_bf16[1]["loss"], "step 1 already runs the FP8 products"
    assert_close(ours, fp8_bf16, range(1, 51), rel=LOSS_TOLERANCE)


# ------------------------------------------------------------------ mixture of experts, BERT, T5


def _grouped_gemm_installed() -> bool:
    try:
        import grouped_gemm  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("grouped", [False, pytest.param(True, marks=pytest.mark.skipif(
    not _grouped_gemm_installed(), reason="the grouped_gemm package is not installed"))])
def test_moe_trains_with_every_expert_used(grouped, tmp_path):
    # Not deterministic: the router's token counting (histograms) has no deterministic CUDA kernel.
    records = gpt_run(tmp_path, "moe", "bf16", [*MOE, f"model.moe.grouped_gemm={str(grouped).lower()}"], deterministic=False)
    assert_loss_falls(records, by=0.3)
    tokens = 8 * 32 * 2  # per step: sequences × sequence length × top-2
    for r in records.values():
        assert sorted(r["expert_tokens"]) == ["1", "3"]
        assert all(sum(c) == tokens and min(c) > 0 for c in r["expert_tokens"].values()), r["expert_tokens"]
        assert r["load_balancing_loss"] >= 1.0


def test_bert_and_t5_losses_fall(data, tmp_path):  # noqa: F811
    for arch, model in (("bert", BERT), ("t5", T5)):
        run_dir = tmp_path / arch
        pretrain(run_dir, [*common(data), *model, "train.iters=10", "parallel.tensor=1", "parallel.pipeline=1",
                                 "parallel.sequence_parallel=false", "launch.nproc=1", *on_device("cuda", "bf16")])
        records = steps(run_dir)
        assert sorted(records) == list(range(1, 11))
        assert_loss_falls(records, by=0.5, key="lm_loss" if arch == "bert" else "loss")


# ------------------------------------------------------------------ convert -> generate


PROMPTS = ["the quick brown", "lazy dog jumps over the", "fox", "over the lazy dog the quick brown fox"]
NEW = 10
GENERATE_MODELS = ["gpt2", "llama_tied_gqa"]


def _convert_and_decode(rank, world, root: str) -> dict:
    """In a spawned process: tiny HF models -> megacli checkpoints; HF's greedy tokens on the GPU
    (prompt by prompt) and ours (one left-padded batch, with and without the KV cache, and each
    prompt alone), fp32 without TF32 on both sides."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from megacli.convert import convert
    from megacli.data.tokenizers import load_tokenizer
    from megacli.engine import distributed
    from megacli.inference.generator import Generator
    from megacli.inference.runner import Model
    from megacli.recipe import base
    from megacli.recipe.generate import GenerateRecipe
    from tests import _convert_models as cm

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    root, out, runtime = Path(root), {}, None
    hf_models = {}
    for name in GENERATE_MODELS:  # every conversion first: convert sets up (and tears down) its own parallel state
        hf_models[name] = cm.build_hf(name, root / name / "hf", with_tokenizer=True).to("cuda")
        convert(Source(root / name / "hf"), root / name / "mc", say=lambda *_: None)
    for name, hf in hf_models.items():
        tok = AutoTokenizer.from_pretrained(root / name / "hf")
        ref = []
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt)], device="cuda")
            with torch.no_grad():
                gen = hf.generate(ids, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
            ref.append(gen[0, ids.shape[1]:].tolist())
        raw = base.read_yaml(root / name / "mc" / "iter_0000000" / "recipe.yaml")
        raw["launch"].update(nproc=1, device="cuda")
        raw["train"].update(precision="fp32", global_batch_size=raw["train"]["micro_batch_size"])
        ours, model = {}, None
        for case, extra in {"cache": {}, "no_cache": {"use_cache": False}}.items():
            recipe = base.validate(GenerateRecipe, {**raw, "generate": {"checkpoint": str(root / name / "mc"),
                                                                         "max_new_tokens": NEW, "stop_at_eod": False, **extra}}, "test")
            if runtime is None:
                runtime = distributed.setup(parallel=recipe.parallel, launch=recipe.launch, seed=0)
            if model is None:
                model = Model(recipe, runtime, vocab_size=recipe.model.vocab_size)
            assert model.device.type == "cuda" and next(model.net.parameters()).is_cuda
            generator = Generator(model, load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path), recipe.generate)
            ours[case] = [c.tokens for c in generator.run_batch(PROMPTS)]
            if case == "cache":
                ours["alone"] = [generator.run_batch([p])[0].tokens for p in PROMPTS]
        out[name] = {"hf": ref, **ours}
    distributed.teardown()
    return out


@pytest.mark.parametrize("name", GENERATE_MODELS)
def test_converted_model_decodes_as_hugging_face_on_the_gpu(name, decoded):
    got = decoded[name]
    assert got["cache"] == got["hf"], "greedy with the KV cache, one left-padded batch"
    assert got["no_cache"] == got["hf"], "greedy recomputing the whole sequence"
    assert got["alone"] == got["hf"], "each prompt alone"


@pytest.fixture(scope="module")
def decoded(tmp_path_factory):
    from tests._dist import spawn

    return spawn(_convert_and_decode, 1, str(tmp_path_factory.mktemp("generate")), timeout=900)[0]


# ------------------------------------------------------------------ memory against the estimate


# The shipped recipe on one GPU: one micro-batch of its size per step, mock data, a byte tokenizer
# (the model keeps the recipe's vocabulary of 50,257), a few steps.
MEMORY_RUN = ["launch.nproc=1", "data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null",
              "train.iters=3", "train.global_batch_size=8", "train.log_interval=1", "train.eval_interval=null",
              "optim.warmup_iters=1", "checkpoint.dir=null"]


@pytest.mark.parametrize("recipe", ["gpt2_124m", "gpt2_350m"])
def test_peak_memory_is_within_15_percent_of_the_dry_run_estimate(recipe, tmp_path, record_property):
    path = _gpu.RECIPES / f"{recipe}.yaml"
    estimate = _gpu.memory_estimate(path, MEMORY_RUN)
    pretrain(tmp_path / "run", MEMORY_RUN, recipe=path)
    measured = _gpu.peak_memory_gib(steps(tmp_path / "run"))
    # In the junit XML (gpu_device_run.sh writes it), so a passing run still reports its numbers.
    record_property("measured_peak_gib", round(measured, 3))
    record_property("estimate_gib", round(estimate.total_gib, 3))
    assert abs(measured - estimate.total_gib) <= 0.15 * estimate.total_gib, (
        f"{recipe}: measured peak {measured:.3f} GiB, estimate {estimate.total_gib:.3f} GiB (weights "
        f"{estimate.weights_gib:.3f}, gradients {estimate.grads_gib:.3f}, optimizer {estimate.optimizer_gib:.3f}, "
        f"activations {estimate.activations_gib:.3f})")
