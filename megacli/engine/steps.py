"""forward_step and loss functions per model type, as Megatron's schedules call them."""

from __future__ import annotations

import importlib
from functools import partial

import torch


def load_custom_loss(ref: str | None, kwargs: dict):
    """`package.module:function` from the recipe, bound to its kwargs. The function gets per-token
    losses [b, s] plus labels and loss_mask (keywords) and returns per-token losses to sum."""
    if ref is None:
        return None
    module_name, fn_name = ref.split(":")
    from megacli.errors import UserError

    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"train.loss = {ref!r}: cannot import it ({exc})") from None
    return partial(fn, **kwargs)


def token_loss_func(loss_mask, output_tensor, *, labels=None, custom=None):
    """Sum of per-token losses under the mask, the token count, and a report for logging.
    Megatron divides by the global token count (calculate_per_token_loss)."""
    losses = output_tensor.float()
    if custom is not None:
        losses = custom(losses, labels=labels, loss_mask=loss_mask)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    report = {"lm loss": torch.stack([loss.detach(), num_tokens.float().detach()])}
    return loss, num_tokens, report


def example_mask(batch: dict):
    """Packed instruction data: [b, 1, s, s], True where a token would attend to another example
    (the causal part is the attention's own); None for plain token streams."""
    segments = batch.get("segments")
    if segments is None:
        return None
    return segments[:, None, :, None] != segments[:, None, None, :]


def gpt_forward_step(*, context_parallel: int, custom_loss=None):
    """Megatron forward_step for GPT: every stage reads the micro-batch (cheap), the first uses
    tokens, the last labels and the loss mask."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if context_parallel > 1:
            from megacli.engine.core_compat import batch_on_this_cp_rank

            batch = batch_on_this_cp_rank(batch)
        output = model(batch["tokens"], batch["position_ids"], example_mask(batch), labels=batch["labels"])
        return output, partial(token_loss_func, batch["loss_mask"], labels=batch["labels"], custom=custom_loss)

    return forward_step


def bert_loss_func(loss_mask, sentence_order, output_tensor, *, labels=None, custom=None):
    """Megatron's BERT objective for one micro-batch: masked-LM mean over the masked tokens plus,
    with the binary head, the sentence-order (SOP) cross-entropy mean over the samples. The schedule
    averages it over micro-batches (and DDP over data-parallel ranks): calculate_per_token_loss is
    off for bert. Reports hold [mean, 1] per micro-batch, so their sums over micro-batches and ranks
    divided by the counts are the averages that were optimised."""
    import torch.nn.functional as F

    lm_losses, sop_logits = output_tensor
    lm_losses = lm_losses.float()
    if custom is not None:
        lm_losses = custom(lm_losses, labels=labels, loss_mask=loss_mask)
    mask = loss_mask.view(-1).float()
    lm_loss = torch.sum(lm_losses.view(-1) * mask) / mask.sum().clamp(min=1)
    one = torch.ones_like(lm_loss)
    report = {"lm loss": torch.stack([lm_loss.detach(), one])}
    loss = lm_loss
    if sop_logits is not None:
        sop_loss = F.cross_entropy(sop_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1)
        report["sop loss"] = torch.stack([sop_loss.detach(), one])
        loss = loss + sop_loss
    return loss, report


def bert_forward_step(*, token_types: bool, custom_loss=None):
    """BERT micro-batch from Megatron's BERTMaskedWordPieceDataset: tokens, token types (when the
    model has token-type embeddings), a padding mask (the dataset's 1 = token), masked-LM labels
    and the SOP label."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        attend = batch["padding_mask"] == 1
        types = torch.where(attend, batch["types"], 0) if token_types else None  # padded types hold the pad id
        output = model(batch["text"], attend.long(), tokentype_ids=types, lm_labels=batch["labels"])
        return output, partial(bert_loss_func, batch["loss_mask"], batch["is_random"], labels=batch["labels"],
                               custom=custom_loss)

    return forward_step


def t5_forward_step(*, custom_loss=None):
    """T5 micro-batch from Megatron's T5MaskedWordPieceDataset: encoder input with sentinels, decoder
    input and labels. Encoder self-attention and cross-attention see the encoder padding mask
    [b, 1, 1, s_enc] (True = pad); decoder self-attention is causal (its padding only follows the
    targets, so no target sees it). The loss is per token, as GPT's."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        enc_pad = (batch["enc_mask"] < 0.5)[:, None, None, :]
        output = model(batch["text_enc"], batch["text_dec"], enc_pad, None, enc_pad, lm_labels=batch["labels"])
        return output, partial(token_loss_func, batch["loss_mask"], labels=batch["labels"], custom=custom_loss)

    return forward_step


def forward_step_for(recipe, custom_loss=None):
    """The forward_step of the recipe's model.arch (and objective)."""
    m = recipe.model
    if getattr(recipe, "preference", None) is not None:
        return preference_forward_step(recipe.preference)
    if m.arch == "bert":
        return bert_forward_step(token_types=m.token_types > 0, custom_loss=custom_loss)
    if m.arch == "t5":
        return t5_forward_step(custom_loss=custom_loss)
    return gpt_forward_step(context_parallel=recipe.parallel.context, custom_loss=custom_loss)


# ---------------------------------------------------------------- preference tuning


def preference_losses(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, *, pref):
    """Per-pair losses and the chosen and rejected rewards, from the summed completion log-probabilities
    of the policy (and, for dpo/ipo, of the reference) and the completion token counts. The
    definitions are TRL's: DPOTrainer's sigmoid loss (with label smoothing, the cDPO form) and its
    ipo (log-ratios averaged over completion tokens), CPOTrainer's simpo (cpo_alpha 0)."""
    import torch.nn.functional as F

    beta, eps = pref.beta, pref.label_smoothing
    if pref.loss == "simpo":
        chosen_avg, rejected_avg = chosen / chosen_tokens, rejected / rejected_tokens
        logits = chosen_avg - rejected_avg - pref.gamma / beta
        losses = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
        return losses, beta * chosen_avg.detach(), beta * rejected_avg.detach()
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if pref.loss == "ipo":
        delta = chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        delta = chosen_ratio - rejected_ratio
        losses = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pair_logps(loss_mask, output_tensor):
    """Per-token cross-entropies [2b, s] of [chosen; rejected] rows -> summed completion
    log-probabilities and completion token counts, each [b, 2]."""
    logps = -(output_tensor.float() * loss_mask).sum(-1)
    counts = loss_mask.sum(-1)
    b = logps.shape[0] // 2
    return torch.stack([logps[:b], logps[b:]], 1), torch.stack([counts[:b], counts[b:]], 1)


def preference_loss_func(loss_mask, ref_logps, output_tensor, *, pref):
    """Sum of the micro-batch's per-pair losses and its pair count (Megatron divides by the global
    count: the loss is the mean over the batch's pairs), and the metrics as (sum, pairs). A pair
    without completion tokens is the filler of a last partial evaluation batch and counts for nothing."""
    logps, counts = pair_logps(loss_mask, output_tensor)
    real = (counts[:, 0] > 0).float()
    ref = ref_logps.float() if ref_logps is not None else torch.zeros_like(logps)
    safe = counts.clamp(min=1)
    losses, chosen_rewards, rejected_rewards = preference_losses(
        logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], safe[:, 0], safe[:, 1], pref=pref)
    n = real.sum()

    def total(x):
        return torch.stack([(x.detach().float() * real).sum(), n.detach()])

    report = {f"{pref.loss} loss": total(losses), "rewards/chosen": total(chosen_rewards),
              "rewards/rejected": total(rejected_rewards), "rewards/margin": total(chosen_rewards - rejected_rewards),
              "rewards/accuracy": total((chosen_rewards > rejected_rewards).float()),
              "logps/chosen": total(logps[:, 0]), "logps/rejected": total(logps[:, 1])}
    return (losses * real).sum(), n.to(torch.int), report


