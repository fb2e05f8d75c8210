"""fp32 linear layers on our own kernel (``fp32_rows.c``: ``dovetail_fp32_linear``), the fp32
target's exact path wherever a C compiler is found.

Every row of a call is reduced in one fixed order whatever the row or thread count, so a tree
node's logits equal the decode logits of the same prefix bit for bit, and an fp32 target stays
exactly lossless. The kernel streams the weight once per call and runs up to 4 rows at a time
(AVX-512; 2 with AVX2 or plain C) over each L1-resident chunk of it, which is what decoding and
small trees need: there it beats MKL's packed sgemm (``fp32_packed``, the other exact kernel)
and ``F.linear`` from 4 rows on and costs about ``F.linear``'s one row.

A prompt is different: its rows are computed by the same calls in ``--mode ar`` and in Dovetail
(the same chunks, ``--prefill-chunk``, alone or batched), so they need not match a decode's bits,
only be fast, and from 64 rows on a GEMM is faster.
Inside ``prompt_rows()`` (the engine's prefill) calls of ``PROMPT_GEMM_ROWS`` rows or more go to
``F.linear``; so do calls of more than ``MAX_KERNEL_ROWS`` rows anywhere (no tree is that large).
Measurements: docs/kernels.md, "fp32 row kernel" (``python -m tools.bench_fp32_kernel``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from cpu_worker.kernels.huge_pages import on_huge_pages, release_freed_memory
from cpu_worker.kernels.linear import LinearKernel
from cpu_worker.kernels.progress import progress_bar
from cpu_worker.native import library as native
from ipc.tree import MAX_TREE_TOKENS

MAX_KERNEL_ROWS = MAX_TREE_TOKENS  # every tree the protocol allows is verified in one call on the kernel
PROMPT_GEMM_ROWS = 64  # a prompt call from this many rows on takes F.linear (faster there from 64 rows)

_in_prompt = contextvars.ContextVar("dovetail_fp32_prompt_rows", default=False)


@contextmanager
def prompt_rows() -> Iterator[None]:
    """Calls inside compute a prompt's rows: rows every mode computes in this same call, so they
    may take a GEMM whose bits depend on the row count (from ``PROMPT_GEMM_ROWS`` rows on)."""
    token = _in_prompt.set(True)
    try:
        yield
    finally:
        _in_prompt.reset(token)


def in_prompt() -> bool:
    """Whether this call computes a prompt's rows (inside ``prompt_rows()``)."""
    return _in_prompt.get()


def streamed_weight(weight: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    """A row kernel's weight: ``weight`` itself where it is already a contiguous ``dtype`` parameter
    (a tied lm_head stays tied to its table), else a frozen contiguous copy in ``dtype``. Every call
    streams it, so it goes onto huge pages (1.08x a 1B fp32 decode step on the EPYC); swapping
    .data keeps the parameter, so whatever shares it (a tied embedding) follows."""
    if isinstance(weight, nn.Parameter) and weight.dtype == dtype and weight.is_contiguous():
        parameter = weight
    else:
        parameter = nn.Parameter(weight.detach().to(dtype).contiguous(), requires_grad=False)
    parameter.data = on_huge_pages(parameter.data)
    return parameter


def frozen_bias(bias: torch.Tensor | None) -> nn.Parameter | None:
    """A row kernel's bias: fp32, contiguous, frozen."""
    return None if bias is None else nn.Parameter(bias.detach().to(torch.float32).contiguous(), requires_grad=False)


def run_row_kernel(function: Callable[..., None], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   gemm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``x W^T + b`` on a row kernel (``dovetail_fp32_linear`` or ``_bf16_linear``, fp32 rows against
    ``weight``), or on ``gemm`` for a prompt's calls of ``PROMPT_GEMM_ROWS`` rows or more and any of more
    than ``MAX_KERNEL_ROWS``."""
    out_features, in_features = weight.shape
    shape = x.shape
    rows = x.reshape(-1, in_features)
    count = rows.shape[0]
    if count > MAX_KERNEL_ROWS or (count >= PROMPT_GEMM_ROWS and in_prompt()):
        return gemm(x)
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        rows = rows.to(torch.float32).contiguous()
    out = torch.empty(count, out_features, dtype=torch.float32)
    function(rows.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), count,
             out_features, in_features, torch.get_num_threads())
    return out.reshape(*shape[:-1], out_features)


class RowInvariantFp32Linear(LinearKernel):
    """``y = x W^T + b`` in fp32 on ``dovetail_fp32_linear`` (a prompt's calls of ``PROMPT_GEMM_ROWS``
    rows or more, and any of more than ``MAX_KERNEL_ROWS``, on ``F.linear``)."""

    row_invariant = True  # one fixed order per row (a prompt's GEMM rows: the same call in every mode)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        library = native.load()
        if library is None:
            raise RuntimeError("the fp32 row kernel needs the compiled kernel library (a C compiler)")
        self._function = library.dovetail_fp32_linear
        self.weight = streamed_weight(weight, torch.float32)
        self.bias = frozen_bias(bias)
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_row_kernel(self._function, x, self.weight, self.bias, self._gemm)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp32 row-invariant kernel"


def use_fp32_row_kernel(model: nn.Module) -> bool:
    """Swap every fp32 ``nn.Linear`` under ``model`` for a RowInvariantFp32Linear (sharing its
    weight, which moves onto huge pages). False, and nothing changed, when the kernel library cannot be built."""
    if native.load() is None:
        return False
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32]
    with progress_bar(len(names), "fp32 row kernel: weights onto huge pages", "matrix") as bar:
        for count, name in enumerate(names, 1):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            dense = getattr(parent, child)
            setattr(parent, child, RowInvariantFp32Linear(dense.weight, dense.bias))
            bar.update()
            if count % 16 == 0:
                release_freed_memory()  # the weights' old homes (moved onto huge pages), as we go
    release_freed_memory()
    return bool(names)
