"""What a recipe will cost, before anything starts: layout, parameters per rank, memory per rank.

Pure arithmetic on the recipe (no torch), so `--dry-run` is instant. Memory follows
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
activations per layer = s·b·h·(34 + 5·a·s/h) bytes at 16-bit, and its TP/SP/recompute forms;
the 5·a·s/h term (attention scores, softmax, dropout mask) only where the attention kernel
stores the scores; plus the logits at the loss.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from megacli.recipe.model import padded_vocab_size
from megacli.recipe.pretrain import TrainingRecipe
from megacli.recipe.stages import chunk_layers

GIB = 1024**3


def model_vocab_size(recipe: TrainingRecipe, tokenizer) -> int:
    """The vocabulary the model is built with: model.vocab_size, else the tokenizer's (T5: plus the
    sentinel tokens it lacks, appended as Megatron-LM's vocab_extra_ids)."""
    from megacli.data.tokenizers import SENTINEL

    m = recipe.model
    if m.vocab_size:
        return m.vocab_size
    size = tokenizer.vocab_size
    if m.arch == "t5":
        known = set(tokenizer.vocabulary().values())
        size += sum(SENTINEL.format(k) not in known for k in range(recipe.masking.sentinel_tokens))
    return size


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # word (+ learned position, + BERT token-type) embedding
    per_layer: int  # a dense layer (T5: an encoder layer)
    layers: int  # how many layers (T5: encoder layers), MoE ones included
    final_norm: int  # T5: one per stack
    output_layer: int  # untied output weight and the output bias (BERT: always; T5 tied: a bias)
    heads: int = 0  # BERT: LM-head transform, pooler and binary head; T5: relative position bias tables
    per_decoder_layer: int = 0  # T5: self-attention, cross-attention and MLP
    decoder_layers: int = 0
    moe_layers: int = 0  # how many layers are MoE
    moe_layer: int = 0  # a MoE layer: attention, norms, router, every expert, the shared expert
    moe_layer_active: int = 0  # the part of a MoE layer one token goes through (top-k experts)
    moe_experts: int = 0  # the routed experts' share of moe_layer (split over EP × expert TP)
    replicated: "ParamCounts | None" = None
    """The same parts, counting only what every tensor-parallel rank holds whole (norms, row-parallel
    biases, learned positions, the router, BERT's heads, T5's relative position tables)."""

    @property
    def total(self) -> int:
        return self._sum(self.moe_layer)

    @property
    def active(self) -> int:
        """Parameters one token is multiplied by (for FLOPs): the total for a dense model."""
        return self._sum(self.moe_layer_active)

    def _sum(self, per_moe_layer: int) -> int:
        dense = self.layers - self.moe_layers
        return (self.embedding + self.per_layer * dense + per_moe_layer * self.moe_layers
                + self.per_decoder_layer * self.decoder_layers + self.final_norm + self.output_layer + self.heads)


def _mla_attention_params(m) -> int:
    """Multi-latent attention: query (direct, or down-projection, its norm and up-projection),
    key/value down-projection (latent + shared rotated key), latent norm, up-projection, output."""
    a, heads, h = m.mla, m.num_attention_heads, m.hidden_size
    qk = a.qk_head_dim + a.qk_pos_emb_head_dim
    q = h * heads * qk if a.q_lora_rank is None else h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * heads * qk
    kv = h * (a.kv_lora_rank + a.qk_pos_emb_head_dim) + a.kv_lora_rank + a.kv_lora_rank * heads * (a.qk_head_dim + a.v_head_dim)
    return q + kv + heads * a.v_head_dim * h + h * int(m.add_bias_linear)


