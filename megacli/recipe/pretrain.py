"""The pretraining recipe: the shared sections plus the arithmetic that ties them together.

Every check names the field, the value and the arithmetic; nothing here changes a value.
"""

from __future__ import annotations

from pydantic import model_validator

from megacli.recipe.base import RecipeError, Section
from megacli.recipe.sections import (
    CheckpointSection,
    DataSection,
    LaunchSection,
    ModelSection,
    OptimSection,
    ParallelSection,
    RunSection,
    TokenizerSection,
    TrainSection,
)


class TrainingRecipe(Section):
    """What `pretrain` (and `finetune`) run: a model, its layout and how to train it."""

    model: ModelSection = ModelSection()
    """Architecture."""
    parallel: ParallelSection = ParallelSection()
    """How the model and batch are split across processes."""
    launch: LaunchSection = LaunchSection()
    """Processes, nodes and device."""
    tokenizer: TokenizerSection = TokenizerSection(type="byte")
    """Tokenizer used to build the data (its vocabulary sizes the embedding)."""
    data: DataSection = DataSection(mock=True)
    """Training data."""
    train: TrainSection = TrainSection()
    """Batch sizes, steps, precision, evaluation and logging."""
    optim: OptimSection = OptimSection()
    """Optimizer and learning-rate schedule."""
    checkpoint: CheckpointSection = CheckpointSection()
    """Saving and resuming."""
    run: RunSection = RunSection()
    """Run directory."""

    # ---- derived numbers (never stored) ----
    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def model_parallel_size(self) -> int:
        p = self.parallel
        return p.tensor * p.pipeline * p.context

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.model_parallel_size

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.data_parallel_size)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.model.seq_length

    @property
    def layers_per_stage(self) -> int:
        return self.model.num_layers // self.parallel.pipeline

    @model_validator(mode="after")
    def _check_arithmetic(self):
        m, p, t = self.model, self.parallel, self.train
        tp = p.tensor
        if m.num_attention_heads % tp:
            raise RecipeError("parallel.tensor", tp, f"must divide model.num_attention_heads = {m.num_attention_heads} "
                              f"({m.num_attention_heads} % {tp} = {m.num_attention_heads % tp}); try a divisor such as "
                              f"{_largest_divisor(m.num_attention_heads, tp)}")
        if m.num_attention_heads % m.query_groups:
            raise RecipeError("model.num_query_groups", m.num_query_groups,
                              f"must divide model.num_attention_heads = {m.num_attention_heads}")
        if m.query_groups % tp:
            raise RecipeError("parallel.tensor", tp, f"must divide model.num_query_groups = {m.query_groups} "
                              f"(each tensor-parallel rank needs whole key/value heads)")
        if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
            raise RecipeError("model.hidden_size", m.hidden_size,
                              f"must be divisible by model.num_attention_heads = {m.num_attention_heads} "
                              f"(or set model.kv_channels)")
        if m.ffn_size % tp:
            raise RecipeError("model.ffn_hidden_size", m.ffn_size, f"must be divisible by parallel.tensor = {tp}")
        stages = p.pipeline * (p.virtual_pipeline or 1)
        if m.num_layers % stages:
            what = f"parallel.pipeline × parallel.virtual_pipeline = {p.pipeline} × {p.virtual_pipeline}" if p.virtual_pipeline \
                else f"parallel.pipeline = {p.pipeline}"
            raise RecipeError("model.num_layers", m.num_layers, f"must be divisible by {what} = {stages} "
                              f"({m.num_layers} % {stages} = {m.num_layers % stages})")
        if p.virtual_pipeline and p.pipeline < 2:
            raise RecipeError("parallel.virtual_pipeline", p.virtual_pipeline, "interleaving needs parallel.pipeline >= 2")
        if self.world_size % self.model_parallel_size:
            raise RecipeError("launch.nproc", self.launch.nproc,
                              f"world size launch.nproc × launch.nnodes = {self.world_size} must be a multiple of "
                              f"tensor × pipeline × context = {tp} × {p.pipeline} × {p.context} = {self.model_parallel_size}")
        dp = self.data_parallel_size
        per_step = t.micro_batch_size * dp
        if t.global_batch_size % per_step:
            raise RecipeError("train.global_batch_size", t.global_batch_size,
                              f"must be divisible by train.micro_batch_size × data-parallel size = "
                              f"{t.micro_batch_size} × {dp} = {per_step} (data-parallel size = world {self.world_size} / "
                              f"(TP {tp} × PP {p.pipeline} × CP {p.context}))")
        if p.virtual_pipeline and self.num_microbatches % p.pipeline:
            raise RecipeError("train.global_batch_size", t.global_batch_size,
                              f"the interleaved schedule needs micro-batches per step ({self.num_microbatches}) "
                              f"to be a multiple of parallel.pipeline = {p.pipeline}")
        if p.sequence_parallel and tp == 1:
            raise RecipeError("parallel.sequence_parallel", True, "needs parallel.tensor > 1")
        if p.context > 1 and m.seq_length % (2 * p.context):
            raise RecipeError("model.seq_length", m.seq_length,
                              f"must be divisible by 2 × parallel.context = {2 * p.context} "
                              f"(each context-parallel rank holds two load-balanced chunks)")
        if p.sequence_parallel and m.seq_length % (tp * p.context):
            raise RecipeError("model.seq_length", m.seq_length,
                              f"must be divisible by parallel.tensor × parallel.context = {tp * p.context} for sequence parallelism")
        if p.overlap_param_gather and not p.distributed_optimizer:
            raise RecipeError("parallel.overlap_param_gather", True, "needs parallel.distributed_optimizer: true")
        if m.position_embedding == "learned" and m.max_positions < m.seq_length:
            raise RecipeError("model.max_position_embeddings", m.max_position_embeddings,
                              f"is smaller than model.seq_length = {m.seq_length}")
        if m.arch == "gpt" and m.position_embedding == "relative":
            raise RecipeError("model.position_embedding", "relative", "is for t5; gpt uses learned, rope, alibi or none")
        if self.tokenizer.type == "null" and m.vocab_size is None:
            raise RecipeError("model.vocab_size", None, "tokenizer.type: null needs an explicit model.vocab_size")
        if self.optim.warmup_iters > (self.optim.decay_iters or t.iters):
            raise RecipeError("optim.warmup_iters", self.optim.warmup_iters,
                              f"is longer than the decay horizon ({self.optim.decay_iters or t.iters} steps)")
        if m.moe is not None and p.expert > 1 and m.moe.get("num_experts", 0) % p.expert:
            raise RecipeError("parallel.expert", p.expert, f"must divide model.moe.num_experts = {m.moe.get('num_experts')}")
        if p.expert > 1 and dp % p.expert:
            raise RecipeError("parallel.expert", p.expert, f"must divide the data-parallel size {dp}")
        return self


def _largest_divisor(n: int, below: int) -> int:
    return max(d for d in range(1, below + 1) if n % d == 0)
