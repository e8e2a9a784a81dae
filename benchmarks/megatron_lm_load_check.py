"""By hand, beside the project: Megatron-LM's own loader reads a checkpoint megacli wrote.

    python benchmarks/megatron_lm_load_check.py MEGATRON_LM_CHECKOUT CKPT HF_DIR [--no-load-rng] [--no-load-optim]
    python benchmarks/megatron_lm_load_check.py MEGATRON_LM_CHECKOUT CKPT --t5 MEGACLI_CKPT [--hf HF_DIR] [...]

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

T5 (``--t5``): CKPT is `megacli convert MEGACLI_CKPT CKPT --to megatron --spec local` of a megacli
T5 checkpoint (``--spec te`` for relative positions, which megacli refuses to write for the local spec). The model is pretrain_t5.py's ``model_provider`` (its local spec), built and loaded
by ``setup_model_and_optimizer``. Without Transformer Engine, core_v0.16.1's local T5 block spec
asks for ``TENorm`` as the encoder's and decoder's final norm and, finding None, builds no final
norm at all; the script gives it Megatron-Core's own ``WrappedTorchNorm`` (the same LayerNorm /
RMSNorm). Two comparisons with megacli's own model of MEGACLI_CKPT (its engine's T5 loaded by its
engine's checkpoint code): every tensor of the two sharded state dicts (the keys a checkpoint
stores), and the logits of one forward (encoder and decoder tokens, a padded encoder sample, masks
as pretrain_t5.py's ``get_batch`` builds them for the local spec). Megatron-Core's local
``DotProductAttention`` refuses an attention bias, so a T5 with relative positions (T5's own) runs
in Megatron-LM only with Transformer Engine (``validate_args`` refuses relative positions with
``--transformer-impl local``): for one, the script lets ``validate_args`` pass by naming Transformer
Engine, builds the local model all the same to load the TE-spec checkpoint into, compares the
tensors and skips the forward, saying so. ``--hf HF_DIR`` (`megacli convert MEGACLI_CKPT HF_DIR --to hf`, relative
positions only: HF's T5 has no learned ones) adds HF's T5ForConditionalGeneration's logits as a
second reference.
"""

from __future__ import annotations

import os
import sys
import types


def main() -> None:
    if "--t5" in sys.argv:
        return t5_main()
    checkout, ckpt, hf_dir = sys.argv[1:4]
    extra = sys.argv[4:]
    _start(checkout)
    import torch

    it_dir = os.path.join(ckpt, _iter_dir(ckpt))
    legacy = not os.path.exists(os.path.join(it_dir, "common.pt"))  # --ckpt-format torch: mp_rank_* files
    common = torch.load(os.path.join(it_dir, "mp_rank_00", "model_optim_rng.pt") if legacy
                        else os.path.join(it_dir, "common.pt"), weights_only=False)
    saved = common["args"]
    sys.argv = ["pretrain_gpt.py", *_megatron_argv(ckpt, saved, "torch" if legacy else "torch_dist"), *extra]
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
    # by keyword: core_v0.19 takes model_type first
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider_func=partial(model_provider, gpt_builder),
                                                            model_type=ModelType.encoder_or_decoder)
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
        from megatron.core.utils import unwrap_model

        # The loaded weights in fp32 (a bf16/fp16 run's weights are exact in fp32), so the
        # comparison is of the weights, not of half-precision arithmetic.
        net = unwrap_model(model[0]).float()
        net.eval()
        pos = torch.arange(tokens.shape[1]).unsqueeze(0)
        out = net(tokens, pos, None)
    got = out[0, :, : ref.shape[-1]]  # the HF model's vocabulary (args.vocab_size excludes NullTokenizer's end-of-document id)
    print(f"max |Megatron-LM logits - HF logits| = {(got - ref).abs().max().item():.3g} over {tuple(got.shape)}")


def _start(checkout: str) -> None:
    """Megatron-LM importable, megacli's CPU backend on, one gloo process."""
    from megatron_lm_checkout import checkout_release

    print(f"checkout: Megatron-LM {checkout_release(checkout)}", flush=True)
    sys.path.insert(0, checkout)
    # Megatron-LM's initialize module imports triton kernels (batch-invariant mode) that a CPU-only
    # torch cannot import; they are never used here.
    stub = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    stub.enable_batch_invariant_mode = lambda *a, **k: None
    sys.modules[stub.__name__] = stub
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

    import torch

    from megacli.backend import cpu

    cpu.enable()
    # A checkpoint trained on the CPU backend saves no CUDA generator state (None); on CPU the one
    # generator is restored from torch_rng_state, so there is nothing more to set. (On CUDA,
    # Megatron-LM loads such a checkpoint with --no-load-rng.)
    set_device_rng = torch.cuda.set_rng_state
    torch.cuda.set_rng_state = lambda state, *a, **k: None if state is None else set_device_rng(state, *a, **k)
    import torch.distributed as dist

    # one process: an in-memory store, no port another run could hold
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())


