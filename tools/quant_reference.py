"""Reference quantization formats, computed by dequantizing and multiplying in float.

Why: to judge a precision before a kernel exists, and to set the bar a kernel must meet, the
quality benchmark (``tools/bench_quality``) runs a real model with each linear layer's weight and
input rounded exactly as a format rounds them. An integer kernel computes the same products
exactly (up to float summation order), so these figures are the format's, not a kernel's.

llama.cpp's block formats follow its reference quantizers (``quantize_row_*_ref`` in ggml):
blocks of 32 along the input dimension, scales stored as fp16, Q8_0 for the activations that
meet Q8_0 and Q4_0 weights (Q8_1, which carries the same values, for Q4_1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cpu_worker.kernels.block_quant import round_half_away

BLOCK = 32
Rounding = Callable[[torch.Tensor], torch.Tensor]


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """The value an fp16 scale field holds."""
    return x.to(torch.float16).to(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension ({x.shape[-1]}) is not a multiple of the block ({block})")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """Q8_0: per 32 values d = amax / 127, q = round(x / d) in [-127, 127], value q * fp16(d)."""
    blocks = _blocks(x, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = round_half_away(blocks * inverse)
    return (q * _fp16(d)).reshape(x.shape)


def q4_0(x: torch.Tensor) -> torch.Tensor:
    """Q4_0: d = (the value of largest magnitude) / -8, q = min(15, trunc(x / d + 8.5)), value (q - 8) * fp16(d)."""
    blocks = _blocks(x, BLOCK)
    index = blocks.abs().argmax(-1, keepdim=True)
    d = blocks.gather(-1, index) / -8
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc(blocks * inverse + 8.5), max=15)
    return ((q - 8) * _fp16(d)).reshape(x.shape)


def q4_1(x: torch.Tensor) -> torch.Tensor:
    """Q4_1: d = (max - min) / 15, q = min(15, trunc((x - min) / d + 0.5)), value q * fp16(d) + fp16(min)."""
    blocks = _blocks(x, BLOCK)
    low = blocks.amin(-1, keepdim=True)
    d = (blocks.amax(-1, keepdim=True) - low) / 15
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc((blocks - low) * inverse + 0.5), max=15)
    return (q * _fp16(d) + _fp16(low)).reshape(x.shape)


def int16_blocks(x: torch.Tensor) -> torch.Tensor:
    """Activations kept at 16 bits: per 32 values d = amax / 32767, q = round(x / d) (VNNI's
    int16 pair products, ``vpdpwssd``, multiply these by weights widened from 8 or 4 bits)."""
    blocks = _blocks(x, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 32767
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).reshape(x.shape)


def int8_per_row(x: torch.Tensor) -> torch.Tensor:
    """One symmetric scale per row (today's int8: per output channel for weights, per token for inputs)."""
    x = x.float()
    d = x.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(x * inverse).clamp(-127, 127) * d


def unchanged(x: torch.Tensor) -> torch.Tensor:
    return x.float()


ROUNDINGS: dict[str, Rounding] = {
    "q8_0": q8_0, "q4_0": q4_0, "q4_1": q4_1, "int16-b32": int16_blocks, "int8-row": int8_per_row,
    "fp32": unchanged,
}


@dataclass(frozen=True)
class Format:
    """How one linear layer rounds: its weight, its input, and the lm_head's weight (llama.cpp
    keeps the output matrix wider than Q4 by default, at Q6_K: Q8_0 stands in for it here)."""

    name: str
    weight: str
    activation: str
    head_weight: str


FORMATS: dict[str, Format] = {
    format.name: format for format in (
        Format("int8-row", "int8-row", "int8-row", "int8-row"),  # today's W8A8: per channel, per token
        Format("q8_0", "q8_0", "q8_0", "q8_0"),  # llama.cpp Q8_0 x Q8_0
        Format("w8b32-a32", "q8_0", "fp32", "q8_0"),  # block weights, float activations
        Format("w8b32-a16", "q8_0", "int16-b32", "q8_0"),  # block weights, 16-bit block activations
        Format("q4_0", "q4_0", "q8_0", "q8_0"),  # llama.cpp Q4_0 x Q8_0
        Format("q4_1", "q4_1", "q8_0", "q8_0"),  # llama.cpp Q4_1 x Q8_1
        Format("w4b32-a16", "q4_0", "int16-b32", "q8_0"),  # Q4_0 weights, 16-bit block activations
        Format("w4mb32-a16", "q4_1", "int16-b32", "q8_0"),  # Q4_1 weights, 16-bit block activations
    )
}


class RoundedLinear(nn.Module):
    """``y = round_a(x) round_w(W)^T + b``, with W rounded once."""

    def __init__(self, linear: nn.Linear, weight: str, activation: str):
        super().__init__()
        self.weight = nn.Parameter(ROUNDINGS[weight](linear.weight.detach()), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self._round_input = ROUNDINGS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._round_input(x), self.weight, self.bias)


def apply_format(model: nn.Module, format: Format) -> nn.Module:
    """Swap every nn.Linear of a float32 model (in place) for its rounded twin."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            weight = format.head_weight if name == "lm_head" else format.weight
            setattr(model, name, RoundedLinear(child, weight, format.activation))
        else:
            apply_format(child, format)
    return model
