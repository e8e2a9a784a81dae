"""GPT-2 training speed on one GPU, three ways, side by side:

* megacli: `megacli pretrain recipes/gpt2_<size>.yaml` at TP1 on one process, step times read from
  its metrics.jsonl (mock data, a byte tokenizer: the model keeps the recipe's 50,257-token vocabulary);
* raw Megatron-Core: the same TransformerConfig and layer spec megacli trains with (its
  `transformer_config` and `gpt_block_spec`), built into GPTModel + DDP + Megatron's optimizer and
  stepped through `forward_backward_func` on random tokens already on the GPU, with nothing of
  megacli's loop, data pipeline, metrics or scheduler around it (the difference is megacli's overhead);
* PyTorch: a plain nn.Module GPT-2 of the same shape (parameter counts checked equal), SDPA causal
  attention, fp32 weights under bf16 autocast, fused AdamW, gradient clipping, torch.compile.

    python benchmarks/gpu_bench.py [--sizes 124m,350m,1.3b,2.7b] [--steps 10] [--warmup 3] [--json out.json]
    python benchmarks/gpu_bench.py --tiny --device cpu --steps 2 --warmup 1      # a smoke test on CPU
    python benchmarks/gpu_bench.py --megacli-set train.compile=true              # megacli with an option
    python benchmarks/gpu_bench.py --variants default,compile,graphs,best,fp8,best_fp8  # every option in one call

Every size at sequence length 2048, bf16 (fp32 with --tiny). Each side runs in a process of its
own; each number is the median over --steps timed optimizer steps after --warmup untimed ones (the
compilation happens there), with --accum micro-batches per step. Reported per side: tokens/s,
TFLOP/s, MFU, peak memory (torch.cuda.max_memory_allocated; on CPU the process's resident memory),
and the ratios megacli / raw Megatron-Core and megacli / PyTorch; an FP8 variant (train.fp8) also over its
bf16 counterpart (fp8 / default, best_fp8 / best), with both losses after the same steps and their
gap against megacli.engine.fp8.LOSS_TOLERANCE. A side that fails (a megacli
variant the layout refuses, say) is recorded with its error and the call goes on; the exit status
is then 1.

FLOPs are megacli's own formula (megacli.plan.flops_per_token): per token 6·N + 12·L·h·s, N the
model's parameters (tied embedding counted once), L layers, h hidden size, s sequence length (the
attention scores and their use, not halved for causality); MFU = TFLOP/s / --peak-tflops (989.4:
the H100/H200 dense bf16 peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# size -> micro-batch size at sequence 2048; 2.7b: the largest that fits one 80 GB GPU without the distributed
# optimizer is 4 (`megacli plan recipes/gpt2_2.7b.yaml -g 1` at sequence 2048: 70.6 GiB), 2 leaves room for FP8
SIZES = {"124m": 8, "350m": 8, "1.3b": 4, "2.7b": 2}
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=512",
        "model.seq_length=64", "model.max_position_embeddings=64", "train.precision=fp32"]
SIDES = ("megacli", "megatron", "pytorch")
# megacli's speed options, each a megacli run of its own in the same call: the default CUDA configuration
# (fused AdamW, fused bias-GeLU, fused cross-entropy in bf16) and what each option adds or takes away.
# best: every option that keeps the maths and measured the fastest, together (the whole step compiled,
# each layer replayed as a CUDA graph; one data-parallel rank gathers no parameters).
VARIANTS = {
    "default": [],
    "unfused": ["optim.fused=false"],
    "compile": ["train.compile=true"],
    "graphs": ["train.cuda_graphs=layers"],
    "graphs_full": ["train.cuda_graphs=full", "parallel.overlap_param_gather=false"],
    "best": ["train.compile=true", "train.cuda_graphs=layers", "parallel.overlap_param_gather=false"],
    "fp8": ["train.fp8=tensorwise"],
    "best_fp8": ["train.compile=true", "train.cuda_graphs=layers", "parallel.overlap_param_gather=false",
                 "train.fp8=tensorwise"],
}
FP8_BASES = {"fp8": "default", "best_fp8": "best"}  # each FP8 variant -> the bf16 variant it is measured against


def recipe_overrides(args, size: str) -> list[str]:
    """The shipped recipe on one device: TP1, one process, mock data, the benchmark's batch and steps."""
    micro = args.micro_batch or (2 if args.tiny else SIZES[size])
    sets = ["parallel.tensor=1", "parallel.pipeline=1", "parallel.sequence_parallel=false", "launch.nproc=1",
            f"launch.device={args.device}", "data.path=null", "data.mock=true", "tokenizer.type=byte", "tokenizer.path=null",
            "model.seq_length=2048", "model.max_position_embeddings=2048",
            f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * args.accum}",
            f"train.iters={args.warmup + args.steps}", "train.log_interval=1", "train.eval_interval=null",
            "optim.warmup_iters=1", "checkpoint.dir=null"]
    return sets + (TINY if args.tiny else [])


