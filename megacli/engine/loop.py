"""The one training loop (pretrain and finetune): build, resume, train, evaluate, save."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch

from megacli.engine import checkpoint, cuda_graphs, distributed, fp8, nonfinite
from megacli.engine.cadences import Evaluations, LogWindow, NonFinitePolicy
from megacli.engine.metrics import MetricsLog, loss_metrics
from megacli.engine.saves import Saves, checkpoint_recipe_yaml
from megacli.engine.starting_point import Start, load_start, pretrained_source
from megacli.engine.stop import StopRequests, record_stop


@dataclass
class Trainer:
    """Everything a step needs, built once."""

    recipe: object
    runtime: distributed.Runtime
    chunks: list
    optimizer: object
    scheduler: object
    forward_step: object
    train_data: object
    valid_data: object | None
    vocab_size: int  # the model's vocabulary before padding (plan.model_vocab_size)
    named_valid: dict = field(default_factory=dict)  # name -> engine.data.ScoredSamples
    reference: object | None = None  # preference tuning: engine.preference.Reference, scoring each batch

    @property
    def num_microbatches(self) -> int:
        return self.recipe.num_microbatches


def train(recipe, *, harness=None) -> None:
    """``harness``: for recipe.eval, a factory ``harness(recipe, trainer, tokenizer)`` of the
    callable that runs the harness tasks at an evaluation (``fn(iteration)`` on every rank, giving
    the eval/<task>/<metric> values); the inference package provides it, the loop only calls it."""
    with distributed.running(parallel=recipe.parallel, launch=recipe.launch, seed=recipe.train.seed,
                             deterministic=recipe.train.deterministic) as runtime:
        _train(recipe, runtime, harness=harness)


def build_trainer(recipe, runtime) -> tuple[Trainer, object]:
    """The model (wrapped for Megatron's schedules), its optimizer and scheduler, the datasets and
    the forward step of the recipe; and its tokenizer."""
    from megacli.data.tokenizers import load_tokenizer
    from megacli.engine import data as data_mod
    from megacli.engine.optim import build_optimizer, build_scheduler
    from megacli.engine.steps import forward_step_for, load_custom_loss
    from megacli.plan import model_vocab_size

    m, p, t = recipe.model, recipe.parallel, recipe.train
    tokenizer = load_tokenizer(type=recipe.tokenizer.type, path=recipe.tokenizer.path, vocab_size=m.vocab_size)
    masked_tokenizer = None
    if m.arch in ("bert", "t5"):  # Megatron's masked datasets read a Megatron-style tokenizer (T5: plus sentinels)
        masked_tokenizer = data_mod.MegatronTokenizer(tokenizer, sentinels=recipe.masking.sentinel_tokens if m.arch == "t5" else 0)
    vocab = model_vocab_size(recipe, tokenizer)  # what masked_tokenizer counts (T5: + sentinels)
    config, chunks = _build_model(recipe, runtime, vocab)
    optimizer = build_optimizer(chunks, optim=recipe.optim, precision=t.precision, distributed_optimizer=p.distributed_optimizer,
                                on_cuda=runtime.is_cuda)
    scheduler = build_scheduler(optimizer, optim=recipe.optim, train_iters=t.iters)
    _set_schedule_hooks(config, chunks, optimizer, p)
    splits, named_valid = _datasets(recipe, tokenizer, masked_tokenizer, vocab)
    forward_step = forward_step_for(recipe, custom_loss=load_custom_loss(t.loss, t.loss_kwargs))
    trainer = Trainer(recipe=recipe, runtime=runtime, chunks=chunks, optimizer=optimizer, scheduler=scheduler,
                      forward_step=forward_step, train_data=splits.train, valid_data=splits.valid, vocab_size=vocab,
                      named_valid=named_valid, reference=_reference(recipe, config, vocab, runtime))
    return trainer, tokenizer


def _build_model(recipe, runtime, vocab: int) -> tuple[object, list]:
    """The TransformerConfig and the model chunks: built, initialised, on the device, compiled
    (train.compile), in half precision (Float16Module) and wrapped in Megatron's DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megacli.engine.models import build_model
    from megacli.engine.optim import grads_sharded
    from megacli.engine.models.config import transformer_config
    from megacli.engine.models.init import init_weights

    m, p, t = recipe.model, recipe.parallel, recipe.train
    cuda_graphs.prepare(t.cuda_graphs, device=runtime.device, seed=t.seed)
    fp8.check_device(t.fp8, emulate=t.fp8_emulate, device=runtime.device)
    config = transformer_config(model=m, parallel=p, precision=t.precision, on_cuda=runtime.is_cuda,
                                deterministic_mode=t.deterministic,  # e.g. embeddings by indexing, not F.embedding
                                **cuda_graphs.config_kwargs(t.cuda_graphs))
    chunks = build_model(recipe=recipe, config=config, vocab_size=vocab)
    init_weights(chunks, seed=t.seed, std=m.init_method_std, num_layers=config.num_layers, gated=config.gated_linear_unit,
                 zero_centered_gamma=config.layernorm_zero_centered_gamma)
    if recipe.lora is not None:
        from megacli.engine.models.lora import freeze_base

        freeze_base(chunks)
    chunks = [c.to(runtime.device) for c in chunks]
    fp8.install(chunks, t.fp8, emulate=t.fp8_emulate, pad_tokens=not fp8.tokens_aligned(recipe))
    compiled = []
    if t.compile:
        from megacli.engine.kernels import compile_model

        compiled = compile_model(chunks)
    if t.precision != "fp32":
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(config, c) for c in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=t.precision != "fp32" and not t.grad_reduce_in_bf16,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=grads_sharded(recipe.optim, p.distributed_optimizer),
        average_in_collective=False,
    )
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
              for i, c in enumerate(chunks)]
    if compiled:
        from megacli.engine.kernels import lift_param_sync_hooks

        for c in chunks:
            lift_param_sync_hooks(c, compiled)
    return config, chunks


