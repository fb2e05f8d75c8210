"""Our fp32 row kernel (``cpu_worker/kernels/fp32_rows.py``, ``dovetail_fp32_linear`` in fp32_rows.c): the
fp32 target's path wherever a C compiler is found. Every row of a call gets the bits it gets
alone, whatever the row count or the thread count, on every build (AVX-512, AVX2 with FMA, plain
C), so trees verify exactly; a prompt's rows from 64 on take F.linear."""

from __future__ import annotations

import ctypes
import shlex
import subprocess

import pytest
import torch
from test_int8 import worst_tree_vs_decode_gap
from torch import nn
from torch.nn import functional as F

from cpu_worker.engine import TargetEngine
from cpu_worker.kernels import int8_kernel
from cpu_worker.kernels.fp32_rows import (
    MAX_KERNEL_ROWS,
    PROMPT_GEMM_ROWS,
    RowInvariantFp32Linear,
    prompt_rows,
    use_fp32_row_kernel,
)
from cpu_worker.native import library as native_library
from cpu_worker.target_loading import load_target_model, weight_bytes
from ipc.placement import cpu_flags
from ipc.tree import MAX_TREE_TOKENS

from conftest import build_for, flags_for


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


# (-march, the x86 flags a CPU needs to run that build, dovetail_fp32_simd's answer)
BUILDS = [("x86-64-v2", set(), 0), ("x86-64-v3", {"avx2", "fma", "f16c", "bmi2", "movbe"}, 1),
          ("skylake-avx512", {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}, 2)]


def _linear(library: ctypes.CDLL, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            threads: int = 2) -> torch.Tensor:
    out = torch.empty(rows.shape[0], weight.shape[0])
    library.dovetail_fp32_linear(rows.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                 out.data_ptr(), rows.shape[0], weight.shape[0], weight.shape[1], threads)
    return out


def test_every_build_gives_a_row_its_bits_alone_and_the_right_sums():
    """Each build this CPU can run (always plain C: 4 lanes, multiply then add; AVX2 with FMA: 8
    lanes, rows in pairs; AVX-512: 16 lanes, rows in fours, remainders of 3, 2, 1): every row
    count from 1 to 9, across the 64-row parking limit, a k with and without a tail past the last
    full vector and the last 256-float chunk, outputs with a tail past the last block of 4."""
    runnable = [(arch, simd) for arch, needs, simd in BUILDS if needs <= cpu_flags()]
    assert runnable[0] == ("x86-64-v2", 0)
    for arch, simd in runnable:
        library = build_for(arch)
        assert library.dovetail_fp32_simd() == simd
        generator = torch.Generator().manual_seed(simd)
        for n_out, k in ((37, 600), (64, 512), (21, 1031), (6, 3)):
            weight = torch.randn(n_out, k, generator=generator) * 0.05
            bias = torch.randn(n_out, generator=generator)
            rows = torch.randn(70, k, generator=generator) * torch.logspace(-2, 2, 70).unsqueeze(1)
            alone = torch.cat([_linear(library, rows[index:index + 1], weight, bias) for index in range(70)])
            for count in (*range(2, 10), 63, 64, 65, 70):
                assert torch.equal(_linear(library, rows[:count], weight, bias), alone[:count]), (arch, k, count)
            assert torch.equal(_linear(library, rows[:9], weight, bias, threads=1), alone[:9])
            exact = (rows.double() @ weight.double().T + bias.double()).float()
            torch.testing.assert_close(alone, exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))


def test_the_fp32_kernel_keeps_its_software_prefetch(tmp_path):
    """GCC deletes a prefetch it thinks has no effect (it once did in the int8 kernel): the next
    block's lines must still be fetched in the built code (1.2-1.3x on 4-8 rows here)."""
    compiler = native_library.find_compiler()
    assert compiler is not None
    flags = [flag for flag in flags_for("native") if flag != "-shared"] + ["-S"]
    assembly = tmp_path / "fp32_rows.s"
    subprocess.run([*shlex.split(compiler), *flags, str(native_library.DIRECTORY / "fp32_rows.c"), "-o", str(assembly)],
                   check=True, capture_output=True)
    assert "prefetcht0" in assembly.read_text()


