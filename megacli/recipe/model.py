"""The model section of a recipe: the architecture Megatron-Core builds (GPT, BERT, T5; dense or
mixture of experts). Every field documents itself; defaults are GPT-2-style."""

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
        return self


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
    """Normalize queries and keys per head before attention."""
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

    @model_validator(mode="after")
    def _rope_scaling_needs_gpt_rope(self):
        if self.rope_scaling is not None and (self.arch != "gpt" or self.position_embedding != "rope"):
            raise RecipeError("model.rope_scaling", self.rope_scaling.type,
                              f"needs model.arch = gpt and model.position_embedding = rope (got {self.arch}, {self.position_embedding})")
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
