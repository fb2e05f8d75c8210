"""Our fp32 row kernel (``cpu_worker/fp32_rows.py``, ``dovetail_fp32_linear`` in int8_gemv.c): the
fp32 path on CPUs where MKL's packed rows depend on their call-mates (AMD). Every row of a call
gets the bits it gets alone, whatever the row count or the thread count, so trees verify exactly."""

from __future__ import annotations

import pytest
import torch
from test_int8 import worst_tree_vs_decode_gap
from torch import nn
from torch.nn import functional as F

from cpu_worker import int8_kernel
from cpu_worker.engine import TargetEngine
from cpu_worker.fp32_rows import MAX_KERNEL_ROWS, RowInvariantFp32Linear, use_fp32_row_kernel
from cpu_worker.loading import load_target_model, weight_bytes
from ipc.tree import MAX_TREE_TOKENS


@pytest.mark.parametrize("shape", [(96, 320), (37, 33), (5, 15), (515, 768)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_row_gets_the_same_bits_whatever_shares_its_call(shape, bias):
    """Widths with and without a 16-float tail, output counts with and without a 4-row tail."""
    torch.manual_seed(shape[0])
    dense = nn.Linear(shape[1], shape[0], bias=bias)
    layer = RowInvariantFp32Linear(dense.weight, dense.bias)
    rows = torch.randn(100, shape[1]) * torch.logspace(-2, 2, 100).unsqueeze(1)
    alone = torch.cat([layer(rows[index:index + 1]) for index in range(rows.shape[0])])
    for count in (2, 3, 7, 16, 33, 64, 100):
        assert torch.equal(layer(rows[:count]), alone[:count]), count
    assert torch.equal(layer(rows[[9, 0, 4]]), alone[[9, 0, 4]])
    assert torch.equal(layer(rows.view(4, 25, shape[1])), alone.view(4, 25, shape[0]))
    with torch.no_grad():
        torch.testing.assert_close(alone, dense(rows), rtol=1e-5, atol=1e-4)


def test_the_thread_count_does_not_change_a_row():
    torch.manual_seed(1)
    layer = RowInvariantFp32Linear(torch.randn(300, 256) * 0.05, torch.randn(300))
    rows = torch.randn(9, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(rows)
        torch.set_num_threads(max(2, before))
        assert torch.equal(layer(rows), one)
    finally:
        torch.set_num_threads(before)


def test_calls_longer_than_any_tree_go_to_f_linear():
    """A prefill of more rows than the largest tree the protocol allows: F.linear's result
    (computed by the same call in --mode ar and in Dovetail, so it need not match a decode's
    bits). Every tree size is on the kernel."""
    assert MAX_KERNEL_ROWS == MAX_TREE_TOKENS
    torch.manual_seed(2)
    dense = nn.Linear(16, 8)
    layer = RowInvariantFp32Linear(dense.weight, dense.bias)
    rows = torch.randn(MAX_KERNEL_ROWS + 1, 16)
    with torch.no_grad():
        assert torch.equal(layer(rows), F.linear(rows, dense.weight, dense.bias))
        torch.testing.assert_close(layer(rows[:MAX_KERNEL_ROWS]), dense(rows[:MAX_KERNEL_ROWS]), rtol=1e-5, atol=1e-5)


def test_the_demo_target_on_the_row_kernel_verifies_trees_bit_exactly(demo_target):
    """On every CPU (the worker takes this kernel only where MKL's check fails, so it is
    tested here directly): the swap shares the weights, and tree logits equal decode logits."""
    model = load_target_model(demo_target)
    plain_bytes = weight_bytes(model)
    dense = load_target_model(demo_target)
    assert use_fp32_row_kernel(model)
    assert not any(type(module) is nn.Linear for module in model.modules())
    assert weight_bytes(model) == plain_bytes
    engine = TargetEngine(model, max_len=128)
    assert engine.exact_tree
    assert worst_tree_vs_decode_gap(engine) == 0.0
    prompt = [(37 * index + 11) % model.spec.vocab_size for index in range(100)]
    reference = TargetEngine(dense, max_len=128)
    torch.testing.assert_close(engine.prefill(prompt).logits, reference.prefill(prompt).logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(engine.decode(5).logits, reference.decode(5).logits, rtol=1e-4, atol=1e-4)


def test_without_a_compiler_fp32_stays_on_f_linear_and_the_worker_says_so(demo_target, monkeypatch, caplog):
    import logging

    from cpu_worker import fp32_packed
    from cpu_worker.server import build_engine

    int8_kernel.clear_cache()
    try:
        monkeypatch.setenv("CC", "/nonexistent/cc")
        monkeypatch.setattr(fp32_packed, "rows_are_independent", lambda weight: (False, "simulated"))
        model = load_target_model(demo_target)
        assert not use_fp32_row_kernel(model)
        with caplog.at_level(logging.WARNING):
            engine, kernel = build_engine(str(demo_target), "fp32", 64)
        assert kernel == "F.linear" and not engine.exact_tree
        assert "float tolerance" in caplog.text
    finally:
        int8_kernel.clear_cache()
