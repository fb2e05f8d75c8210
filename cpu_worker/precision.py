"""Target precision on the CPU: fp32 (the reference), bf16 (weights; activations fp32), a block
format (int8: Q8_0's weights, activations 16 bits per block of 32; q8_0, q4_0 alias int4, q4_1:
llama.cpp's blocks of 32, activations int8 per block), or int8-row (W8A8, one scale per weight row
and per token).

Lossless means equal to the target as it runs at that precision, in ``--mode ar``: every
kernel here gives a row the same result whatever other rows share its call (see
``cpu_worker.kernels.int8`` for why torch's own dynamic int8 does not).
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from cpu_worker.kernels import exact_attention
from cpu_worker.kernels.bf16_rows import bf16_linear_maker
from cpu_worker.kernels.block_quant import quantize_block_linears
from cpu_worker.kernels.int8 import quantize_linears
from cpu_worker.model.embedding import StoredEmbedding
from cpu_worker.model.fusion import fuse_projections
from cpu_worker.model.llama import LlamaDecoder
from ipc.dtypes import BLOCK_PRECISIONS, KV_DTYPES, TARGET_PRECISIONS, WIDE_ACTIVATION_PRECISIONS
from ipc.placement import cpu_flags

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def block_type(precision: str) -> str | None:
    """The block type (q8_0, q4_0, q4_1) a block precision holds its weights in; None for the others."""
    return BLOCK_PRECISIONS.get(precision)


def head_block_type(precision: str) -> str | None:
    """The block type of the lm_head at a block precision: the 4-bit ones keep it at q8_0, as llama.cpp
    keeps its output matrix wider than Q4 (Q6_K). Why: SmolLM2-135M-Instruct's is its tied embedding,
    and at q4_0 the KL divergence from fp32 was 0.36 with a q4_0 lm_head against 0.29 with a q8_0 one,
    0.054 -> 0.0035 at q4_1 (python -m tools.bench_quality, docs/performance.md)."""
    kind = block_type(precision)
    return "q8_0" if kind in ("q4_0", "q4_1") else kind


def activation_bits(precision: str) -> int:
    """How wide a block precision quantizes its activations per block of 32: 8 or 16 bits."""
    return 16 if precision in WIDE_ACTIVATION_PRECISIONS else 8


def is_integer(precision: str) -> bool:
    """int8-row and the block formats: integer weights and activations, fp32 in between."""
    return precision == "int8-row" or precision in BLOCK_PRECISIONS


def activation_dtype(precision: str) -> torch.dtype:
    """The dtype of activations at a target precision: fp32 at every one (bf16 is the weights'
    dtype: ``bf16_rows``)."""
    if precision not in TARGET_PRECISIONS:
        raise ValueError(f"target dtype {precision!r} is not one of {', '.join(TARGET_PRECISIONS)}")
    return torch.float32


def kv_cache_dtype(precision: str, requested: str = "auto") -> torch.dtype:
    """The KV cache's dtype: ``fp32``/``bf16`` as asked, or ``auto``: bf16 for a bf16 target on the
    native kernels (exact; without them its trees are ~1e-6 off decoding, which bf16 K/V would
    amplify) and for an integer one where bf16 attention is cheap (our exact attention kernel
    builds, or the CPU has native bf16); else fp32.

    Why: a bf16 cache halves the cache and the bytes attention reads per step. Tree rows and
    decodes read the same rounded keys and values back from the cache (``Attention.forward``;
    the kernel widens them exactly and computes in fp32), so an int8 target stays bit-exact
    against ``--mode ar`` with the same cache. What it costs in fidelity is small beside int8's
    own: on the demo target, teacher-forced top-1 agreement with the fp32 target over 30
    held-out prompts x 128 tokens was 0.9945 with an fp32 cache and 0.9951 with bf16. An fp32
    target keeps an fp32 cache: whoever asked for fp32 asked for full precision, and where its
    linears are not batch-invariant a bf16 rounding of K/V amplifies their ~1e-6 tree/decode
    difference to ~1e-2 (measured on the demo target); ask for bf16 explicitly to trade that. A bf16
    target asked for bf16's memory: its cache is bf16 too.
    """
    if requested not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {requested!r} is not one of {', '.join(KV_DTYPES)}")
    if requested == "auto":
        if precision == "bf16" and exact_attention.available():
            return torch.bfloat16
        if is_integer(precision) and (exact_attention.available() or cpu_has_native_bf16()):
            return torch.bfloat16
        return activation_dtype(precision)
    activation_dtype(precision)  # the precision's own check
    return torch.bfloat16 if requested == "bf16" else torch.float32


def apply_precision(model: ModuleT, precision: str) -> tuple[ModuleT, torch.dtype]:
    """Convert ``model`` in place; returns it and the dtype of its activations and KV cache."""
    dtype = activation_dtype(precision)
    if precision == "bf16":
        narrow_weights(model.float())
        if isinstance(model, LlamaDecoder):
            fuse_projections(model)  # as loading does
        return model, dtype
    if is_integer(precision):
        kind = block_type(precision)
        if kind is None:
            quantize_linears(model.float())
        else:
            quantize_block_linears(model.float(), kind, head_block_type(precision), activation_bits(precision))
        if isinstance(model, LlamaDecoder):
            fuse_projections(model)  # q/k/v and gate/up in one call each, the same bits
        return model, dtype
    return model.to(dtype), dtype


def narrow_weights(model: nn.Module) -> None:
    """A bf16 target from an fp32 model, in place: each linear layer on bf16 weights (``bf16_rows``),
    each embedding table stored in bf16 (a tied lm_head keeps sharing it), as ``load_target_model``
    builds it tensor by tensor."""
    make = bf16_linear_maker()
    narrowed: dict[int, nn.Parameter] = {}  # id of an fp32 table -> its bf16 replacement
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Embedding):
            stored = StoredEmbedding(module.weight.detach().to(torch.bfloat16))
            narrowed[id(module.weight)] = stored.weight
            _replace(model, name, stored)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            weight = narrowed.get(id(module.weight), module.weight)
            _replace(model, name, make(weight, module.bias, name))


def _replace(model: nn.Module, name: str, replacement: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
