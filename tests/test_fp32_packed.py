"""fp32 targets on MKL's packed sgemm: a row gets the same bits whatever shares its call, so a
tree node's logits equal the decode logits of the same prefix bit for bit (``F.linear`` differs
by ~1e-6), and dovetail gives exactly --mode ar's tokens at fp32."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_int8 import worst_tree_vs_decode_gap
from test_runtime_e2e import CODE_PROMPTS
from torch import nn

from cpu_worker import fp32_packed
from cpu_worker.engine import TargetEngine
from cpu_worker.fp32_packed import PackedFp32Linear, pack_fp32_linears, rows_are_independent
from cpu_worker.loading import load_target_model, weight_bytes

from runtime_harness import dovetail_run


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_row_gets_the_same_bits_whatever_shares_its_call(bias):
    torch.manual_seed(0)
    dense = nn.Linear(320, 96, bias=bias)
    layer = PackedFp32Linear(dense.weight, dense.bias)
    rows = torch.randn(40, 320) * torch.logspace(-2, 2, 40).unsqueeze(1)
    batched = layer(rows)
    torch.testing.assert_close(batched, dense(rows).detach(), rtol=1e-5, atol=1e-4)
    for index in range(rows.shape[0]):
        assert torch.equal(layer(rows[index:index + 1]), batched[index:index + 1])
    assert torch.equal(layer(rows[[7, 0, 3]]), batched[[7, 0, 3]])
    assert torch.equal(layer(rows.view(4, 10, 320)), batched.view(4, 10, 96))
    # Control: F.linear's one-row path rounds differently from its many-row one.
    controls = [not torch.equal(dense(rows[i:i + 1]), dense(rows)[i:i + 1]) for i in range(rows.shape[0])]
    assert any(controls)


def test_packing_swaps_every_linear_and_the_model_still_computes_the_same(demo_target):
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


def test_packed_fp32_tree_logits_equal_decode_logits_bit_for_bit(demo_target):
    model = load_target_model(demo_target)
    assert pack_fp32_linears(model)
    engine = TargetEngine(model, max_len=128)
    assert engine.exact_tree
    assert worst_tree_vs_decode_gap(engine) == 0.0
    # A bf16 KV cache keeps it exact: tree rows and decodes read the same rounded keys and values.
    bf16_kv = TargetEngine(model, max_len=128, kv_dtype=torch.bfloat16)
    assert bf16_kv.exact_tree
    assert worst_tree_vs_decode_gap(bf16_kv) == 0.0
    # Control: F.linear with the same exact attention is not (its gap is float rounding).
    dense = TargetEngine(load_target_model(demo_target), max_len=128, exact_tree=True)
    assert not dense.exact_tree or worst_tree_vs_decode_gap(dense) > 0


def test_a_failed_check_leaves_the_model_on_f_linear(demo_target, monkeypatch, caplog):
    model = load_target_model(demo_target)
    monkeypatch.setattr(fp32_packed, "rows_are_independent", lambda weight: (False, "a row changes (simulated)"))
    with caplog.at_level(logging.WARNING):
        assert not pack_fp32_linears(model)
    assert "a row changes (simulated)" in caplog.text and "float tolerance" in caplog.text
    assert not any(isinstance(module, PackedFp32Linear) for module in model.modules())
    assert not TargetEngine(model, max_len=32).exact_tree
    monkeypatch.setattr(fp32_packed, "mkl_packing_available", lambda: False)
    assert not pack_fp32_linears(model)
    assert not any(isinstance(module, PackedFp32Linear) for module in model.modules())


def test_the_check_catches_a_kernel_whose_rows_depend_on_their_call_mates(monkeypatch):
    """The load-time check is what makes packing safe: with torch 2.13's MKL, matrices with
    fewer than 256 outputs (64x128 here) take a path whose rows do depend on their call-mates,
    as does a pack for a one-row batch hint. A kernel that rounds by batch size must fail it."""
    weight = torch.randn(256, 256)
    assert rows_are_independent(weight) == (True, "")
    small_ok, small_why = rows_are_independent(torch.randn(64, 128))
    print(f"MKL packed 64x128: row-independent {small_ok} {small_why}")
    packed_forward = PackedFp32Linear.forward
    monkeypatch.setattr(PackedFp32Linear, "forward",  # accurate, but rounds by the call's row count
                        lambda self, x: packed_forward(self, x) * (1 + 1e-6 * x.shape[0]))
    ok, why = rows_are_independent(weight)
    assert not ok and "rows share the call" in why


def test_fp32_target_through_the_runtime_equals_ar(tmp_path, demo_target, demo_draft):
    prompt_file = tmp_path / "code.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CODE_PROMPTS))
    done = dovetail_run("--target", str(demo_target), "--draft", str(demo_draft), "--compare-ar", "--json",
                        "--prompt-file", str(prompt_file), "--max-new-tokens", "64", "--log-level", "info")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "target: fp32 (mkl-packed)" in done.stderr and "trees verified bit-exact" in done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == len(CODE_PROMPTS)
    for line in lines:
        assert line["ar"]["same_tokens"], f"fp32 dovetail differs from fp32 ar for {line['prompt']!r}"
        assert line["stats"]["tau"] > 1.5
