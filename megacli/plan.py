"""What a recipe will cost, before anything starts: layout, parameters per rank, memory per rank.

Pure arithmetic on the recipe (no torch), so `--dry-run` is instant. Memory follows
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
activations per layer = s·b·h·(34 + 5·a·s/h) bytes at 16-bit, and its TP/SP/recompute forms.
"""

from __future__ import annotations

from dataclasses import dataclass

from megacli.recipe.pretrain import TrainingRecipe

GIB = 1024**3


def padded_vocab_size(vocab_size: int, *, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron pads the embedding to a multiple of divisible_by × TP (whole 128-row tiles per rank)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # word (+ learned position) embedding
    per_layer: int
    final_norm: int
    output_layer: int  # 0 when tied to the embedding

    def total(self, num_layers: int) -> int:
        return self.embedding + self.per_layer * num_layers + self.final_norm + self.output_layer


def count_params(recipe: TrainingRecipe, vocab_size: int) -> ParamCounts:
    """Parameters of the unsharded GPT-style model (BERT/T5 are close enough for an estimate)."""
    m = recipe.model
    h, hd = m.hidden_size, m.head_dim
    q_width, kv_width = m.num_attention_heads * hd, m.query_groups * hd
    bias = m.add_bias_linear
    norm = h if m.normalization == "rmsnorm" else 2 * h
    attn = h * (q_width + 2 * kv_width) + q_width * h
    attn += (q_width + 2 * kv_width) * int(bias or m.add_qkv_bias) + h * int(bias)
    glu = 2 if m.activation == "swiglu" else 1
    mlp = h * m.ffn_size * glu + m.ffn_size * h + (m.ffn_size * glu + h) * int(bias)
    vocab = padded_vocab_size(vocab_size, divisible_by=m.make_vocab_size_divisible_by, tensor_parallel=recipe.parallel.tensor)
    pos = m.max_positions * h if m.position_embedding == "learned" else 0
    return ParamCounts(
        embedding=vocab * h + pos,
        per_layer=attn + mlp + 2 * norm + (2 * hd if m.qk_layernorm else 0),
        final_norm=norm,
        output_layer=vocab * h if m.untie_embeddings else 0,
    )


@dataclass(frozen=True)
class RankMemory:
    params: int
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    optimizer_gib_without_dist_opt: float
    activations_gib: float

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib


def bytes_per_param(precision: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state incl. fp32 master copy) bytes per parameter with Adam.
    Mixed precision keeps fp32 gradients (grad_reduce_in_fp32) and an fp32 master copy."""
    if precision == "fp32":
        return 4, 4, 8
    return 2, 4, 12


def activation_bytes_per_layer(recipe: TrainingRecipe) -> float:
    """Korthikanti et al. 2022, eqs. 1-5 (16-bit activations; fp32 doubles it).
    Without parallelism: s·b·h·(34 + 5·a·s/h). TP splits all but 10·s·b·h; SP splits those too;
    selective recompute drops the 5·a·s/h attention term; full recompute keeps only the layer input."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    s = m.seq_length // p.context
    b, h, a, tp = t.micro_batch_size, m.hidden_size, m.num_attention_heads, p.tensor
    attn_term = 5 * a * s / h
    if p.recompute == "full":
        per = 2 * s * b * h / (tp if p.sequence_parallel else 1)
    elif p.sequence_parallel:
        per = s * b * h * (34 + (0 if p.recompute == "selective" else attn_term)) / tp
    else:
        per = s * b * h * (10 + (24 + (0 if p.recompute == "selective" else attn_term)) / tp)
    return per * (2 if t.precision == "fp32" else 1)


def estimate(recipe: TrainingRecipe, vocab_size: int) -> tuple[ParamCounts, RankMemory]:
    """Memory of the busiest rank: the first pipeline stage (embedding + in-flight activations)."""
    p = recipe.parallel
    counts = count_params(recipe, vocab_size)
    layers = recipe.layers_per_stage
    stage_params = counts.per_layer * layers + counts.embedding
    if p.pipeline == 1:
        stage_params += counts.final_norm + counts.output_layer
    rank_params = stage_params // p.tensor
    w, g, o = bytes_per_param(recipe.train.precision)
    dp = recipe.data_parallel_size
    optimizer = o / dp if p.distributed_optimizer else o
    # 1F1B: the first stage holds activations of `pipeline` micro-batches (L/p layers each = L layers),
    # interleaving adds (1 + (p-1)/(p·v)) (Narayanan et al. 2021).
    in_flight_layers = layers * min(p.pipeline, recipe.num_microbatches)
    if p.virtual_pipeline:
        in_flight_layers *= 1 + (p.pipeline - 1) / (p.pipeline * p.virtual_pipeline)
    act = activation_bytes_per_layer(recipe) * in_flight_layers
    mem = RankMemory(
        params=rank_params,
        weights_gib=rank_params * w / GIB,
        grads_gib=rank_params * g / GIB,
        optimizer_gib=rank_params * optimizer / GIB,
        optimizer_gib_without_dist_opt=rank_params * o / GIB,
        activations_gib=act / GIB,
    )
    return counts, mem


def flops_per_token(recipe: TrainingRecipe, n_params: int, attention_factor: int = 12) -> float:
    """Training FLOPs per token: 6·N for the matmuls plus attention scores, 12·L·h·s
    (attention_factor=6 is the causal-halved convention)."""
    m = recipe.model
    return 6 * n_params + attention_factor * m.num_layers * m.hidden_size * m.seq_length
