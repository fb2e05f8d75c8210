"""fp32 targets on MKL's packed sgemm where its rows are independent of their call-mates (Intel
CPUs; checked at load), else on our row kernel (``test_fp32_rows``): a tree node's logits equal
the decode logits of the same prefix bit for bit (``F.linear`` differs by ~1e-6), so dovetail
gives exactly --mode ar's tokens at fp32 (tests/system/test_fp32_runtime.py). Whether MKL's
packed rows are independent depends on the CPU (on AMD EPYC they are not), so these tests hold
the load-time check to the truth on whatever CPU runs them, and test the packing's mechanics
with the check's verdict given."""

from __future__ import annotations

import logging

import pytest
import torch
from test_int8 import worst_tree_vs_decode_gap
from torch import nn

from cpu_worker.engine import TargetEngine
from cpu_worker.kernels import fp32_packed
from cpu_worker.kernels.fp32_packed import PackedFp32Linear, pack_fp32_linears, rows_are_independent
from cpu_worker.target_loading import load_target_model, weight_bytes


def rows_match_alone(layer: nn.Module, rows: torch.Tensor) -> bool:
    """Does every row of a call get the bits it gets alone, for calls of several sizes?"""
    alone = torch.cat([layer(rows[index:index + 1]) for index in range(rows.shape[0])])
    return all(torch.equal(layer(rows[:count]), alone[:count]) for count in (2, 3, 5, 8, 16, 17, 33, rows.shape[0]))


@pytest.mark.parametrize("bias", [False, True])
def test_the_load_time_check_tells_the_truth_about_this_cpus_packed_rows(bias):
    """Whatever this CPU does, the check's verdict on a shape is what rows of that shape do, and
    a packed layer computes the linear layer to float tolerance."""
    torch.manual_seed(0)
    for out_features, in_features in ((96, 320), (256, 256), (300, 512)):
        dense = nn.Linear(in_features, out_features, bias=bias)
        ok, why = rows_are_independent(dense.weight)
        layer = PackedFp32Linear(dense.weight, dense.bias)
        rows = torch.randn(64, in_features) * torch.logspace(-2, 2, 64).unsqueeze(1)
        with torch.no_grad():
            torch.testing.assert_close(layer(rows), dense(rows), rtol=1e-5, atol=1e-4)
            assert rows_match_alone(layer, rows) == ok or (not ok and "F.linear" in why), (out_features, why)
            batched = layer(rows)
            assert torch.equal(layer(rows.view(4, 16, in_features)), batched.view(4, 16, out_features))
    # Control: F.linear's one-row path rounds differently from its many-row one.
    with torch.no_grad():
        assert not rows_match_alone(dense, rows)


def test_packing_swaps_every_linear_and_the_model_still_computes_the_same(demo_target, monkeypatch):
    """The swap itself, with the check's verdict given (on a CPU where MKL's packed rows depend on
    their call-mates the real check refuses, and ``build_engine`` takes our row kernel instead)."""
    monkeypatch.setattr(fp32_packed, "rows_are_independent", lambda weight: (True, ""))
    dense_model = load_target_model(demo_target)
    model = load_target_model(demo_target)
    plain_bytes = weight_bytes(model)
    assert pack_fp32_linears(model)
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    linears = sum(isinstance(module, PackedFp32Linear) for module in model.modules())
    assert linears == 7 * model.spec.num_layers + 1  # q k v o gate up down per layer, and lm_head
    assert weight_bytes(model) == plain_bytes  # the embedding stays; each matrix is counted once
    prompt = [(37 * index + 11) % model.spec.vocab_size for index in range(300)]  # prefill rows > any check's
    packed, dense = TargetEngine(model, max_len=320), TargetEngine(dense_model, max_len=320)
    torch.testing.assert_close(packed.prefill(prompt).logits, dense.prefill(prompt).logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed.decode(5).logits, dense.decode(5).logits, rtol=1e-4, atol=1e-4)


def test_the_workers_fp32_tree_logits_equal_decode_logits_bit_for_bit(demo_target):
    """The fp32 engine exactly as the cpu_worker builds it (MKL packed where the check passes, our
    row kernel where it does not) verifies trees bit-exactly, with an fp32 or a bf16 KV cache."""
    from cpu_worker.server import build_engine

    engine, kernel = build_engine(str(demo_target), "fp32", 128)
    assert kernel in ("mkl-packed", "dovetail-fp32"), kernel
    assert engine.exact_tree
    assert worst_tree_vs_decode_gap(engine) == 0.0
    # A bf16 KV cache keeps it exact: tree rows and decodes read the same rounded keys and values.
    bf16_kv = TargetEngine(engine.model, max_len=128, kv_dtype=torch.bfloat16)
    assert bf16_kv.exact_tree
    assert worst_tree_vs_decode_gap(bf16_kv) == 0.0
    # Control: F.linear with the same exact attention is not (its gap is float rounding).
    dense = TargetEngine(load_target_model(demo_target), max_len=128, exact_tree=True)
    assert not dense.exact_tree or worst_tree_vs_decode_gap(dense) > 0


def test_a_failed_check_leaves_the_model_unpacked_and_says_why(demo_target, monkeypatch, caplog):
    model = load_target_model(demo_target)
    monkeypatch.setattr(fp32_packed, "rows_are_independent", lambda weight: (False, "a row changes (simulated)"))
    with caplog.at_level(logging.INFO):
        assert not pack_fp32_linears(model)
    assert "a row changes (simulated)" in caplog.text
    assert not any(isinstance(module, PackedFp32Linear) for module in model.modules())
    assert not TargetEngine(model, max_len=32).exact_tree
    monkeypatch.setattr(fp32_packed, "mkl_packing_available", lambda: False)
    assert not pack_fp32_linears(model)
    assert not any(isinstance(module, PackedFp32Linear) for module in model.modules())


def test_the_check_catches_a_kernel_whose_rows_depend_on_their_call_mates(monkeypatch):
    """The load-time check is what makes packing safe: with torch 2.13's MKL, matrices with
    fewer than 256 outputs (64x128 here) take a path whose rows do depend on their call-mates,
    as does a pack for a one-row batch hint, and on AMD CPUs every shape does. A kernel that
    rounds by batch size must fail it; one whose rows are independent must pass it."""
    weight = torch.randn(256, 256)
    packed_forward = PackedFp32Linear.forward
    monkeypatch.setattr(PackedFp32Linear, "forward",  # row by row: independent by construction
                        lambda self, x: torch.cat([packed_forward(self, row) for row in x.split(1)]))
    assert rows_are_independent(weight) == (True, "")
    monkeypatch.setattr(PackedFp32Linear, "forward",  # accurate, but rounds by the call's row count
                        lambda self, x: packed_forward(self, x) * (1 + 1e-6 * x.shape[0]))
    ok, why = rows_are_independent(weight)
    assert not ok and "rows share the call" in why
