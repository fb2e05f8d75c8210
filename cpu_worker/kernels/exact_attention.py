"""Exact attention on our native kernel (``attention.c``): decode steps, tree rows and prompt
chunks, fp32 queries over an fp32 or bf16 KV cache, fp32 arithmetic.

A tree node must attend exactly as the one-token decode of the same prefix would, bit for bit
(an int8 target's per-row rounding can turn a 1e-6 difference into another token). torch's
batched masked attention does not round like its one-row call, so without this kernel tree
rows attend one at a time (``attention.attend_per_row``), each re-reading the whole cached
prefix. The kernel reads the prefix once for all rows and sums every row's keys in the order a
later decode sees them, so decoding and verification both call it and agree. A prompt chunk's
rows (``attend_causal``) are summed the same way, each as its own decode: a prompt's bits then do
not depend on how it is cut into chunks.

Used for fp32 queries over an fp32 or bf16 cache on the CPU, without autograd, whenever the
library builds (a bf16 cache halves the bytes a step reads; its rows are widened exactly, so
decode and tree still agree); ``DOVETAIL_ATTENTION=torch`` forces torch's attention (for comparisons).
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from cpu_worker.native import library as native

FORCE_VARIABLE = "DOVETAIL_ATTENTION"
# A decode step's extra slots (none): made once, as every layer of every step would make them.
_NO_EXTRA_SLOTS = torch.zeros(2, dtype=torch.int64)


@dataclass(frozen=True)
class TreePaths:
    """A tree's rows as attention reads them, made once per tree and used by every layer: each
    node's path of node indices, root first (``rows``, for torch's row-by-row path), and the
    same paths concatenated with where each row's starts (``flat``, ``offsets``: the kernel's)."""

    rows: tuple[torch.Tensor, ...]
    flat: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> TreePaths:
        rows = tuple(torch.as_tensor(path, dtype=torch.int64) for path in paths)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.as_tensor([len(path) for path in rows]), 0)
        return cls(rows=rows, flat=torch.cat(rows), offsets=offsets)

    @property
    def size(self) -> int:
        return len(self.rows)


@cache
def available() -> bool:
    """Whether attention runs on the kernel in this process."""
    if os.environ.get(FORCE_VARIABLE, "").lower() == "torch":
        return False
    return native.load() is not None


CACHE_DTYPES = (torch.float32, torch.bfloat16)  # the kernel widens a bf16 row exactly, then works in fp32


def applies(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether this call can take the kernel: fp32 queries on the CPU over an fp32 or bf16 cache,
    one sequence, a contiguous cache layer, no gradient wanted; then ``available()``."""
    return (q.dtype == torch.float32 and keys.dtype in CACHE_DTYPES and q.device.type == "cpu"
            and keys.shape[0] == 1 and q.shape[0] == 1 and keys.is_contiguous() and not q.requires_grad
            and available())


def check_cache_layer(keys: torch.Tensor, values: torch.Tensor) -> None:
    """The kernels read one contiguous fp32 or bf16 cache layer, keys and values alike: else ValueError."""
    if keys.dtype not in CACHE_DTYPES or values.dtype != keys.dtype or values.shape != keys.shape \
            or not keys.is_contiguous() or not values.is_contiguous():
        raise ValueError(f"keys {keys.dtype} {tuple(keys.shape)} and values {values.dtype} {tuple(values.shape)}: "
                         "the kernel reads one contiguous fp32 or bf16 cache layer")


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, shared: int, tree: TreePaths | None = None,
           library: ctypes.CDLL | None = None) -> torch.Tensor:
    """q [1, heads, rows, head_dim] over one layer's cache ``keys``/``values`` [1, kv_heads,
    max_len, head_dim]: every row sees slots [0, shared), then (a tree, whose rows sit at the
    slots after ``shared`` in node order) slot shared + n for each node n of its path, root
    first. Returns [1, heads, rows, head_dim]. ``library``: another build (tests compare builds)."""
    library = library or native.load()
    assert library is not None
    _, heads, rows, head_dim = q.shape
    kv_heads, max_len = keys.shape[1], keys.shape[2]
    # The kernel trusts its slot indices: a row must see at least one key, all inside the cache.
    used = shared + (tree.size if tree is not None else 0)
    if used < 1 or used > max_len:
        raise ValueError(f"attention over {shared} shared slots and {used - shared} tree rows of a "
                         f"{max_len}-slot cache")
    if tree is not None and tree.size != rows:
        raise ValueError(f"{rows} query rows for a {tree.size}-node tree")
    check_cache_layer(keys, values)
    queries = q[0].contiguous()
    out = torch.empty_like(queries)
    if tree is not None:
        extra, extra_start = tree.flat, tree.offsets
    else:
        extra = extra_start = _NO_EXTRA_SLOTS if rows == 1 else torch.zeros(rows + 1, dtype=torch.int64)
    if library.dovetail_attention(queries.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                  int(keys.dtype == torch.bfloat16), max_len, shared, extra.data_ptr(),
                                  extra_start.data_ptr(), out.data_ptr(), rows, heads, kv_heads, head_dim,
                                  1.0 / math.sqrt(head_dim), torch.get_num_threads()) != 0:
        raise MemoryError(f"attention: no memory for {rows} rows' scores")
    return out.unsqueeze(0)


def attend_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                  library: ctypes.CDLL | None = None) -> torch.Tensor:
    """A prompt chunk: q [1, heads, rows, head_dim], row r at slot ``start`` + r (its keys and values
    already in the cache) attending to slots [0, start + r]. Each row rounds exactly as its
    one-token decode would (``attend`` with ``start`` + r + 1 shared slots), so a prompt gets the
    same bits however it is cut into chunks. Returns [1, heads, rows, head_dim]."""
    library = library or native.load()
    assert library is not None
    _, heads, rows, head_dim = q.shape
    kv_heads, max_len = keys.shape[1], keys.shape[2]
    if start < 0 or rows < 1 or start + rows > max_len:
        raise ValueError(f"{rows} prompt rows after {start} cached slots of a {max_len}-slot cache")
    # The kernel trusts its shapes: it reads q and the cache as dense fp32 / bf16 arrays.
    if q.dtype != torch.float32 or q.shape[0] != 1 or keys.shape[0] != 1 or keys.shape[3] != head_dim \
            or heads % kv_heads != 0:
        raise ValueError(f"queries {q.dtype} {tuple(q.shape)} over a cache {tuple(keys.shape)}: the kernel takes "
                         "fp32 queries of one sequence, heads a multiple of the cache's, the same head size")
    check_cache_layer(keys, values)
    queries = q[0].contiguous()
    out = torch.empty_like(queries)
    if library.dovetail_attention_causal(queries.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                         int(keys.dtype == torch.bfloat16), max_len, start, out.data_ptr(), rows,
                                         heads, kv_heads, head_dim, 1.0 / math.sqrt(head_dim),
                                         torch.get_num_threads()) != 0:
        raise MemoryError(f"attention: no memory for {rows} prompt rows' scores")
    return out.unsqueeze(0)


def clear_cache() -> None:
    available.cache_clear()
