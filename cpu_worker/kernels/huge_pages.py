"""Weights on transparent huge pages (Linux).

Why: a decode step streams every weight once, and on 4 KB pages that is a TLB miss every 4 KB of
the stream. torch's CPU allocator does not advise huge pages (unless ``THP_MEM_ALLOC_ENABLE=1``),
and most Linux systems ship with THP in ``madvise`` mode, so weights sit on 4 KB pages unless we
ask. Anonymous memory from ``mmap`` advised with ``MADV_HUGEPAGE``, its tensor view starting on a
2 MB boundary, is backed by 2 MB pages where the kernel has them; elsewhere (THP ``never``, no
``MADV_HUGEPAGE``, macOS) this changes nothing and costs one copy at load time.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
# Smaller tensors would not fill one huge page; the norms and scales stay where torch put them.
MIN_BYTES = HUGE_PAGE_BYTES


def advice() -> int | None:
    """``mmap.MADV_HUGEPAGE`` where the platform has it."""
    return getattr(mmap, "MADV_HUGEPAGE", None)


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor in memory advised for transparent huge pages, aligned
    to a huge page (its memory lives as long as the tensor: it holds the mapping); an ordinary
    ``torch.empty`` when it is smaller than ``MIN_BYTES`` or the advice cannot be given. Why not
    only ``on_huge_pages``: a weight packed or joined at load is written here directly, not
    written once and copied (one pass over a 7B model's bytes less)."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    huge = advice()
    if nbytes < MIN_BYTES or huge is None:
        return torch.empty(shape, dtype=dtype)
    # Private: a shared anonymous mapping is shmem, which has its own THP switch (mostly off).
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(memory)
    offset = -ctypes.addressof(anchor) % HUGE_PAGE_BYTES
    del anchor  # a live export would pin the mapping's buffer
    # Only whole huge pages: the tail stays on 4 KB pages instead of rounding up the resident size.
    try:
        memory.madvise(huge, offset, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    except OSError:  # a kernel built without THP
        memory.close()
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(memory, dtype=dtype, count=numel, offset=offset).view(shape)


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` on huge pages (``empty_on_huge_pages``); ``tensor`` itself
    when it is smaller than ``MIN_BYTES`` or the platform has no ``MADV_HUGEPAGE``."""
    if tensor.numel() * tensor.element_size() < MIN_BYTES or advice() is None:
        return tensor
    out = empty_on_huge_pages(tuple(tensor.shape), tensor.dtype)
    out.copy_(tensor)
    return out


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS. Converting tensor by tensor frees a
    source and an fp32 copy per weight; glibc keeps much of that in its arenas, which showed
    as ~0.5-1.5 GB more resident memory than the model after a 7B int8 load."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: nothing to trim
            pass
