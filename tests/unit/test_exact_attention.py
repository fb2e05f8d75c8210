"""Exact attention (cpu_worker/native/attention.c): close to torch's attention, a tree row and a prompt
chunk's row equal bit for bit to their decodes, a bf16 cache read as its exact fp32 widening, the
same bits at any thread count, and the engine's tree logits equal to its decode logits with the
kernel and with torch's per-row fallback, over an fp32 or a bf16 cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_int8 import forced_tree_vs_decode_gap

from cpu_worker.engine import tree_paths
from cpu_worker.kernels import exact_attention

from conftest import build_for


@pytest.fixture(scope="module", autouse=True)
def kernel():
    exact_attention.clear_cache()
    assert exact_attention.available(), "the native library did not build (it needs a C compiler)"


def cache(kv_heads: int, head_dim: int, length: int = 300, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, kv_heads, length, head_dim, generator=generator),
            torch.randn(1, kv_heads, length, head_dim, generator=generator))


def tree_of(parents: list[int]) -> exact_attention.TreePaths:
    return exact_attention.TreePaths.from_paths(tree_paths(parents))


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 20), (6, 3, 128)])
@pytest.mark.parametrize("sharpness", [1.0, 30.0])  # 30: peaked softmaxes, exp far into underflow
def test_a_decode_step_matches_torch_attention(heads, kv_heads, head_dim, sharpness):
    keys, values = cache(kv_heads, head_dim)
    q = torch.randn(1, heads, 1, head_dim, generator=torch.Generator().manual_seed(1)) * sharpness
    for length in (1, 7, 131):
        expected = F.scaled_dot_product_attention(q, keys[:, :, :length], values[:, :, :length],
                                                  enable_gqa=heads != kv_heads)
        got = exact_attention.attend(q, keys, values, length)
        assert torch.allclose(got, expected, atol=2e-6, rtol=1e-5), (length, (got - expected).abs().max())


@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 2, 3, 3, 6], [-1, 0, 1, 2, 3], [-1]])
def test_a_tree_row_equals_the_decode_of_its_path_bit_for_bit(parents):
    heads, kv_heads, head_dim, start = 8, 4, 64, 100
    keys, values = cache(kv_heads, head_dim)
    q = torch.randn(1, heads, len(parents), head_dim, generator=torch.Generator().manual_seed(2))
    paths = tree_of(parents)
    tree = exact_attention.attend(q, keys, values, start, paths)
    for row, path in enumerate(paths.rows):
        # The decode of this node: its ancestors committed after the prefix, in path order.
        committed_keys, committed_values = keys.clone(), values.clone()
        committed_keys[:, :, start:start + len(path)] = keys[:, :, start + path]
        committed_values[:, :, start:start + len(path)] = values[:, :, start + path]
        decode = exact_attention.attend(q[:, :, row:row + 1], committed_keys, committed_values, start + len(path))
        assert torch.equal(decode[0, :, 0], tree[0, :, row]), f"row {row}"
        expected = F.scaled_dot_product_attention(q[:, :, row:row + 1], committed_keys[:, :, :start + len(path)],
                                                  committed_values[:, :, :start + len(path)], enable_gqa=True)
        assert torch.allclose(decode, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 2, 3, 3, 6], [-1]])
def test_a_bf16_cache_is_read_as_its_exact_fp32_widening(parents):
    """The kernel widens each bf16 row exactly and then does the fp32 arithmetic: the same bits as
    over the widened cache, for a decode step and for a tree (so tree rows still equal decodes)."""
    keys, values = (each.bfloat16() for each in cache(4, 64, seed=6))
    wide_keys, wide_values = keys.float(), values.float()
    q = torch.randn(1, 8, len(parents), 64, generator=torch.Generator().manual_seed(7))
    paths = tree_of(parents)
    assert exact_attention.applies(q, keys)
    assert torch.equal(exact_attention.attend(q, keys, values, 100, paths),
                       exact_attention.attend(q, wide_keys, wide_values, 100, paths))
    assert torch.equal(exact_attention.attend(q[:, :, :1], keys, values, 131),
                       exact_attention.attend(q[:, :, :1], wide_keys, wide_values, 131))
    with pytest.raises(ValueError, match="one contiguous fp32 or bf16 cache layer"):
        exact_attention.attend(q[:, :, :1], keys, wide_values, 131)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 20), (4, 4, 128)])
@pytest.mark.parametrize(("start", "rows"), [(0, 1), (0, 70), (13, 9), (100, 33)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_chunk_row_equals_its_decode_bit_for_bit(heads, kv_heads, head_dim, start, rows, cache_dtype):
    """Row r of a chunk starting at slot ``start`` attends to slots [0, start + r] exactly as the
    decode of that token does: so a prompt's attention is the same bits however it is cut (70 rows
    cross the kernel's 32-row tiles; head_dim 20 takes the scalar path)."""
    keys, values = (each.to(cache_dtype) for each in cache(kv_heads, head_dim, seed=8))
    q = torch.randn(1, heads, rows, head_dim, generator=torch.Generator().manual_seed(9)) * 4
    chunk = exact_attention.attend_causal(q, keys, values, start)
    for row in range(rows):
        decode = exact_attention.attend(q[:, :, row:row + 1], keys, values, start + row + 1)
        assert torch.equal(decode[0, :, 0], chunk[0, :, row]), f"row {row}"
    end = start + rows
    mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
    expected = F.scaled_dot_product_attention(q, keys[:, :, :end].float(), values[:, :, :end].float(),
                                              attn_mask=mask, enable_gqa=heads != kv_heads)
    assert torch.allclose(chunk, expected, atol=1e-5, rtol=1e-5), (chunk - expected).abs().max()


