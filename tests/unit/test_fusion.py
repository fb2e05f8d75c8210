"""Fused int8 projections (q/k/v in one layer, gate/up in another) change no bit: each weight row
is quantized on its own and summed exactly, so the fused model is the unfused one, faster."""

from __future__ import annotations

import pytest
import torch

from cpu_worker.engine import TargetEngine
from cpu_worker.kernels import int8_kernel
from cpu_worker.kernels.int8 import RowwiseInt8Linear, quantize_linears
from cpu_worker.model.fusion import fuse_projections
from cpu_worker.precision import apply_precision
from cpu_worker.target_loading import load_target_model


def _logits(model, tokens: list[int], tree: tuple[list[int], list[int]]) -> torch.Tensor:
    engine = TargetEngine(model, max_len=64)
    first = engine.prefill(tokens).logits
    second = engine.decode(7).logits
    _, tree_logits = engine.tree_logits(*tree)
    return torch.cat([first[None], second[None], tree_logits])


@pytest.mark.parametrize("family", ["llama-gqa-tied", "qwen2"])  # q wider than k/v; qkv biases
def test_fused_int8_model_gives_the_unfused_models_logits_bit_for_bit(tiny_models, family):
    unfused = quantize_linears(load_target_model(tiny_models[family]))
    fused = quantize_linears(load_target_model(tiny_models[family]))
    assert fuse_projections(fused) == 2 * fused.spec.num_layers
    for layer in fused.layers:
        assert isinstance(layer.self_attn.qkv_proj, RowwiseInt8Linear) and not hasattr(layer.self_attn, "q_proj")
        assert isinstance(layer.mlp.gate_up_proj, RowwiseInt8Linear) and not hasattr(layer.mlp, "up_proj")
    assert fuse_projections(fused) == 0  # already fused
    tokens = [3, 14, 15, 92, 65, 35, 8, 9, 79]
    tree = ([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 3])
    assert torch.equal(_logits(fused, tokens, tree), _logits(unfused, tokens, tree))


def test_int8_loading_and_conversion_fuse_and_fp32_is_left_alone(tiny_models):
    for model in (load_target_model(tiny_models["llama-mha"], "int8-row"),
                  apply_precision(load_target_model(tiny_models["llama-mha"]), "int8-row")[0]):
        assert all(layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
                   for layer in model.layers)
    fp32 = load_target_model(tiny_models["llama-mha"])
    assert fuse_projections(fp32) == 0
    assert all(layer.self_attn.qkv_proj is None and hasattr(layer.self_attn, "q_proj") for layer in fp32.layers)


@pytest.mark.parametrize("kernel", ["ours", "fbgemm"])
def test_concatenated_layer_equals_its_parts_side_by_side(monkeypatch, kernel):
    if kernel == "fbgemm":
        monkeypatch.setattr(int8_kernel, "kernel_name", lambda: "fbgemm")
    torch.manual_seed(3)
    parts = [RowwiseInt8Linear(torch.randn(rows, 96) * 0.1, torch.randn(rows) if index != 1 else None)
             for index, rows in enumerate((64, 16, 40))]
    fused = RowwiseInt8Linear.concatenate(parts)
    assert fused.kernel == parts[0].kernel and (fused.kernel == "fbgemm") == (kernel == "fbgemm")
    for count in (1, 5, 30):  # the GEMV and, from INT_MM_MIN_ROWS on, the int8 GEMM path
        rows = torch.randn(count, 96) * torch.logspace(-1, 1, count).unsqueeze(1)
        assert torch.equal(fused(rows), torch.cat([part(rows) for part in parts], dim=-1))
    with pytest.raises(ValueError, match="same input width"):
        RowwiseInt8Linear.concatenate([parts[0], RowwiseInt8Linear(torch.randn(8, 32))])



@pytest.mark.parametrize("projections", ["int8", "q4_0"])
@pytest.mark.parametrize("fusion", ["dgf", "fc"])
def test_a_quantized_draft_head_fuses_to_the_same_bits(monkeypatch, fusion, projections):
    """A head drafting on the CPU in int8 or q4_0 fuses its layers' projections too, and computes
    what the unfused head computes, bit for bit."""
    from test_draft_head import random_pairs, run_head
    from test_draft_support import tiny_head

    import gpu_worker.head_formats
    from gpu_worker.head_formats import quantize_projections

    fused = quantize_projections(tiny_head(fusion, layers=2), projections)
    assert all(layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None for layer in fused.layers)
    monkeypatch.setattr(gpu_worker.head_formats, "fuse_projections", lambda model: 0)
    unfused = quantize_projections(tiny_head(fusion, layers=2), projections)
    assert all(layer.self_attn.qkv_proj is None for layer in unfused.layers)
    features, tokens = random_pairs(9)
    assert torch.equal(run_head(fused, features, tokens, [5, 4]), run_head(unfused, features, tokens, [5, 4]))


def test_dense_fusion_is_asked_for_and_stays_close_and_exact_on_the_workers_kernel(tiny_models, demo_target):
    """fp32 layers are fused only with ``dense`` (their GEMM rounds a larger matrix differently);
    the fused model agrees with the unfused one to float tolerance, and on the worker's fp32
    kernel (our row kernel; MKL's packed sgemm where no C compiler is found) its tree nodes still
    equal decodes bit for bit."""
    from test_int8 import worst_tree_vs_decode_gap

    from cpu_worker.kernels.fp32_packed import pack_fp32_linears
    from cpu_worker.kernels.fp32_rows import use_fp32_row_kernel

    tokens = [3, 14, 15, 92, 65, 35, 8, 9, 79]
    tree = ([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 3])
    unfused = load_target_model(tiny_models["qwen2"])
    fused = load_target_model(tiny_models["qwen2"])
    assert fuse_projections(fused) == 0  # float layers need dense=True
    assert fuse_projections(fused, dense=True) == 2 * fused.spec.num_layers
    assert all(isinstance(layer.self_attn.qkv_proj, torch.nn.Linear) and layer.self_attn.qkv_proj.bias is not None
               for layer in fused.layers)
    torch.testing.assert_close(_logits(fused, tokens, tree), _logits(unfused, tokens, tree), rtol=1e-5, atol=1e-5)
    demo = load_target_model(demo_target)
    fuse_projections(demo, dense=True)
    assert use_fp32_row_kernel(demo) or pack_fp32_linears(demo)  # as build_engine does
    engine = TargetEngine(demo, max_len=128)
    assert engine.exact_tree
    assert worst_tree_vs_decode_gap(engine) == 0.0


def test_the_workers_engine_is_fused_at_fp32_and_int8(demo_target):
    from cpu_worker.server import build_engine

    for precision in ("fp32", "int8-row"):
        engine, _ = build_engine(str(demo_target), precision, 64)
        assert all(layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
                   for layer in engine.model.layers), precision
