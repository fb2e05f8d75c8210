"""bf16 targets (``cpu_worker/kernels/bf16_rows.py``, ``dovetail_bf16_linear`` in fp32_rows.c): bf16
weights widened on the fp32 row kernel, fp32 activations. A row's bits are the fp32 kernel's on the
widened weights, alone or in any call, on every build the CPU runs; so a bf16 engine verifies
trees exactly, its decode runs in the native layer loop, and its table is stored once in bf16."""

from __future__ import annotations

import logging

import torch
from test_fp32_rows import BUILDS
from test_int8 import worst_tree_vs_decode_gap
from torch import nn
from torch.nn import functional as F

from cpu_worker.kernels import bf16_rows, exact_attention, int8_kernel
from cpu_worker.kernels.bf16_rows import Bf16Linear, RowInvariantBf16Linear, widened_linear
from cpu_worker.kernels.fp32_rows import PROMPT_GEMM_ROWS, RowInvariantFp32Linear, prompt_rows
from cpu_worker.model.embedding import StoredEmbedding
from cpu_worker.server import build_engine
from cpu_worker.target_loading import load_target_model, weight_bytes
from ipc.placement import cpu_flags

from conftest import TINY_FAMILIES, build_for, save_tiny_model


def _call(function, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, threads: int = 2) -> torch.Tensor:
    out = torch.empty(rows.shape[0], weight.shape[0])
    function(rows.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr(), rows.shape[0], weight.shape[0],
             weight.shape[1], threads)
    return out


def test_every_build_gives_a_row_the_fp32_kernels_bits_on_the_widened_weights():
    """Each build this CPU can run (plain C, AVX2, AVX-512): every row count from 1 to 9 and past
    the 64-row parking limit, k with and without a tail past the last vector, outputs with a tail
    past the last block of 4, one thread or two: bf16 rows equal the fp32 kernel's on w.float()."""
    runnable = [arch for arch, needs, _ in BUILDS if needs <= cpu_flags()]
    for arch in runnable:
        library = build_for(arch)
        generator = torch.Generator().manual_seed(len(arch))
        for n_out, k in ((37, 600), (21, 1031), (6, 3), (64, 512)):
            weight = (torch.randn(n_out, k, generator=generator) * 0.05).to(torch.bfloat16)
            widened = weight.float()
            bias = torch.randn(n_out, generator=generator)
            rows = torch.randn(70, k, generator=generator) * torch.logspace(-2, 2, 70).unsqueeze(1)
            for count in (1, 2, 3, 4, 5, 9, 65, 70):
                got = _call(library.dovetail_bf16_linear, rows[:count], weight, bias)
                assert torch.equal(got, _call(library.dovetail_fp32_linear, rows[:count], widened, bias)), (arch, k)
            alone = _call(library.dovetail_bf16_linear, rows[5:6], weight, bias, threads=1)
            assert torch.equal(alone[0], _call(library.dovetail_bf16_linear, rows[:9], weight, bias)[5])
            exact = (rows.double() @ widened.double().T + bias.double()).float()
            torch.testing.assert_close(_call(library.dovetail_bf16_linear, rows, weight, bias), exact, rtol=1e-5,
                                       atol=1e-5 * float(exact.abs().max()))


def test_a_layer_keeps_a_rows_bits_in_any_call_and_a_prompt_takes_the_widened_gemm():
    torch.manual_seed(4)
    dense = nn.Linear(96, 40)
    layer = RowInvariantBf16Linear(dense.weight, dense.bias)
    assert layer.weight.dtype == torch.bfloat16 and layer.row_invariant
    widened = RowInvariantFp32Linear(layer.weight.float(), dense.bias)
    rows = torch.randn(PROMPT_GEMM_ROWS + 6, 96)
    alone = torch.cat([layer(rows[index:index + 1]) for index in range(rows.shape[0])])
    assert torch.equal(alone, widened(rows))  # outside a prompt: the kernel, whatever the count
    assert torch.equal(layer(rows[[7, 0, 3]]), alone[[7, 0, 3]])
    with torch.no_grad(), prompt_rows():
        gemm = F.linear(rows, layer.weight.float(), dense.bias)
        assert torch.equal(layer(rows), gemm)  # 70 prompt rows: the GEMM on the widened weights
        assert torch.equal(layer(rows[:PROMPT_GEMM_ROWS - 1]), alone[:PROMPT_GEMM_ROWS - 1])


def test_the_gemm_widens_a_slab_at_a_time(monkeypatch):
    """A matrix wider than one slab goes in slabs: each slab's columns are that slab's GEMM's."""
    torch.manual_seed(5)
    weight = torch.randn(50, 64).to(torch.bfloat16)
    bias = torch.randn(50)
    rows = torch.randn(8, 64)
    monkeypatch.setattr(bf16_rows, "SLAB_WEIGHTS", 16 * 64)  # 16 rows a slab: 4 slabs, the last of 2
    got = widened_linear(rows, weight, bias)
    for start in range(0, 50, 16):
        part = F.linear(rows, weight[start:start + 16].float(), bias[start:start + 16])
        assert torch.equal(got[:, start:start + 16], part)


def test_a_bf16_engine_verifies_trees_exactly_in_half_of_fp32s_memory(demo_target):
    engine, kernel = build_engine(str(demo_target), "bf16", 128)
    assert kernel == "dovetail-bf16" and engine.exact_tree and engine.kv_dtype == torch.bfloat16
    assert engine.model.layer_loop is not None  # decode steps and trees in the C layer loop
    assert worst_tree_vs_decode_gap(engine) == 0.0
    model = engine.model
    assert isinstance(model.embed_tokens, StoredEmbedding) and model.embed_tokens.weight.dtype == torch.bfloat16
    linears = [module for module in model.modules() if isinstance(module, Bf16Linear)]
    assert linears and all(module.weight.dtype == torch.bfloat16 for module in linears)
    fp32 = load_target_model(demo_target, "fp32")
    assert weight_bytes(model) < 0.51 * weight_bytes(fp32)  # the norms stay fp32


def test_a_tied_table_is_stored_once_in_bf16(tmp_path):
    path = save_tiny_model(tmp_path / "tied", weight_format="sharded", **TINY_FAMILIES["llama-gqa-tied"])
    model = load_target_model(path, "bf16")
    assert isinstance(model.embed_tokens, StoredEmbedding) and isinstance(model.lm_head, Bf16Linear)
    assert model.lm_head.weight is model.embed_tokens.weight and model.lm_head.weight.dtype == torch.bfloat16


def test_without_a_compiler_bf16_runs_the_widened_gemm_and_the_worker_says_so(demo_target, monkeypatch, caplog):
    int8_kernel.clear_cache()
    exact_attention.clear_cache()
    try:
        monkeypatch.setenv("CC", "/nonexistent/cc")
        with caplog.at_level(logging.WARNING):
            engine, kernel = build_engine(str(demo_target), "bf16", 64)
        assert kernel == "F.linear" and not engine.exact_tree and "float tolerance" in caplog.text
        assert engine.kv_dtype == torch.float32  # a bf16 cache would amplify the ~1e-6 to ~1e-2
        linears = [module for module in engine.model.modules() if isinstance(module, Bf16Linear)]
        assert linears and not any(isinstance(module, RowInvariantBf16Linear) for module in linears)
        layer = linears[0]
        rows = torch.randn(3, layer.in_features)
        assert torch.equal(layer(rows), F.linear(rows, layer.weight.float(), layer.bias))
    finally:
        int8_kernel.clear_cache()
        exact_attention.clear_cache()
