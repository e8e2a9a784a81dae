"""By hand, beside the project: megacli reads a MoE checkpoint that Megatron-LM's own save_checkpoint wrote.

    python benchmarks/megatron_lm_save_check.py MEGATRON_LM_CHECKOUT OUT [extra Megatron-LM args]

e.g. ``... /path/to/Megatron-LM out_plain`` and ``... /path/to/Megatron-LM out_dist --use-distributed-optimizer``.

1. Megatron-LM (a core_v0.16.1 or core_v0.19.x checkout, the installed Megatron-Core's release, in a child process, on CPU: megacli's CPU backend, gloo, the
   local layer spec, fp32): a tiny Mixtral-shaped GPT (every layer MoE: --moe-layer-freq at its
   default 1, so Megatron-Core stacks the layers under one key) built by ``setup_model_and_optimizer``
   with pretrain_gpt.py's ``model_provider`` + ``gpt_builder``, trained ``SAVE_AT`` steps by
   Megatron-LM's ``train_step`` on pretrain_gpt.py's mock data (its ``forward_step`` and dataset
   provider, the iterator ``build_train_valid_test_data_iterators`` builds), saved by its
   ``save_checkpoint`` into OUT/ckpt. Right after the save: the model's logits (eval, fp32) on fixed
   random tokens and a greedy continuation (whole sequence recomputed per token). Then ``AFTER``
   more ``train_step`` calls from that state (nothing saved), on the batches megacli's resumed run
   reads (see ``_megacli_batches``: megacli's mock data differs from Megatron-LM's for a
   NullTokenizer run). All of it (tokens, logits, greedy continuation, losses) in OUT/logits.pt.
2. megacli (this process, the CLI in subprocesses): the stored MoE keys (stacked:
   ``decoder.layers.mlp.router.weight`` with a leading layer axis); ``megacli convert OUT/ckpt
   OUT/hf --to hf``, the HF model's logits and greedy continuation against Megatron-LM's; the
   engine's logits from OUT/ckpt as stored; ``megacli reshard OUT/ckpt OUT/resharded --tensor 1``
   and the engine's logits of its output; ``megacli generate -c OUT/ckpt`` (greedy) against
   Megatron-LM's continuation; ``megacli pretrain`` resumed from OUT/ckpt (``checkpoint.resume``,
   the recipe the args map to as ``reshard inspect`` prints it, ``model.padded_vocab_in_loss=true``
   as Megatron-LM computes its loss, the mock split Megatron-LM used) for ``AFTER`` steps: the
   iteration it resumes at and its losses against Megatron-LM's (step SAVE_AT + 2 depends on the
   restored optimizer state and scheduler).

Phase 1 is skipped when OUT/logits.pt exists (the megacli side again). Megatron-LM's run
needs two things a source checkout lacks on a CPU-only machine, supplied here without changing
the checkout: its triton batch-invariant kernels (stubbed, never used) and the compiled dataset
index helpers (the installed Megatron-Core's, when its helpers.cpp is the same file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

SAVE_AT = 2
AFTER = 2  # steps after the save, in Megatron-LM and in megacli's resumed run
SEED = 1234
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings", "32",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
         "--moe-ffn-hidden-size", "96", "--moe-aux-loss-coeff", "0.01", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "255", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--train-iters", "10", "--lr", "1e-3", "--seed", str(SEED), "--ckpt-format", "torch_dist",
         "--eval-interval", "1000", "--eval-iters", "0"]
# Megatron-LM on CPU: no Transformer Engine, no fused CUDA kernels, weights drawn on the CPU.
CPU = ["--transformer-impl", "local", "--distributed-backend", "gloo", "--use-cpu-initialization",
       "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
       "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm", "--num-workers", "0"]


def main() -> None:
    if sys.argv[1] == "--megatron-lm":
        megatron_lm(sys.argv[2], Path(sys.argv[3]), sys.argv[4:])
        return
    from megatron_lm_checkout import checkout_release

    checkout, out = sys.argv[1], Path(sys.argv[2])
    extra = sys.argv[3:]
    print(f"checkout: Megatron-LM {checkout_release(checkout)}", flush=True)
    if not (out / "logits.pt").exists():  # else phase 1 ran already: only the megacli side again
        subprocess.run([sys.executable, __file__, "--megatron-lm", checkout, str(out), *extra], check=True)
    megacli_side(out)


# ---------------------------------------------------------------- 1. Megatron-LM


def megatron_lm(checkout: str, out: Path, extra: list[str]) -> None:
    sys.path.insert(0, checkout)
    # Megatron-LM's initialize module imports triton kernels (batch-invariant mode) that a CPU-only
    # torch cannot import; they are never used here.
    stub = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    stub.enable_batch_invariant_mode = lambda *a, **k: None
    sys.modules[stub.__name__] = stub
    _installed_dataset_helpers(checkout)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

    import torch

    from megacli.backend import cpu

    cpu.enable()
    import torch.distributed as dist

    # one process: an in-memory store, no port another run could hold
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    sys.argv = ["pretrain_gpt.py", *MODEL, *CPU, "--save", str(out / "ckpt"), "--save-interval", str(SAVE_AT), *extra]
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import (
        RerunMode,
        initialize_rerun_state_machine,
    )
    from megatron.training import get_args, get_timers
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    args = parse_args()
    # The router's optional TE GEMM is left undefined by Megatron-Core without Transformer Engine.
    from megacli.engine.models.moe import _define_absent_te_gemm

    _define_absent_te_gemm()
    validate_args(args, {})
    set_global_variables(args)
    args = get_args()
    initialize_rerun_state_machine(mode=RerunMode(args.rerun_mode))
    mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    cpu.seed_all(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)

    from functools import partial

    import pretrain_gpt
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.training import (
        build_train_valid_test_data_iterators,
        setup_model_and_optimizer,
        train_step,
    )
    from megatron.core.utils import unwrap_model

    # by keyword: core_v0.19 takes model_type first
    model, optimizer, scheduler = setup_model_and_optimizer(
        model_provider_func=partial(pretrain_gpt.model_provider, pretrain_gpt.gpt_builder),
        model_type=ModelType.encoder_or_decoder)
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True  # as pretrain_gpt.py's __main__ sets it
    train_iter, _, _ = build_train_valid_test_data_iterators(pretrain_gpt.train_valid_test_datasets_provider)
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    forward_backward = get_forward_backward_func()
    losses = {}

    def step(iteration: int) -> int:
        """Megatron-LM's train() around one train_step: returns the next iteration."""
        nonlocal train_iter
        args.curr_iteration = iteration
        for m in model:
            m.train()
        loss, skipped, *_ = train_step(pretrain_gpt.forward_step, train_iter, model, optimizer, scheduler, config,
                                       forward_backward, iteration=iteration)
        assert not skipped
        args.consumed_train_samples += args.global_batch_size
        losses[iteration + 1] = loss["lm loss"].item()
        print(f"Megatron-LM step {iteration + 1}: lm loss {losses[iteration + 1]!r}", flush=True)
        return iteration + 1

    iteration = 0
    while iteration < SAVE_AT:
        iteration = step(iteration)
    args.iteration = iteration
    save_checkpoint(iteration, model, optimizer, scheduler, num_floating_point_operations_so_far=0)

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
    net = unwrap_model(model[0])
    net.eval()
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        logits = net(tokens, pos, None).float()
        # greedy decoding, the whole sequence recomputed for each new token
        prompt = greedy = tokens[:1, :8]
        for _ in range(8):
            pos = torch.arange(greedy.shape[1]).unsqueeze(0)
            greedy = torch.cat([greedy, net(greedy, pos, None)[:, -1:].argmax(-1)], dim=1)
    # Steps SAVE_AT + 1.. continue Megatron-LM's run from the saved state on the batches megacli's
    # resumed run reads (see MEGACLI_BATCHES).
    from megatron.core.rerun_state_machine import RerunDataIterator

    train_iter = RerunDataIterator(_megacli_batches(out / "ckpt", args, first_sample=iteration * args.global_batch_size))
    for _ in range(AFTER):
        iteration = step(iteration)
    torch.save({"tokens": tokens, "logits": logits, "losses": losses, "prompt": prompt, "greedy": greedy, "padded_vocab_size": args.padded_vocab_size,
                "vocab_size": args.vocab_size, "use_distributed_optimizer": args.use_distributed_optimizer},
               out / "logits.pt")
    dist.destroy_process_group()