def _set_schedule_hooks(config, chunks: list, optimizer, p) -> None:
    """The hooks Megatron's schedules call (as Megatron-LM's training loop wires them)."""
    from megatron.core.distributed import finalize_model_grads

    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if p.overlap_grad_reduce:
        no_sync = [c.no_sync for c in chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if p.overlap_param_gather:
        config.param_sync_func = [c.start_param_sync for c in chunks]
        config.param_sync_func = config.param_sync_func[0] if len(chunks) == 1 else config.param_sync_func


def _datasets(recipe, tokenizer, masked_tokenizer, vocab: int) -> tuple[object, dict]:
    """The training and validation splits of the recipe's data (masked, sft, preference,
    on-the-fly or GPT datasets) and the named validation sets."""
    from megacli.engine import data as data_mod

    m, t = recipe.model, recipe.train
    train_samples = t.iters * t.global_batch_size
    valid_samples = (t.iters // t.eval_interval + 1) * t.eval_iters * t.global_batch_size if t.eval_interval else 0
    cache_dir = data_mod.cache_dir_for(recipe.data, recipe.run.dir)
    if masked_tokenizer is not None:
        if masked_tokenizer.vocab_size > vocab:
            from megacli.errors import UserError

            raise UserError(f"model.vocab_size = {vocab} is smaller than the {m.arch} vocabulary "
                            f"({masked_tokenizer.vocab_size} ids with the sentinel tokens)")
        splits = data_mod.build_masked_datasets(arch=m.arch, data=recipe.data, masking=recipe.masking, seq_length=m.seq_length,
                                                decoder_seq_length=m.dec_seq_length, binary_head=m.bert_binary_head,
                                                seed=t.seed, tokenizer=masked_tokenizer, train_samples=train_samples,
                                                valid_samples=valid_samples, cache_dir=cache_dir)
    elif recipe.sft is not None:
        from megacli.data.sft import build_sft_datasets

        train_ds, valid_ds, summary = build_sft_datasets(sft=recipe.sft, tokenizer=tokenizer, tokenizer_path=recipe.tokenizer.path,
                                                         seq_length=m.seq_length, seed=t.seed)
        train_ds.summary = summary
        splits = data_mod.Splits(train=train_ds, valid=valid_ds, test=None)
    elif recipe.preference is not None:
        from megacli.data.preference import build_preference_datasets

        train_ds, valid_ds, summary = build_preference_datasets(pref=recipe.preference, tokenizer=tokenizer,
                                                                tokenizer_path=recipe.tokenizer.path,
                                                                seq_length=m.seq_length, seed=t.seed)
        train_ds.summary = summary
        splits = data_mod.Splits(train=train_ds, valid=valid_ds, test=None)
    elif recipe.data.on_the_fly:
        splits = data_mod.Splits(train=data_mod.stream_data(data=recipe.data, tokenizer_section=recipe.tokenizer,
                                                            tokenizer=tokenizer, vocab_size=m.vocab_size, seq_length=m.seq_length,
                                                            seed=t.seed),
                                 valid=None, test=None)
    else:
        splits = data_mod.build_gpt_datasets(data=recipe.data, seq_length=m.seq_length, seed=t.seed, tokenizer=tokenizer,
                                             train_samples=train_samples, valid_samples=valid_samples, cache_dir=cache_dir)
    named_valid = data_mod.named_validation_sets(data=recipe.data, sft=recipe.sft, preference=recipe.preference,
                                                 train=t, tokenizer=tokenizer,
                                                 tokenizer_path=recipe.tokenizer.path, seq_length=m.seq_length,
                                                 cache_dir=cache_dir)
    return splits, named_valid


def _reference(recipe, config, vocab: int, runtime):
    """Preference tuning that scores each batch with a reference (copy: built here, frozen, from
    the starting checkpoint, before anything is resumed; base: the policy without its adapters)."""
    pref = recipe.preference
    if pref is None or pref.loss == "simpo" or pref.reference == "precompute":
        return None
    from megacli.engine.preference import Reference, build_reference_chunks

    if pref.reference == "base":
        return Reference(mode="base")
    return Reference(mode="copy", chunks=build_reference_chunks(recipe, config, vocab, runtime.device,
                                                                pretrained_source(recipe.checkpoint)))


def precomputed_sets(trainer: Trainer) -> dict:
    """The datasets whose pairs reference: precompute scores before training, by name."""
    sets = {"train": trainer.train_data}
    if trainer.valid_data is not None:
        sets["validation"] = trainer.valid_data
    sets.update({f"valid_{name}": scored.dataset for name, scored in trainer.named_valid.items()})
    return sets


def data_iterators(trainer: Trainer, dataset, start_sample: int) -> list:
    """One iterator per model chunk over the same micro-batch stream (Megatron's interleaved schedule
    advances each chunk's iterator separately)."""
    from megatron.core import parallel_state as ps

    from megacli.engine.data import micro_batches

    t = trainer.recipe.train
    if hasattr(dataset, "iterators"):  # on-the-fly data: this rank's own stream
        return dataset.iterators(len(trainer.chunks), micro_batch_size=t.micro_batch_size, dp_rank=ps.get_data_parallel_rank(),
                                 dp_size=ps.get_data_parallel_world_size(), device=trainer.runtime.device)
    return [micro_batches(dataset, start_sample=start_sample, micro_batch_size=t.micro_batch_size,
                          dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                          device=trainer.runtime.device) for _ in trainer.chunks]


def run_schedule(trainer: Trainer, iterators: list, *, forward_only: bool) -> dict[str, tuple[float, float]]:
    """One global batch through Megatron's pipeline schedule. Returns each report key's
    (sum, count) - e.g. "lm loss": (loss sum, token count) - summed over micro-batches and
    data-parallel ranks, on the last pipeline stage (an empty dict elsewhere)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megacli.plan import rows_per_microbatch

    m = trainer.recipe.model
    if trainer.reference is not None:
        iterators = trainer.reference.attach(trainer, iterators)
    forward_backward = cuda_graphs.schedule(trainer.recipe.train.cuda_graphs, get_forward_backward_func())
    reports = forward_backward(
        forward_step_func=trainer.forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=trainer.chunks if len(trainer.chunks) > 1 else trainer.chunks[0],
        num_microbatches=trainer.num_microbatches,
        seq_length=m.seq_length,
        decoder_seq_length=m.dec_seq_length if m.arch == "t5" else None,
        micro_batch_size=rows_per_microbatch(trainer.recipe),
        forward_only=forward_only,
    )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    keys = sorted({k for r in reports for k in r})  # the same on every rank of the last stage
    total = torch.zeros(len(keys), 2, dtype=torch.float64, device=trainer.runtime.device)
    for r in reports:
        for i, k in enumerate(keys):
            total[i] += r[k].to(total)
    torch.distributed.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    return {k: (float(total[i, 0]), float(total[i, 1])) for i, k in enumerate(keys)}


def train_step(trainer: Trainer, iterators: list) -> tuple[dict[str, float], float | None, bool]:
    """One optimizer step. Returns the step's losses ("loss" and, for several report keys, each
    by its metric name; see metrics.loss_metrics), the gradient norm and whether the step was taken.
    Raises nonfinite.NonFiniteStep, before the optimizer step, when the loss or gradients are not finite."""
    for chunk in trainer.chunks:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    reports = run_schedule(trainer, iterators, forward_only=False)
    nonfinite.check_step(trainer.chunks, reports, check_grads=trainer.recipe.train.precision != "fp16")
    ok, grad_norm, _ = trainer.optimizer.step()
    if ok:
        trainer.scheduler.step(increment=1)
    return loss_metrics(reports), grad_norm, ok


def evaluate(trainer: Trainer, dataset, *, batches: int) -> dict[str, float] | None:
    """Losses over the first ``batches`` global batches of ``dataset`` (the same every time), as
    train_step's; None without a dataset, and off the last pipeline stage."""
    if dataset is None:
        return None
    for chunk in trainer.chunks:
        chunk.eval()
    iterators = data_iterators(trainer, dataset, start_sample=0)
    totals: dict[str, tuple[float, float]] = {}
    with torch.no_grad():
        for _ in range(batches):
            for k, (s, n) in run_schedule(trainer, iterators, forward_only=True).items():
                s0, n0 = totals.get(k, (0.0, 0.0))
                totals[k] = (s0 + s, n0 + n)
    for chunk in trainer.chunks:
        chunk.train()
    return loss_metrics(totals) if totals else None


def describe_kernels(runtime) -> str:
    if runtime.is_cuda:
        return "CUDA: Megatron-Core with our SDPA core attention and norms (no Transformer Engine/Apex needed)"
    return "CPU backend: Megatron-Core on gloo, torch SDPA attention, torch norms"


def _describe_run(log, recipe, runtime, n_params: int, chunks: list) -> None:
    from megacli.engine.kernels import describe_attention

    m, p, t = recipe.model, recipe.parallel, recipe.train
    experts = f" | {m.moe.num_experts} experts, top-{m.moe.router_topk}, EP {p.expert}" if m.moe else ""
    log.say(f"megacli {m.arch} | {n_params / 1e6:.2f}M params{experts} | TP {p.tensor} × PP {p.pipeline} × "
            f"CP {p.context} × DP {recipe.data_parallel_size} on {runtime.world_size} {runtime.device.type} processes | "
            f"{recipe.num_microbatches} micro-batches/step | {describe_kernels(runtime)}")
    log.say(describe_attention(recipe, runtime.device))
    if t.compile:
        log.say("train.compile: the transformer layers, embedding, final norm, output layer and loss run through "
                "torch.compile (the first steps include compiling)")
    if t.cuda_graphs != "none":
        log.say(f"train.cuda_graphs = {t.cuda_graphs}: Megatron-Core's CUDA graphs, captured after the first steps")
    if t.grad_reduce_in_bf16:
        log.say("train.grad_reduce_in_bf16: gradients are accumulated and all-reduced in bf16")
    if t.fp8 != "none":
        log.say(fp8.describe(chunks, t.fp8, emulate=t.fp8_emulate, pad_tokens=not fp8.tokens_aligned(recipe)))


def _train(recipe, runtime, *, harness=None) -> None:
    from megacli.engine.kernels import choose_attention
    from megacli.plan import count_params, flops_per_token

    t = recipe.train
    choose_attention(t.attention_backend, runtime.device)
    trainer, tokenizer = build_trainer(recipe, runtime)
    start = load_start(recipe, trainer)
    counts = count_params(recipe, trainer.vocab_size)
    log = MetricsLog(run_dir=recipe.run.dir, enabled=distributed.is_reporting_rank(), total_iters=t.iters,
                     start_iter=start.iteration, tokens_per_step=recipe.tokens_per_step,
                     flops_per_step=flops_per_token(recipe, counts.active) * recipe.tokens_per_step,
                     world_size=runtime.world_size, device=runtime.device, loggers=t.loggers_in_use,
                     run_name=recipe.run.name, run_config=recipe.model_dump(mode="json"), resumed=start.source is not None,
                     plot=t.plot)
    _describe_run(log, recipe, runtime, counts.total, trainer.chunks)
    expert_stats = _expert_stats(recipe, trainer, runtime)
    _prepare_start(log, recipe, trainer, start, n_params=counts.total)
    run_tasks = harness(recipe, trainer, tokenizer) if harness is not None and recipe.eval is not None else None
    _run_steps(log, recipe, trainer, start, tokenizer=tokenizer, expert_stats=expert_stats, run_tasks=run_tasks)


def _prepare_start(log, recipe, trainer: Trainer, start: Start, *, n_params: int) -> None:
    """What is said and done before the first step: the datasets' summaries, the reference's
    scores (preference tuning with reference: precompute), the starting weights, the adapters
    and the resume's notes."""
    for line in getattr(trainer.train_data, "summary", []) + [ds.summary for ds in trainer.named_valid.values()]:
        log.say(line)
    pref, ck = recipe.preference, recipe.checkpoint
    if pref is not None and pref.loss != "simpo" and pref.reference == "precompute":
        from megacli.engine.preference import precompute

        precompute(trainer, precomputed_sets(trainer), pretrained=pretrained_source(ck), fresh=start.source is None,
                   say=log.say)
    if start.pretrained is not None:
        log.say(f"starting from the weights of {start.pretrained}")
    if recipe.lora is not None:
        from megacli.engine.models.lora import adapter_params

        lo = recipe.lora
        n_lora = adapter_params(recipe.model, lo)
        log.say(f"LoRA rank {lo.rank}, alpha {lo.alpha:g}, dropout {lo.dropout:g} on {', '.join(lo.targets)}: "
                f"{n_lora / 1e6:.3f}M trainable params ({n_lora / n_params:.2%} of the model), base weights frozen")
    for note in start.notes:
        log.say(note)


def _lora_base(recipe, start: Start):
    """The base checkpoint a LoRA run's saves name: the resumed checkpoint's, else checkpoint.pretrained."""
    if recipe.lora is None:
        return None
    source = start.source
    return (checkpoint.lora_base_of(source) if source is not None else None) or pretrained_source(recipe.checkpoint)


def _run_steps(log, recipe, trainer: Trainer, start: Start, *, tokenizer, expert_stats, run_tasks) -> None:
    """Train from the start to train.iters (or train.exit_after_iters), each step followed by its
    cadences (log window, evaluations, saves) and a check for a stop request; then the last save,
    the plot and the summaries."""
    t, ck, runtime = recipe.train, recipe.checkpoint, trainer.runtime
    iteration, consumed = start.iteration, start.consumed
    iterators = data_iterators(trainer, trainer.train_data, start_sample=consumed)
    stop_at = min(t.iters, iteration + t.exit_after_iters) if t.exit_after_iters else t.iters
    saves = Saves(recipe=recipe, trainer=trainer, recipe_yaml=checkpoint_recipe_yaml(recipe, writer=runtime.rank == 0),
                  run_id=start.run_id or uuid.uuid4().hex,  # carried across resumes: keep_last prunes only this run's checkpoints
                  lora_base=_lora_base(recipe, start), last_good=start.source, log=log,
                  stream_meta=lambda: _stream_meta(trainer))
    window = LogWindow(log=log, recipe=recipe, trainer=trainer, tokenizer=tokenizer, expert_stats=expert_stats,
                       stop_at=stop_at, device=runtime.device)
    evaluations = Evaluations(trainer=trainer, log=log, evaluate=evaluate, run_tasks=run_tasks)
    nonfinite_policy = NonFinitePolicy(on_nonfinite=t.on_nonfinite, log=log, saves=saves)
    # Half the time the launcher gives workers after a signal goes to reaching a step boundary, half to the save.
    stops = StopRequests(save_on_signal=ck.save_on_signal, time_limit_minutes=t.time_limit_minutes, device=runtime.device,
                         max_wait_s=recipe.launch.timeout_minutes * 60 / 2, run_dir=recipe.run.dir, saves=bool(ck.dir))
    stopped = None
    try:
        while iteration < stop_at:
            lr = trainer.optimizer.param_groups[0]["lr"]  # the rate this step uses (the scheduler moves it after)
            losses, grad_norm, ok = nonfinite_policy.step(lambda: train_step(trainer, iterators), iteration + 1)
            iteration += 1
            consumed += t.global_batch_size
            window.step(iteration=iteration, losses=losses, lr=lr, grad_norm=grad_norm, ok=ok,
                        skipped=nonfinite_policy.skipped)
            evaluated = evaluations.step(iteration)
            stopped = stops.reason()
            saved, path = saves.step(iteration=iteration, consumed=consumed, last=bool(stopped) or iteration == stop_at)
            if evaluated or saved:
                window.paused()
            if stopped:
                record_stop(run_dir=recipe.run.dir, rank=runtime.rank, reason=stopped, iteration=iteration, checkpoint=path)
                log.say(f"stopped on {stopped} at iteration {iteration}: "
                        + (f"saved checkpoint {path}" if path else "nothing saved (no checkpoint.dir)"))
                break
        saves.finish()
        log.plot()
    except BaseException:
        saves.abort()
        raise
    finally:
        stops.close()
        log.close()
        if hasattr(trainer.train_data, "close"):
            trainer.train_data.close()
    if not stopped:
        for line in (evaluations.summary(iteration), nonfinite_policy.summary()):
            if line:
                log.say(line)


def _stream_meta(trainer: Trainer) -> dict | None:
    """On-the-fly data: every data-parallel rank's stream position, for megacli.json."""
    if not hasattr(trainer.train_data, "iterators"):
        return None
    from megacli.engine.stream_data import gathered_states

    return {"stream": gathered_states(trainer.train_data), "stream_sources": trainer.train_data.fingerprints}


def _expert_stats(recipe, trainer, runtime):
    """Load-balancing loss and expert load reporting for a MoE model (None for a dense one)."""
    m = recipe.model
    if m.moe is None:
        return None
    from megacli.engine.models.moe import ExpertStats

    return ExpertStats(trainer.chunks, num_layers=m.num_layers, num_experts=m.moe.num_experts,
                       aux_loss=m.moe.aux_loss_coeff > 0, data_parallel=recipe.data_parallel_size,
                       microbatches=recipe.num_microbatches, device=runtime.device)
