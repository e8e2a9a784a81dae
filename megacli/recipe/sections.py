"""The recipe sections shared by the subcommands. Every field documents itself; defaults are the
ones a GPT-2-style run would choose, so a recipe lists only what differs."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, field_validator, model_validator

from megacli.recipe.base import RecipeError, Section
from megacli.recipe.stream import FIMSection, StreamFields, StreamSource, check_stream_location


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
    """CPU backend: torch threads per worker (default: cores / nproc, at least 1)."""
    job_id: Optional[str] = None
    """One id for all nodes of a job (its rendezvous and run-directory lock). Default: the scheduler's
    job id (SLURM_JOB_ID), else torchrun's run id, else one derived from launch.rdzv_endpoint."""
    timeout_minutes: PositiveFloat = 10.0
    """How long a rank waits for the others before the job fails: the nodes' rendezvous and every
    collective operation (the process-group timeout); also how long workers get to save and stop
    after a signal before they are killed."""

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


class TokenizerSection(Section):
    type: Literal["huggingface", "byte", "sentencepiece", "wordpiece", "none"] = "huggingface"
    """huggingface (a directory with tokenizer.json), byte (no files: 256 bytes + specials),
    sentencepiece (a .model file), wordpiece (a BERT vocab.txt), none (no tokenizer: data is ids
    already, Megatron-LM's NullTokenizer; needs model.vocab_size, which counts the ids and the
    end-of-document id after them, Megatron-LM's --vocab-size + 1). The old spelling null, which
    YAML reads as no value, still means none."""
    path: Optional[str] = None
    """Tokenizer directory or file (not needed for byte/none)."""

    @field_validator("type", mode="before")
    @classmethod
    def _old_none_spelling(cls, v):
        return "none" if v is None or v == "null" else v

    @model_validator(mode="after")
    def _needs_path(self):
        if self.type in ("huggingface", "sentencepiece", "wordpiece") and not self.path:
            raise ValueError(f"tokenizer type {self.type!r} needs tokenizer.path")
        return self


