"""By hand, beside the project: Megatron-LM's own loader reads a checkpoint megacli wrote.

    python benchmarks/megatron_lm_load_check.py MEGATRON_LM_CHECKOUT CKPT HF_DIR [--no-load-rng] [--no-load-optim]

CKPT is a Megatron-LM torch_dist checkpoint written by `megacli convert SRC CKPT --to megatron
--spec local` (or `reshard --format megatron`; a legacy one from `reshard --format legacy` is read
with --ckpt-format torch), HF_DIR the same weights as a Hugging Face model
(`megacli convert SRC HF_DIR --to hf`). In one process on CPU (gloo, megacli's CPU backend),
the script parses Megatron-LM's arguments from the checkpoint (``--use-checkpoint-args``), builds
the model, DDP, optimizer and scheduler as Megatron-LM's training does
(``setup_model_and_optimizer`` with pretrain_gpt.py's ``model_provider`` + ``gpt_builder``, which
calls ``load_checkpoint``), runs a forward and prints the largest difference to the HF model's
logits. Transformer Engine is not available on CPU, so the model is the local spec (and a MoE
model's experts run as SequentialMLP, whatever --moe-grouped-gemm the checkpoint records). The run is
one process (TP = PP = 1) whatever layout the checkpoint was written for: torch_dist loads under
any layout (Megatron-LM then skips the RNG state, which is per rank).
"""

from __future__ import annotations

import os
import sys
import types


def main() -> None:
    checkout, ckpt, hf_dir = sys.argv[1:4]
    extra = sys.argv[4:]
    sys.path.insert(0, checkout)
    # Megatron-LM's initialize module imports triton kernels (batch-invariant mode) that a CPU-only
    # torch cannot import; they are never used here.
    stub = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    stub.enable_batch_invariant_mode = lambda *a, **k: None
    sys.modules[stub.__name__] = stub
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")

    import torch

    from megacli.backend import cpu

    cpu.enable()
    # A checkpoint trained on the CPU backend saves no CUDA generator state (None); on CPU the one
    # generator is restored from torch_rng_state, so there is nothing more to set. (On CUDA,
    # Megatron-LM loads such a checkpoint with --no-load-rng.)
    set_device_rng = torch.cuda.set_rng_state
    torch.cuda.set_rng_state = lambda state, *a, **k: None if state is None else set_device_rng(state, *a, **k)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    it_dir = os.path.join(ckpt, _iter_dir(ckpt))
    legacy = not os.path.exists(os.path.join(it_dir, "common.pt"))  # --ckpt-format torch: mp_rank_* files
    common = torch.load(os.path.join(it_dir, "mp_rank_00", "model_optim_rng.pt") if legacy
                        else os.path.join(it_dir, "common.pt"), weights_only=False)
    saved = common["args"]
    sys.argv = ["pretrain_gpt.py", "--load", ckpt, "--ckpt-format", "torch" if legacy else "torch_dist",
                "--use-checkpoint-args",
                "--transformer-impl", "local", "--distributed-backend", "gloo",
                "--micro-batch-size", str(saved.micro_batch_size), "--global-batch-size", str(saved.global_batch_size),
                "--tokenizer-type", "NullTokenizer",
                "--vocab-size", str(saved.vocab_size), "--mock-data", "--no-gradient-accumulation-fusion",
                "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
                "--no-rope-fusion", "--no-persist-layer-norm", "--use-cpu-initialization",
                # the run's training schedule, as the checkpoint's args record it (Megatron-LM checks it on load)
                *[x for name in _SCHEDULE if getattr(saved, name) is not None
                  for x in ("--" + name.replace("_", "-"), str(getattr(saved, name)))], *extra]
    from megatron.core.enums import ModelType
    from megatron.training import get_args
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_args_from_checkpoint
    from megatron.training.global_vars import set_global_variables
    from megatron.core import parallel_state as mpu, tensor_parallel

    args = parse_args()
    load_args_from_checkpoint(args)
    if getattr(args, "num_experts", None):
        # MoE arguments --use-checkpoint-args does not carry (a run passes them on its command line)
        for name in _MOE_NOT_CARRIED:
            setattr(args, name, getattr(saved, name))
        # On CPU the experts run as SequentialMLP: --moe-grouped-gemm (TEGroupedMLP / GroupedMLP) needs
        # CUDA; all three store the same sharded keys. The router's optional TE GEMM is left undefined
        # by Megatron-Core without Transformer Engine (megacli.engine.models.moe).
        args.moe_grouped_gemm = False
        from megacli.engine.models.moe import _define_absent_te_gemm

        _define_absent_te_gemm()
    validate_args(args, {})
    set_global_variables(args, build_tokenizer=False)
    args = get_args()
    args.padded_vocab_size = saved.padded_vocab_size
    mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)

    from functools import partial

    from gpt_builders import gpt_builder
    from model_provider import model_provider
    from megatron.training.training import setup_model_and_optimizer

    import megatron.training.training as training

    if args.use_distributed_optimizer:
        # Megatron-Core 0.16's DistributedOptimizer cannot build its load-time state dict with torch's
        # Adam (no Apex / Transformer Engine, as on CPU): the workaround megacli's engine applies.
        from megacli.engine.checkpoint import _prepare_distributed_optimizer_load

        original = training.load_checkpoint

        def load_checkpoint(model, optimizer, *a, **k):
            _prepare_distributed_optimizer_load(optimizer)
            return original(model, optimizer, *a, **k)

        training.load_checkpoint = load_checkpoint
    model, optimizer, scheduler = setup_model_and_optimizer(partial(model_provider, gpt_builder),
                                                            ModelType.encoder_or_decoder)
    import random

    restored, saved_rng = random.getstate(), _saved_rng(ckpt)
    print(f"loaded: iteration {args.iteration}, scheduler num_steps {scheduler.num_steps}, "
          f"optimizer step {_step(optimizer)}, Python RNG state equal to the checkpoint's: "
          f"{'(none saved)' if saved_rng is None else restored == saved_rng['random_rng_state']}")

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tokens = torch.randint(0, saved.vocab_size, (1, 12))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(tokens).logits[0]
        from megatron.training.utils import unwrap_model

        # The loaded weights in fp32 (a bf16/fp16 run's weights are exact in fp32), so the
        # comparison is of the weights, not of half-precision arithmetic.
        net = unwrap_model(model[0]).float()
        net.eval()
        pos = torch.arange(tokens.shape[1]).unsqueeze(0)
        out = net(tokens, pos, None)
    got = out[0, :, : ref.shape[-1]]  # the HF model's vocabulary (args.vocab_size excludes NullTokenizer's end-of-document id)
    print(f"max |Megatron-LM logits - HF logits| = {(got - ref).abs().max().item():.3g} over {tuple(got.shape)}")


