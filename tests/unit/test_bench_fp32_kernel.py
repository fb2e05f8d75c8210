"""tools.bench_fp32_kernel's table: "verify T=max / decode" divides the largest tree's verify by a decode."""

from __future__ import annotations

from tools.bench_fp32_kernel import largest_tree_over_decode


def test_the_largest_tree_wherever_trees_lists_it():
    row = [50.0, 2.0, 8.0, 3.0]  # prefill, decode, verify T=16, verify T=4 (--trees 16,4)
    assert largest_tree_over_decode(row, [16, 4]) == 4.0  # T=16: 8 / 2, not T=4's 3 / 2
    assert largest_tree_over_decode([50.0, 2.0, 3.0, 8.0], [4, 16]) == 4.0
