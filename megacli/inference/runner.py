"""A checkpoint loaded for decoding (once), and its model run token by token across TP/PP.

Megatron-Core's text-generation controller pins CUDA (a CUDA torch.Generator, CUDA graphs), so
the loop is ours: every step, the first pipeline stage embeds the tokens, hidden states travel
stage to stage by point-to-point sends, the last stage gathers vocab-parallel logits over TP and
broadcasts them down its pipeline group. Every rank then holds the same logits and makes the
same choice (inference.sampling), so only token ids need to agree, never a second broadcast.

Prompts of different lengths are left-padded (``left_padded``): pads are masked out as keys, their
positions (learned embeddings) start at each prompt's first real token; RoPE and ALiBi depend on
relative positions only, so a left-padded prompt scores as it does alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megacli.backend.cpu import device_rewriting_paused
from megacli.errors import UserError


def load_for_decoding(recipe, runtime, *, vocab_size: int):
    """(net, config, checkpoint): the recipe's model with the weights of generate.checkpoint on this
    rank, bare (no wrappers) and in eval mode, and its TransformerConfig."""
    from pathlib import Path

    from megacli.checkpoint.megatron_lm import dist_reader as megatron_lm
    from megacli.checkpoint.source import MEGATRON_LM, kind_of, user_source
    from megacli.engine import checkpoint
    from megacli.engine.models import build_model
    from megacli.engine.models.common import unwrap
    from megacli.engine.models.config import transformer_config

    source = recipe.generate.checkpoint
    ckpt = checkpoint.find_checkpoint(source) if source else None
    if ckpt is None and source and kind_of(Path(source)) == MEGATRON_LM:
        ckpt = megatron_lm.weights_dir(user_source(source, recipe.checkpoint))
    if ckpt is None:
        raise UserError(f"generate.checkpoint = {source!r}: no checkpoint there (a directory with `latest` "
                        f"or an iter_* directory)")
    config = transformer_config(model=recipe.model, parallel=recipe.parallel, precision=recipe.train.precision,
                                on_cuda=runtime.is_cuda)
    chunks = [c.to(runtime.device) for c in build_model(recipe=recipe, config=config, vocab_size=vocab_size)]
    checkpoint.load(source=user_source(ckpt, recipe.checkpoint), chunks=chunks, optimizer=None, scheduler=None,
                    load_optimizer=False)
    return unwrap(chunks[0]).eval(), config, ckpt


@dataclass
class PaddedBatch:
    """Prompts left-padded to one width, with room for max_new_tokens after it."""

    tokens: torch.Tensor  # [b, width + max_new_tokens]: pads and the tokens still to come are 0
    positions: torch.Tensor  # [b, width + max_new_tokens]: 0 at each prompt's first token
    pad_mask: torch.Tensor  # [b, width + max_new_tokens]: True = pad
    width: int


def left_padded(encoded: list[list[int]], *, max_new_tokens: int, device) -> PaddedBatch:
    width = max(map(len, encoded))
    tokens = torch.zeros(len(encoded), width + max_new_tokens, dtype=torch.long, device=device)
    for i, ids in enumerate(encoded):
        tokens[i, width - len(ids) : width] = torch.tensor(ids)
    pads = torch.tensor([width - len(ids) for ids in encoded], device=device)
    cols = torch.arange(width, device=device)
    pad_mask = torch.nn.functional.pad(cols[None, :] < pads[:, None], (0, max_new_tokens))
    positions = (cols[None, :] - pads[:, None]).clamp(min=0)
    positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(max_new_tokens, device=device)], 1)
    return PaddedBatch(tokens=tokens, positions=positions, pad_mask=pad_mask, width=width)


def _prefill_mask(pad_mask: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s], True = masked: pads are never keys, except for themselves (a fully masked
    row would turn a pad's output into NaN, and NaN values poison the real rows' sums)."""
    s = pad_mask.size(1)
    mask = pad_mask[:, None, None, :].expand(-1, 1, s, s).clone()
    mask &= ~torch.eye(s, dtype=torch.bool, device=pad_mask.device)
    return mask


def _step_mask(pad_mask: torch.Tensor, upto: int) -> torch.Tensor | None:
    """Decode-step mask [b, 1, 1, upto] (True = pad key), or None when nothing is padded (the
    attention then needs no mask at all, which is faster)."""
    return pad_mask[:, None, None, :upto] if pad_mask.any() else None


def _full_mask(pad_mask: torch.Tensor, upto: int) -> torch.Tensor | None:
    """Prefill (or cache-less) mask over the first `upto` positions, or None without padding
    (plain causal attention)."""
    return _prefill_mask(pad_mask[:, :upto]) if pad_mask.any() else None


def kv_cache(batch_size: int, length: int, *, use_cache: bool):
    """A KV cache for ``batch_size`` sequences of up to ``length`` tokens, or None: then every step
    runs the whole sequence again."""
    from megacli.engine.models.kv_cache import DecodeContext

    return DecodeContext(batch_size, length) if use_cache else None


