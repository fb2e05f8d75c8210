"""Exact fp32 attention on our native kernel (``attention.c``): decode steps and tree rows.

A tree node must attend exactly as the one-token decode of the same prefix would, bit for bit
(an int8 target's per-row rounding can turn a 1e-6 difference into another token). torch's
batched masked attention does not round like its one-row call, so without this kernel tree
rows attend one at a time (``Attention._attend_per_row``), each re-reading the whole cached
prefix. The kernel reads the prefix once for all rows and sums every row's keys in the order a
later decode sees them, so decoding and verification both call it and agree.

Used for fp32 queries over an fp32 cache on the CPU, without autograd, whenever the library
builds; ``DOVETAIL_ATTENTION=torch`` forces torch's attention (for comparisons).
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Sequence
from functools import cache

import torch

from . import int8_kernel

FORCE_VARIABLE = "DOVETAIL_ATTENTION"
# A decode step's extra slots (none): made once, as every layer of every step would make them.
_NO_EXTRA_SLOTS = torch.zeros(2, dtype=torch.int64)


@cache
def available() -> bool:
    """Whether attention runs on the kernel in this process."""
    if os.environ.get(FORCE_VARIABLE, "").lower() == "torch":
        return False
    return int8_kernel.load_library() is not None


def applies(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether this call can take the kernel: fp32 on the CPU, one sequence, a contiguous cache
    layer, no gradient wanted; then ``available()``."""
    return (q.dtype == torch.float32 and keys.dtype == torch.float32 and q.device.type == "cpu"
            and keys.shape[0] == 1 and q.shape[0] == 1 and keys.is_contiguous() and not q.requires_grad
            and available())


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, shared: int,
           paths: Sequence[torch.Tensor] | None = None, start: int = 0,
           library: ctypes.CDLL | None = None) -> torch.Tensor:
    """q [1, heads, rows, head_dim] over one layer's cache ``keys``/``values`` [1, kv_heads,
    max_len, head_dim]: every row sees slots [0, shared), then (a tree) slots start + path[i]
    of its own path, root first. Returns [1, heads, rows, head_dim]. ``library``: another build
    (tests compare builds)."""
    library = library or int8_kernel.load_library()
    assert library is not None
    _, heads, rows, head_dim = q.shape
    kv_heads, max_len = keys.shape[1], keys.shape[2]
    # The kernel trusts its slot indices: a row must see at least one key, all inside the cache.
    if not (paths is not None or shared >= 1) or shared > max_len:
        raise ValueError(f"attention over {shared} shared slots of a {max_len}-slot cache")
    queries = q[0].contiguous()
    out = torch.empty_like(queries)
    if paths is None:
        extra = extra_start = _NO_EXTRA_SLOTS if rows == 1 else torch.zeros(rows + 1, dtype=torch.int64)
    else:
        extra = torch.cat(list(paths)).to(torch.int64) + start
        extra_start = torch.zeros(rows + 1, dtype=torch.int64)
        extra_start[1:] = torch.cumsum(torch.as_tensor([len(path) for path in paths]), 0)
    if library.dovetail_attention(queries.data_ptr(), keys.data_ptr(), values.data_ptr(), max_len, shared,
                                  extra.data_ptr(), extra_start.data_ptr(), out.data_ptr(), rows, heads, kv_heads,
                                  head_dim, 1.0 / math.sqrt(head_dim), torch.get_num_threads()) != 0:
        raise MemoryError(f"attention: no memory for {rows} rows' scores")
    return out.unsqueeze(0)


def clear_cache() -> None:
    available.cache_clear()