class DataSection(StreamFields):
    source: Literal["indexed", "hf", "jsonl"] = "indexed"
    """indexed (the default; null means it too): Megatron .bin/.idx files (data.path or data.blend);
    jsonl or hf: documents read and tokenized while training (files / name), packed like Megatron's
    GPTDataset without shuffling."""
    sources: Optional[list[StreamSource]] = None
    """Weighted mixture of on-the-fly sources, each {source, weight, files | name, ...}; leave data.source unset."""
    tokenizer_workers: NonNegativeInt = 1
    """On-the-fly data: processes tokenizing ahead of training (0: a background thread does it)."""
    restart_changed_sources: bool = False
    """On-the-fly data: resume although a source changed since the checkpoint (files replaced,
    truncated, appended to or reordered; sources reordered), reading each changed source from its
    first document. false: such a resume is refused, naming the source."""
    reset_position_ids: bool = False
    """Position ids restart after each end-of-document token (Megatron-LM's --reset-position-ids)."""
    reset_attention_mask: bool = False
    """Tokens attend only within their own document (Megatron-LM's --reset-attention-mask)."""
    eod_mask_loss: bool = False
    """No loss on end-of-document tokens (Megatron-LM's --eod-mask-loss)."""
    fim: Optional[FIMSection] = None
    """Fill-in-the-middle rewriting of on-the-fly samples; null = off."""
    path: Optional[str] = None
    """One Megatron indexed-dataset prefix (the path without .bin/.idx)."""
    blend: Optional[list[tuple[PositiveFloat, str]]] = None
    """Weighted mixture: a list of [weight, prefix] pairs (weights need not sum to 1)."""
    split: str = "969,30,1"
    """Train,validation,test proportions of each dataset, Megatron style."""
    cache_dir: Optional[str] = None
    """Where sample-index caches go; default <run.dir>/data_cache."""
    mock: bool = False
    """Random tokens instead of files (smoke tests, benchmarks). true wins: data.path, data.blend and
    data.valid are then not read (they may stay in the recipe, so `--set data.mock=true` is all a
    smoke run needs)."""
    valid: dict[str, str] = {}
    """Named validation sets (gpt), name -> indexed-dataset prefix (the whole dataset, in file order, cut
    into model.seq_length windows). At each evaluation every set gives val_loss/<name> and
    val_ppl/<name> beside the split-based val_loss: over train.eval_iters global batches, or the
    whole set when it holds fewer. Names are identifiers (letters, digits, _)."""

    @field_validator("source", mode="before")
    @classmethod
    def _null_source_is_indexed(cls, v):
        return "indexed" if v is None else v

    @field_validator("split")
    @classmethod
    def _split(cls, v: str) -> str:
        parts = v.replace("/", ",").split(",")
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            raise ValueError("expected comma-separated numbers like '969,30,1'") from None
        if len(nums) > 3 or any(n < 0 for n in nums) or sum(nums) <= 0:
            raise ValueError("expected up to three non-negative numbers with a positive sum")
        return v

    @field_validator("valid")
    @classmethod
    def _valid_names(cls, sets: dict[str, str]) -> dict[str, str]:
        check_set_names(sets)
        return sets

    @model_validator(mode="after")
    def _one_source(self):
        if self.on_the_fly:
            if self.sources and self.source != "indexed":
                raise ValueError("give data.source (one on-the-fly source) or data.sources (a mixture), not both")
            if self.path or self.blend or self.mock:
                raise ValueError("on-the-fly data (data.source / data.sources) reads no data.path, data.blend or data.mock")
            if self.source != "indexed":
                check_stream_location(self, self.source, where="data")
            return self
        if self.reset_attention_mask:
            raise ValueError("data.reset_attention_mask is for on-the-fly data (data.source jsonl or hf); indexed "
                             "batches carry no per-document mask")
        if self.fim is not None:
            raise ValueError("data.fim rewrites on-the-fly samples (data.source jsonl or hf); Megatron-Core 0.16.1 "
                             "has no FIM dataset for indexed data")
        if self.path and self.blend:
            raise ValueError("give data.path or data.blend, not both")
        return self

    @property
    def named(self) -> bool:
        """Whether a source is given (a training run needs one; instruction finetuning reads sft instead)."""
        return bool(self.path or self.blend or self.mock or self.on_the_fly)

    @property
    def on_the_fly(self) -> bool:
        """Documents are read and tokenized while training (not from indexed files)."""
        return self.source != "indexed" or bool(self.sources)

    def stream_sources(self) -> list[StreamSource]:
        """The on-the-fly sources as a mixture (one entry of weight 1 for data.source)."""
        if self.sources:
            return list(self.sources)
        fields = {k: getattr(self, k) for k in StreamFields.model_fields}
        return [StreamSource(source=self.source, **fields)]

    @property
    def prefixes(self) -> list[str]:
        """The indexed datasets the run reads (none with mock data)."""
        if self.mock:
            return []
        if self.path:
            return [self.path]
        return [p for _, p in self.blend or []]

    @property
    def named_valid(self) -> dict[str, str]:
        """The named validation sets the run reads (none with mock data)."""
        return {} if self.mock else dict(self.valid)


def check_set_names(sets: dict[str, str]) -> None:
    """Named validation sets: each name an identifier (it becomes part of a metric name)."""
    for name in sets:
        if not (name.isascii() and name.isidentifier()):
            raise ValueError(f"validation set name {name!r} is not an identifier (letters, digits and _, "
                             f"not starting with a digit): it becomes the metric val_loss/{name}")




