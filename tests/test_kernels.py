"""Training's kernel options on CPU, each against the default path in fp32 (bf16 for the bf16
gradient reduce): train.compile (torch.compile of the step: one graph for all transformer layers,
one each for the embedding, the final norm and the output layer with the loss; no graph break, no
recompile), train.cuda_graphs (its Megatron-Core settings and its refusals; the graphs themselves
are tests/test_gpu.py's), train.attention_backend (the kernel logged at start, and torch's switches
set to it), train.grad_reduce_in_bf16 (data-parallel, two ranks), and the gradient norm and
scaling on torch's multi-tensor kernels against Megatron-Core's local fallbacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TINY = [
    "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null", "model.num_layers=4", "model.hidden_size=32",
    "model.num_attention_heads=4", "model.ffn_hidden_size=64", "model.seq_length=32", "train.iters=4",
    "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_interval=0", "train.log_interval=1",
    "optim.warmup_iters=0", "optim.lr=1e-2", "train.precision=fp32", "parallel.tensor=1", "parallel.pipeline=1",
    "parallel.sequence_parallel=false", "launch.nproc=1", "checkpoint.dir=null",
    # Megatron's DDP then hooks every module (the parameter all-gather wait), which compile must not trace per layer
    "parallel.distributed_optimizer=true", "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true",
]

# Three one-process runs in one interpreter (the CLI's in-process path), then what torch recorded.
SCRIPT = """
import json, os, sys
import torch
from megacli.cli import _register, app
_register()
os.environ["MEGACLI_IN_PROCESS"] = "1"
for args in json.loads(sys.argv[1]):
    app(args, standalone_mode=False)
    print("SWITCHES", json.dumps([torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()]))
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from megatron.core.transformer.transformer_layer import TransformerLayer
print("DYNAMO", json.dumps({"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
                            "frames": counters["frames"]["total"], "frames_ok": counters["frames"]["ok"],
                            "layer_entries": len(_debug_get_cache_entry_list(TransformerLayer.forward.__code__))}))