class Model:
    """One GPT replica split over this rank's TP/PP group, stepped token by token."""

    def __init__(self, recipe, runtime, *, vocab_size: int, net=None):
        """The recipe's checkpoint (generate.checkpoint) loaded for decoding; or ``net``, a training
        model's own bare chunk (in eval mode while it is used), run as it is: no decode-time
        shortcuts patched into it, and no inference tensors (its cached RoPE tables are used again
        by the training steps after)."""
        from megatron.core import parallel_state as ps

        from megacli.inference.lean import lean_attention_and_mlp, lean_layers, lean_linears

        self.recipe, self.device = recipe, runtime.device
        self.vocab_size = vocab_size  # as training sized it: model.vocab_size, else the tokenizer's
        if net is None:
            self.net, self.config, self.checkpoint = load_for_decoding(recipe, runtime, vocab_size=vocab_size)
            lean_linears(self.net)
            lean_attention_and_mlp(self.net)
            lean_layers(self.net)
            self._no_grad = torch.inference_mode
        else:
            self.net, self.config, self.checkpoint = net, net.config, None
            self._no_grad = torch.no_grad
        self.dtype = self.config.params_dtype
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.prev_rank, self.next_rank = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
        self.last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, context,
                *, all_positions: bool = False) -> torch.Tensor:
        """Logits [b, vocab] of the last position (all_positions: [b, s, vocab]) on every rank."""
        with self._no_grad():
            return self._forward(tokens, positions, mask, context, all_positions=all_positions)

    def _forward(self, tokens, positions, mask, context, *, all_positions: bool) -> torch.Tensor:
        import torch.distributed as dist

        from megacli.engine.core_compat import inference_forward, last_token_logits_only

        b, s = tokens.shape
        if not self.first:
            hidden = torch.empty(s, b, self.config.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(hidden, src=self.prev_rank)
            self.net.set_input_tensor(hidden)
        if context is not None:
            last_token_logits_only(context, not all_positions)
        with device_rewriting_paused(), inference_forward(context):
            out = self.net(tokens, positions, mask, inference_context=context, runtime_gather_output=True)
        if not self.last:
            dist.send(out.contiguous(), dst=self.next_rank)
            shape = (b, s if all_positions else 1, self.vocab_size)
            logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        else:
            # gathered over TP by the output layer; contiguous, since a broadcast sends a view's
            # memory from its first element on, not the view
            logits = (out if all_positions else out[:, -1:])[..., : self.vocab_size].float().contiguous()
        if self.pp_size > 1:
            dist.broadcast(logits, src=self.last_rank, group=self.pp_group)
        return logits if all_positions else logits[:, -1]

    def prefill(self, batch: PaddedBatch, context) -> torch.Tensor:
        """Next-token logits after the prompts (filling the KV cache, if any)."""
        w = batch.width
        return self.forward(batch.tokens[:, :w], batch.positions[:, :w], _full_mask(batch.pad_mask, w), context)

    def all_logits(self, batch: PaddedBatch) -> torch.Tensor:
        """Next-token logits [b, width, vocab] at every position of the prompts (no KV cache)."""
        w = batch.width
        return self.forward(batch.tokens[:, :w], batch.positions[:, :w], _full_mask(batch.pad_mask, w), None,
                            all_positions=True)

    def step(self, tokens: torch.Tensor, batch: PaddedBatch, cur: int, context) -> torch.Tensor:
        """Next-token logits once ``tokens[:, cur]`` is known: that one token through the KV cache,
        or, without one, the whole sequence again."""
        if context is None:
            return self.forward(tokens[:, : cur + 1], batch.positions[:, : cur + 1],
                                _full_mask(batch.pad_mask, cur + 1), None)
        context.sequence_len_offset = cur
        context.enable_decode_mode()
        return self.forward(tokens[:, cur : cur + 1], batch.positions[:, cur : cur + 1],
                            _step_mask(batch.pad_mask, cur + 1), context)


class Seq2Seq:
    """A T5 replica (tensor parallel; Megatron-Core has no T5 pipelining): the encoder runs once
    per batch, the decoder over the whole target prefix at each step (no KV cache: T5's decoder
    inputs here are short, and its relative position biases are computed per length)."""

    def __init__(self, recipe, runtime, *, vocab_size: int, bos: int | None):
        self.recipe, self.device, self.vocab_size = recipe, runtime.device, vocab_size
        self.net, _config, ckpt = load_for_decoding(recipe, runtime, vocab_size=vocab_size)
        self.decoder_start = self._decoder_start(ckpt, bos)

    def _decoder_start(self, ckpt, bos: int | None) -> int:
        from megacli.checkpoint.layout import carried_hf_config

        start = self.recipe.generate.decoder_start_token
        if start is None:
            start = (carried_hf_config(ckpt, self.recipe) or {}).get("decoder_start_token_id", bos)
        if start is None:
            raise UserError("the tokenizer has no BOS token to start the T5 decoder with; set generate.decoder_start_token")
        if not 0 <= start < self.vocab_size:
            raise UserError(f"generate.decoder_start_token = {start} is outside the vocabulary (0..{self.vocab_size - 1})")
        return int(start)

    def encoder_inputs(self, encoded: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts right-padded with ``pad`` [b, width], and their padding mask [b, 1, 1, width] (True = pad)."""
        width = max(map(len, encoded))
        enc = torch.full((len(encoded), width), pad, dtype=torch.long, device=self.device)
        for i, ids in enumerate(encoded):
            enc[i, : len(ids)] = torch.tensor(ids)
        lengths = torch.tensor([len(x) for x in encoded], device=self.device)
        return enc, (torch.arange(width, device=self.device)[None, :] >= lengths[:, None])[:, None, None, :]

    @torch.no_grad()
    def encode(self, enc: torch.Tensor, enc_pad: torch.Tensor) -> torch.Tensor:
        with device_rewriting_paused():
            return self.net(enc, None, enc_pad, None, None, output_encoder_hidden_only=True)

    @torch.no_grad()
    def logits(self, enc, enc_hidden, enc_pad, dec) -> torch.Tensor:
        """[b, vocab] for the next decoder token, gathered over TP."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        with device_rewriting_paused():
            out = self.net(enc, dec, enc_pad, None, enc_pad, encoder_hidden_states=enc_hidden)
        return gather_from_tensor_model_parallel_region(out[:, -1:].contiguous())[:, -1, : self.vocab_size].float()