class HeldOutData(Section):
    """JSONL training data with a validation file, named validation sets or a held-out share."""

    train: str
    """Training JSONL file."""
    valid: Union[str, dict[str, str], None] = None
    """Validation JSONL file (val_loss); null = hold out valid_fraction of the training file. A map
    name -> JSONL file gives named validation sets instead, one val_loss/<name> and val_ppl/<name>
    each (over train.eval_iters global batches, or the whole set when it holds fewer), and val_loss
    then comes from the held-out valid_fraction. Names are identifiers (letters, digits, _)."""
    valid_fraction: float = Field(0.05, ge=0, lt=1)
    """Share of the training records held out for validation when valid is not a single file."""

    @field_validator("valid")
    @classmethod
    def _valid_names(cls, valid):
        if isinstance(valid, dict):
            check_set_names(valid)
        return valid

    @property
    def valid_file(self) -> str | None:
        """The one validation file, when valid names one (not a map of named sets)."""
        return self.valid if isinstance(self.valid, str) else None

    @property
    def named_valid(self) -> dict[str, str]:
        """The named validation sets, name -> JSONL file (none unless valid is a map)."""
        return dict(self.valid) if isinstance(self.valid, dict) else {}


class SFTSection(HeldOutData):
    """Instruction data for `megacli finetune` (JSONL): {"prompt", "response"} or {"messages": [...]}."""

    template: Literal["auto", "tokenizer", "chatml", "plain"] = "auto"
    """How records become text: the tokenizer's chat template (auto: when it has one, else plain),
    chatml (<|im_start|>role ... <|im_end|>), or plain (the texts one after the other)."""
    packing: bool = True
    """Pack several examples into one sequence (attention and positions restart per example); false pads each."""
    too_long: Literal["truncate", "drop"] = "truncate"
    """What to do with an example longer than model.seq_length + 1 tokens."""