def test_a_prompt_s_rows_from_64_on_take_f_linear_and_no_other_call_does():
    """Inside prompt_rows() (the engine's prefill), calls of PROMPT_GEMM_ROWS rows or more are
    F.linear's bits; fewer rows, and every call outside (trees of any size), the kernel's."""
    torch.manual_seed(3)
    dense = nn.Linear(96, 40)
    layer = RowInvariantFp32Linear(dense.weight, dense.bias)
    rows = torch.randn(PROMPT_GEMM_ROWS + 6, 96)
    alone = torch.cat([layer(rows[index:index + 1]) for index in range(rows.shape[0])])
    with torch.no_grad():
        gemm = F.linear(rows, dense.weight, dense.bias)
        with prompt_rows():
            assert torch.equal(layer(rows), gemm)
            first = rows[:PROMPT_GEMM_ROWS]
            assert torch.equal(layer(first), F.linear(first, dense.weight, dense.bias))
            assert torch.equal(layer(rows[:PROMPT_GEMM_ROWS - 1]), alone[:PROMPT_GEMM_ROWS - 1])
        assert torch.equal(layer(rows), alone)  # outside a prompt: the kernel, whatever the count
    assert not torch.equal(alone, gemm), "F.linear and the kernel round these rows alike: the test shows nothing"


def test_the_engine_prefills_a_long_prompt_on_f_linear_and_decodes_on_the_kernel(demo_target):
    """A 100-token prompt's features are F.linear's exactly (the same call in every mode); after
    it, a tree of more than PROMPT_GEMM_ROWS nodes stays on the kernel: every node's logits equal
    the decode of its path (a root and 69 children, so each path is two decodes)."""
    model = load_target_model(demo_target)
    assert use_fp32_row_kernel(model)
    engine = TargetEngine(model, max_len=200)
    reference = TargetEngine(load_target_model(demo_target), max_len=200)
    vocab = model.spec.vocab_size
    prompt = [(37 * index + 11) % vocab for index in range(100)]
    assert torch.equal(engine.prefill(prompt).features, reference.prefill(prompt).features)
    size = PROMPT_GEMM_ROWS + 6
    tokens = [(53 * index + 7) % vocab for index in range(size)]
    _, tree = engine.tree_logits(tokens, [-1] + [0] * (size - 1))
    engine.prefill(prompt)
    root = engine.decode(tokens[0]).logits
    assert torch.equal(root, tree[0])
    for node in range(1, size):
        engine.prefill(prompt)
        engine.decode(tokens[0])
        assert torch.equal(engine.decode(tokens[node]).logits, tree[node]), node


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

    from cpu_worker.kernels import fp32_packed
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


@pytest.mark.parametrize("forced", ["auto", "dovetail", "mkl", "bogus"])
def test_the_worker_takes_our_kernel_unless_told_otherwise(demo_target, monkeypatch, caplog, forced):
    """build_engine's fp32 choice: our row kernel where it builds; DOVETAIL_FP32_KERNEL=mkl takes
    MKL's packed sgemm instead (or F.linear where this torch has no MKL or its rows fail the check);
    an unknown value is auto, and the log says so."""
    import logging

    from cpu_worker.kernels.fp32_packed import PackedFp32Linear
    from cpu_worker.server import FP32_KERNEL_VARIABLE, build_engine

    monkeypatch.setenv(FP32_KERNEL_VARIABLE, forced)
    with caplog.at_level(logging.WARNING):
        engine, kernel = build_engine(str(demo_target), "fp32", 64)
    kinds = {type(module) for module in engine.model.modules()}
    if forced == "mkl":
        assert kernel in ("mkl-packed", "F.linear") and RowInvariantFp32Linear not in kinds
        assert (kernel == "mkl-packed") == (PackedFp32Linear in kinds)
    else:
        assert kernel == "dovetail-fp32" and RowInvariantFp32Linear in kinds and PackedFp32Linear not in kinds
    assert ("'bogus' is not auto, dovetail or mkl" in caplog.text) == (forced == "bogus")
