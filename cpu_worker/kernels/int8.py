"""W8A8 int8 linear layers whose result for a row never depends on the other rows of its call.

Why: a tree verification runs T rows through each linear layer at once, a plain decode one
row. With one activation scale per call (torch's ``quantize_dynamic``), a token's int8
rounding depends on the largest activation among all rows, so the tree and the decode of the
same prefix disagree and Dovetail is no longer lossless against the int8 target. Here every
row gets its own scale (per-token), every output channel its own weight scale (per-channel),
and the integer products are accumulated exactly, so a row's result is the same whatever
rows share its call.

Two kernels, the same rule. Ours (``int8_gemv.c`` via ``int8_kernel``: built for this CPU on
first use, AMX tiles or AVX512-VNNI where present) quantizes each row symmetrically and streams
the weights once per call; it decodes faster than fbgemm (docs/kernels.md). For weights held [N, K] on a
VNNI CPU, calls from 24 rows on (prefill, large trees) send the same quantized rows through
torch's int8 GEMM (``torch._int_mm``), which gives the same integer sums, and the same float
epilogue follows, so the path a call takes never changes a row's bits. Where the kernel cannot
be built (no C compiler), fbgemm's is used as follows.

On fbgemm/oneDNN's fast dynamic int8 GEMM (which computes one activation scale and
zero point from the min and max of the whole input): each row is divided by its own absolute
maximum, so every row lies in [-1, 1], and one extra "pin" row holding +1 and -1 is appended.
The kernel's min and max are then exactly -1 and +1 for every call, so its quantization
parameters never change with the batch; the rows are scaled back by their maxima after the
integer GEMM. The pin row costs one more row of a memory-bound kernel.

Everything else in a decoder layer is row-wise except attention, whose batched masked call
rounds differently per batch (~1e-6); one flipped int8 rounding turns that into ~1e-2 in the
logits, enough to change a near-tied token. So with these layers the engine verifies trees
row by row in attention (``TargetEngine.exact_tree``) and a node's logits equal a decode's
bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from cpu_worker.kernels import int8_kernel
from cpu_worker.kernels.linear import LinearKernel
from cpu_worker.native import library as native
from ipc.placement import cpu_flags

_TINY = torch.finfo(torch.float32).tiny


def _cpu_has_vnni() -> bool:
    """VNNI accumulates u8 x s8 products in int32; without it fbgemm's int16 pair sums can
    saturate unless activations use 7 bits (``reduce_range``)."""
    return bool({"avx512_vnni", "avx_vnni"} & cpu_flags())


class RowwiseInt8Linear(LinearKernel):
    """``y = x W^T + b`` with int8 W (per output channel) and int8 x (per row)."""

    row_invariant = True  # per-row scales and exact integer sums, on either kernel

    _pin: torch.Tensor  # the [1, in_features] row of +1/-1 that fixes the kernel's quantization range

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        values, scales = _quantize_per_row(weight.detach())
        self._build(values, scales, bias)

    @classmethod
    def concatenate(cls, layers: Sequence[RowwiseInt8Linear]) -> RowwiseInt8Linear:
        """One layer whose outputs are ``layers``' outputs side by side, bit for bit: weights are
        quantized per output row and sums are exact, so stacking the quantized rows changes no
        value. Why: a decoder layer's q/k/v (and gate/up) read the same input, and one call then
        quantizes it once and streams one larger matrix (fewer calls, better bandwidth)."""
        if len({layer.in_features for layer in layers}) != 1:
            raise ValueError("only layers reading the same input width can be concatenated")
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        if all(layer.kernel != "fbgemm" for layer in layers):
            # Our kernel's weights join as they are held (no unpacking and packing again).
            weights = int8_kernel.Int8Weights.concatenate([layer._int8 for layer in layers])
            fused.out_features, fused.in_features = weights.out_features, weights.in_features
            fused.bias = None if weights.bias is None else nn.Parameter(weights.bias, requires_grad=False)
            fused.kernel = layers[0].kernel
            fused._int8 = weights
            return fused
        bias = None
        if any(layer.bias is not None for layer in layers):
            bias = torch.cat([layer.bias if layer.bias is not None else torch.zeros(layer.out_features)
                              for layer in layers])
        fused._build(torch.cat([layer.int8_weight() for layer in layers]),
                     torch.cat([layer.weight_scales() for layer in layers]), bias)
        return fused

    def _build(self, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Hold int8 ``values`` [out, in] with their fp64 per-row ``scales`` on the fastest kernel."""
        self.out_features, self.in_features = values.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)
        # Our kernel where it builds (decodes near the bandwidth roofline), else fbgemm's.
        self.kernel = int8_kernel.kernel_name()
        if self.in_features > int8_kernel.MAX_IN_FEATURES:
            self.kernel = "fbgemm"  # wider than any Llama's; the kernel's int32 sums could overflow
        if self.kernel != "fbgemm":
            self._int8 = int8_kernel.Int8Weights(values, scales, self.bias)
            return
        with warnings.catch_warnings():
            # torch's wording: "... quantize_per_channel and other quantized tensor creation functions ... deprecated"
            warnings.filterwarnings("ignore", message=".*quantize_per_channel.*deprecated")
            warnings.filterwarnings("ignore", message=".*_make_per_channel_quantized_tensor.*deprecated")
            quantized = torch._make_per_channel_quantized_tensor(
                values, scales.to(torch.float64), torch.zeros(self.out_features, dtype=torch.long), 0)
        self._packed = torch.ops.quantized.linear_prepack(quantized, None)
        self.reduce_range = not _cpu_has_vnni()
        pin = torch.zeros(1, self.in_features)
        pin[0, 0], pin[0, -1] = 1.0, -1.0
        self.register_buffer("_pin", pin, persistent=False)

    def weight_scales(self) -> torch.Tensor:
        """The per-row weight scales [out] in fp64 (the kernel keeps them in fp32, exactly)."""
        if self.kernel != "fbgemm":
            return self._int8.scales.to(torch.float64)
        return torch.ops.quantized.linear_unpack(self._packed)[0].q_per_channel_scales()

    def int8_weight(self) -> torch.Tensor:
        """The int8 weight values [out, in], whichever kernel holds them (a new tensor where
        they are held packed or prepacked)."""
        if self.kernel != "fbgemm":
            return self._int8.values
        return torch.ops.quantized.linear_unpack(self._packed)[0].int_repr()

    @property
    def nbytes(self) -> int:
        """Resident bytes: the int8 weight and its scales (any layout, fbgemm's prepacked one too)."""
        return self.out_features * (self.in_features + 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self.kernel != "fbgemm":
            if rows.dtype != torch.float32 or not rows.is_contiguous():
                rows = rows.to(torch.float32).contiguous()
            return self._int8(rows).reshape(*shape[:-1], self.out_features)
        rows = rows.to(torch.float32)
        count = rows.shape[0]
        # Few, fused ops: at small widths (the 9M demo) their overhead, not the GEMM, is the cost.
        maxima = torch.linalg.vector_norm(rows, ord=float("inf"), dim=1, keepdim=True).clamp_(min=_TINY)
        pinned = torch.empty(count + 1, self.in_features)
        torch.div(rows, maxima, out=pinned[:count])
        pinned[count:] = self._pin
        out = torch.ops.quantized.linear_dynamic(pinned, self._packed, self.reduce_range)[:count].mul_(maxima)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, W8A8 per-row, {self.kernel}"


# The source dtypes the library's quantizer reads as they are (dovetail.h's dtype codes).
_QUANTIZER_DTYPES = {torch.float32: native.DTYPE_FP32, torch.float16: native.DTYPE_FP16,
                     torch.bfloat16: native.DTYPE_BF16}


def _quantize_per_row(weight: torch.Tensor, rows_per_chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel (row): the int8 values [out, in] and fp64 scales [out].
    The kernel library's quantizer where it builds (torch's ``quantize_per_channel`` arithmetic,
    10x faster: it was half of a 7B target's load) reads fp32, fp16 or bf16 rows as they are,
    widening each exactly as it goes; else torch's, on fp32 copies a chunk of rows at a time (a
    loader quantising a 7B-sized matrix from fp16 then holds the fp16 source and the int8 result,
    not also a whole fp32 copy and its absolute values: +0.5 GB at peak)."""
    out_features, in_features = weight.shape
    scales = torch.empty(out_features, dtype=torch.float64)
    values = torch.empty(weight.shape, dtype=torch.int8)
    library = native.load()
    if library is not None and weight.dtype in _QUANTIZER_DTYPES:
        source = weight.contiguous()
        row_scales = torch.empty(out_features, dtype=torch.float32)
        status = library.dovetail_quantize_weight_rows(source.data_ptr(), _QUANTIZER_DTYPES[weight.dtype],
                                                       values.data_ptr(), row_scales.data_ptr(), out_features,
                                                       in_features, torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"quantizing a {out_features}x{in_features} weight: no memory for a row buffer")
        scales.copy_(row_scales)
        return values, scales
    for first in range(0, out_features, rows_per_chunk):
        rows = slice(first, first + rows_per_chunk)
        # Rows quantise independently, so chunks give the whole matrix's bits.
        chunk_values, scales[rows] = _torch_quantize_rows(weight[rows].to(torch.float32).contiguous())
        values[rows] = chunk_values
    return values, scales


def _torch_quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's per-channel int8 quantization of fp32 ``rows``: the reference the library's matches."""
    scales = (torch.linalg.vector_norm(rows, ord=float("inf"), dim=1) / 127.0).clamp(min=1e-12).double()
    with warnings.catch_warnings():
        # Quantized tensors are deprecated for a future torch; they work in the 2.11-2.14 we support.
        warnings.filterwarnings("ignore", message=".*quantize_per_channel.*deprecated")
        zero_points = torch.zeros(rows.shape[0], dtype=torch.long)
        return torch.quantize_per_channel(rows, scales, zero_points, 0, torch.qint8).int_repr(), scales


def quantize_linears(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear under ``model`` (in place) for a RowwiseInt8Linear."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, RowwiseInt8Linear(child.weight, child.bias))
        else:
            quantize_linears(child)
    return model