def test_a_prompt_chunk_is_refused_where_it_does_not_fit_the_cache():
    keys, values = cache(2, 16, length=10)
    with pytest.raises(ValueError, match="4 prompt rows after 7 cached slots of a 10-slot cache"):
        exact_attention.attend_causal(torch.randn(1, 2, 4, 16), keys, values, 7)


@pytest.mark.parametrize(("heads", "kv_heads"), [(16, 8), (9, 3)])
def test_the_thread_count_does_not_change_a_bit(heads, kv_heads):
    """Threads take equal stretches of all kv heads' queries, cut anywhere (9 / 3 is SmolLM2's
    grouping: 3 kv heads on 2 threads), and no cut changes a bit."""
    keys, values = cache(kv_heads, 64)
    q = torch.randn(1, heads, 5, 64, generator=torch.Generator().manual_seed(3))
    paths = tree_of([-1, 0, 0, 1, 1])
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            results.append((exact_attention.attend(q, keys, values, 200, paths),
                            exact_attention.attend_causal(q, keys, values, 200)))
    finally:
        torch.set_num_threads(threads)
    for tree, chunk in results[1:]:
        assert torch.equal(results[0][0], tree) and torch.equal(results[0][1], chunk)


def test_gradients_or_other_dtypes_keep_torch_attention():
    keys, values = cache(2, 16)
    q = torch.randn(1, 2, 1, 16)
    assert exact_attention.applies(q, keys)
    assert not exact_attention.applies(q.requires_grad_(), keys)
    assert not exact_attention.applies(q.detach().bfloat16(), keys.bfloat16())


@pytest.mark.parametrize("precision", ["fp32", "int8-row"])
@pytest.mark.parametrize("force_torch", [False, True])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_engine_tree_logits_equal_decode_logits_on_either_attention(demo_target, monkeypatch, precision,
                                                                     force_torch, kv_dtype):
    engine, gap = forced_tree_vs_decode_gap(demo_target, precision, monkeypatch, exact_attention, force_torch,
                                            kv_dtype)
    assert engine.exact_tree and engine.kv_dtype == (torch.bfloat16 if kv_dtype == "bf16" else torch.float32)
    assert gap == 0.0


def test_the_plain_c_build_gives_the_native_build_s_bits():
    """The AVX2 exponential and the plain C one must round alike (a row's tail, past its last
    multiple of 8, always takes the plain one)."""
    plain = build_for("x86-64-v2")
    keys, values = cache(4, 64, seed=4)
    q = torch.randn(1, 8, 6, 64, generator=torch.Generator().manual_seed(5)) * 8
    paths = tree_of([-1, 0, 0, 1, 3, 4])
    native = exact_attention.attend(q, keys, values, 93, paths)
    assert torch.equal(native, exact_attention.attend(q, keys, values, 93, paths, library=plain))
    chunk = exact_attention.attend_causal(q, keys, values, 93)
    assert torch.equal(chunk, exact_attention.attend_causal(q, keys, values, 93, library=plain))
    keys, values = keys.bfloat16(), values.bfloat16()  # the plain widening of a bf16 row too
    native = exact_attention.attend(q, keys, values, 93, paths)
    assert torch.equal(native, exact_attention.attend(q, keys, values, 93, paths, library=plain))


def test_slot_counts_outside_the_cache_are_refused_before_the_kernel_reads_them():
    keys, values = cache(2, 16, length=10)
    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(ValueError, match="0 shared slots"):
        exact_attention.attend(q, keys, values, 0)
    with pytest.raises(ValueError, match="11 shared slots and 0 tree rows of a 10-slot cache"):
        exact_attention.attend(q, keys, values, 11)
    tree = tree_of([-1, 0, 1])
    with pytest.raises(ValueError, match="8 shared slots and 3 tree rows of a 10-slot cache"):
        exact_attention.attend(torch.randn(1, 2, 3, 16), keys, values, 8, tree)
    with pytest.raises(ValueError, match="1 query rows for a 3-node tree"):
        exact_attention.attend(q, keys, values, 5, tree)
    assert torch.allclose(exact_attention.attend(q, keys, values, 10),
                          F.scaled_dot_product_attention(q, keys, values), atol=2e-6)