def _megatron_argv(ckpt: str, saved, ckpt_format: str) -> list[str]:
    """Megatron-LM's command line for loading ``ckpt`` on CPU with its own args."""
    return ["--load", ckpt, "--ckpt-format", ckpt_format, "--use-checkpoint-args",
            "--transformer-impl", "local", "--distributed-backend", "gloo",
            "--micro-batch-size", str(saved.micro_batch_size), "--global-batch-size", str(saved.global_batch_size),
            "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(saved.vocab_size), "--mock-data", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
            "--no-rope-fusion", "--no-persist-layer-norm", "--use-cpu-initialization",
            # --use-checkpoint-args restores neither the norms' epsilon nor the bias-GeLU fusion (on by
            # default, the tanh approximation: megacli's args turn it off but for gelu_tanh)
            "--norm-epsilon", str(saved.layernorm_epsilon),
            # nor the precision: without it a bf16 run's model is built in fp32, and loading the
            # distributed optimizer's state then copies its fp32 main parameters into it
            *(["--bf16"] if getattr(saved, "bf16", False) else ["--fp16"] if getattr(saved, "fp16", False) else []),
            *([] if getattr(saved, "bias_gelu_fusion", True) else ["--no-bias-gelu-fusion"]),
            # the run's training schedule, as the checkpoint's args record it (Megatron-LM checks it on load)
            *[x for name in _SCHEDULE if getattr(saved, name) is not None
              for x in ("--" + name.replace("_", "-"), str(getattr(saved, name)))]]


def _option(name: str, default=None):
    if name not in sys.argv:
        return default
    i = sys.argv.index(name)
    value = sys.argv[i + 1]
    del sys.argv[i : i + 2]
    return value


