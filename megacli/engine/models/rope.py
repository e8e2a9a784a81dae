"""RoPE scaling (model.rope_scaling) computed as Hugging Face's modeling_rope_utils does.

Megatron-Core's RotaryEmbedding hard-codes Llama 3's low/high frequency factors (1, 4) and original
context (8192), and its YaRN module is built only for multi-latent attention. So the inverse
frequencies are computed here and installed in each chunk's rotary embedding, which training, the
KV-cache path and generation all read. YaRN's attention factor scales cos and sin, i.e. both q and
k: the same as multiplying the attention scores by its square (see ``softmax_scale_factor``).
"""

from __future__ import annotations

import math

import torch


def _plain(*, base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s) -> torch.Tensor:
    low_freq_wavelen = s.original_max_positions / s.low_freq_factor
    high_freq_wavelen = s.original_max_positions / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(*, base: float, dim: int, s, max_positions: int) -> torch.Tensor:
    original = s.original_max_positions or max_positions

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast or 32), correction_dim(s.beta_slow or 1)
    if s.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    extrapolation_share = 1 - ramp
    return interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share


def inverse_frequencies(*, model) -> torch.Tensor:
    """The fp32 inverse frequencies of a recipe's model section (its rotated dimensions only: with
    multi-latent attention, model.mla.qk_pos_emb_head_dim)."""
    dim = model.mla.qk_pos_emb_head_dim if model.mla is not None else int(model.head_dim * model.rotary_percent)
    base, s = float(model.rotary_base), model.rope_scaling
    if s is not None and s.type == "yarn":
        return _yarn(base=base, dim=dim, s=s, max_positions=model.max_positions)
    inv_freq = _plain(base=base, dim=dim)
    if s is None:
        return inv_freq
    return inv_freq / s.factor if s.type == "linear" else _llama3(inv_freq, s)


def attention_factor(scaling) -> float:
    """The factor on cos and sin (1 except for yarn)."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return float(mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim))
    return mscale(scaling.factor)


def softmax_scale_factor(scaling) -> float:
    """What the attention scores are multiplied by beyond the usual scale: cos and sin scaled by a
    factor rotate q and k each scaled by it."""
    return attention_factor(scaling) ** 2


def install(chunk, *, model) -> None:
    """Give a built chunk's rotary embedding the recipe's scaled inverse frequencies and, with
    model.rotary_base_local, give its sliding-window layers' attention (``local_rope``) a second,
    plain table at that base."""
    import copy

    rotary = getattr(chunk, "rotary_pos_emb", None)
    if rotary is None:
        return
    if model.rope_scaling is not None:
        rotary.inv_freq = inverse_frequencies(model=model).to(rotary.inv_freq.device)
    if model.rotary_base_local is None:
        return
    local = copy.copy(rotary)  # inv_freq is a plain attribute (no buffer): the copy gets its own
    dim = int(model.head_dim * model.rotary_percent)
    local.inv_freq = _plain(base=float(model.rotary_base_local), dim=dim).to(rotary.inv_freq.device)
    for module in chunk.modules():
        if getattr(module, "local_rope", False):
            module.__dict__["local_rotary"] = local  # shared, not a submodule (it holds no weights)