"""


def _losses(run_dir: Path) -> list[tuple[float, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in records if "loss" in r]


def _close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * abs(b)


def test_compile_and_attention_backend_equal_the_default_path(tmp_path):
    variants = {"default": [], "compile": ["train.compile=true"], "math": ["train.attention_backend=math"]}
    # padded vocabulary rows (the byte vocabulary padded to 300), masked out of the loss in the compiled head too
    padded = ["model.make_vocab_size_divisible_by=100"]
    runs = [["pretrain", *[x for s in [*TINY, *padded, *extra, f"run.dir={tmp_path / name}"] for x in ("--set", s)]]
            for name, extra in variants.items()]
    res = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(runs)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = res.stdout
    # The start line names the kernel torch picks on CPU for this model (fp32, causal, no dropout),
    # and who chose it; math turns the fused kernels off.
    assert out.count("attention: SDPA flash kernel on CPU (torch's choice)") == 2, out[-3000:]
    assert "attention: SDPA math kernel on CPU (train.attention_backend = math)" in out
    switches = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("SWITCHES")]
    assert switches == [[True, True], [True, True], [False, True]]
    dynamo = json.loads(out.split("DYNAMO ", 1)[1].splitlines()[0])
    # One graph serves all four layers (a recompile per layer would add cache entries, frames and
    # graphs), one each the embedding, the final norm and the output layer with the loss; each is
    # compiled once (four frames converted over four steps: no recompile) and whole, not partly eager.
    assert dynamo == {"graphs": 4, "breaks": 0, "frames": 4, "frames_ok": 4, "layer_entries": 1}, dynamo
    assert "train.compile: the transformer layers, embedding, final norm, output layer and" in out
    default = _losses(tmp_path / "default")
    assert len(default) == 4
    # fp32: compiled (fused, reordered) elementwise ops and reductions, and the math kernel's
    # unfused softmax, differ from the default path by float rounding only (~1e-7 relative per
    # op, measured 1e-7 on the loss after 4 steps); 1e-5 is far below any real change of the
    # arithmetic (a dropped bias or scale moves the loss by >1e-3).
    for name in ("compile", "math"):
        got = _losses(tmp_path / name)
        assert len(got) == 4
        for (loss, norm), (want_loss, want_norm) in zip(got, default):
            assert _close(loss, want_loss, 1e-5) and _close(norm, want_norm, 1e-5), (name, got, default)


def _two_runs(rank, world, root: str):
    """Default bf16 and train.grad_reduce_in_bf16, one after the other in the same two ranks."""
    from megacli.engine.loop import train
    from megacli.recipe.jobs import load_job_recipe
    from tests._dist import use_next_store

    for i, extra in enumerate([[], ["train.grad_reduce_in_bf16=true"]]):
        if i:
            use_next_store()
        sets = [*TINY, "train.precision=bf16", "train.global_batch_size=8", "launch.nproc=2", *extra,
                f"run.dir={root}/run{i}"]
        train(load_job_recipe("pretrain", None, sets))


@pytest.mark.slow
def test_bf16_gradient_reduce_is_close_to_fp32_reduce(tmp_path):
    from megacli import plan
    from megacli.recipe.jobs import load_job_recipe
    from tests._dist import spawn

    spawn(_two_runs, 2, str(tmp_path), timeout=600)
    fp32_reduce, bf16_reduce = _losses(tmp_path / "run0"), _losses(tmp_path / "run1")
    assert len(fp32_reduce) == len(bf16_reduce) == 4
    # Step 1's forward is the same: its loss is bitwise equal. Its gradients are rounded to bf16
    # (8 significant bits, 2^-9 = 0.2% relative) as each rank sums its two micro-batches and as
    # the two ranks' sums are added: a few roundings, so the norm is within 1% and not equal (the
    # option took effect). Later losses move by the Adam steps' response to those 0.2%: 1e-3.
    assert bf16_reduce[0][0] == fp32_reduce[0][0]
    assert bf16_reduce[0][1] != fp32_reduce[0][1]
    for (loss, norm), (want_loss, want_norm) in zip(bf16_reduce, fp32_reduce):
        assert _close(norm, want_norm, 1e-2) and _close(loss, want_loss, 1e-3), (bf16_reduce, fp32_reduce)
    # The memory plan counts 2-byte gradients.
    base = [*TINY, "train.precision=bf16", "model.vocab_size=256"]
    grads = [plan.estimate(load_job_recipe("pretrain", None, [*base, *extra]), 256)[1].grads_gib
             for extra in ([], ["train.grad_reduce_in_bf16=true"])]
    assert grads[1] == pytest.approx(grads[0] / 2)


def test_kernel_option_refusals():
    from megacli.recipe.jobs import load_job_recipe

    for extra, message in [(["train.grad_reduce_in_bf16=true"], "train.grad_reduce_in_bf16"),
                           (["train.precision=fp16", "train.grad_reduce_in_bf16=true"], "is for bf16 training, not fp16"),
                           (["train.deterministic=true", "train.attention_backend=flash"], "train.attention_backend"),
                           (["train.attention_backend=fast"], "attention_backend")]:
        with pytest.raises(Exception, match=message):
            load_job_recipe("pretrain", None, [*TINY, *extra])
    import torch

    from megacli.engine.kernels import choose_attention
    from megacli.errors import UserError

    with pytest.raises(UserError, match="cudnn' is a CUDA kernel; this run is on cpu"):
        choose_attention("cudnn", torch.device("cpu"))


def _mlp_outputs_and_grads(rank, world):
    """For gelu_tanh and geglu, a GPT MLP with biases as megacli configures it on CUDA (fused) and
    on CPU (plain), on the same weights and input: its output and gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from megacli.backend import cpu
    from megacli.engine.models.config import transformer_config
    from megacli.recipe.model import ModelSection
    from megacli.recipe.sections import ParallelSection

    cpu.enable()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    results = {}
    for activation in ("gelu_tanh", "geglu"):
        model = ModelSection(activation=activation, add_bias_linear=True, hidden_size=32, num_attention_heads=4,
                             ffn_hidden_size=64)
        for fused in (True, False):
            config = transformer_config(model=model, parallel=ParallelSection(), precision="fp32", on_cuda=fused)
            assert config.bias_activation_fusion is fused
            mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in mlp.parameters():
                    p.copy_(torch.randn(p.shape, generator=g))
            x = torch.randn(8, 2, 32, generator=g, requires_grad=True)
            out, bias = mlp(x)
            (out + bias).square().sum().backward()
            results[activation, fused] = {"out": out + bias, "x": x.grad, **{n: p.grad for n, p in mlp.named_parameters()}}
    # The loss as GPTModel computes it under each config: fused (CUDA) or plain vocab-parallel
    # cross-entropy, on logits whose padded vocabulary rows are masked as models.common does.
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 2, 64, generator=g).bfloat16()
    logits[..., 60:] = torch.finfo(logits.dtype).min
    labels = torch.randint(0, 60, (2, 16), generator=g)
    # its backward rounds the gradient to bf16 whatever the logits' dtype: CUDA fuses bf16 runs only
    assert not transformer_config(model=model, parallel=ParallelSection(), precision="fp32", on_cuda=True).cross_entropy_loss_fusion
    for fused in (True, False):
        config = transformer_config(model=model, parallel=ParallelSection(), precision="bf16", on_cuda=fused)
        assert config.cross_entropy_loss_fusion is fused and config.cross_entropy_fusion_impl == "native"
        x = logits.clone().requires_grad_()
        ce = (fused_vocab_parallel_cross_entropy(x, labels.t().contiguous(), parallel_state.get_tensor_model_parallel_group())
              if fused else tensor_parallel.vocab_parallel_cross_entropy(x, labels.t().contiguous()))
        ce.sum().backward()
        results["cross_entropy", fused] = {"loss": ce, "logits": x.grad.float()}
    return results


