"""Weights copied onto memory advised for transparent huge pages (cpu_worker/kernels/huge_pages.py):
the same values, aligned to a huge page, the advice visible to the kernel, the memory alive as
long as the tensor, and the int8 and fp32 kernels' weights placed there."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from test_int8_kernel import integer_reference
from torch import nn

from cpu_worker.kernels import huge_pages, int8_kernel
from cpu_worker.kernels.fp32_rows import RowInvariantFp32Linear


def mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


linux_only = pytest.mark.skipif(huge_pages.advice() is None or not sys.platform.startswith("linux"),
                                reason="MADV_HUGEPAGE and /proc/self/smaps are Linux's")


@linux_only
@pytest.mark.parametrize("dtype", [torch.int8, torch.float32])
def test_a_large_tensor_is_copied_onto_advised_aligned_private_memory(dtype):
    element = torch.tensor([], dtype=dtype).element_size()
    source = ((torch.arange(7 * (3 * huge_pages.HUGE_PAGE_BYTES // element // 7 + 5)) % 251) - 125).to(dtype)
    source = source.view(7, -1)  # 3 huge pages and a bit
    copy = huge_pages.on_huge_pages(source)
    assert copy.shape == source.shape and copy.dtype == dtype and copy.is_contiguous()
    assert torch.equal(copy, source)
    assert copy.data_ptr() != source.data_ptr()
    assert copy.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    flags = mapping_flags(copy.data_ptr())
    assert "hg" in flags  # MADV_HUGEPAGE
    assert "sh" not in flags  # shared anonymous memory is shmem, which THP's madvise mode leaves alone


@linux_only
def test_the_copy_outlives_its_source_and_writes_stay_its_own():
    source = torch.randint(-127, 128, (1024, 4096), dtype=torch.int8)
    expected = source.clone()
    copy = huge_pages.on_huge_pages(source)
    del source
    gc.collect()
    assert torch.equal(copy, expected)
    copy[0, 0] = 7 if expected[0, 0] != 7 else 8
    assert not torch.equal(copy, expected)


def test_a_small_tensor_is_left_where_it_is():
    small = torch.ones(huge_pages.MIN_BYTES // 4 - 1)
    assert huge_pages.on_huge_pages(small) is small


@linux_only
def test_int8_weights_are_streamed_from_advised_memory():
    library = int8_kernel.load()
    assert library is not None, "no int8 kernel on this machine"
    values = torch.randint(-127, 128, (1024, 2048), dtype=torch.int8)
    weights = int8_kernel.Int8Weights(values, torch.rand(1024) + 0.01, None, library)
    assert "hg" in mapping_flags(weights.stored.data_ptr())
    assert torch.equal(weights.values, values)
    rows = torch.randn(3, 2048)
    assert torch.equal(weights(rows), integer_reference(rows, values, weights.scales, None))


@linux_only
def test_fp32_row_kernel_weights_move_onto_advised_memory_and_stay_shared():
    weight = nn.Parameter(torch.randn(1024, 1024), requires_grad=False)  # 4 MB
    expected = weight.detach().clone()
    layer = RowInvariantFp32Linear(weight)
    assert layer.weight is weight  # a tied embedding holding this parameter follows the move
    assert "hg" in mapping_flags(weight.data_ptr())
    assert torch.equal(weight, expected)
    rows = torch.randn(2, 1024)
    torch.testing.assert_close(layer(rows), rows @ expected.T, rtol=1e-5, atol=1e-4)
