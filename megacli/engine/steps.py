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


def gpt_forward_step(*, context_parallel: int, custom_loss=None):
    """Megatron forward_step for GPT: every stage reads the micro-batch (cheap), the first uses
    tokens, the last labels and the loss mask."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if context_parallel > 1:
            from megatron.core.utils import get_batch_on_this_cp_rank

            batch = get_batch_on_this_cp_rank(batch)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(token_loss_func, batch["loss_mask"], labels=batch["labels"], custom=custom_loss)

    return forward_step