def count_params(recipe: TrainingRecipe, vocab_size: int) -> ParamCounts:
    """Parameters of the unsharded model, as Megatron-Core builds GPT, BERT and T5 (engine.models)."""
    m = recipe.model
    h, hd = m.hidden_size, m.head_dim
    q_width, kv_width = m.num_attention_heads * hd, m.query_groups * hd
    bias = int(m.add_bias_linear)
    norm = h if m.normalization == "rmsnorm" else 2 * h
    attn = h * (q_width + 2 * kv_width) + q_width * h
    attn += (q_width + 2 * kv_width) * int(bias or m.add_qkv_bias) + h * bias
    if m.mla is not None:
        attn = _mla_attention_params(m)
    glu = 2 if m.gated else 1

    def mlp_params(ffn: int) -> int:
        return h * ffn * glu + ffn * h + (ffn * glu + h) * bias

    vocab = padded_vocab_size(vocab_size, divisible_by=m.make_vocab_size_divisible_by, tensor_parallel=recipe.parallel.tensor)
    pos = m.max_positions * h if m.position_embedding == "learned" else 0
    qk_norm = (q_width + kv_width if m.qk_norm_scope == "projection" else 2 * hd) if m.qk_layernorm else 0
    norms = (4 if m.norm_placement == "sandwich" else 2) * norm + qk_norm  # sandwich: + output norms
    rest = attn + norms
    layer = rest + mlp_params(m.ffn_size)
    # Held whole by every TP rank: norms, the row-parallel layers' biases (attention output, MLP output).
    rest_whole = norms + h * bias + (_mla_replicated(m) if m.mla is not None else 0)
    layer_whole = rest_whole + h * bias
    output = vocab * h if m.untie_embeddings else 0
    if m.arch == "bert":  # post-LN moves the final norm to the embeddings: the same count
        binary = m.bert_binary_head
        heads = (h * h + h + norm) + ((h * h + h) + (2 * h + 2) if binary else 0)  # LM transform + norm; pooler, binary head
        whole = ParamCounts(embedding=pos + m.token_types * h, per_layer=layer_whole, layers=m.num_layers,
                            final_norm=norm, output_layer=0, heads=heads)
        return ParamCounts(
            embedding=vocab * h + pos + m.token_types * h,
            per_layer=layer, layers=m.num_layers, final_norm=norm,
            output_layer=output + vocab,  # the LM head's output layer always has a bias
            heads=heads, replicated=whole,
        )
    if m.arch == "t5":
        cross = h * q_width + h * 2 * kv_width + q_width * h + (q_width + 2 * kv_width + h) * bias + norm
        tables = 2 * 32 * m.num_attention_heads if m.position_embedding == "relative" else 0  # 32 buckets, per stack
        whole = ParamCounts(embedding=pos, per_layer=layer_whole, layers=m.num_layers, final_norm=2 * norm,
                            output_layer=0, heads=tables, per_decoder_layer=layer_whole + norm + h * bias,
                            decoder_layers=m.dec_num_layers)
        return ParamCounts(
            embedding=vocab * h + pos, per_layer=layer, layers=m.num_layers, final_norm=2 * norm,
            output_layer=output if m.untie_embeddings else vocab,  # tied: the LM head keeps only a bias
            heads=tables, per_decoder_layer=layer + cross, decoder_layers=m.dec_num_layers, replicated=whole,
        )
    moe, moe_whole = {}, {}
    if m.moe is not None:
        e = m.moe
        router = e.num_experts * h + e.num_experts * bias
        shared = mlp_params(e.shared_expert_ffn_hidden_size) + h * int(e.shared_expert_gate) if e.shared_expert_ffn_hidden_size else 0
        expert = mlp_params(m.expert_ffn_size)
        moe = dict(moe_layers=sum(m.moe_layers()), moe_layer=rest + router + shared + e.num_experts * expert,
                   moe_layer_active=rest + router + shared + e.router_topk * expert, moe_experts=e.num_experts * expert)
        shared_whole = (h * bias + h * int(e.shared_expert_gate)) if e.shared_expert_ffn_hidden_size else 0
        moe_whole = dict(moe_layers=moe["moe_layers"], moe_layer=rest_whole + router + shared_whole)
    whole = ParamCounts(embedding=pos, per_layer=layer_whole, layers=m.num_layers, final_norm=norm, output_layer=0,
                        **moe_whole)
    return ParamCounts(embedding=vocab * h + pos, per_layer=layer, layers=m.num_layers, final_norm=norm,
                       output_layer=output, replicated=whole, **moe)


def _mla_replicated(m) -> int:
    """Multi-latent attention's parts every TP rank holds whole: the down-projections and their norms."""
    a, h = m.mla, m.hidden_size
    q_down = h * a.q_lora_rank + a.q_lora_rank if a.q_lora_rank is not None else 0
    return q_down + h * (a.kv_lora_rank + a.qk_pos_emb_head_dim) + a.kv_lora_rank


@dataclass(frozen=True)
class RankMemory:
    params: int
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    optimizer_gib_without_dist_opt: float
    optimizer_gib_with_dist_opt: float
    activations_gib: float
    logits_gib: float = 0.0  # the output layer's logits at the loss (last pipeline stage)
    stage: int = 0  # the pipeline stage this rank belongs to
    reference_gib: float = 0.0  # preference tuning with reference: copy, the frozen second model's weights

    @property
    def total_gib(self) -> float:
        return (self.weights_gib + self.grads_gib + self.optimizer_gib + self.activations_gib + self.logits_gib
                + self.reference_gib)


