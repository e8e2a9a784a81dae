"""The recipe's precision names and the torch dtypes they stand for."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def params_dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]


def precision_of(dtype: torch.dtype) -> str:
    """The precision name of a dtype (fp32 for every other dtype)."""
    return next((name for name, d in DTYPES.items() if d == dtype), "fp32")