_MOE_NOT_CARRIED = ("moe_shared_expert_gate", "moe_router_dtype", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                    "moe_token_dispatcher_type", "moe_expert_capacity_factor", "moe_token_drop_policy",
                    "moe_pad_expert_input_to_capacity", "moe_router_num_groups", "moe_router_group_topk",
                    "moe_router_bias_update_rate", "expert_model_parallel_size", "expert_tensor_parallel_size")
_SCHEDULE = ("train_iters", "lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_warmup_iters", "weight_decay",
             "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "seed")


def _iter_dir(ckpt: str) -> str:
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        return f"iter_{int(f.read().strip()):07d}"


def _saved_rng(ckpt: str) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    import io as _io

    import torch

    it_dir = os.path.join(ckpt, _iter_dir(ckpt))
    legacy = os.path.join(it_dir, "mp_rank_00", "model_optim_rng.pt")
    if os.path.exists(legacy):
        return torch.load(legacy, weights_only=False)["rng_state"][0]
    meta = FileSystemReader(it_dir).read_metadata()
    for index, info in meta.storage_data.items():
        if index.fqn.startswith("rng_state/shard_0.0_"):
            with open(os.path.join(it_dir, info.relative_path), "rb") as f:
                f.seek(info.offset)
                return torch.load(_io.BytesIO(f.read(info.length)), weights_only=False)[0][0]
    return None  # weights only (converted from HF)


def _step(optimizer):
    try:
        inner = optimizer.chained_optimizers[0].optimizer
        state = next(iter(inner.state.values()))
        return float(state["step"])
    except Exception as exc:  # noqa: BLE001 - only for the printout
        return f"? ({type(exc).__name__})"


if __name__ == "__main__":
    main()
