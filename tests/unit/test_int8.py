"""int8 targets stay lossless: W8A8 with per-row activation scales gives a row the same bits
whatever rows share its call, attention verifies tree rows one by one with the decode's own
call, so a tree node's logits equal the decode logits of the same prefix bit for bit (that
dovetail then gives exactly --mode ar's tokens at int8: tests/system/test_int8_runtime.py)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn

from cpu_worker.engine import TargetEngine
from cpu_worker.kernels.int8 import RowwiseInt8Linear, quantize_linears
from cpu_worker.precision import apply_precision
from cpu_worker.server import build_engine
from cpu_worker.target_loading import load_target_model

from tree_paths import path_to


def per_tensor_int8(model: nn.Module) -> nn.Module:
    """The rule this module replaces: one activation scale per call (the deliberately wrong control)."""
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


@pytest.mark.parametrize("bias", [False, True])
def test_a_row_gets_the_same_bits_whatever_shares_its_call(bias):
    torch.manual_seed(0)
    layer = RowwiseInt8Linear(torch.randn(96, 320) * 0.05, torch.randn(96) if bias else None)
    rows = torch.randn(9, 320) * torch.logspace(-2, 2, 9).unsqueeze(1)  # very different row scales
    batched = layer(rows)
    for index in range(rows.shape[0]):
        assert torch.equal(layer(rows[index:index + 1]), batched[index:index + 1])
        assert torch.equal(layer(rows[[index, 0, 3]])[0], batched[index])
    assert torch.equal(layer(rows.view(3, 3, 320)), batched.view(3, 3, 96))


def test_rowwise_int8_is_accurate_and_the_per_tensor_control_is_not_invariant():
    torch.manual_seed(1)
    reference = nn.Linear(256, 128)
    rows = torch.randn(8, 256)
    rows[0] *= 50  # one loud row: with one scale per call it drowns the others' precision
    exact = reference(rows)
    ours = RowwiseInt8Linear(reference.weight, reference.bias)(rows)
    assert ((ours - exact).norm(dim=1) / exact.norm(dim=1)).max() < 0.03
    control = per_tensor_int8(nn.Sequential(reference))
    assert not torch.equal(control(rows)[1:2], control(rows[1:2]))


def test_zero_rows_and_quantize_linears_swap_every_linear(tiny_models):
    layer = RowwiseInt8Linear(torch.randn(8, 16))
    assert torch.equal(layer(torch.zeros(2, 16)), torch.zeros(2, 8))
    model = quantize_linears(load_target_model(tiny_models["qwen2"]))  # qkv biases
    assert not any(isinstance(module, nn.Linear) for module in model.modules())
    assert sum(isinstance(module, RowwiseInt8Linear) for module in model.modules()) == 2 * 7 + 1


def worst_tree_vs_decode_gap(engine: TargetEngine, trials: int = 4, size: int = 16) -> float:
    """Largest |logit| difference between a tree node and a decode of its path, over random trees."""
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    worst = 0.0
    for _ in range(trials):
        prompt = [rng.randrange(3, vocab) for _ in range(40)]
        parents = [-1] + [rng.randrange(0, index) for index in range(1, size)]
        tokens = [rng.randrange(3, vocab) for _ in range(size)]
        engine.prefill(prompt)
        _, tree = engine.tree_logits(tokens, parents)
        for node in range(size):
            engine.prefill(prompt)
            for step in path_to(parents, node):
                logits = engine.decode(tokens[step]).logits
            worst = max(worst, float((logits - tree[node]).abs().max()))
    return worst


def forced_tree_vs_decode_gap(target, precision: str, monkeypatch, switch, force_torch: bool,
                              kv_dtype: str = "auto") -> tuple[TargetEngine, float]:
    """The engine the cpu_worker builds (with that ``--kv-dtype``), with ``switch`` (a module with
    FORCE_VARIABLE, available() and clear_cache(): exact_attention, layer_ops) on its kernel or
    forced to torch, and its worst_tree_vs_decode_gap."""
    if force_torch:
        monkeypatch.setenv(switch.FORCE_VARIABLE, "torch")
    switch.clear_cache()
    try:
        assert switch.available() is not force_torch
        engine, _ = build_engine(str(target), precision, 128, kv_dtype)
        return engine, worst_tree_vs_decode_gap(engine, trials=2)
    finally:
        monkeypatch.delenv(switch.FORCE_VARIABLE, raising=False)
        switch.clear_cache()


def test_tree_logits_equal_decode_logits_bit_for_bit_at_int8(demo_target):
    model, dtype = apply_precision(load_target_model(demo_target), "int8-row")
    engine = TargetEngine(model, max_len=128, activation_dtype=dtype)
    assert engine.exact_tree
    assert worst_tree_vs_decode_gap(engine) == 0.0
    # A bf16 KV cache: tree rows and decodes read the same rounded keys and values.
    bf16_kv = TargetEngine(model, max_len=128, activation_dtype=dtype, kv_dtype=torch.bfloat16)
    assert bf16_kv.cache.keys.dtype == torch.bfloat16 and bf16_kv.cache.nbytes * 2 == engine.cache.nbytes
    assert worst_tree_vs_decode_gap(bf16_kv) == 0.0
    # Controls: the batched masked attention rounds differently per batch (~1e-6), and int8
    # rounding amplifies that (measured ~0.03); one activation scale per call breaks it outright.
    batched = worst_tree_vs_decode_gap(TargetEngine(model, max_len=128, activation_dtype=dtype, exact_tree=False))
    per_tensor = worst_tree_vs_decode_gap(
        TargetEngine(per_tensor_int8(load_target_model(demo_target)), max_len=128, exact_tree=True))
    print(f"int8 worst |tree - decode| logit: batched attention {batched:.4f}, per-tensor scales {per_tensor:.4f}")
    assert batched > 0 and per_tensor > 0.1


def test_kv_cache_dtype_choice(monkeypatch):
    from cpu_worker import precision
    from cpu_worker.precision import kv_cache_dtype

    # int8: bf16 where bf16 attention is cheap (our exact kernel, or native bf16), else fp32.
    for native, kernel, int8_auto in ((True, True, torch.bfloat16), (True, False, torch.bfloat16),
                                      (False, True, torch.bfloat16), (False, False, torch.float32)):
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda native=native: native)
        monkeypatch.setattr(precision.exact_attention, "available", lambda kernel=kernel: kernel)
        assert kv_cache_dtype("int8-row") == int8_auto
        assert kv_cache_dtype("q4_0") == int8_auto == kv_cache_dtype("q8_0")  # block formats: as int8
        assert kv_cache_dtype("fp32") == torch.float32  # its tree rows are not exact: bf16 K/V amplifies that
        # bf16: its own dtype where its trees are exact (the kernels build), else fp32 (as fp32's)
        assert kv_cache_dtype("bf16") == (torch.bfloat16 if kernel else torch.float32)
    assert kv_cache_dtype("fp32", "bf16") == torch.bfloat16 and kv_cache_dtype("bf16", "fp32") == torch.float32
    with pytest.raises(ValueError, match="KV cache dtype 'fp16' is not one of auto, fp32, bf16"):
        kv_cache_dtype("int8-row", "fp16")
    with pytest.raises(ValueError, match="target dtype 'int3'"):
        kv_cache_dtype("int3", "bf16")
