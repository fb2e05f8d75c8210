"""Where the draft head runs and in which precision.

The same code path runs on CUDA and on the CPU: nothing here requires CUDA.
"""

from __future__ import annotations

import logging

import torch

from ipc.dtypes import torch_dtype

log = logging.getLogger(__name__)


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``auto`` picks CUDA when available, else the CPU, and logs which; anything else is explicit."""
    if isinstance(name, torch.device):
        device = name
    elif name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("draft device: %s (auto%s)", device,
                 "" if device.type == "cuda" else ": no CUDA device available")
        return device
    else:
        device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"draft device {device} requested but CUDA is not available")
    return device


def resolve_dtype(device: torch.device, dtype: str | torch.dtype | None = None) -> torch.dtype:
    """fp16 by default on CUDA (bf16 or fp32 selectable); fp32 only on the CPU, where half
    precision matmuls are slow or unsupported and fp32 keeps the draft deterministic."""
    if dtype is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported draft dtype {dtype}; choose one of fp16, bf16, fp32")
    if device.type != "cuda" and dtype != torch.float32:
        raise ValueError(f"draft dtype {dtype} is only supported on CUDA; on the CPU the draft runs in fp32, int8 or "
                         "q4_0")
    return dtype