def rows_per_microbatch(recipe: TrainingRecipe) -> int:
    """Sequences in one micro-batch: preference pairs put their chosen and rejected sequences in one forward."""
    return recipe.train.micro_batch_size * (2 if getattr(recipe, "preference", None) is not None else 1)


def holds_reference_copy(recipe: TrainingRecipe) -> bool:
    """Preference tuning with a frozen second model in memory (reference: copy; simpo needs none)."""
    pref = recipe.preference
    return pref is not None and pref.loss != "simpo" and pref.reference == "copy"


def bytes_per_param(precision: str, *, bf16_grads: bool = False) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state incl. fp32 master copy) bytes per parameter with Adam.
    Mixed precision keeps fp32 gradients (grad_reduce_in_fp32) and an fp32 master copy;
    ``bf16_grads`` (train.grad_reduce_in_bf16): bf16 gradients."""
    if precision == "fp32":
        return 4, 4, 8
    return 2, 2 if bf16_grads else 4, 12


ATTENTION_KERNELS = {
    "flash": "SDPA flash kernel: keeps only the softmax statistics, not the s×s scores",
    "memory-efficient": "SDPA memory-efficient kernel: keeps only the softmax statistics, not the s×s scores",
    "ring": "ring attention (context parallelism): flash-style blocks, recomputed in the backward",
    "math": "SDPA math kernel: stores the s×s scores, softmax and dropout mask (the 5as/h term)",
    "cudnn": "SDPA cuDNN kernel: keeps only the softmax statistics, not the s×s scores",
}


def attention_kernel(recipe: TrainingRecipe, *, device: str) -> str:
    """The kernel engine.attention.CoreAttention runs for this recipe on ``device`` ("cuda" or
    "cpu"), by torch's SDPA rules: on CPU its flash kernel takes masks but not dropout; on CUDA
    flash needs 16-bit inputs without a mask (causal GPT), memory-efficient takes fp32 and masks
    (BERT/T5 padding, ALiBi and T5 biases, packed finetuning), and both need head dims divisible
    by 8 (flash at most 256). torch decides at run time; this is the kernel it is expected to pick."""
    m, t = recipe.model, recipe.train
    if recipe.parallel.context > 1:
        return "ring"
    auto = _auto_attention_kernel(recipe, device=device)
    # train.attention_backend: the chosen kernel where torch would run it, else the math kernel.
    chosen = {"auto": auto, "math": "math", "flash": "flash" if auto == "flash" else "math",
              "efficient": "memory-efficient" if device == "cuda" and m.head_dim % 8 == 0 else "math",
              "cudnn": "cudnn" if device == "cuda" and auto == "flash" else "math"}
    return chosen[t.attention_backend]


def _auto_attention_kernel(recipe: TrainingRecipe, *, device: str) -> str:
    m, t = recipe.model, recipe.train
    if device == "cpu":
        return "math" if m.attention_dropout > 0 else "flash"
    if m.head_dim % 8:
        return "math"
    packed = recipe.sft is not None and recipe.sft.packing  # per-example masks
    masked = m.arch != "gpt" or m.position_embedding == "alibi" or packed
    if t.precision == "fp32" or masked or m.head_dim > 256:
        return "memory-efficient"
    return "flash"


def unsplit_activation_factor(recipe: TrainingRecipe, *, device: str = "cuda") -> int:
    """The part of a layer's activations (× s·b·h bytes) TP does not split: Korthikanti's 10, of
    which 2 are the two hidden-dropout masks: none without dropout; on CPU torch's dropout keeps
    its mask in the activations' dtype (2 bytes), on CUDA as bool (1 byte)."""
    return 8 + (2 * (1 if device == "cuda" else 2) if recipe.model.dropout > 0 else 0)


