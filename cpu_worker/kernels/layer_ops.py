"""A decoder layer's small fp32 steps on our native kernel (``layer_ops.c``): RMSNorm, the
fused q/k/v output's rotary and KV-cache write, and the fused gate/up output's SiLU.

Why: at a decode step these act on a few thousand floats, and torch runs each as a chain of
small ops whose dispatch, not arithmetic, is the cost (see ``layer_ops.c``). One foreign call
each does the same work. Every row is computed on its own in a fixed order, so a tree node's
values equal its later decode step's bit for bit, as with the linears and attention.

Used for fp32 tensors on the CPU without autograd, whenever the library builds; training
(autograd) and CUDA drafts keep torch's ops, and ``DOVETAIL_LAYER_OPS=torch`` forces them (for
comparisons).
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

from cpu_worker.native import library as native

FORCE_VARIABLE = "DOVETAIL_LAYER_OPS"
CACHE_DTYPES = (torch.float32, torch.bfloat16)  # rope_qkv rounds into a bf16 cache as torch's copy does


@cache
def available() -> bool:
    """Whether these steps run on the kernel in this process."""
    if os.environ.get(FORCE_VARIABLE, "").lower() == "torch":
        return False
    return native.load() is not None


def applies(*tensors: torch.Tensor) -> bool:
    """fp32 CPU tensors, none wanting a gradient (and no gradient being recorded), and the kernel built."""
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors):
        return False
    return all(tensor.dtype == torch.float32 and tensor.device.type == "cpu" for tensor in tensors) and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension; fp32 CPU tensors.
    ``library``: another build (tests compare builds)."""
    library = library or native.load()
    assert library is not None
    rows = x.contiguous()
    out = torch.empty_like(rows)
    dim = rows.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"an RMSNorm weight of shape {tuple(weight.shape)} for rows of {dim}")
    library.dovetail_rms_norm(rows.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(), rows.numel() // dim,
                              dim, eps, torch.get_num_threads())
    return out


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             start: int, heads: int, kv_heads: int, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """A fused q/k/v projection's output [1, S, (heads + 2 kv_heads) * head_dim] for S tokens at
    cache slots [start, start + S): their keys, rotated by ``cos``/``sin`` [S, head_dim], and their
    values go to one layer's cache ``keys``/``values`` [1, kv_heads, max_len, head_dim]
    (contiguous, fp32 or bf16); returns the rotated queries [1, heads, S, head_dim], fp32."""
    library = library or native.load()
    assert library is not None
    _, length, width = qkv.shape
    head_dim = keys.shape[-1]
    max_len = keys.shape[2]
    if qkv.shape[0] != 1 or width != (heads + 2 * kv_heads) * head_dim or keys.shape[:2] != (1, kv_heads) \
            or values.shape != keys.shape:
        raise ValueError(f"q/k/v rows of width {width} do not fit {heads} + 2 x {kv_heads} heads of {head_dim} "
                         f"or a cache of shape {tuple(keys.shape)}")
    if cos.shape != (length, head_dim) or sin.shape != (length, head_dim):
        raise ValueError(f"cos/sin of shapes {tuple(cos.shape)}, {tuple(sin.shape)} for {length} rows of {head_dim}")
    if start < 0 or start + length > max_len:
        raise ValueError(f"slots [{start}, {start + length}) outside a {max_len}-slot cache")
    if not (keys.is_contiguous() and values.is_contiguous()) or keys.dtype not in CACHE_DTYPES \
            or values.dtype != keys.dtype:
        raise ValueError(f"rope_qkv writes into a contiguous fp32 or bf16 cache layer, not {keys.dtype}/{values.dtype}")
    rows = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(1, heads, length, head_dim)
    library.dovetail_rope_qkv(rows.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), keys.data_ptr(),
                              values.data_ptr(), int(keys.dtype == torch.bfloat16), length, heads, kv_heads,
                              head_dim, max_len, start, torch.get_num_threads())
    return q


def silu_mul(gate: torch.Tensor, up: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``silu(gate) * up``, fp32 CPU tensors of one shape [..., width] (the two halves of a fused
    gate/up output are read in place). ``library``: another build (tests compare builds)."""
    library = library or native.load()
    assert library is not None
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    width = gate.shape[-1]
    gates, ups = gate.reshape(-1, width), up.reshape(-1, width)  # views where the layout allows
    if gates.stride() != ups.stride() or gates.stride(-1) != 1:
        gates, ups = gates.contiguous(), ups.contiguous()
    out = torch.empty(gate.shape)
    rows = gates.shape[0]
    library.dovetail_silu_mul(gates.data_ptr(), ups.data_ptr(), gates.stride(0) if rows > 1 else width,
                              out.data_ptr(), rows, width, torch.get_num_threads())
    return out


def clear_cache() -> None:
    available.cache_clear()
