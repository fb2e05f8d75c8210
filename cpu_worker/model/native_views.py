"""The C library's view of a model's modules: a linear layer on one of our kernels, an RMSNorm's
weight, a fused decoder layer, as the native layer loops read them (``dovetail_linear``,
``dovetail_layer``). The target's loop (``cpu_worker.native_layers``) and a CPU draft head's
(``cpu_worker.model.native_head``) both build on these."""

from __future__ import annotations

import math

import torch

from cpu_worker.kernels.bf16_rows import RowInvariantBf16Linear
from cpu_worker.kernels.block_quant import ACTIVATION_PLANES, TYPES, BlockQuantLinear
from cpu_worker.kernels.fp32_rows import MAX_KERNEL_ROWS, RowInvariantFp32Linear
from cpu_worker.kernels.int8 import RowwiseInt8Linear
from cpu_worker.model.llama import DecoderLayer, LlamaSpec, RMSNorm
from cpu_worker.native import library as native
from cpu_worker.native.library import Layer as _Layer
from cpu_worker.native.library import Linear as _Linear
from cpu_worker.native.library import Shape as _Shape

# DOVETAIL_NATIVE_LAYERS=python keeps every layer, the target's and a CPU draft head's, on torch (comparisons).
LAYERS_VARIABLE = "DOVETAIL_NATIVE_LAYERS"

_LINEAR_FP32 = native.LINEAR_FP32
_INT8_KINDS = {"rows": native.LINEAR_INT8, "packed": native.LINEAR_INT8_PACKED, "tiles": native.LINEAR_INT8_TILES}


def describe_linear(module: torch.nn.Module) -> tuple[_Linear, int] | None:
    """The C view of a linear layer on one of our kernels, and the most rows a call of it may
    have there and keep its Python bits; None for any other layer."""
    if isinstance(module, RowwiseInt8Linear) and module.kernel != "fbgemm":
        weights = module._int8
        limit = weights.matmul_min_rows - 1 if weights.matmul_min_rows is not None else MAX_KERNEL_ROWS
        bias = None if weights.bias is None else weights.bias.data_ptr()
        return _Linear(_INT8_KINDS[weights.layout], weights.stored.data_ptr(),
                       weights.scales.data_ptr(), weights.offsets.data_ptr(), bias, weights.out_features,
                       weights.in_features), limit
    if isinstance(module, BlockQuantLinear):  # row-invariant at any row count
        blocks = module.weights
        bias = None if module.bias is None else module.bias.data_ptr()
        minimums = None if blocks.minimums is None else blocks.minimums.data_ptr()
        return _Linear(native.LINEAR_BLOCK, blocks.data.data_ptr(), None, None, bias, module.out_features,
                       module.in_features, blocks.scales.data_ptr(), minimums, TYPES[blocks.kind],
                       ACTIVATION_PLANES[module.activation_bits]), MAX_KERNEL_ROWS
    if isinstance(module, (RowInvariantFp32Linear, RowInvariantBf16Linear)):
        bias = None if module.bias is None else module.bias.data_ptr()
        kind = _LINEAR_FP32 if isinstance(module, RowInvariantFp32Linear) else native.LINEAR_BF16
        return _Linear(kind, module.weight.data_ptr(), None, None, bias, module.out_features,
                       module.in_features), MAX_KERNEL_ROWS
    return None


def norm_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """An RMSNorm's weight as the C loop reads it (fp32, contiguous), or None."""
    if isinstance(module, RMSNorm) and module.weight.dtype == torch.float32 and module.weight.is_contiguous():
        return module.weight
    return None


def describe_layer(layer: torch.nn.Module, first_of_head: bool = False) -> tuple[_Layer, int] | None:
    """The C view of a fused decoder layer on our kernels and the most rows a call may have (as
    ``describe_linear``); None for any other layer. ``first_of_head``: a draft head's first layer,
    which may have no input norm (its attention reads the fused rows as they are)."""
    if not isinstance(layer, DecoderLayer):
        return None
    attention, mlp = layer.self_attn, layer.mlp
    if attention.qkv_proj is None or mlp.gate_up_proj is None:
        return None
    linears = [describe_linear(attention.qkv_proj), describe_linear(attention.o_proj),
               describe_linear(mlp.gate_up_proj), describe_linear(mlp.down_proj)]
    views = [item for item in linears if item is not None]
    unnormed = first_of_head and isinstance(layer.input_layernorm, torch.nn.Identity)
    input_norm = None if unnormed else norm_weight(layer.input_layernorm)
    post_norm = norm_weight(layer.post_attention_layernorm)
    if len(views) < len(linears) or post_norm is None or (input_norm is None and not unnormed):
        return None
    limit = min(limit for _, limit in views)
    return _Layer(None if input_norm is None else input_norm.data_ptr(), post_norm.data_ptr(),
                  *(view for view, _ in views)), limit


def loop_shape(spec: LlamaSpec, max_len: int) -> _Shape:
    """A model's sizes as the C layer loops read them (``dovetail_shape``), over caches of ``max_len`` slots."""
    return _Shape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size, max_len,
                  spec.rms_norm_eps, 1.0 / math.sqrt(spec.head_dim))


class Scratch:
    """fp32 scratch for the native calls: as large as each call asks, kept for the next call only up to
    ``keep`` floats (a step's or a tree's stays; a long prompt chunk's is freed after its call, not held
    for the server's life)."""

    def __init__(self, keep: int):
        self.keep = keep
        self._kept = torch.empty(0)

    def at_least(self, floats: int) -> torch.Tensor:
        """At least ``floats`` floats; hold the tensor until the call that reads it returns."""
        if self._kept.numel() >= floats:
            return self._kept
        scratch = torch.empty(floats, dtype=torch.float32)
        if floats <= self.keep:
            self._kept = scratch
        return scratch

    @property
    def kept_floats(self) -> int:
        return self._kept.numel()
