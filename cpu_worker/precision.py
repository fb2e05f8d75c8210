"""Target precision on the CPU: fp32 (the reference), bf16, or int8 (W8A8, per-token).

Lossless means equal to the target as it runs at that precision, in ``--mode ar``: every
kernel here gives a row the same result whatever other rows share its call (see
``cpu_worker.int8`` for why torch's own dynamic int8 does not).
"""

from __future__ import annotations

import logging
from typing import TypeVar

import torch
from torch import nn

from ipc.dtypes import TARGET_PRECISIONS

from .cores import cpu_flags
from .int8 import quantize_linears

log = logging.getLogger(__name__)

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def activation_dtype(precision: str) -> torch.dtype:
    """The dtype of activations and of the KV cache at a target precision."""
    if precision not in TARGET_PRECISIONS:
        raise ValueError(f"target dtype {precision!r} is not one of {', '.join(TARGET_PRECISIONS)}")
    return torch.bfloat16 if precision == "bf16" else torch.float32


def apply_precision(model: ModuleT, precision: str) -> tuple[ModuleT, torch.dtype]:
    """Convert ``model`` in place; returns it and the dtype of its activations and KV cache."""
    dtype = activation_dtype(precision)
    if precision == "bf16" and not cpu_has_native_bf16():
        log.warning("this CPU has no native bf16 (avx512_bf16/amx_bf16): bf16 will be slow; fp32 is likely faster")
    if precision == "int8":
        quantize_linears(model.float())
        return model, dtype
    return model.to(dtype), dtype