def activation_bytes_per_layer(recipe: TrainingRecipe, *, kernel: str, device: str = "cuda") -> float:
    """Korthikanti et al. 2022, eqs. 1-5 (16-bit activations; fp32 doubles it).
    Without parallelism: s·b·h·(34 + 5·a·s/h), 2·s·b·h less without hidden dropout (its two masks).
    TP splits all but 10·s·b·h; SP splits those too;
    selective recompute drops the 5·a·s/h attention term, and so does an attention ``kernel`` that
    never stores the scores (all but math); full recompute keeps only the layer input."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    s = m.seq_length // p.context
    b, h, a, tp = rows_per_microbatch(recipe), m.hidden_size, m.num_attention_heads, p.tensor
    attn_term = 5 * a * s / h if kernel == "math" else 0
    unsplit = unsplit_activation_factor(recipe, device=device)
    if p.recompute == "full":
        per = 2 * s * b * h / (tp if p.sp_enabled else 1)
    elif p.sp_enabled:
        per = s * b * h * (unsplit + 24 + (0 if p.recompute == "selective" else attn_term)) / tp
    else:
        per = s * b * h * (unsplit + (24 + (0 if p.recompute == "selective" else attn_term)) / tp)
    return per * (2 if t.precision == "fp32" else 1)


def logits_bytes(recipe: TrainingRecipe, padded_vocab: int) -> float:
    """The logits of one micro-batch at the loss, at their peak: the 16-bit logits and Megatron's
    fp32 copy (its softmax, kept for backward, which becomes the gradient) alive together,
    6·s·b·V/TP bytes (fp32 training: that gradient and its padded-vocabulary-masked copy, 8·s·b·V/TP)."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    s = (m.dec_seq_length if m.arch == "t5" else m.seq_length) // p.context
    return (8 if t.precision == "fp32" else 6) * s * rows_per_microbatch(recipe) * padded_vocab / p.tensor


def estimate(recipe: TrainingRecipe, vocab_size: int, *, device: str = "cuda") -> tuple[ParamCounts, RankMemory]:
    """Memory of a rank of the busiest pipeline stage, with the activations of the attention kernel
    the run uses on ``device`` ("cuda" or "cpu")."""
    counts = count_params(recipe, vocab_size)
    stages = [stage_memory(recipe, counts, vocab_size, stage, device=device) for stage in range(recipe.parallel.pipeline)]
    return counts, max(stages, key=lambda mem: mem.total_gib)


@functools.lru_cache(maxsize=256)
def moe_layers_per_stage(pattern: tuple[int, ...], pipeline: int, virtual_pipeline: int | None,
                         first: int | None, last: int | None) -> tuple[int, ...]:
    """MoE layers on each pipeline stage, for the MoE ``pattern`` (1 per MoE layer) of the model."""
    chunks = chunk_layers(len(pattern), pipeline, virtual_pipeline, first, last)
    return tuple(sum(pattern[i] for chunk in stage for i in chunk) for stage in chunks)


def _stage_params(counts: ParamCounts, stage: int, pipeline: int, layers: int, moe_layers: int, tied_copy: int) -> int:
    """Parameters of pipeline stage ``stage`` (of ``layers`` layers, ``moe_layers`` of them MoE),
    routed experts left out: its layers; the embedding on the first stage; the final norm, output
    layer, heads and ``tied_copy`` (a tied output layer's copy of the word embedding) on the last."""
    if pipeline == 1:  # the whole model (T5 and BERT: their decoder layers and heads too)
        return counts.total - counts.moe_experts * moe_layers
    params = counts.per_layer * (layers - moe_layers) + (counts.moe_layer - counts.moe_experts) * moe_layers
    if stage == 0:
        params += counts.embedding
    if stage == pipeline - 1:
        params += counts.final_norm + counts.output_layer + counts.heads + tied_copy
    return params


