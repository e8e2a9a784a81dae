"""The recipe sections of how a run is laid out and driven, shared by the subcommands: parallel
layout, launch, training loop, optimizer, checkpoints, run directory. Every field documents itself;
defaults are the ones a GPT-2-style run would choose, so a recipe lists only what differs. What a
run reads is in ``data_sections``, finetuning's own sections in ``finetune_sections``."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, field_validator, model_validator

from megacli.recipe.base import RecipeError, Section, Seed
from megacli.recipe.slurm import SlurmSection


class ParallelSection(Section):
    tensor: PositiveInt = 1
    """Tensor-parallel size (splits each layer's matrices across GPUs)."""
    pipeline: PositiveInt = 1
    """Pipeline-parallel size (splits the layers into stages)."""
    virtual_pipeline: Optional[PositiveInt] = None
    """Model chunks per pipeline stage for the interleaved 1F1B schedule; null = plain 1F1B."""
    first_stage_layers: Optional[PositiveInt] = None
    """Transformer layers on the first pipeline stage when the layers do not split evenly (or to
    lighten the stage that also holds the embedding); the other stages share the rest evenly.
    Megatron-Core's num_layers_in_first_pipeline_stage. null = an even split."""
    last_stage_layers: Optional[PositiveInt] = None
    """Transformer layers on the last pipeline stage (which also holds the output layer and the
    loss); Megatron-Core's num_layers_in_last_pipeline_stage. null = an even split."""
    sequence_parallel: Union[bool, Literal["auto"]] = "auto"
    """Shard norms/dropout activations along the sequence across the tensor-parallel group.
    auto: on when tensor > 1 (it only saves memory); true with tensor = 1 is an error."""
    context: PositiveInt = 1
    """Context-parallel size (ring attention over sequence chunks)."""
    expert: PositiveInt = 1
    """Expert-parallel size (MoE)."""
    expert_tensor: Optional[PositiveInt] = None
    """Tensor-parallel size inside experts; default = tensor."""
    distributed_optimizer: bool = False
    """Shard optimizer state and fp32 master weights across data-parallel ranks (ZeRO-1)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute: selective (attention core only) or full (whole layers)."""
    recompute_num_layers: PositiveInt = 1
    """full recompute: layers per recompute group (uniform method)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduce with the backward pass."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the forward pass."""

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Transformer layers on each pipeline stage (of a split the recipe checks accepted)."""
        from megacli.recipe.stages import stage_layer_counts

        return stage_layer_counts(num_layers, self.pipeline, self.first_stage_layers, self.last_stage_layers)

    def chunk_layers(self, num_layers: int) -> list[list[range]]:
        """[stage][virtual chunk] -> the global layer numbers it holds."""
        from megacli.recipe.stages import chunk_layers

        return chunk_layers(num_layers, self.pipeline, self.virtual_pipeline, self.first_stage_layers, self.last_stage_layers)

    @property
    def sp_enabled(self) -> bool:
        """Whether the run uses sequence parallelism (sequence_parallel with auto resolved)."""
        return sequence_parallel_on(self.sequence_parallel, tensor=self.tensor)


def sequence_parallel_on(value: bool | str, *, tensor: int) -> bool:
    """parallel.sequence_parallel resolved: auto means on exactly when tensor parallelism is.
    Also for raw recipe dicts (checkpoints' recipe.yaml)."""
    return tensor > 1 if value == "auto" else bool(value)


class LaunchSection(Section):
    nproc: PositiveInt = 1
    """Worker processes per node (one per GPU on CUDA)."""
    nnodes: PositiveInt = 1
    """Number of nodes."""
    node_rank: int = Field(0, ge=0)
    """This node's rank (multi-node without Slurm)."""
    rdzv_endpoint: Optional[str] = None
    """host:port of the rendezvous (multi-node); default a free local port."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """auto: CUDA with NCCL when a GPU is present, else the CPU backend with gloo."""
    threads_per_process: Optional[PositiveInt] = None
    """CPU backend: torch threads per worker (default: cores / nproc, at least 1; `serve` keeps one
    core for its HTTP side: (cores - 1) / nproc)."""
    job_id: Optional[str] = None
    """One id for all nodes of a job (its rendezvous and run-directory lock). Default: the scheduler's
    job id (SLURM_JOB_ID), else torchrun's run id, else one derived from launch.rdzv_endpoint."""
    timeout_minutes: PositiveFloat = 10.0
    """How long a rank waits for the others before the job fails: the nodes' rendezvous and every
    collective operation (the process-group timeout); also how long workers get to save and stop
    after a signal before they are killed."""
    slurm: SlurmSection = SlurmSection()
    """`megacli submit`: the sbatch script's partition, account, time limit, warning and requeue."""

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


class TrainSection(Section):
    iters: PositiveInt = 1000
    """Optimizer steps to train for."""
    micro_batch_size: PositiveInt = 4
    """Sequences per forward/backward pass on one data-parallel rank."""
    global_batch_size: PositiveInt = 32
    """Sequences per optimizer step across all data-parallel ranks."""
    seed: Seed = 1234
    """Seed of weight init, dropout and data order (the same seed gives the same init in any layout)."""
    eval_interval: Optional[NonNegativeInt] = 100
    """Evaluate every this many steps (and at the end); 0 or null = never."""
    eval_iters: PositiveInt = 10
    """Validation batches per evaluation."""
    log_interval: PositiveInt = 10
    """Steps between console lines / metrics.jsonl records."""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    """Compute precision; fp16 uses dynamic loss scaling; master weights are fp32."""
    loss: Optional[str] = None
    """Custom loss 'package.module:function', called on the last pipeline stage as
    fn(per_token_losses, labels=labels, loss_mask=loss_mask, **loss_kwargs) with per_token_losses
    [b, s] (fp32 cross-entropy), returning per-token losses [b, s] that are masked and summed. The
    module is imported and runs with the run's rights, like transformers' trust_remote_code: name
    only code you trust."""
    loss_kwargs: dict[str, Any] = {}
    """Keyword arguments for the custom loss."""
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = []
    """Experiment trackers that get every metrics.jsonl record, the resolved recipe as the run
    config, the versions and the run's name: tensorboard (<run.dir>/tensorboard), wandb (W&B;
    WANDB_MODE=offline writes <run.dir>/wandb to sync later), mlflow (MLFLOW_TRACKING_URI, default
    the file store <run.dir>/mlruns). A resumed run continues the same tracker run. metrics.jsonl
    is always written."""
    tensorboard: bool = False
    """Older spelling of listing tensorboard in loggers (either one turns TensorBoard on)."""
    plot: bool = True
    """Redraw <run.dir>/plot.png from metrics.jsonl at each checkpoint and at the end (with
    matplotlib installed; each redraw costs about a CPU-second). `megacli plot` draws it any time."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradients are inf/NaN: stop (naming the iteration and the last good
    checkpoint), or skip it (the optimizer does not step; skipped steps are counted and logged).
    Weights that are no longer finite are never saved."""
    exit_after_iters: Optional[PositiveInt] = None
    """Stop (with a checkpoint) after this many steps of this process, leaving the schedule as for iters."""
    deterministic: bool = False
    """Bitwise-reproducible runs: the same recipe and seed give the same losses on the same GPU
    (deterministic kernels: torch's deterministic algorithms, SDPA's math kernel; slower)."""

    @field_validator("loggers")
    @classmethod
    def _loggers_once(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("a logger is named twice")
        return v

    @property
    def loggers_in_use(self) -> list[str]:
        """train.loggers, plus tensorboard when the older train.tensorboard flag asks for it."""
        if self.tensorboard and "tensorboard" not in self.loggers:
            return ["tensorboard", *self.loggers]
        return list(self.loggers)
    time_limit_minutes: Optional[PositiveFloat] = None
    """Stop (with a checkpoint, as on SIGTERM) at the first step boundary after this much wall time."""
    compile: bool = False
    """torch.compile the step: one graph that every transformer layer reuses (TorchInductor fuses
    its norms, RoPE, activation and bias-dropout-adds; no Transformer Engine needed) and, for gpt,
    the embedding, the final norm, and the output layer with the loss (the padded-vocabulary mask
    fused into the cross-entropy). The first steps compile (seconds to minutes), later ones run the
    compiled code; fp32 losses equal the default path's to float rounding."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA kernel of the attention: auto = torch's own choice; flash, cudnn or efficient = that
    kernel where it can run (the math kernel where it cannot, e.g. flash on fp32 CUDA inputs);
    math = always the math kernel. The kernel a training micro-batch gets is logged at start."""
    cuda_graphs: Literal["none", "layers", "full"] = "none"
    """CUDA graphs (Megatron-Core's own, no Transformer Engine) for models whose steps are bound by
    kernel launches: layers = each transformer layer's forward and backward, captured at the end of
    the first step and replayed; full = the whole forward-backward of a step (all micro-batches,
    loss, gradient reduction; not the optimizer), captured at the third step. The same maths; CUDA
    only, fixed shapes (gpt pretraining: no sft, preference, MoE or eval.tasks; full: no pipeline
    or context parallelism, no parallel.overlap_param_gather; layers: no full recompute, no
    evaluation of a model with dropout, with train.compile no parallel.overlap_param_gather)."""
    grad_reduce_in_bf16: bool = False
    """bf16 training: accumulate and all-reduce the gradients in bf16 (Megatron-Core DDP
    grad_reduce_in_fp32: false) instead of fp32: half the gradient memory and reduce traffic,
    with bf16 rounding of each micro-batch's gradient sum (the optimizer still steps fp32 master
    weights). Off by default; for bf16 only (fp16 gradients would overflow without fp32 sums)."""
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    """bf16 training with FP8 matrix products (torchao's float8 training, no Transformer Engine) in
    the transformer layers' column- and row-parallel linears: tensorwise = one dynamic scale per
    tensor (e4m3 forward, e5m2 gradients; the fastest), rowwise = one scale per row of each
    operand (e4m3 throughout, scales rounded down to powers of two). Master weights and checkpoints stay as in bf16, so a
    resume may turn it on or off. The output layer, MoE experts and router, and linears whose shape
    on a rank is not a multiple of 16 stay bf16 (said at start). Needs torchao (megacli[fp8]) and a
    GPU with FP8 matrix units (Ada, Hopper or newer) unless train.fp8_emulate."""
    fp8_emulate: bool = False
    """train.fp8 emulated: the same casts to FP8 (values rounded as FP8 holds them), the products
    in fp32; runs on a CPU or any GPU, slower than bf16. For testing the FP8 path."""

    @model_validator(mode="after")
    def _check_kernels(self):
        if self.grad_reduce_in_bf16 and self.precision != "bf16":
            raise RecipeError("train.grad_reduce_in_bf16", True, f"is for bf16 training, not {self.precision}")
        if self.fp8 != "none" and self.precision != "bf16":
            raise RecipeError("train.fp8", self.fp8, f"is for bf16 training (train.precision: bf16), not {self.precision}")
        if self.deterministic and self.attention_backend not in ("auto", "math"):
            raise RecipeError("train.attention_backend", self.attention_backend,
                              "train.deterministic runs SDPA's math kernel (the others may accumulate with atomics)")
        return self

    @field_validator("loss")
    @classmethod
    def _loss_ref(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError("expected 'package.module:function'")
        return v


class OptimSection(Section):
    optimizer: Literal["adam", "sgd", "muon"] = "adam"
    """adam (AdamW, decoupled weight decay), sgd, or muon: Muon on the hidden 2-D weights (the
    orthogonalized momentum scaled by 0.2·sqrt(max(rows, cols)), so optim.lr serves both), AdamW on
    embeddings, output layer, norms and biases; needs Python 3.12+ with Megatron-Core 0.19."""
    lr: PositiveFloat = 3e-4
    """Peak learning rate."""
    min_lr: float = Field(3e-5, ge=0)
    """Learning rate at the end of decay."""
    warmup_iters: Optional[int] = Field(None, ge=0)
    """Linear warmup steps, shorter than the decay horizon; when given it is used and warmup_fraction
    is not (so `--set optim.warmup_iters=N` works on any recipe); null = warmup_fraction."""
    warmup_fraction: Optional[float] = Field(None, ge=0, lt=1)
    """Linear warmup as a share of the decay horizon (optim.decay_iters or train.iters), rounded down
    as Megatron-LM's --lr-warmup-fraction; stays valid when train.iters changes. null (and no
    warmup_iters) = no warmup."""
    decay_style: Literal["constant", "linear", "cosine", "wsd"] = "cosine"
    """Shape of the decay after warmup; wsd = warmup-stable-decay."""
    decay_iters: Optional[PositiveInt] = None
    """Steps over which lr decays (default: train.iters)."""
    wsd_decay_iters: Optional[PositiveInt] = None
    """wsd: length of the final decay phase (default 10% of decay_iters)."""
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay (not applied to biases and norms)."""
    clip_grad: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this (0 = off)."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """Adam beta1."""
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    """Adam beta2."""
    adam_eps: PositiveFloat = 1e-8
    """Adam epsilon."""
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    """muon: momentum of the matrix updates (Nesterov)."""
    initial_loss_scale: PositiveFloat = 2.0**16
    """fp16: starting dynamic loss scale."""
    fused: Optional[bool] = None
    """torch's fused optimizer kernel (AdamW or SGD: each step in one kernel per device and dtype,
    instead of one per operation over a list of tensors); the same maths. null: on with CUDA, off on CPU."""

    def fused_on(self, on_cuda: bool) -> bool:
        """Whether this run's optimizer uses torch's fused kernel."""
        return on_cuda if self.fused is None else self.fused

    @model_validator(mode="after")
    def _lr_order(self):
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr ({self.min_lr}) is above optim.lr ({self.lr})")
        return self

    def decay_horizon(self, train_iters: int) -> int:
        """Steps over which the learning rate decays: decay_iters, else the whole run."""
        return self.decay_iters or train_iters

    def warmup_steps(self, train_iters: int) -> int:
        """Warmup steps of a run of ``train_iters`` steps: warmup_iters, else warmup_fraction of the horizon."""
        if self.warmup_iters is not None:
            return self.warmup_iters
        return int((self.warmup_fraction or 0.0) * self.decay_horizon(train_iters))


class CheckpointSection(Section):
    dir: Optional[str] = None
    """Checkpoint directory; null = never save."""
    save_interval: Optional[NonNegativeInt] = None
    """Save every this many steps; 0 or null = never periodically. A run with checkpoint.dir set
    always saves at its end (checkpoint.dir: null saves nothing)."""
    resume: str = "auto"
    """auto (continue from dir's latest if any), none (start fresh), or a checkpoint path to load."""
    load_optimizer: bool = True
    """Restore optimizer and scheduler state when resuming (off for finetuning from pretrained weights)."""
    pretrained: Optional[str] = None
    """Weights to start from when there is nothing to resume (finetuning): a megacli checkpoint,
    e.g. one from `megacli convert`. Its optimizer state and iteration are not used."""
    keep_last: Optional[PositiveInt] = None
    """Delete this run's older checkpoints (those of earlier runs it resumed included), keeping its newest
    this many (null = keep all). Other runs' checkpoints, and the one `latest` names, are never deleted."""
    verify: bool = True
    """Check every file of a checkpoint against its manifest (sizes and xxh3-64 checksums written at
    save) before loading it, refusing a truncated or corrupt file; false loads without checking."""
    overwrite: bool = False
    """Allow resume: none in a dir that already holds checkpoints (this run's saves replace those of the
    same iteration and move `latest`); without it such a run is refused."""
    async_save: bool = True
    """Write periodic saves in the background while training goes on (Megatron-Core's asynchronous
    torch_dist save, in a forked process): `latest` moves once every rank's write is complete.
    The saves of a stop and of the run's end are written before the run goes on; false: every save
    stalls training until written. Without fork (not Linux) saves are synchronous."""
    save_on_signal: bool = True
    """On SIGTERM or SIGUSR1 (what Slurm sends before preemption or the time limit), save a checkpoint
    at the next step boundary and exit 0; copies of the signal within 5 s are one request, a signal
    after that stops at once. false: stop at once."""
    trust_pickle: bool = False
    """Unpickle any object the checkpoints loaded (resume, pretrained, LoRA base) hold; by default
    only tensors and known-safe types, since a pickle can run code. Only for checkpoints you trust."""


class RunSection(Section):
    dir: str = "runs/default"
    """Where the resolved recipe, versions, logs and metrics.jsonl go."""
    name: Optional[str] = None
    """A label for the run (defaults to the directory name)."""
