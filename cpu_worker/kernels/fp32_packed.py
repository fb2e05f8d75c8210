"""fp32 linear layers on MKL's packed sgemm: a row's result never depends on its call-mates.
The fallback exact kernel: the worker takes our row kernel (``fp32_rows``, faster at decoding
and verifying) wherever a C compiler is found; this one where none is.

Why: ``F.linear`` picks a different kernel for one row (a GEMV) than for a tree's T rows (a
GEMM), so a node's logits differ from the decode logits of the same prefix by float rounding
(~1e-6), and a near-tied token can flip: fp32 Dovetail was lossless only up to that. It is
also slow exactly where a tree is verified (its cost grows with every row).

MKL's ``cblas_sgemm_compute`` on a weight packed once (``cblas_sgemm_pack``, exposed by torch
as ``mkl::_mkl_reorder_linear_weight`` and ``mkl::_mkl_linear``) runs one blocking for every
row count, so a row gets the same bits alone or among 64 others, and several rows cost less
than on ``F.linear`` (one row a little more: MKL's GEMV is the better one-row kernel). Measured,
not promised: packing for a batch hint of one row gives a one-row path that rounds differently
(so the hint is ``PACK_ROWS``), and so do matrices with fewer than 256 outputs. So
``pack_fp32_linears`` checks every weight shape of the model at load (row by row against the
whole call, and against ``F.linear`` up to a prefill's rows) before it swaps anything.
Where MKL is absent (non-x86 builds) or a check fails (AMD CPUs: MKL takes another path there),
a model without our row kernel keeps ``F.linear``, and its trees are verified to float tolerance.
The numbers: docs/kernels.md, "MKL packed fp32" (``python -m tools.bench_fp32_kernel``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

from cpu_worker.kernels.huge_pages import release_freed_memory
from cpu_worker.kernels.linear import LinearKernel

log = logging.getLogger(__name__)

PACK_ROWS = 16  # the batch hint of the packing; 1 gives a separate one-row path (not invariant)
CHECK_ROWS = (2, 3, 5, 8, 16, 17, 33, 64)  # row counts the load-time check compares with one row
PREFILL_CHECK_ROWS = 300  # and a prefill-sized call, checked against F.linear


def mkl_packing_available() -> bool:
    """True when this torch build has MKL and its packed fp32 linear ops."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        return hasattr(torch.ops.mkl, "_mkl_linear") and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


class PackedFp32Linear(LinearKernel):
    """``y = x W^T + b`` in fp32 on MKL's packed sgemm; W is kept only in packed form."""

    row_invariant = True  # checked for every weight shape before a model is packed (pack_fp32_linears)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self._packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().to(torch.float32).contiguous(),
                                                                PACK_ROWS)
        # _mkl_linear reads the original weight only for its shape and dtype when the row count
        # it is given matches the input's (always, here): a zero-stride view stands in for it.
        self._shape_of_weight = torch.zeros((), dtype=torch.float32).expand(self.out_features, self.in_features)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the matrix. MKL allocates its packed buffer larger (``numel`` says ~8 MB
        more per matrix, +15-30%), but resident memory grows by the matrix alone (measured:
        ten 4096x4096 weights, +0.65 GB of RSS for 0.67 GB of weights)."""
        return self.out_features * self.in_features * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkl._mkl_linear(rows, self._packed, self._shape_of_weight, None, rows.shape[0])
        if self.bias is not None:
            out = out + self.bias  # after the GEMM, row-wise: the bias never enters its blocking
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp32 MKL packed"


def rows_are_independent(weight: torch.Tensor, seed: int = 0) -> tuple[bool, str]:
    """Pack ``weight`` and check, on random inputs, that every row of a call of each
    ``CHECK_ROWS`` size equals the same row computed alone, bit for bit, and that the result
    agrees with ``F.linear``. Returns (ok, why not)."""
    generator = torch.Generator().manual_seed(seed)
    layer = PackedFp32Linear(weight)
    dense = weight.detach().to(torch.float32)
    inputs = torch.randn(max(CHECK_ROWS), layer.in_features, generator=generator)
    with torch.inference_mode():
        alone = torch.cat([layer(inputs[row:row + 1]) for row in range(inputs.shape[0])])
        reference = F.linear(inputs, dense)
        scale = float(reference.abs().max()) or 1.0
        if not torch.allclose(alone, reference, rtol=1e-4, atol=1e-5 * scale):
            return False, f"differs from F.linear by {float((alone - reference).abs().max()):.3g}"
        for count in CHECK_ROWS:
            if not torch.equal(layer(inputs[:count]), alone[:count]):
                return False, f"a row's result changes when {count} rows share the call"
        # A prompt's prefill calls with hundreds of rows: right there too (rows need not match bits).
        prompt = torch.randn(PREFILL_CHECK_ROWS, layer.in_features, generator=generator)
        reference = F.linear(prompt, dense)
        error = float((layer(prompt) - reference).abs().max())
        if error > 1e-4 * (float(reference.abs().max()) or 1.0) + 1e-5:
            return False, f"a {PREFILL_CHECK_ROWS}-row call differs from F.linear by {error:.3g}"
    return True, ""


def pack_fp32_linears(model: nn.Module) -> bool:
    """Swap every fp32 ``nn.Linear`` under ``model`` (in place) for a PackedFp32Linear when MKL
    packing is available and row-independent for each of the model's weight shapes (checked
    here, with this process's threads). All or nothing: returns False, and changes nothing,
    when any check fails. One weight is converted at a time, so peak memory grows by one
    packed matrix, not by a model."""
    # Names only: holding the modules would keep every dense weight alive until the end.
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32]
    if not names:
        return False
    if not mkl_packing_available():
        log.info("fp32: this torch build has no MKL packed sgemm")
        return False
    checked: set[tuple[int, int]] = set()
    for name in names:
        layer = model.get_submodule(name)
        assert isinstance(layer, nn.Linear)
        weight = layer.weight
        shape = (int(weight.shape[0]), int(weight.shape[1]))
        if shape in checked:
            continue
        ok, why = rows_are_independent(weight)
        if not ok:
            log.info("fp32: MKL packed sgemm is not used: on %s %s %s", name, list(shape), why)
            return False
        checked.add(shape)
    for count, name in enumerate(names, 1):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dense = getattr(parent, child)
        setattr(parent, child, PackedFp32Linear(dense.weight, dense.bias))
        del dense
        if count % 16 == 0:
            release_freed_memory()
    release_freed_memory()
    return True
