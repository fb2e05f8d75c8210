"""Target precision on the CPU: fp32 (default), bf16, or int8 linear layers."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from ipc.dtypes import TARGET_PRECISIONS

log = logging.getLogger(__name__)

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))


class Int8WeightLinear(nn.Module):
    """Weight-only int8 linear (per-output-channel scales), for torch builds without
    ``torch.ao.quantization.quantize_dynamic``."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight_int8", torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight_int8, self.scales)
        out = out.reshape(*shape[:-1], -1)
        return out if self.bias is None else out + self.bias


def _quantize_int8(model: ModuleT) -> ModuleT:
    try:
        from torch.ao.quantization import quantize_dynamic
    except ImportError:
        return _int8_weight_only(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Dynamic int8: int8 weights, activations quantized per call (fbgemm/onednn kernels).
        return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)


def _int8_weight_only(model: ModuleT) -> ModuleT:
    """Swap every nn.Linear under ``model`` (in place) for an Int8WeightLinear."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8WeightLinear(child))
        else:
            _int8_weight_only(child)
    return model


def apply_precision(model: ModuleT, target_dtype: str) -> tuple[ModuleT, torch.dtype]:
    """Convert ``model`` in place; returns it and the dtype of its activations and KV cache."""
    if target_dtype == "fp32":
        return model.float(), torch.float32
    if target_dtype == "bf16":
        if not cpu_has_native_bf16():
            log.warning("this CPU has no native bf16 (avx512_bf16/amx_bf16): bf16 will be slow; fp32 is likely faster")
        return model.to(torch.bfloat16), torch.bfloat16
    if target_dtype == "int8":
        return _quantize_int8(model.float()), torch.float32
    raise ValueError(f"target dtype {target_dtype!r} is not one of {', '.join(TARGET_PRECISIONS)}")