def pair_rows(batch: dict) -> dict:
    """A micro-batch of b pairs ([b, 2, s] arrays) as 2b rows: the b chosen, then the b rejected."""
    return {k: batch[k].transpose(0, 1).reshape(-1, batch[k].shape[-1])
            for k in ("tokens", "labels", "loss_mask", "position_ids")}


def preference_forward_step(pref):
    """Megatron forward_step for preference pairs: chosen and rejected in one forward, their
    per-token log-probabilities from Megatron's vocab-parallel cross-entropy (the model's labels
    path: no logits gathered over tensor-parallel ranks)."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        rows = pair_rows(batch)
        output = model(rows["tokens"], rows["position_ids"], None, labels=rows["labels"])
        return output, partial(preference_loss_func, rows["loss_mask"], batch.get("ref_logps"), pref=pref)

    return forward_step


def scoring_forward_step():
    """forward_step that reports each pair's summed completion log-probabilities, [b, 2] per
    micro-batch (the reference model's pass)."""

    def loss_func(loss_mask, output_tensor):
        logps, _ = pair_logps(loss_mask, output_tensor)
        return logps.sum() * 0, torch.ones((), dtype=torch.int), {"logps": logps.detach()}

    def forward_step(data_iterator, model):
        rows = pair_rows(next(data_iterator))
        output = model(rows["tokens"], rows["position_ids"], None, labels=rows["labels"])
        return output, partial(loss_func, rows["loss_mask"])

    return forward_step