def _megacli_batches(ckpt: Path, args, *, first_sample: int):
    """MEGACLI_BATCHES: the mock batches megacli's resumed run reads, from ``first_sample`` on, built
    by megacli's own data code (Megatron-Core's MockGPTDataset) from the recipe the checkpoint's args
    map to, collated as Megatron-LM's data loader collates them. They differ from Megatron-LM's
    own: megacli builds the none tokenizer for model.vocab_size = --vocab-size + 1 as a
    NullTokenizer(model.vocab_size) (eod = --vocab-size + 1, one id more than Megatron-LM's
    NullTokenizer(--vocab-size)), and the mock documents' tokens are taken modulo the tokenizer's
    vocabulary."""
    import tempfile

    from torch.utils.data import default_collate

    from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint
    from megacli.checkpoint.source import Source
    from megacli.data.tokenizers import load_tokenizer
    from megacli.engine import data as data_mod
    from megacli.recipe.base import apply_overrides, validate
    from megacli.recipe.pretrain import TrainingRecipe

    recipe = validate(TrainingRecipe, apply_overrides(MegatronLMCheckpoint(Source(ckpt)).recipe(), RESUME_SETS), str(ckpt))
    m, t = recipe.model, recipe.train
    tokenizer = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path, vocab_size=m.vocab_size)
    valid = (t.iters // t.eval_interval + 1) * t.eval_iters * t.global_batch_size if t.eval_interval else 0
    splits = data_mod.build_gpt_datasets(data=recipe.data, seq_length=m.seq_length, seed=t.seed, tokenizer=tokenizer,
                                         train_samples=t.iters * t.global_batch_size, valid_samples=valid,
                                         cache_dir=tempfile.mkdtemp())
    mbs = args.micro_batch_size
    for start in range(first_sample, t.iters * t.global_batch_size, mbs):
        yield default_collate([splits.train[i] for i in range(start, start + mbs)])


def _installed_dataset_helpers(checkout: str) -> None:
    """A source checkout has the dataset index builder (helpers.cpp) uncompiled; the installed
    Megatron-Core's compiled one is used when its source is the same file (nothing is built in the
    checkout)."""
    import importlib.machinery
    import importlib.util
    import sysconfig

    name = "megatron.core.datasets.helpers_cpp"
    ours = Path(checkout) / "megatron/core/datasets"
    if any(ours.glob("helpers_cpp*.so")):
        return
    site = Path(sysconfig.get_paths()["purelib"]) / "megatron/core/datasets"
    built = next(site.glob("helpers_cpp*.so"), None)
    if built is None or (site / "helpers.cpp").read_bytes() != (ours / "helpers.cpp").read_bytes():
        sys.exit(f"build {ours}/helpers_cpp (make -C {ours}): no installed Megatron-Core with the same helpers.cpp")
    spec = importlib.util.spec_from_file_location(name, built, loader=importlib.machinery.ExtensionFileLoader(name, str(built)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module


# ---------------------------------------------------------------- 2. megacli


def megacli_side(out: Path) -> None:
    import shutil

    import torch

    from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint
    from megacli.checkpoint.source import Source
    from megacli.checkpoint.torch_dist import TorchDistReader

    for name in ("hf", "resharded", "resumed"):  # the megacli side's outputs, when it runs again
        shutil.rmtree(out / name, ignore_errors=True)
    ref = torch.load(out / "logits.pt")
    tokens, mlm_logits, vocab = ref["tokens"], ref["logits"], ref["padded_vocab_size"]
    ckpt = out / "ckpt"
    src = MegatronLMCheckpoint(Source(ckpt))
    stored = TorchDistReader(Source(src.it_dir)).tensors
    print("\n== the checkpoint Megatron-LM saved: its MoE keys (stacked: a leading layer axis)")
    for k in sorted(stored):
        if ".mlp." in k and not k.startswith("optimizer."):
            print(f"   {k} {tuple(stored[k].shape)}")
    router = stored.get("decoder.layers.mlp.router.weight")
    assert router is not None and router.shape[0] == 2, "the layers are not stacked"
    print(f"   optimizer-state tensors: {sum(k.startswith('optimizer.') for k in stored)}")

    print("\n== megacli convert -> HF")
    _megacli("convert", str(ckpt), str(out / "hf"), "--to", "hf")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        hf_logits = hf(tokens).logits.float()
    n = min(hf_logits.shape[-1], vocab)
    print(f"   HF {type(hf).__name__}: max |HF - Megatron-LM| logits = "
          f"{(hf_logits[..., :n] - mlm_logits[..., :n]).abs().max().item():.3g} over {tuple(hf_logits[..., :n].shape)}")
    with torch.no_grad():
        hf_greedy = hf.generate(ref["prompt"], max_new_tokens=ref["greedy"].shape[1] - ref["prompt"].shape[1],
                                do_sample=False, pad_token_id=0)
    print(f"   HF greedy continuation equal to Megatron-LM's: {torch.equal(hf_greedy, ref['greedy'])}")

    print("\n== megacli engine, loading the Megatron-LM checkpoint as stored")
    got = _engine_logits(ckpt, tokens)
    print(f"   max |engine - Megatron-LM| logits = {(got[..., :vocab] - mlm_logits).abs().max().item():.3g}")

    print("\n== megacli reshard OUT/ckpt OUT/resharded --tensor 1")
    _megacli("reshard", str(ckpt), str(out / "resharded"), "--tensor", "1")
    got = _engine_logits(out / "resharded", tokens)
    print(f"   max |engine(resharded) - Megatron-LM| logits = {(got[..., :vocab] - mlm_logits).abs().max().item():.3g}")

    print("\n== megacli generate -c OUT/ckpt (greedy)")
    prompt = " ".join(str(int(t)) for t in ref["prompt"][0])
    new = ref["greedy"].shape[1] - ref["prompt"].shape[1]
    _megacli("generate", "-c", str(ckpt), "-p", prompt, "-n", str(new), "-o", str(out / "generated.jsonl"))
    record = json.loads((out / "generated.jsonl").read_text().splitlines()[0])
    print(f"   generated: {record}")
    want = " ".join(str(int(t)) for t in ref["greedy"][0, ref["prompt"].shape[1]:])
    print(f"   equal to Megatron-LM's greedy continuation ({want}): "
          f"{str(record.get('text', record.get('completion', ''))).strip() == want}")

    print("\n== megacli pretrain --set checkpoint.resume=OUT/ckpt, steps")
    import yaml

    (out / "recipe.yaml").write_text(yaml.safe_dump(src.recipe(), sort_keys=False))
    run = out / "resumed"
    sets = [f"run.dir={run}", f"checkpoint.resume={ckpt}", "checkpoint.dir=null", f"train.exit_after_iters={AFTER}",
            "train.log_interval=1", "model.padded_vocab_in_loss=true", *RESUME_SETS]
    text = _megacli("pretrain", str(out / "recipe.yaml"), *[x for s in sets for x in ("--set", s)],
                    env={"MEGACLI_IN_PROCESS": "1"})
    for line in text.splitlines():
        if "resum" in line.lower() or "optimizer" in line.lower() or "rng" in line.lower():
            print(f"   | {line.strip()}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    print(f"   megacli losses by iteration: {losses}")
    print(f"   Megatron-LM losses by iteration: {ref['losses']} (after {SAVE_AT}: on megacli's batches)")
    for step in range(SAVE_AT + 1, SAVE_AT + AFTER + 1):
        got, mlm = losses.get(step), ref["losses"][step]
        print(f"   step {step}: megacli {got!r}, Megatron-LM {mlm!r}, |diff| "
              f"{'(none)' if got is None else format(abs(got - mlm), '.3g')}")


# The mock run's data split as Megatron-LM used it (no --split with --mock-data: Megatron-Core's 1,1,1).
RESUME_SETS = ["data.split=1,1,1"]


def _megacli(*argv: str, env: dict | None = None) -> str:
    cmd = [sys.executable, "-m", "megacli", *argv]
    print("   $ megacli " + " ".join(argv), flush=True)
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200", **(env or {})})
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-6000:])
        sys.exit(f"megacli {argv[0]} failed ({done.returncode})")
    return done.stdout + done.stderr


def _engine_logits(ckpt: Path, tokens):
    """The engine's logits of a checkpoint (a Megatron-LM one loaded as stored), one process, fp32."""
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from megacli.checkpoint.source import MEGACLI, Source\n"
        "from megacli.convert.megatron_io import megatron_process\n"
        "from megacli.engine import checkpoint\n"
        "from megacli.engine.models import build_model\n"
        "from megacli.engine.models.config import transformer_config\n"
        "from megacli.recipe.base import apply_overrides, load, validate\n"
        "from megacli.recipe.pretrain import TrainingRecipe\n"
        "path, toks = Path(sys.argv[1]), torch.load(sys.argv[2])\n"
        "with megatron_process():\n"
        "    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed\n"
        "    model_parallel_cuda_manual_seed(0)  # the initial weights, all overwritten by the load\n"
        "    src = Source(path)\n"
        "    if src.kind == MEGACLI:\n"
        "        ckpt = src.ckpt\n"
        "        recipe = load(TrainingRecipe, ckpt / 'recipe.yaml', [])\n"
        "    else:  # Megatron-LM's: the recipe its args map to\n"
        "        from megacli.checkpoint.megatron_lm.dist_reader import MegatronLMCheckpoint\n"
        "        mlm = MegatronLMCheckpoint(src)\n"
        "        ckpt, recipe = mlm.it_dir, validate(TrainingRecipe, apply_overrides(mlm.recipe(), []), str(path))\n"
        "    config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision='fp32', on_cuda=False)\n"
        "    chunks = build_model(recipe=recipe, config=config, vocab_size=recipe.model.vocab_size)\n"
        "    checkpoint.load(source=src.at(ckpt), chunks=chunks, optimizer=None, scheduler=None, load_optimizer=False)\n"
        "    chunks[0].eval()\n"
        "    with torch.no_grad():\n"
        "        pos = torch.arange(toks.shape[1]).unsqueeze(0).expand_as(toks)\n"
        "        torch.save(chunks[0](toks, pos, None).float(), sys.argv[3])\n"
    )
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        torch.save(tokens, f"{tmp}/tokens.pt")
        done = subprocess.run([sys.executable, "-c", code, str(ckpt), f"{tmp}/tokens.pt", f"{tmp}/logits.pt"],
                              check=False, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-6000:])
            sys.exit("the engine could not load the checkpoint")
        return torch.load(f"{tmp}/logits.pt")


if __name__ == "__main__":
    main()
