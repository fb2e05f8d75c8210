"""fp32 linear layers on our own kernel (``int8_gemv.c``: ``dovetail_fp32_linear``), for CPUs
where MKL's packed sgemm is not row-independent (AMD: checked at load, ``fp32_packed``).

Every row of a call is reduced in one fixed order whatever the row or thread count, so a tree
node's logits equal the decode logits of the same prefix bit for bit, and an fp32 target stays
exactly lossless. The kernel streams the weight once per call and reuses each block of 4 weight
rows from cache for every row, which is what decoding and small trees need. Calls of more than
``MAX_KERNEL_ROWS`` rows (the largest tree the protocol allows, so only a long prompt's prefill)
go to ``F.linear``: a prefill's rows are computed by the same call in ``--mode ar`` and in
Dovetail, so they need not match a decode's bits, only be fast. Prompts of up to that many
tokens prefill on this kernel, which is slower than a GEMM there (1.7x ``F.linear``'s time at
256 rows of 4096x4096 on the EPYC, 1.25x at 64), the price of exact trees of every size.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ipc.tree import MAX_TREE_TOKENS

from . import int8_kernel
from .huge_pages import on_huge_pages
from .loading import release_freed_memory

MAX_KERNEL_ROWS = MAX_TREE_TOKENS  # every tree the protocol allows is verified in one call on the kernel


class RowInvariantFp32Linear(nn.Module):
    """``y = x W^T + b`` in fp32; rows of up to ``MAX_KERNEL_ROWS`` on ``dovetail_fp32_linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        library = int8_kernel.load_library()
        if library is None:
            raise RuntimeError("the fp32 row kernel needs the compiled kernel library (a C compiler)")
        self._function = library.dovetail_fp32_linear
        if isinstance(weight, nn.Parameter) and weight.dtype == torch.float32 and weight.is_contiguous():
            self.weight = weight  # the same parameter: a tied lm_head stays tied
        else:
            self.weight = nn.Parameter(weight.detach().to(torch.float32).contiguous(), requires_grad=False)
        # Every call streams the weight: onto huge pages (1.08x a 1B fp32 decode step on the EPYC).
        # Swapping .data keeps the parameter, so whatever shares it (a tied embedding) follows.
        self.weight.data = on_huge_pages(self.weight.data)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32).contiguous(),
                                                           requires_grad=False)
        self.out_features, self.in_features = self.weight.shape
        self._bias_pointer = None if self.bias is None else self.bias.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        count = rows.shape[0]
        if count > MAX_KERNEL_ROWS:
            return F.linear(x, self.weight, self.bias)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.to(torch.float32).contiguous()
        out = torch.empty(count, self.out_features, dtype=torch.float32)
        self._function(rows.data_ptr(), self.weight.data_ptr(), self._bias_pointer, out.data_ptr(), count,
                       self.out_features, self.in_features, torch.get_num_threads())
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp32 row-invariant kernel"


def use_fp32_row_kernel(model: nn.Module) -> bool:
    """Swap every fp32 ``nn.Linear`` under ``model`` for a RowInvariantFp32Linear (sharing its
    weight, which moves onto huge pages). False, and nothing changed, when the kernel library cannot be built."""
    if int8_kernel.load_library() is None:
        return False
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32]
    for count, name in enumerate(names, 1):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dense = getattr(parent, child)
        setattr(parent, child, RowInvariantFp32Linear(dense.weight, dense.bias))
        if count % 16 == 0:
            release_freed_memory()  # the weights' old homes (moved onto huge pages), as we go
    release_freed_memory()
    return bool(names)
