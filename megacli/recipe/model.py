"""The model section of a recipe: the architecture Megatron-Core builds (GPT, BERT, T5; dense or
mixture of experts). Every field documents itself; defaults are GPT-2-style."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from megacli.recipe.base import RecipeError, Section



def every_nth_global(n: int, num_layers: int) -> list[int]:
    """Per-layer flags when every n-th layer is global and the others use the sliding window
    (Megatron's window_attn_skip_freq, Hugging Face's sliding_window_pattern): 1 windowed, 0 global."""
    return [int((i + 1) % n != 0) for i in range(num_layers)]

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


class ModelSection(Section):
    arch: Literal["gpt", "bert", "t5"] = "gpt"
    """Model class: gpt (decoder-only), bert (encoder) or t5 (encoder-decoder)."""
    num_layers: PositiveInt = 12
    """Transformer layers (for t5: encoder layers)."""
    decoder_num_layers: Optional[PositiveInt] = None
    """t5 only: decoder layers (default: num_layers)."""
    hidden_size: PositiveInt = 768
    """Width of the residual stream."""
    num_attention_heads: PositiveInt = 12
    """Attention heads per layer."""
    num_query_groups: Optional[PositiveInt] = None
    """Key/value heads for grouped-query attention; 1 = multi-query; default = num_attention_heads."""
    kv_channels: Optional[PositiveInt] = None
    """Per-head dimension; default hidden_size / num_attention_heads."""
    ffn_hidden_size: Optional[PositiveInt] = None
    """MLP inner width; default 4 * hidden_size."""
    seq_length: PositiveInt = 1024
    """Training sequence length in tokens (for t5: encoder length)."""
    decoder_seq_length: Optional[PositiveInt] = None
    """t5 only: decoder sequence length (default: seq_length / 4, at least 16)."""
    max_position_embeddings: Optional[PositiveInt] = None
    """Size of the learned position table; default seq_length."""
    position_embedding: Literal["learned", "rope", "alibi", "relative", "none"] = "learned"
    """learned (GPT-2, BERT), rope (Llama), alibi (BLOOM-style bias), relative (T5), none."""
    rotary_base: PositiveFloat = 10000.0
    """RoPE base frequency (theta)."""
    rotary_percent: float = Field(1.0, gt=0, le=1)
    """Fraction of each head's dimensions that RoPE rotates."""
    rope_scaling: Optional[RopeScalingSection] = None
    """gpt with rope only: RoPE scaling (Llama 3.1+, YaRN, linear); null = plain RoPE."""
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Norm layer type."""
    norm_epsilon: PositiveFloat = 1e-5
    """Epsilon of the norm layers."""
    activation: Literal["gelu", "gelu_tanh", "swiglu", "geglu", "relu", "squared_relu"] = "gelu"
    """MLP activation: gelu (exact), gelu_tanh (GPT-2's gelu_new), swiglu (gated SiLU), geglu (gated
    tanh-GELU, T5 v1.1), relu, squared_relu."""
    add_bias_linear: bool = True
    """Biases on all linear layers (GPT-2/BERT yes, Llama no)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection even when add_bias_linear is false (Qwen2)."""
    qk_layernorm: bool = False
    """Normalize queries and keys before RoPE and attention (scope: model.qk_norm_scope)."""
    qk_norm_scope: Literal["head", "projection"] = "head"
    """gpt with qk_layernorm only: what one query (key) norm spans. head: each head's head_dim
    features, one gain of head_dim shared by the heads (Qwen3); projection: all heads of the query
    (key) projection at once, gains of num_attention_heads (num_query_groups) × head_dim (OLMo 2;
    under tensor parallelism the sum of squares is all-reduced over the tensor-parallel group)."""
    norm_placement: Literal["pre", "output", "sandwich"] = "pre"
    """gpt only: where a layer's norms sit. pre: before attention and before the MLP (Llama);
    output: none before them, one on the attention output and one on the MLP output before each
    is added to the residual stream (OLMo 2); sandwich: both, before and after each sublayer
    (Gemma 2/3's post_attention_layernorm and post_feedforward_layernorm). The output norms are
    stored as ``self_attn_bda.norm`` and ``mlp_bda.norm``. All keep the final norm."""
    untie_embeddings: bool = False
    """Separate output projection instead of sharing the input embedding."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Hidden (residual) dropout probability."""
    attention_dropout: float = Field(0.0, ge=0, lt=1)
    """Attention-probability dropout."""
    softmax_scale: Optional[PositiveFloat] = None
    """Factor on the attention scores before the softmax; null = 1/sqrt(head dim). T5 uses 1.0 (its
    query weights carry the scale)."""
    vocab_size: Optional[PositiveInt] = None
    """Vocabulary size; default: taken from the tokenizer."""
    make_vocab_size_divisible_by: PositiveInt = 128
    """The embedding is padded to a multiple of this times the tensor-parallel size (fast GEMMs)."""
    padded_vocab_in_loss: bool = False
    """Let the padded vocabulary rows (the embedding's rows past the vocabulary) take part in the
    softmax, as Megatron-LM trains: set it to continue a Megatron-LM run with its own losses. Off,
    their logits are masked out, so the loss depends neither on the padding nor on the TP size."""
    init_method_std: PositiveFloat = 0.02
    """Std of the normal weight initialisation."""
    norm_position: Literal["pre", "post"] = "pre"
    """bert only: pre (a norm before attention and before the MLP, and a final norm: Megatron-LM's
    BERT) or post (a norm after each residual sum and after the embeddings, no final norm: the
    original BERT, Hugging Face's BertForPreTraining)."""
    bert_binary_head: bool = True
    """bert only: train the sentence-order binary head (with its pooler) beside masked LM."""
    bert_token_types: Optional[Literal[0, 2]] = None
    """bert only: token-type (segment) embeddings, 0 or 2; default 2 with the binary head, 0 without
    (Megatron-LM's rule). Hugging Face's *ForMaskedLM models have them without the head."""
    scale_decoder_output: bool = False
    """t5 only: multiply the decoder output by hidden_size**-0.5 before the LM head (the original T5
    with its tied head; T5 v1.1 and flan-T5 do not)."""
    moe: Optional[MoESection] = None
    """Mixture of experts: replace the MLP of some layers by routed experts; null = dense model."""
    sliding_window: Optional[PositiveInt] = None
    """gpt only: sliding-window attention, as Hugging Face defines it (Mistral, Qwen2, Gemma): the
    token at position i attends to positions i - sliding_window + 1 .. i (itself included); null =
    the whole causal prefix. Megatron's window_size is (sliding_window - 1, 0)."""
    sliding_window_layers: Union[PositiveInt, list[Literal[0, 1]], None] = None
    """With sliding_window: which layers are windowed. null = all; N = every N-th layer (N, 2N, ...)
    attends to the whole prefix and the others are windowed (Gemma 2: 2, Gemma 3: 6; Megatron's
    window_attn_skip_freq); or one 0/1 per layer, 1 = windowed (Qwen2's max_window_layers)."""
    rotary_base_local: Optional[PositiveFloat] = None
    """gpt with rope and sliding_window: RoPE base of the windowed layers, which then use plain RoPE
    (Gemma 3's rope_local_base_freq, 10000); null = rotary_base (and rope_scaling) everywhere."""
    attention_softcap: Optional[PositiveFloat] = None
    """gpt only: soft-cap the scaled attention scores to cap * tanh(score / cap) before the mask and
    softmax (Gemma 2: 50); null = off. Runs as explicit matmuls instead of fused SDPA kernels."""
    final_logit_softcap: Optional[PositiveFloat] = None
    """gpt only: soft-cap the output logits to cap * tanh(logit / cap) (Gemma 2: 30); null = off."""
    scale_embeddings: bool = False
    """gpt only: multiply the input embeddings by sqrt(hidden_size), the factor rounded to the
    parameter dtype first (Gemma)."""
    norm_zero_centered_gamma: bool = False
    """Every norm's gain is stored as gamma - 1 (initialised to 0) and applied as 1 + weight (Gemma's
    RMSNorm; Megatron's layernorm_zero_centered_gamma)."""
    mla: Optional[MLASection] = None
    """gpt only: multi-latent attention (DeepSeek) instead of multi-head attention; null = standard attention."""

    @model_validator(mode="after")
    def _rope_scaling_needs_gpt_rope(self):
        if self.rope_scaling is not None and (self.arch != "gpt" or self.position_embedding != "rope"):
            raise RecipeError("model.rope_scaling", self.rope_scaling.type,
                              f"needs model.arch = gpt and model.position_embedding = rope (got {self.arch}, {self.position_embedding})")
        return self

    @model_validator(mode="after")
    def _gpt_attention_features(self):
        gpt_only = {"sliding_window": self.sliding_window, "attention_softcap": self.attention_softcap,
                    "final_logit_softcap": self.final_logit_softcap, "scale_embeddings": self.scale_embeddings}
        for name, value in gpt_only.items():
            if value and self.arch != "gpt":
                raise RecipeError(f"model.{name}", value, f"is for gpt models, not {self.arch}")
        if self.sliding_window_layers is not None and self.sliding_window is None:
            raise RecipeError("model.sliding_window_layers", self.sliding_window_layers, "needs model.sliding_window")
        if isinstance(self.sliding_window_layers, list):
            if len(self.sliding_window_layers) != self.num_layers:
                raise RecipeError("model.sliding_window_layers", self.sliding_window_layers,
                                  f"has {len(self.sliding_window_layers)} entries for model.num_layers = {self.num_layers}")
        if self.sliding_window is not None and not any(self.window_layers()):
            raise RecipeError("model.sliding_window_layers", self.sliding_window_layers,
                              "leaves no layer windowed (set model.sliding_window: null for global attention everywhere)")
        if self.rotary_base_local is not None:
            if self.sliding_window is None or self.position_embedding != "rope":
                raise RecipeError("model.rotary_base_local", self.rotary_base_local,
                                  "needs model.sliding_window and model.position_embedding = rope")
            if self.rope_scaling is not None and self.rope_scaling.type == "yarn":
                raise RecipeError("model.rotary_base_local", self.rotary_base_local,
                                  "cannot be combined with yarn scaling (its attention factor applies to every layer)")
        return self

    @property
    def megatron_window(self) -> tuple[int, int] | None:
        """Megatron's window_size for sliding_window: Hugging Face's window w (token i sees
        i-w+1..i) is Megatron's (w - 1, 0) (token i sees i-left..i)."""
        return None if self.sliding_window is None else (self.sliding_window - 1, 0)

    def window_layers(self) -> list[int]:
        """1 for each sliding-window layer, 0 for each global one (all 0 without a window)."""
        if self.sliding_window is None:
            return [0] * self.num_layers
        pattern = self.sliding_window_layers
        if pattern is None:
            return [1] * self.num_layers
        if isinstance(pattern, int):
            return every_nth_global(pattern, self.num_layers)
        return list(pattern)

    @model_validator(mode="after")
    def _mla_fits(self):
        if self.mla is None:
            return self
        if self.arch != "gpt" or self.position_embedding != "rope":
            raise RecipeError("model.mla", "set", f"needs model.arch = gpt and model.position_embedding = rope "
                              f"(got {self.arch}, {self.position_embedding}): Megatron-Core's MLA rotates part of each head")
        refused = {
            "rotary_percent": (self.rotary_percent != 1.0, "MLA rotates exactly model.mla.qk_pos_emb_head_dim dimensions"),
            "num_query_groups": (self.query_groups != self.num_attention_heads,
                                 "MLA has one key/value head per query head (its latent is what is shared)"),
            "kv_channels": (self.kv_channels is not None, "MLA's head dimensions are set in model.mla"),
            "qk_layernorm": (self.qk_layernorm, "MLA always normalises its compressed query and key/value"),
            "add_qkv_bias": (self.add_qkv_bias, "MLA's projections have no QKV bias"),
            "attention_softcap": (self.attention_softcap is not None, "MLA's core attention has no soft-cap"),
            "rotary_base_local": (self.rotary_base_local is not None, "MLA builds one RoPE for every layer"),
            "softmax_scale": (self.softmax_scale is not None,
                              "MLA's scale is 1/sqrt(qk_head_dim + qk_pos_emb_head_dim), times yarn's mscale_all_dim factor"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise RecipeError(f"model.{name}", getattr(self, name), f"is not supported with model.mla: {why}")
        return self

    @model_validator(mode="after")
    def _gpt_norm_options(self):
        if self.qk_norm_scope != "head" and not (self.arch == "gpt" and self.qk_layernorm):
            raise RecipeError("model.qk_norm_scope", self.qk_norm_scope,
                              f"needs model.arch = gpt and model.qk_layernorm = true (got {self.arch}, {self.qk_layernorm})")
        if self.qk_norm_scope == "projection" and self.normalization != "rmsnorm":
            raise RecipeError("model.qk_norm_scope", self.qk_norm_scope, f"is an RMSNorm (model.normalization = rmsnorm, "
                              f"got {self.normalization})")
        if self.norm_placement != "pre" and self.arch != "gpt":
            raise RecipeError("model.norm_placement", self.norm_placement,
                              f"is a gpt layer option (bert has model.norm_position; got model.arch = {self.arch})")
        return self

    @property
    def gated(self) -> bool:
        """A gated MLP: linear_fc1 holds [gate; up]."""
        return self.activation in ("swiglu", "geglu")

    @property
    def token_types(self) -> int:
        """Token-type embeddings of a BERT (bert_token_types, else 2 with the binary head, else 0)."""
        if self.bert_token_types is not None:
            return self.bert_token_types
        return 2 if self.bert_binary_head else 0

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_ffn_size(self) -> int:
        """MLP inner width of each routed expert (MoE models)."""
        return (self.moe.ffn_hidden_size if self.moe else None) or self.ffn_size

    def moe_layers(self) -> list[int]:
        """1 for each MoE layer, 0 for each dense one (all 0 for a dense model)."""
        return self.moe.layer_pattern(self.num_layers) if self.moe else [0] * self.num_layers

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def dec_seq_length(self) -> int:
        return self.decoder_seq_length or max(16, self.seq_length // 4)

    @property
    def dec_num_layers(self) -> int:
        return self.decoder_num_layers or self.num_layers