def load_recipe(args, size: str):
    from megacli.recipe.jobs import load_job_recipe

    return load_job_recipe("pretrain", ROOT / "recipes" / f"gpt2_{size}.yaml", recipe_overrides(args, size))


def flops_per_step(recipe) -> tuple[float, int]:
    """megacli's training FLOPs per step and the model's parameter count."""
    from megacli.plan import count_params, flops_per_token

    n = count_params(recipe, recipe.model.vocab_size).total
    return flops_per_token(recipe, n) * recipe.tokens_per_step, n


def summary(step_times: list[float], peak_bytes: float, recipe, peak_tflops: float, **extra) -> dict:
    step = statistics.median(step_times)
    flops, params = flops_per_step(recipe)
    tflops = flops / step / 1e12
    return {"step_time_s": step, "tokens_per_s": recipe.tokens_per_step / step, "tflops": tflops,
            "mfu": tflops / peak_tflops, "peak_memory_gib": peak_bytes / 1024**3, "params": params,
            "steps_timed": len(step_times), **extra}


# ---------------------------------------------------------------- megacli


def megacli_side(args, size: str, workdir: Path, variant: str = "default") -> dict:
    run_dir = workdir / f"megacli_{size}_{variant}"
    sets = [*recipe_overrides(args, size), *VARIANTS[variant], *args.megacli_set, f"run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "megacli", "pretrain", str(ROOT / "recipes" / f"gpt2_{size}.yaml"),
           *[x for s in sets for x in ("--set", s)]]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"megacli pretrain failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r["step_time_s"] for r in records if "step_time_s" in r and r["iteration"] > args.warmup]
    peak = max(r["memory_gib"] for r in records if "memory_gib" in r) * 1024**3
    return summary(timed, peak, load_recipe(args, size), args.peak_tflops, final_loss=records[-1]["loss"],
                   megacli_sets=[*VARIANTS[variant], *args.megacli_set])


# ---------------------------------------------------------------- raw Megatron-Core


def megatron_side(args, size: str) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from megacli.engine.models.config import transformer_config  # what megacli trains: config and layers
    from megacli.engine.models.gpt import gpt_block_spec
    from megacli.launch import free_port
    from megacli.recipe.model import padded_vocab_size

    recipe = load_recipe(args, size)
    m, p, t, o = recipe.model, recipe.parallel, recipe.train, recipe.optim
    cuda = args.device == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if cuda:
        torch.cuda.set_device(0)
    else:  # only so the --tiny smoke test runs without a GPU: Megatron-Core needs the CPU bridges there
        from megacli.backend import cpu

        cpu.enable()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")

    config = transformer_config(model=m, parallel=p, precision=t.precision, on_cuda=cuda)
    model = GPTModel(config=config, transformer_layer_spec=gpt_block_spec(model=m, config=config, vp_stage=None),
                     vocab_size=padded_vocab_size(m.vocab_size, divisible_by=m.make_vocab_size_divisible_by, tensor_parallel=1),
                     max_sequence_length=m.max_positions, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=not m.untie_embeddings, position_embedding_type="learned_absolute")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, m.init_method_std) if param.dim() > 1 else (param.zero_() if name.endswith("bias") else param.fill_(1.0))
    model = model.to(device)
    if t.precision != "fp32":
        model = Float16Module(config, model)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=t.precision != "fp32", overlap_grad_reduce=p.overlap_grad_reduce,
                                        overlap_param_gather=p.overlap_param_gather,
                                        use_distributed_optimizer=p.distributed_optimizer, average_in_collective=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=t.precision == "bf16",
        fp16=t.precision == "fp16", params_dtype=config.params_dtype, use_distributed_optimizer=p.distributed_optimizer), [model])
    if o.fused_on(cuda):  # the optimizer kernel megacli's default configuration uses
        from megacli.engine.optim import torch_optimizers, use_fused_kernels

        for inner in torch_optimizers(optimizer):
            use_fused_kernels(inner)
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if p.overlap_grad_reduce:
        config.no_sync_func = model.no_sync
    if p.overlap_param_gather:
        config.param_sync_func = model.start_param_sync

    b, s = t.micro_batch_size, m.seq_length
    gen = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, m.vocab_size, (b, s + 1), device=device, generator=gen) for _ in range(4)]
    positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)

    def loss_func(output):
        loss = output.float().sum()
        tokens = torch.tensor(b * s, device=device, dtype=torch.int)
        return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        return chunk(batch[:, :-1], positions, None, labels=batch[:, 1:]), loss_func

    def cycle():
        while True:
            yield from batches

    data = cycle()
    forward_backward = get_forward_backward_func()

    def one_step(_step: int) -> None:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=data, model=model, num_microbatches=args.accum,
                         seq_length=s, micro_batch_size=b, forward_only=False)
        optimizer.step()

    times = timed_steps(one_step, args, cuda)
    result = summary(times, peak_memory(cuda), recipe, args.peak_tflops, **profiled(one_step, args, cuda))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return result


