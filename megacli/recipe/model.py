"""The model section of a recipe: the architecture Megatron-Core builds (GPT, BERT, T5; dense or
mixture of experts). Every field documents itself; defaults are GPT-2-style."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from megacli.recipe.base import RecipeError, Section
from megacli.recipe.model_subsections import MLASection, MoESection, RopeScalingSection


def every_nth(n: int, num_layers: int) -> list[int]:
    """Per-layer flags of every n-th layer counting from 1 (layers n, 2n, ...): 1 there, else 0."""
    return [int((i + 1) % n == 0) for i in range(num_layers)]


def every_nth_global(n: int, num_layers: int) -> list[int]:
    """Per-layer flags when every n-th layer is global and the others use the sliding window
    (Megatron's window_attn_skip_freq, Hugging Face's sliding_window_pattern): 1 windowed, 0 global."""
    return [1 - flag for flag in every_nth(n, num_layers)]


def padded_vocab_size(vocab_size: int, *, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron pads the embedding to a multiple of divisible_by × TP (whole 128-row tiles per rank)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


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