class PreferenceSection(HeldOutData):
    """Preference tuning for `megacli finetune`: pairs in TRL's format, {"prompt", "chosen",
    "rejected"} as strings or as lists of chat messages (JSONL, or a local Hugging Face dataset
    directory saved with save_to_disk), and the objective. Only completion tokens are scored."""

    template: Literal["auto", "tokenizer", "chatml", "plain"] = "auto"
    """How chat messages become text (as sft.template); plain strings are used as they are."""
    loss: Literal["dpo", "ipo", "simpo"] = "dpo"
    """dpo: -log sigmoid(beta·Δ) of the log-ratio margin Δ (Rafailov et al.), with label_smoothing
    the conservative cDPO; ipo: (Δ/len - 1/(2·beta))² with log-ratios averaged over completion
    tokens (TRL's definition); simpo: no reference model, length-normalised rewards beta·mean
    log-prob and the margin gamma (TRL's CPOTrainer loss_type simpo)."""
    beta: PositiveFloat = 0.1
    """Strength of the implicit KL penalty (dpo, ipo: TRL's beta; simpo: its reward scale)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """dpo and simpo: the assumed share of flipped labels (cDPO); 0 = the plain sigmoid loss."""
    gamma: float = 0.5
    """simpo: the target reward margin (TRL's simpo_gamma)."""
    reference: Literal["copy", "precompute", "base"] = "copy"
    """dpo/ipo's reference model: copy (a frozen second copy of the starting weights in the same
    layout), precompute (the reference log-probabilities of every pair computed once before training
    and cached under run.dir: one model in memory while training), base (LoRA: the base weights
    with the adapters switched off). Unused by simpo."""
    max_prompt_length: Optional[PositiveInt] = None
    """Prompts longer than this keep their last max_prompt_length tokens; null = no limit."""
    max_length: Optional[PositiveInt] = None
    """Prompt + completion longer than this keep their first max_length tokens (TRL's keep_start);
    a pair whose prompt alone fills it is dropped. null = model.seq_length + 1."""


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class LoRASection(Section):
    """Low-rank adapters (LoRA) for finetuning: each target linear layer W gets trainable A (rank ×
    in) and B (out × rank), the layer computes W·x + (alpha / rank)·B·A·dropout(x); the base
    weights stay frozen and only the adapters are trained and saved."""

    rank: PositiveInt = 8
    """Adapter rank r."""
    alpha: PositiveFloat = 16.0
    """Scaling numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (training only)."""
    targets: list[Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]] = list(LORA_TARGETS)
    """Which linear layers of every transformer layer get adapters: linear_qkv (attention input),
    linear_proj (attention output), linear_fc1 and linear_fc2 (MLP)."""

    @field_validator("targets")
    @classmethod
    def _some_targets(cls, targets):
        if not targets:
            raise ValueError(f"name at least one of {', '.join(LORA_TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError("a target is named twice")
        return targets


class MaskingSection(Section):
    """How BERT and T5 samples are masked (Megatron-Core's masked WordPiece datasets); unused by gpt."""

    probability: float = Field(0.15, gt=0, lt=1)
    """Fraction of each sample's tokens to mask (bert: predict them; t5: replace spans by sentinels)."""
    short_sequence_probability: float = Field(0.1, ge=0, le=1)
    """Probability that a sample is cut shorter than the sequence length (BERT's short-sequence trick)."""
    max_ngram: Optional[PositiveInt] = None
    """Longest span of words masked together; default 3 for bert, 10 for t5 (as Megatron-LM)."""
    geometric_ngrams: Optional[bool] = None
    """Draw span lengths from a geometric distribution (p = 0.2, SpanBERT) instead of P(n) ∝ 1/n;
    default: t5 yes, bert no (as Megatron-LM)."""
    whole_word: bool = True
    """Mask whole words: WordPiece '##' continuations (or SentencePiece pieces without '▁') go with
    their word. Other tokenizers mark no word pieces, so each token is its own word there."""
    sentinel_tokens: PositiveInt = 100
    """t5: sentinel tokens <extra_id_0>, <extra_id_1>, ... that replace masked spans; those the
    tokenizer lacks are appended to its vocabulary (Megatron-LM's --vocab-extra-ids)."""

    def ngram(self, arch: str) -> int:
        return self.max_ngram or (10 if arch == "t5" else 3)

    def geometric(self, arch: str) -> bool:
        return self.geometric_ngrams if self.geometric_ngrams is not None else arch == "t5"

    def max_masked(self, seq_length: int, arch: str) -> int:
        """Most tokens one sample can have masked: Megatron masks at most probability × the
        sample's token budget (seq_length less [CLS]/[SEP]/[SEP] for bert, <bos>/<eos> for t5)."""
        import math

        budget = seq_length - (3 if arch == "bert" else 2)
        return max(0, math.floor(self.probability * budget + 1e-9))

class TrainSection(Section):
    iters: PositiveInt = 1000
    """Optimizer steps to train for."""
    micro_batch_size: PositiveInt = 4
    """Sequences per forward/backward pass on one data-parallel rank."""
    global_batch_size: PositiveInt = 32
    """Sequences per optimizer step across all data-parallel ranks."""
    seed: int = 1234
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
    """torch.compile each transformer layer (TorchInductor fuses its norms, RoPE, activation and
    bias-dropout-adds; no Transformer Engine needed). The first steps compile (seconds to minutes),
    later ones run the compiled code; fp32 losses equal the default path's to float rounding."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA kernel of the attention: auto = torch's own choice; flash, cudnn or efficient = that
    kernel where it can run (the math kernel where it cannot, e.g. flash on fp32 CUDA inputs);
    math = always the math kernel. The kernel a training micro-batch gets is logged at start."""
    grad_reduce_in_bf16: bool = False
    """bf16 training: accumulate and all-reduce the gradients in bf16 (Megatron-Core DDP
    grad_reduce_in_fp32: false) instead of fp32: half the gradient memory and reduce traffic,
    with bf16 rounding of each micro-batch's gradient sum (the optimizer still steps fp32 master
    weights). Off by default; for bf16 only (fp16 gradients would overflow without fp32 sums)."""

    @model_validator(mode="after")
    def _check_kernels(self):
        if self.grad_reduce_in_bf16 and self.precision != "bf16":
            raise RecipeError("train.grad_reduce_in_bf16", True, f"is for bf16 training, not {self.precision}")
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
    optimizer: Literal["adam", "sgd"] = "adam"
    """adam (AdamW, decoupled weight decay) or sgd."""
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