# ---------------------------------------------------------------- plain PyTorch


def pytorch_side(args, size: str) -> dict:
    import torch

    from benchmarks.gpt2_torch import GPT2
    from megacli.recipe.model import padded_vocab_size

    recipe = load_recipe(args, size)
    m, t, o = recipe.model, recipe.train, recipe.optim
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.manual_seed(t.seed)
    model = GPT2(vocab=padded_vocab_size(m.vocab_size, divisible_by=m.make_vocab_size_divisible_by, tensor_parallel=1),
                 positions=m.max_positions, layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
                 ffn=m.ffn_size, eps=m.norm_epsilon, std=m.init_method_std).to(device)
    params = sum(x.numel() for x in model.parameters())
    expected = flops_per_step(recipe)[1]
    if params != expected:
        raise RuntimeError(f"the PyTorch GPT-2 has {params:,} parameters, megacli's {expected:,}: not the same model")
    if args.compile == "model":
        step_model = torch.compile(model)
    else:
        step_model = model
        if args.compile == "blocks":
            for block in model.blocks:
                block.compile()
    decay = [x for x in model.parameters() if x.dim() > 1]
    no_decay = [x for x in model.parameters() if x.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, fused=True)
    b, s = t.micro_batch_size, m.seq_length
    gen = torch.Generator(device=device).manual_seed(0)
    batches = [torch.randint(0, m.vocab_size, (b, s + 1), device=device, generator=gen) for _ in range(4)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16")

    def one_step(step: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        for micro in range(args.accum):
            batch = batches[(step * args.accum + micro) % len(batches)]
            with autocast:
                loss = step_model(batch[:, :-1], batch[:, 1:])
            (loss / args.accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad, foreach=True)
        optimizer.step()

    times = timed_steps(one_step, args, cuda)
    return summary(times, peak_memory(cuda), recipe, args.peak_tflops, compile=args.compile, **profiled(one_step, args, cuda))


# ---------------------------------------------------------------- helpers and the driver


def timed_steps(one_step, args, cuda: bool) -> list[float]:
    """Seconds of each step after the warm-up ones."""
    times = []
    for step in range(args.warmup + args.steps):
        start = sync_time(cuda)
        one_step(step)
        if step >= args.warmup:
            times.append(sync_time(cuda) - start)
    return times


def profiled(one_step, args, cuda: bool) -> dict:
    """With --profile: one more step under torch.profiler, its top kernels by own device time."""
    if not args.profile:
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        one_step(args.warmup + args.steps)
        sync_time(cuda)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return {"profile": prof.key_averages().table(sort_by=key, row_limit=25)}


def sync_time(cuda: bool) -> float:
    if cuda:
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def peak_memory(cuda: bool) -> float:
    if cuda:
        import torch

        return float(torch.cuda.max_memory_allocated())
    import psutil

    return float(psutil.Process().memory_info().rss)


def run_side(args, side: str, size: str, workdir: Path) -> dict:
    """One side in a process of its own (a megacli side, "megacli" or "megacli:VARIANT", is the CLI's)."""
    if side.startswith("megacli"):
        return megacli_side(args, size, workdir, side.partition(":")[2] or "default")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--size", size, *passthrough(args)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    if out.returncode != 0:
        raise RuntimeError(f"{side} side failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def passthrough(args) -> list[str]:
    flags = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device, "--accum", str(args.accum),
             "--peak-tflops", str(args.peak_tflops), "--compile", args.compile] + (["--profile"] if args.profile else [])
    if args.micro_batch:
        flags += ["--micro-batch", str(args.micro_batch)]
    return flags + (["--tiny"] if args.tiny else [])


def side_names(args) -> list[str]:
    """The sides of one size in run order: a megacli side per variant (plain "megacli" when only the
    default runs), then raw Megatron-Core and PyTorch."""
    wanted = args.sides.split(",")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    megacli = (["megacli"] if variants == ["default"] else [f"megacli:{v}" for v in variants]) if "megacli" in wanted else []
    return megacli + [x for x in SIDES[1:] if x in wanted]


def main(argv=None) -> int:
    from benchmarks.gpu_bench_report import table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="124m,350m,1.3b", help="comma-separated GPT-2 sizes (124m, 350m, 1.3b, 2.7b)")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per side")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator warm-up)")
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=None, help="micro-batch size (default per size: 8, 8, 4)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model in fp32 (seconds on CPU)")
    ap.add_argument("--compile", default="model", choices=["model", "blocks", "none"],
                    help="PyTorch side: torch.compile the whole model, each block, or nothing")
    ap.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 peak for MFU (H100/H200: 989.4)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--profile", action="store_true",
                    help="raw Megatron-Core and PyTorch sides: one more step under torch.profiler; top kernels in the JSON")
    ap.add_argument("--megacli-set", action="append", default=[], metavar="KEY=VALUE",
                    help="megacli side: one more recipe override (repeatable), e.g. train.compile=true, "
                         "train.attention_backend=cudnn, train.grad_reduce_in_bf16=true")
    ap.add_argument("--sides", default=",".join(SIDES), help="comma-separated sides to run (megacli, megatron, pytorch)")
    ap.add_argument("--variants", default="default",
                    help=f"comma-separated megacli variants, each a megacli side in this call ({', '.join(VARIANTS)})")
    ap.add_argument("--side", choices=SIDES[1:], help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1")
    if args.side:  # a child process: one side, its result as the last line of stdout
        result = (megatron_side if args.side == "megatron" else pytorch_side)(args, args.size)
        print(json.dumps(result), flush=True)
        return 0
    sizes = [x.strip() for x in args.sizes.split(",") if x.strip()]
    unknown = [x for x in sizes if x not in SIZES]
    if unknown:
        ap.error(f"unknown size {unknown[0]!r}: choose from {', '.join(SIZES)}")
    unknown = [v for v in args.variants.split(",") if v.strip() and v.strip() not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant {unknown[0]!r}: choose from {', '.join(VARIANTS)}")
    run_sides = side_names(args)
    if not run_sides:
        ap.error(f"--sides: choose from {', '.join(SIDES)}")
    report = {"device": None, "sequence_length": 64 if args.tiny else 2048, "tiny": args.tiny,
              "steps": args.steps, "warmup": args.warmup, "accum": args.accum, "peak_tflops": args.peak_tflops,
              "megacli_sets": args.megacli_set, "variants": {v: VARIANTS[v] for v in args.variants.split(",") if v},
              "flops_formula": "6*N + 12*L*h*s per token (megacli.plan.flops_per_token)", "results": {}}
    results = measure(args, sizes, run_sides, report)
    print(table(results))
    return 1 if any("error" in r for sides in results.values() for r in sides.values()) else 0


def measure(args, sizes: list[str], run_sides: list[str], report: dict) -> dict:
    """Every side of every size, one after the other; the report (``--json``) is rewritten after
    each side, so a call cut short keeps what it measured."""
    from benchmarks.gpu_bench_report import device_name, fp8_losses, ratios
    from megacli.engine.fp8 import LOSS_TOLERANCE

    report["device"] = device_name(args.device)
    results = report["results"]
    with tempfile.TemporaryDirectory(prefix="gpu_bench_") as tmp:
        for size in sizes:
            sides = {}
            for side in run_sides:
                began = time.perf_counter()
                try:
                    sides[side] = run_side(args, side, size, Path(tmp))
                    print(f"{size} {side}: {sides[side]['tokens_per_s']:,.0f} tokens/s, MFU {sides[side]['mfu'] * 100:.1f}% "
                          f"({time.perf_counter() - began:.0f} s)", flush=True)
                except RuntimeError as exc:  # the other sides still run: one device call measures them all
                    sides[side] = {"error": str(exc)[-4000:]}
                    print(f"{size} {side}: failed ({time.perf_counter() - began:.0f} s)\n{exc}", flush=True)
                results[size] = {**sides, "ratios": ratios(sides, SIDES[1:], FP8_BASES),
                                 "fp8_loss": fp8_losses(sides, FP8_BASES, LOSS_TOLERANCE)}
                if args.json:
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps(report, indent=1))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
