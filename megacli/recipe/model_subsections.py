"""The optional sub-sections of a recipe's model: mixture of experts (model.moe), RoPE scaling
(model.rope_scaling) and multi-latent attention (model.mla)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from megacli.recipe.base import RecipeError, Section


class MoESection(Section):
    """Mixture of experts (Megatron-Core's MoELayer): a router sends each token to ``router_topk`` of
    ``num_experts`` MLPs and sums their outputs weighted by the router probabilities. Experts are
    split over ``parallel.expert`` ranks (expert parallelism) and tokens travel to them by all-to-all."""

    num_experts: PositiveInt
    """Routed experts per MoE layer (Mixtral: 8)."""
    router_topk: PositiveInt = 2
    """Experts each token is sent to."""
    ffn_hidden_size: Optional[PositiveInt] = None
    """MLP inner width of each expert; default model.ffn_hidden_size."""
    aux_loss_coeff: float = Field(1e-2, ge=0)
    """Weight of the Switch-Transformer load-balancing loss, E · Σ_i f_i · P_i per layer
    (f_i: share of routed tokens, P_i: mean router probability of expert i); 0 = off."""
    capacity_factor: Optional[PositiveFloat] = None
    """Expert capacity as a multiple of the even share (tokens × top-k / experts); tokens over it are
    dropped (they skip the experts, keeping the residual). null = dropless."""
    drop_policy: Literal["probs", "position"] = "probs"
    """With a capacity: which tokens an over-full expert keeps: highest router probability, or earliest position."""
    pad_to_capacity: bool = False
    """With a capacity: pad every expert's input to exactly its capacity (static shapes)."""
    shared_expert_ffn_hidden_size: Optional[PositiveInt] = None
    """Inner width of an always-on shared expert added to the routed output (Qwen2-MoE); null = none."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x · w), a learned per-token gate (Qwen2-MoE)."""
    layer_freq: Union[PositiveInt, list[Literal[0, 1]]] = 1
    """Which layers are MoE: N = every N-th layer starting with the first (1 = all), or one 0/1 per layer."""
    router_dtype: Optional[Literal["fp32", "fp64"]] = "fp32"
    """Precision of the router logits, softmax and top-k; null = the model's precision."""
    router_pre_softmax: bool = False
    """Softmax over all experts before the top-k, probabilities kept as they are (Qwen2-MoE without
    norm_topk_prob); false: softmax over the top-k logits, i.e. renormalised (Mixtral)."""
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach the experts' ranks: all-to-all (only the routed tokens travel) or all-gather."""
    grouped_gemm: bool = True
    """On CUDA, run all local experts as one grouped GEMM when the grouped_gemm package is installed
    (Megatron's GroupedMLP); sequential per-expert GEMMs otherwise (and always on CPU)."""
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """softmax (Mixtral, DeepSeek-V2) or sigmoid (DeepSeek-V3: a sigmoid score per expert, the top-k
    scores renormalised to sum to 1 when router_topk > 1)."""
    router_expert_bias: bool = False
    """sigmoid only: a per-expert bias added to the scores when choosing the top k (not to the
    weights), nudged towards balance during training (DeepSeek-V3's auxiliary-loss-free balancing;
    Hugging Face's e_score_correction_bias)."""
    router_bias_update_rate: float = Field(1e-3, ge=0)
    """With router_expert_bias: how far each training step moves the bias towards balance."""
    router_num_groups: Optional[PositiveInt] = None
    """Group-limited routing (DeepSeek): experts form this many equal groups; each token first picks
    router_group_topk groups (by the sum of each group's top router_topk / router_group_topk scores),
    then its router_topk experts among them. null = no groups."""
    router_group_topk: Optional[PositiveInt] = None
    """Group-limited routing: the groups each token picks (Hugging Face's topk_group)."""
    router_topk_scaling_factor: Optional[PositiveFloat] = None
    """Factor on the routing weights after the top-k (Hugging Face's routed_scaling_factor); null = 1."""

    def layer_pattern(self, num_layers: int) -> list[int]:
        """1 for each MoE layer, 0 for each dense one."""
        if isinstance(self.layer_freq, int):
            return [int(i % self.layer_freq == 0) for i in range(num_layers)]
        return list(self.layer_freq)

    @model_validator(mode="after")
    def _consistent(self):
        if self.router_topk > self.num_experts:
            raise RecipeError("model.moe.router_topk", self.router_topk,
                              f"a token cannot go to more than model.moe.num_experts = {self.num_experts} experts")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise RecipeError("model.moe.pad_to_capacity", True, "needs model.moe.capacity_factor (the capacity to pad to)")
        if self.shared_expert_gate and self.shared_expert_ffn_hidden_size is None:
            raise RecipeError("model.moe.shared_expert_gate", True,
                              "needs a shared expert: set model.moe.shared_expert_ffn_hidden_size")
        if isinstance(self.layer_freq, list) and not any(self.layer_freq):
            raise RecipeError("model.moe.layer_freq", self.layer_freq, "marks no layer as MoE (use model.moe: null for a dense model)")
        if self.router_expert_bias and self.router_score_function != "sigmoid":
            raise RecipeError("model.moe.router_expert_bias", True, "needs model.moe.router_score_function = sigmoid "
                              "(Megatron-Core's expert bias is for sigmoid scores)")
        if self.router_pre_softmax and self.router_score_function != "softmax":
            raise RecipeError("model.moe.router_pre_softmax", True, "is a softmax option; sigmoid scores are always "
                              "taken over all experts")
        self._check_groups()
        return self

    def _check_groups(self) -> None:
        groups, picked = self.router_num_groups, self.router_group_topk
        if (groups is None) != (picked is None):
            raise RecipeError("model.moe.router_group_topk" if groups is not None else "model.moe.router_num_groups", None,
                              "group-limited routing needs both model.moe.router_num_groups and model.moe.router_group_topk")
        if groups is None:
            return
        if self.num_experts % groups:
            raise RecipeError("model.moe.router_num_groups", groups,
                              f"must divide model.moe.num_experts = {self.num_experts}")
        if picked > groups:
            raise RecipeError("model.moe.router_group_topk", picked, f"exceeds model.moe.router_num_groups = {groups}")
        if self.router_topk < picked or picked * (self.num_experts // groups) < self.router_topk:
            raise RecipeError("model.moe.router_group_topk", picked,
                              f"with {groups} groups of {self.num_experts // groups} experts cannot give each token "
                              f"model.moe.router_topk = {self.router_topk} experts (at least one per picked group)")


# Fields of model.rope_scaling each scaling type uses (the others must stay unset).
_ROPE_SCALING_FIELDS = {
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_positions"},
    "yarn": {"factor", "original_max_positions", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"},
}


class RopeScalingSection(Section):
    """RoPE scaling for a context longer than pretraining's, as Hugging Face computes it
    (modeling_rope_utils): the inverse frequencies are rescaled once, and for yarn the attention
    scores are multiplied by attention_factor**2 (HF scales cos and sin by attention_factor)."""

    type: Literal["linear", "llama3", "yarn"]
    """linear (positions divided by factor), llama3 (Llama 3.1+: low frequencies divided by factor,
    high ones kept, a smooth band between), yarn (YaRN: per-dimension blend plus an attention factor)."""
    factor: PositiveFloat
    """Context extension factor."""
    low_freq_factor: Optional[PositiveFloat] = None
    """llama3: wavelengths above original_max_positions / low_freq_factor are divided by factor."""
    high_freq_factor: Optional[PositiveFloat] = None
    """llama3: wavelengths below original_max_positions / high_freq_factor are kept."""
    original_max_positions: Optional[PositiveInt] = None
    """llama3 (required), yarn (default model.max_position_embeddings): pretraining's context length."""
    beta_fast: Optional[PositiveFloat] = None
    """yarn: rotations bounding the extrapolated (unscaled) dimensions; null = 32."""
    beta_slow: Optional[PositiveFloat] = None
    """yarn: rotations bounding the interpolated (scaled) dimensions; null = 1."""
    attention_factor: Optional[PositiveFloat] = None
    """yarn: factor on cos and sin; null = 0.1 ln(factor) + 1 (or the mscale / mscale_all_dim ratio)."""
    mscale: Optional[float] = None
    """yarn (DeepSeek): with mscale_all_dim, attention_factor = (0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1)."""
    mscale_all_dim: Optional[float] = None
    """yarn (DeepSeek): see mscale."""
    truncate: Optional[bool] = None
    """yarn: round the correction range to whole dimensions; null = true."""

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, data):
        if isinstance(data, dict) and data.get("type") == "dynamic":
            raise RecipeError("model.rope_scaling.type", "dynamic",
                              "dynamic (NTK) scaling recomputes the frequencies from each batch's length; Megatron-Core "
                              "has no position-dependent rotary embedding, so it is not supported (use linear, llama3 or yarn)")
        return data

    @model_validator(mode="after")
    def _fields_of_the_type(self):
        allowed = _ROPE_SCALING_FIELDS[self.type]
        for name in sorted(self.model_fields_set - allowed - {"type"}):
            if getattr(self, name) is not None:
                raise RecipeError(f"model.rope_scaling.{name}", getattr(self, name), f"is not used by {self.type} scaling")
        if self.type == "llama3":
            for name in ("low_freq_factor", "high_freq_factor", "original_max_positions"):
                if getattr(self, name) is None:
                    raise RecipeError(f"model.rope_scaling.{name}", None, "llama3 scaling needs it")
            if self.high_freq_factor <= self.low_freq_factor:
                raise RecipeError("model.rope_scaling.high_freq_factor", self.high_freq_factor,
                                  f"must be greater than low_freq_factor = {self.low_freq_factor}")
        return self


class MLASection(Section):
    """Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's MLASelfAttention): keys and values
    come from one compressed latent per token (kv_lora_rank wide, RMS-normalised), and each head's
    query and key are a part without position (qk_head_dim) plus a RoPE-rotated part
    (qk_pos_emb_head_dim) whose key is shared by all heads. Needs model.position_embedding = rope;
    model.rope_scaling applies to the rotated part, and with yarn the attention scale is multiplied
    by (0.1 mscale_all_dim ln factor + 1)^2 (DeepSeek's rule)."""

    q_lora_rank: Optional[PositiveInt] = None
    """Width of the compressed (RMS-normalised) query; null = queries projected directly from the
    hidden state (DeepSeek-V2-Lite)."""
    kv_lora_rank: PositiveInt
    """Width of the compressed key/value latent."""
    qk_head_dim: PositiveInt
    """Per-head query/key dimensions without position embedding (Hugging Face's qk_nope_head_dim)."""
    qk_pos_emb_head_dim: PositiveInt
    """Per-head query/key dimensions RoPE rotates (Hugging Face's qk_rope_head_dim); even."""
    v_head_dim: PositiveInt
    """Per-head value dimensions."""

    @model_validator(mode="after")
    def _even_rope(self):
        if self.qk_pos_emb_head_dim % 2:
            raise RecipeError("model.mla.qk_pos_emb_head_dim", self.qk_pos_emb_head_dim, "must be even (RoPE rotates pairs)")
        return self
