"""bf16 linear layers: bf16 weights, fp32 activations, on our row kernel (``fp32_rows.c``:
``dovetail_bf16_linear``) wherever a C compiler is found.

Why: a bf16 target is chosen to halve fp32's memory and the bytes a decode step streams. Run on
torch's bf16 ops it rounded every activation to bf16 too, took oneDNN's kernels, whose rows
round differently by call (trees only close to decoding, ~1e-2), and was 1.5x slower than fp32
on a CPU without AMX. Here each weight vector is widened to fp32 as it is loaded (exact) and the
fp32 row kernel's fixed order runs on it: a row's bits are the fp32 kernel's on the widened
weights whatever shares its call, so trees verify bit-exactly against decoding, the activations
keep fp32's precision, and a step reads half of fp32's bytes on any x86 CPU.

A prompt's calls of ``PROMPT_GEMM_ROWS`` rows or more (and any of more than ``MAX_KERNEL_ROWS``)
take a GEMM on the widened weights, a slab of rows at a time (so no fp32 copy of a whole matrix is
ever held), as fp32's do: every mode computes those rows in the same calls.
Without the library every call takes that path and trees verify to float tolerance (``Bf16Linear``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from cpu_worker.kernels.fp32_rows import frozen_bias, run_row_kernel, streamed_weight
from cpu_worker.kernels.linear import LinearKernel
from cpu_worker.native import library as native

SLAB_WEIGHTS = 1 << 22  # weights widened at a time for a GEMM call: 16 MB of fp32


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` in fp32 with the bf16 ``weight`` widened a slab of rows at a time."""
    x = x.to(torch.float32)
    slab = max(1, SLAB_WEIGHTS // weight.shape[1])
    parts = [F.linear(x, weight[start:start + slab].to(torch.float32),
                      None if bias is None else bias[start:start + slab])
             for start in range(0, weight.shape[0], slab)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class Bf16Linear(LinearKernel):
    """``y = x W^T + b``: W held in bf16, x and y fp32; every call a GEMM on the widened weights
    (where the row kernel cannot be built: its rows round by call, so it is not row-invariant)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = streamed_weight(weight, torch.bfloat16)  # a tied lm_head shares its embedding's table
        self.bias = frozen_bias(bias)
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return widened_linear(x, self.weight, self.bias)

    @classmethod
    def concatenate(cls, layers: list[Bf16Linear]) -> Bf16Linear:
        """One layer whose outputs are ``layers``' side by side (rows of W are independent on the kernel)."""
        weight = torch.cat([layer.weight.detach() for layer in layers])
        biases = [layer.bias for layer in layers]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(layer.out_features) for b, layer in zip(biases, layers)])
        return cls(weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 weights, fp32 activations"


class RowInvariantBf16Linear(Bf16Linear):
    """``Bf16Linear`` on ``dovetail_bf16_linear`` (a prompt's calls of ``PROMPT_GEMM_ROWS`` rows or
    more, and any of more than ``MAX_KERNEL_ROWS``, on the widened GEMM)."""

    row_invariant = True  # one fixed order per row (a prompt's GEMM rows: the same call in every mode)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        library = native.load()
        if library is None:
            raise RuntimeError("the bf16 row kernel needs the compiled kernel library (a C compiler)")
        super().__init__(weight, bias)
        self._function = library.dovetail_bf16_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_row_kernel(self._function, x, self.weight, self.bias, super().forward)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", row-invariant kernel"


def bf16_linear_maker() -> Callable[[torch.Tensor, torch.Tensor | None, str], Bf16Linear]:
    """Builds each linear layer of a bf16 target from its checkpoint weight as it streams in
    (``WeightPlacer``): on the row kernel where the library builds, else on the widened GEMM."""
    kind = RowInvariantBf16Linear if native.load() is not None else Bf16Linear

    def make(weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> Bf16Linear:
        return kind(weight, bias)
    return make


def bf16_kernel_name(model: nn.Module) -> str:
    """The kernel a bf16 model's linears run: dovetail-bf16 (the row kernel) or F.linear (widened)."""
    exact = any(isinstance(module, RowInvariantBf16Linear) for module in model.modules())
    return "dovetail-bf16" if exact else "F.linear"