def buffer_numel(params: int, dp: int, *, distributed: bool) -> int:
    """Elements of a gradient buffer holding ``params``: Megatron-Core's DDP pads it to a multiple of
    lcm(data-parallel size, 128) for the distributed optimizer (param_and_grad_buffer; each
    parameter's start is also aligned to 64 elements there, which sizes that are multiples of 64,
    as hidden sizes are, never need)."""
    if not distributed or not params:
        return params
    step = math.lcm(dp, 128)
    return -(-params // step) * step


def shard_numel(params: int, dp: int, dp_rank: int) -> int:
    """Elements of ``params`` in data-parallel rank ``dp_rank``'s equal slice of the padded buffer:
    what the distributed optimizer keeps state for on that rank (the padding falls on the last)."""
    shard = buffer_numel(params, dp, distributed=True) // dp
    return max(0, min(shard, params - dp_rank * shard))


def rank_params_of_stage(recipe: TrainingRecipe, counts: ParamCounts, vocab_size: int, stage: int) -> tuple[int, int]:
    """(dense, routed-expert) parameters of a rank of pipeline stage ``stage``."""
    p, m = recipe.parallel, recipe.model
    padded = padded_vocab_size(vocab_size, divisible_by=m.make_vocab_size_divisible_by, tensor_parallel=p.tensor)
    layers = recipe.layers_per_stage[stage]
    moe_layers = moe_layers_per_stage(tuple(m.moe_layers()), p.pipeline, p.virtual_pipeline, p.first_stage_layers,
                                      p.last_stage_layers)[stage] if m.moe is not None else 0
    tied_copy = 0 if m.untie_embeddings else padded * m.hidden_size  # on the last stage, split like the embedding
    stage_params = _stage_params(counts, stage, p.pipeline, layers, moe_layers, tied_copy)
    whole = _stage_params(counts.replicated, stage, p.pipeline, layers, moe_layers, 0) if counts.replicated else 0
    # Routed experts are split over expert parallel × expert tensor parallel, the rest over TP but
    # for what every TP rank holds whole.
    expert_params = counts.moe_experts * moe_layers // (p.expert * recipe.expert_tensor_size)
    return (stage_params - whole) // p.tensor + whole, expert_params


def state_numels(recipe: TrainingRecipe, dense: int, experts: int, *, dp_rank: int = 0,
                 expert_dp_rank: int = 0) -> tuple[int, int]:
    """(gradient-buffer elements, elements the optimizer keeps state for) of a rank holding ``dense``
    and ``experts`` parameters (expert ones reduce and shard over the expert data-parallel group)."""
    dist = recipe.parallel.distributed_optimizer
    dp, edp = recipe.data_parallel_size, recipe.expert_data_parallel_size
    grads = buffer_numel(dense, dp, distributed=dist) + buffer_numel(experts, edp, distributed=dist)
    if not dist:
        return grads, dense + experts
    return grads, shard_numel(dense, dp, dp_rank) + shard_numel(experts, edp, expert_dp_rank)


def stage_memory(recipe: TrainingRecipe, counts: ParamCounts, vocab_size: int, stage: int, *, device: str) -> RankMemory:
    """A rank of pipeline stage ``stage`` (data-parallel rank 0, whose optimizer shard is the fullest):
    its layers; the embedding on the first stage; the final norm, output layer and logits on the last."""
    p = recipe.parallel
    layers = recipe.layers_per_stage[stage]
    last = stage == p.pipeline - 1
    dense, expert_params = rank_params_of_stage(recipe, counts, vocab_size, stage)
    rank_params = dense + expert_params
    w, g, o = bytes_per_param(recipe.train.precision, bf16_grads=recipe.train.grad_reduce_in_bf16)
    grad_numel, state_numel = state_numels(recipe, dense, expert_params)
    padded = padded_vocab_size(vocab_size, divisible_by=recipe.model.make_vocab_size_divisible_by, tensor_parallel=p.tensor)
    sharded = o * (shard_numel(dense, recipe.data_parallel_size, 0)
                   + shard_numel(expert_params, recipe.expert_data_parallel_size, 0))
    # 1F1B: stage k holds activations of (pipeline - k) micro-batches (the first stage: L/p layers
    # each = L layers), interleaving adds (1 + (p-1)/(p·v)) (Narayanan et al. 2021).
    in_flight_layers = layers * min(p.pipeline - stage, recipe.num_microbatches)
    if p.virtual_pipeline:
        in_flight_layers *= 1 + (p.pipeline - 1) / (p.pipeline * p.virtual_pipeline)
    act = activation_bytes_per_layer(recipe, kernel=attention_kernel(recipe, device=device), device=device) * in_flight_layers
    return RankMemory(
        params=rank_params,
        weights_gib=rank_params * w / GIB,
        grads_gib=grad_numel * g / GIB,
        optimizer_gib=state_numel * o / GIB,
        optimizer_gib_without_dist_opt=rank_params * o / GIB,
        optimizer_gib_with_dist_opt=sharded / GIB,
        activations_gib=act / GIB,
        logits_gib=logits_bytes(recipe, padded) / GIB if last else 0.0,
        stage=stage,
        reference_gib=rank_params * w / GIB if holds_reference_copy(recipe) else 0.0,
    )


def flops_per_token(recipe: TrainingRecipe, n_params: int, attention_factor: int = 12) -> float:
    """Training FLOPs per token: 6·N for the matmuls plus, per layer, the scores and their use,
    attention_factor/2 · span · (query-key width + value width): 12·L·h·s for plain multi-head
    attention (attention_factor=6 is the causal-halved convention). A sliding-window layer's span is
    its window; the widths are heads × head_dim (MLA: heads × (qk_head_dim + qk_pos_emb_head_dim)
    and heads × v_head_dim)."""
    m = recipe.model
    heads = m.num_attention_heads
    if m.mla is not None:
        qk_width, v_width = heads * (m.mla.qk_head_dim + m.mla.qk_pos_emb_head_dim), heads * m.mla.v_head_dim
    else:
        qk_width = v_width = heads * m.head_dim
    window = m.sliding_window or m.seq_length
    spans = sum(min(window, m.seq_length) if windowed else m.seq_length for windowed in m.window_layers())
    return 6 * n_params + attention_factor / 2 * spans * (qk_width + v_width)
