"""tools.soak's report: the latency percentiles are nearest-rank (the ceil(p * n)-th smallest)."""

from __future__ import annotations

from tools.soak import percentile


def test_the_median_of_an_even_count_is_the_lower_middle_value():
    assert percentile([6.0, 1.0, 5.0, 2.0, 4.0, 3.0], 0.5) == 3.0
    assert percentile([float(v) for v in range(1, 11)], 0.5) == 5.0
    assert percentile([2.0, 1.0], 0.5) == 1.0


def test_p99_of_a_hundred_values_is_the_99th_not_the_largest():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 0.07) == 7.0  # 0.07 * 100 is 7.000000000000001 in floats


def test_edges():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([1.0, 2.0, 3.0], 0.0) == 1.0
    assert percentile([1.0, 2.0, 3.0], 1.0) == 3.0
    assert percentile([1.0, 2.0, 3.0], 0.5) == 2.0