def t5_main() -> None:
    megacli_ckpt, hf_dir = _option("--t5"), _option("--hf")
    checkout, ckpt = sys.argv[1:3]
    extra = sys.argv[3:]
    _start(checkout)
    import torch

    saved = torch.load(os.path.join(ckpt, _iter_dir(ckpt), "common.pt"), weights_only=False)["args"]
    # --use-checkpoint-args carries neither the decoder's length nor the T5 relative buckets
    sys.argv = ["pretrain_t5.py", *_megatron_argv(ckpt, saved, "torch_dist"),
                "--decoder-seq-length", str(saved.decoder_seq_length),
                "--relative-attention-num-buckets", str(saved.relative_attention_num_buckets),
                "--relative-attention-max-distance", str(saved.relative_attention_max_distance), *extra]
    from megatron.core import parallel_state as mpu, tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.training import get_args
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_args_from_checkpoint
    from megatron.training.global_vars import set_global_variables

    args = parse_args()
    load_args_from_checkpoint(args)
    relative = args.position_embedding_type == "relative"
    if relative:  # validate_args refuses it without Transformer Engine; built local here only to load the tensors
        args.transformer_impl = "transformer_engine"
    validate_args(args, {"tokenizer_type": "BertWordPieceLowerCase"})
    args.transformer_impl = "local"
    set_global_variables(args, build_tokenizer=False)
    args = get_args()
    args.padded_vocab_size = saved.padded_vocab_size
    mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)

    import megatron.core.models.T5.t5_spec as t5_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if t5_spec.TENorm is None:  # no Transformer Engine: the local block spec's final norm (see above)
        t5_spec.TENorm = WrappedTorchNorm
    from pretrain_t5 import model_provider
    from megatron.training.training import setup_model_and_optimizer
    from megatron.core.utils import unwrap_model

    model, optimizer, scheduler = setup_model_and_optimizer(model_provider_func=model_provider,
                                                            model_type=ModelType.encoder_or_decoder)
    import random

    restored, saved_rng = random.getstate(), _saved_rng(ckpt)
    print(f"loaded: iteration {args.iteration}, scheduler num_steps {scheduler.num_steps}, "
          f"optimizer step {_step(optimizer)}, Python RNG state equal to the checkpoint's: "
          f"{'(none saved)' if saved_rng is None else restored == saved_rng['random_rng_state']}")
    net = unwrap_model(model[0]).float().eval()
    print(f"Megatron-LM's T5: {args.encoder_num_layers} encoder + {args.num_layers} decoder layers, "
          f"{args.position_embedding_type} positions, final norms {type(net.encoder.final_layernorm).__name__} / "
          f"{type(net.decoder.final_layernorm).__name__}")

    ours, vocab = _megacli_t5(megacli_ckpt)
    theirs_sd, ours_sd = _sharded_tensors(net), _sharded_tensors(ours)
    differ = sorted(k for k in theirs_sd.keys() & ours_sd.keys() if theirs_sd[k] is None or not torch.equal(theirs_sd[k], ours_sd[k]))
    print(f"sharded state: Megatron-LM {len(theirs_sd)} tensors ({', '.join(sorted(theirs_sd))}),\n  megacli "
          f"{len(ours_sd)}; only in Megatron-LM's "
          f"{sorted(theirs_sd.keys() - ours_sd.keys())}, only in megacli's {sorted(ours_sd.keys() - theirs_sd.keys())}; "
          f"not bitwise equal: {differ}")

    torch.manual_seed(0)
    enc = torch.randint(1, vocab, (2, saved.seq_length))
    dec = torch.randint(1, vocab, (2, saved.decoder_seq_length))
    enc[1, saved.seq_length // 2 :] = 0  # padding: id 0, as Megatron-LM's T5 dataset pads
    enc_pad = (enc == 0)[:, None, None, :]
    with torch.no_grad():
        mc = ours(enc, dec, enc_pad, None, enc_pad)[..., :vocab]
        if relative:
            print("Megatron-LM forward skipped: relative positions need Transformer Engine (validate_args refuses "
                  "them with --transformer-impl local, whose DotProductAttention takes no attention bias)")
        else:
            from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset

            masks = T5MaskedWordPieceDataset.config_attention_mask(enc, dec, None, None, use_local=True)
            got = net(enc, dec, *masks)[..., :vocab]
            print(f"max |Megatron-LM logits - megacli logits| = {(got - mc).abs().max().item():.3g} over "
                  f"{tuple(got.shape)} (max |logit| {mc.abs().max().item():.3g})")
        if hf_dir:
            from transformers import T5ForConditionalGeneration

            hf = T5ForConditionalGeneration.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
            ref = hf(input_ids=enc, attention_mask=(enc != 0).long(), decoder_input_ids=dec).logits[..., :vocab]
            print(f"max |megacli logits - HF logits| = {(mc - ref).abs().max().item():.3g} over {tuple(ref.shape)}")


def _megacli_t5(ckpt_path: str):
    """megacli's own T5 of a megacli checkpoint, as its engine builds and loads it, and its vocabulary."""
    from pathlib import Path

    from megacli.checkpoint.layout import find_checkpoint, read_recipe
    from megacli.data.tokenizers import load_tokenizer
    from megacli.engine import checkpoint
    from megacli.engine.models import build_model
    from megacli.engine.models.common import unwrap
    from megacli.engine.models.config import transformer_config
    from megacli.plan import model_vocab_size
    from megacli.recipe.base import validate
    from megacli.recipe.pretrain import TrainingRecipe

    ck = find_checkpoint(Path(ckpt_path))
    recipe = validate(TrainingRecipe, read_recipe(ck), str(ck))
    vocab = recipe.model.vocab_size or model_vocab_size(recipe, load_tokenizer(type=recipe.tokenizer.type,
                                                                               path=recipe.tokenizer.path))
    config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision="fp32", on_cuda=False)
    chunks = build_model(recipe=recipe, config=config, vocab_size=vocab)
    checkpoint.load(ckpt=ck, chunks=chunks, optimizer=None, scheduler=None, load_optimizer=False)
    return unwrap(chunks[0]).float().eval(), vocab


def _sharded_tensors(net) -> dict:
    """key[layer] -> tensor of a model's sharded state dict (what a checkpoint stores), extra state left out."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    import re

    out = {}
    for name, entry in net.sharded_state_dict().items():
        if isinstance(entry, (ShardedTensor, ShardedTensorFactory)):  # a factory: SwiGLU's fc1, stored as 2 halves
            layer = re.search(r"\.layers\.(\d+)\.", name)  # the layers of a block share one stacked key
            out[entry.key + (f"[{layer.group(1)}]" if layer else "")] = entry.data.detach().float()
        elif not name.endswith("_extra_state"):
            out[f"{name} ({type(entry).__name__})"] = None  # not compared: reported as differing
    return out


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
