"""tools.bench_fp32_kernel's table: "verify T=max / decode" divides the largest tree's verify by a decode."""

from __future__ import annotations

import pytest

from tools import bench_fp32_kernel
from tools.bench_fp32_kernel import largest_tree_over_decode


def test_the_largest_tree_wherever_trees_lists_it():
    row = [50.0, 2.0, 8.0, 3.0]  # prefill, decode, verify T=16, verify T=4 (--trees 16,4)
    assert largest_tree_over_decode(row, [16, 4]) == 4.0  # T=16: 8 / 2, not T=4's 3 / 2
    assert largest_tree_over_decode([50.0, 2.0, 3.0, 8.0], [4, 16]) == 4.0


@pytest.mark.parametrize(("arguments", "says"), [
    (["--trees", "4,x"], "argument --trees: 'x' is not a whole number"),  # was a ValueError traceback
    (["--rounds", "0"], "argument --rounds: 0 is below 1"),  # was a KeyError building the table
    (["--steps", "300"], "--steps at most 256"),  # was a ContextOverflowError after loading three engines
    (["--trees", "512"], "--trees below 512"),
])
def test_bad_arguments_are_usage_errors_before_loading(monkeypatch, capsys, arguments, says):
    monkeypatch.setattr(bench_fp32_kernel, "load_target_model", not_loaded)
    with pytest.raises(SystemExit) as exit_:
        bench_fp32_kernel.main(["--target", "t", *arguments])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def not_loaded(*_args, **_kwargs):
    raise AssertionError("the model loaded before the arguments were checked")