def test_cuda_fusions_compute_the_unfused_functions():
    """CUDA's config routes gelu_tanh/geglu through Megatron-Core's fused bias-GeLU/GeGLU and the
    loss through its native fused cross-entropy: the same functions and gradients as the unfused
    paths (the GeLU kernels' constants are rounded to 8 digits: fp32 rounding)."""
    from tests._dist import spawn

    (results,) = spawn(_mlp_outputs_and_grads, 1)
    for activation in ("gelu_tanh", "geglu", "cross_entropy"):
        fused, plain = results[activation, True], results[activation, False]
        assert fused.keys() == plain.keys()
        for name in plain:
            # fp32 rounding, relative to each tensor's scale (measured ~8e-8); a different function
            # (exact GeLU, a dropped bias) differs by >1e-3 of it
            error = (fused[name] - plain[name]).abs().max() / plain[name].abs().max()
            assert error < 1e-6, (activation, name, error.item())


def test_cuda_graphs_map_to_megatron_and_refuse_what_cannot_be_captured(tmp_path, monkeypatch):
    """train.cuda_graphs: layers and full are Megatron-Core's local implementation, per layer or the
    whole forward-backward; layouts whose shapes or launches vary per step are refused naming the
    field, and so is a run off CUDA (exit 2, before anything is built)."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.transformer.enums import CudaGraphScope

    from megacli.engine import cuda_graphs
    from megacli.engine.models.config import transformer_config
    from megacli.errors import UserError
    from megacli.recipe.jobs import load_job_recipe
    from tests.conftest import pretrain_losses

    recipe = load_job_recipe("pretrain", None, [*TINY, "train.cuda_graphs=layers"])
    assert recipe.train.cuda_graphs == "layers"
    scopes = {"none": ("none", []), "layers": ("local", []), "full": ("local", [CudaGraphScope.full_iteration])}
    for choice, (impl, scope) in scopes.items():
        config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="bf16", on_cuda=True,
                                    **cuda_graphs.config_kwargs(choice))
        assert (config.cuda_graph_impl, config.cuda_graph_scope) == (impl, scope), choice
        assert config.cuda_graph_warmup_steps == (cuda_graphs.WARMUP_STEPS if choice != "none" else 3)

    def step(**_):
        return []

    assert cuda_graphs.schedule("none", step) is step and cuda_graphs.schedule("layers", step) is step
    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)  # the wrapper's copy stream (no CUDA here)
    wrapped = cuda_graphs.schedule("full", step)
    assert isinstance(wrapped, FullCudaGraphWrapper) and wrapped.forward_backward_func is step
    assert cuda_graphs.schedule("full", step) is wrapped  # one wrapper for the run: its graph persists

    for extra, message in [
        (["model.moe.num_experts=4", "train.cuda_graphs=layers"], "mixture-of-experts routing"),
        (["parallel.recompute=full", "train.cuda_graphs=layers"], "full recomputation"),
        (["train.eval_interval=2", "model.dropout=0.1", "train.cuda_graphs=layers"], "captured in training mode"),
        (["parallel.overlap_param_gather=false", "parallel.pipeline=2", "launch.nproc=2", "train.cuda_graphs=full"],
         "one pipeline stage"),
        (["train.cuda_graphs=full"], "set parallel.overlap_param_gather: false"),
        (["train.compile=true", "train.cuda_graphs=layers"], "set parallel.overlap_param_gather: false"),
        (["train.cuda_graphs=all"], "train.cuda_graphs"),
    ]:
        with pytest.raises(Exception, match=message) as info:
            load_job_recipe("pretrain", None, [*TINY, *extra])
        assert "train.cuda_graphs" in str(info.value), (extra, str(info.value))
    # evaluation is allowed where it replays nothing captured in training mode
    load_job_recipe("pretrain", None, [*TINY, "train.eval_interval=2", "model.dropout=0.1", "train.cuda_graphs=full",
                                       "parallel.overlap_param_gather=false"])
    load_job_recipe("pretrain", None, [*TINY, "train.compile=true", "train.cuda_graphs=layers",
                                       "parallel.overlap_param_gather=false"])

    with pytest.raises(UserError, match="train.cuda_graphs = 'full' captures CUDA graphs; this run is on cpu"):
        cuda_graphs.prepare("full", device=torch.device("cpu"), seed=1)
    out, losses = pretrain_losses([*[x for s in [*TINY, "train.cuda_graphs=layers"] for x in ("--set", s)]],
                                  tmp_path / "run", in_process=True)
    assert out.returncode == 2 and not losses, out.stdout[-2000:] + out.stderr[-2000:]
    assert "train.cuda_graphs = 'layers' captures CUDA graphs; this run is on cpu" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr


def _grad_kernels_against_megatrons(rank, world):
    """Megatron-Core's local fallbacks and megacli's multi-tensor ones on the same tensors: the
    norms (mixed dtypes, per tensor, none), the scaled copies, and which implementations
    use_foreach_grad_kernels installs."""
    import torch.distributed as dist
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    from megacli.backend import cpu
    from megacli.engine import kernels

    cpu.enable()
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32,), (7, 3, 5), (1,), (128,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float16]
    tensors = [torch.randn(shape, generator=g).to(dtype) * 10 ** i for i, (shape, dtype) in enumerate(zip(shapes, dtypes))]
    flag = torch.zeros(1, dtype=torch.int, device="cuda")
    out = {"local": utils.local_multi_tensor_applier(utils.local_multi_tensor_l2_norm, flag, [tensors], False)[0],
           "foreach": utils.local_multi_tensor_applier(kernels.foreach_l2_norm, flag, [tensors], False)[0],
           "per_tensor": kernels.foreach_l2_norm(0, flag, [tensors], True)[1],
           "torch_norms": torch.stack([torch.norm(t).float() for t in tensors]),
           "empty": (kernels.foreach_l2_norm(0, flag, [[]], True), utils.local_multi_tensor_l2_norm(0, flag, [[]], False)[0])}
    for scale in (0.37, 1.0):
        fp32 = [torch.randn(shape, generator=g) for shape in shapes]
        local_in_place, foreach_in_place = [t.clone() for t in tensors], [t.clone() for t in tensors]
        utils.local_multi_tensor_scale(0, flag, [local_in_place, local_in_place], scale)
        kernels.foreach_scale(0, flag, [foreach_in_place, foreach_in_place], scale)
        local_copy, foreach_copy = [torch.zeros_like(t) for t in tensors], [torch.zeros_like(t) for t in tensors]
        utils.local_multi_tensor_scale(0, flag, [fp32, local_copy], scale)
        kernels.foreach_scale(0, flag, [fp32, foreach_copy], scale)
        out[scale] = (local_in_place, foreach_in_place, local_copy, foreach_copy)
    kernels.foreach_scale(0, flag, [[], []], 0.5)
    grads = [torch.randn(shape, generator=g) for shape in shapes]
    out["grad_norm_local"] = clip_grads.get_grad_norm_fp32(grads)
    kernels.use_foreach_grad_kernels()
    kernels.use_foreach_grad_kernels()
    out["grad_norm_foreach"] = clip_grads.get_grad_norm_fp32(grads)
    out["installed"] = [f.__name__ for f in (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl,
                                             optimizer.multi_tensor_scale_impl)]
    apex_like = lambda *args: None  # noqa: E731
    clip_grads.l2_norm_impl = clip_grads.multi_tensor_scale_impl = optimizer.multi_tensor_scale_impl = apex_like
    kernels.use_foreach_grad_kernels()
    out["kept"] = [f is apex_like for f in (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl,
                                            optimizer.multi_tensor_scale_impl)]
    return out


def test_foreach_grad_kernels_compute_megatrons_local_fallbacks():
    """The gradient norm on torch._foreach_norm equals Megatron-Core's local multi_tensor_l2norm
    (bf16/fp16 tensors' norms taken in their dtype, as it does) as one float32 element, and the
    scaling on torch._foreach_mul equals its local multi_tensor_scale, in place and as a
    dtype-converting copy; they replace only Megatron's local fallbacks."""
    from tests._dist import spawn

    (out,) = spawn(_grad_kernels_against_megatrons, 1)
    assert out["foreach"].shape == (1,) and out["foreach"].dtype == torch.float32
    torch.testing.assert_close(out["foreach"], out["local"], rtol=1e-6, atol=0)
    torch.testing.assert_close(out["per_tensor"], out["torch_norms"], rtol=0, atol=0)
    (empty_norm, empty_per_tensor), empty_local = out["empty"]
    assert empty_norm.tolist() == empty_local.tolist() == [0.0] and empty_per_tensor.numel() == 0
    for scale in (0.37, 1.0):
        local_in_place, foreach_in_place, local_copy, foreach_copy = out[scale]
        for want, got in [*zip(local_in_place, foreach_in_place), *zip(local_copy, foreach_copy)]:
            assert got.dtype == want.dtype and torch.equal(got, want), scale
    assert out["grad_norm_foreach"] == pytest.approx(out["grad_norm_local"], rel=1e-6)
    assert out["installed"] == ["foreach_l2_norm", "foreach_scale", "foreach_scale"]
    assert out["kept"] == [True, True, True]


def _local_and_foreach_runs(rank, world, root: str):
    """The same clipped fp32 pretraining with Megatron-Core's local fallbacks, then with megacli's
    multi-tensor kernels, in one process; the norm implementation each run used."""
    from megatron.core.optimizer import clip_grads

    from megacli.engine import kernels
    from megacli.engine.loop import train
    from megacli.recipe.jobs import load_job_recipe
    from tests._dist import use_next_store
    from tests.conftest import MOCK_GPT, layout

    install, used = kernels.use_foreach_grad_kernels, []
    for name in ("local", "foreach"):
        kernels.use_foreach_grad_kernels = install if name == "foreach" else (lambda: None)
        if name == "foreach":
            use_next_store()
        train(load_job_recipe("pretrain", None, [*MOCK_GPT, *layout(), "train.iters=4", "optim.clip_grad=0.05",
                                                 f"run.dir={root}/{name}"]))
        used.append(clip_grads.l2_norm_impl.__name__)
    kernels.use_foreach_grad_kernels = install
    return used


@pytest.mark.slow
def test_foreach_grad_kernels_give_the_local_fallbacks_losses(tmp_path):
    from tests._dist import spawn
    from tests.conftest import assert_close, steps

    (used,) = spawn(_local_and_foreach_runs, 1, str(tmp_path), timeout=600)
    assert used == ["local_multi_tensor_l2_norm", "foreach_l2_norm"]
    local, foreach = steps(tmp_path / "local"), steps(tmp_path / "foreach")
    assert sorted(foreach) == sorted(local) == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0.05 for r in local.values())  # every step clipped
    assert_close(foreach, local, range(1, 5), rel=1e-6)
    assert_close(foreach, local, range(1, 5), rel=1e-6, key="grad_norm")
