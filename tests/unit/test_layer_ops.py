"""A layer's small steps on the native kernel (cpu_worker/native/layer_ops.c): RMSNorm close to torch's
and the same bits whatever rows share a call or however many threads run it; rotary and the
KV-cache write equal to torch's bit for bit; the engine's tree logits still equal its decode
logits, with the kernel and with torch's ops forced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_int8 import forced_tree_vs_decode_gap

from cpu_worker.kernels import layer_ops
from cpu_worker.model.llama import RMSNorm, apply_rope
from cpu_worker.server import build_engine

from conftest import build_for


@pytest.fixture(scope="module", autouse=True)
def kernel():
    layer_ops.clear_cache()
    assert layer_ops.available(), "the native library did not build (it needs a C compiler)"


def rows(count: int, dim: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(count, dim, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("dim", [20, 256, 2048, 4099])  # 20 and 4099: tails past the last 8 lanes
def test_rms_norm_is_close_to_torch_and_row_invariant(dim):
    x, weight = rows(9, dim), rows(1, dim, seed=1)[0]
    out = layer_ops.rms_norm(x, weight, 1e-6)
    assert torch.allclose(out, F.rms_norm(x, (dim,), weight, 1e-6), rtol=2e-6, atol=2e-6)
    alone = torch.cat([layer_ops.rms_norm(x[r:r + 1], weight, 1e-6) for r in range(9)])
    assert torch.equal(out, alone)


def test_rms_norm_gives_the_same_bits_at_any_thread_count():
    x, weight = rows(300, 1024), rows(1, 1024, seed=2)[0]  # large enough to run on the pool
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer_ops.rms_norm(x, weight, 1e-5)
        torch.set_num_threads(3)
        three = layer_ops.rms_norm(x, weight, 1e-5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


def test_the_module_takes_the_kernel_only_without_autograd():
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(rows(1, 64, seed=3)[0])
    x = rows(2, 64)
    assert layer_ops.applies(x, norm.weight) is False  # the weight is a trainable parameter
    with torch.no_grad():
        assert layer_ops.applies(x, norm.weight)
        assert torch.equal(norm(x), layer_ops.rms_norm(x, norm.weight, 1e-6))
    trained = norm(x.clone().requires_grad_())
    trained.sum().backward()  # torch's path: gradients flow
    assert norm.weight.grad is not None
    assert not layer_ops.applies(x.bfloat16(), norm.weight.detach().bfloat16())


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 64), (4, 4, 20), (6, 3, 128)])
def test_rope_qkv_equals_torch_rotary_and_cache_writes_bit_for_bit(heads, kv_heads, head_dim):
    length, slots, start = 5, 40, 11
    qkv = rows(length, (heads + 2 * kv_heads) * head_dim, seed=4).unsqueeze(0)
    angles = rows(length, head_dim // 2, seed=5)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    keys, values = torch.full((1, kv_heads, slots, head_dim), 7.0), torch.full((1, kv_heads, slots, head_dim), 7.0)
    q = layer_ops.rope_qkv(qkv, cos, sin, keys, values, start, heads, kv_heads)
    split = qkv.view(1, length, -1, head_dim).transpose(1, 2)
    rotated = apply_rope(split[:, :heads + kv_heads], cos, sin)
    assert torch.equal(q, rotated[:, :heads])
    assert torch.equal(keys[:, :, start:start + length], rotated[:, heads:])
    assert torch.equal(values[:, :, start:start + length], split[:, heads + kv_heads:])
    outside = torch.cat([keys[:, :, :start], keys[:, :, start + length:], values[:, :, :start],
                         values[:, :, start + length:]], dim=2)
    assert bool((outside == 7.0).all())


def test_rope_qkv_rounds_into_a_bf16_cache_as_torch_s_copy_does():
    heads, kv_heads, head_dim, length, start = 8, 2, 64, 6, 3
    qkv = rows(length, (heads + 2 * kv_heads) * head_dim, seed=11, scale=40.0).unsqueeze(0)
    qkv[0, 0, -4:] = torch.tensor([0.0, -0.0, 1e-40, 3.4e38])  # zeros, a subnormal, one that rounds to inf
    angles = rows(length, head_dim // 2, seed=12)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    keys, values = (torch.zeros(1, kv_heads, 20, head_dim, dtype=torch.bfloat16) for _ in range(2))
    q = layer_ops.rope_qkv(qkv, cos, sin, keys, values, start, heads, kv_heads)
    split = qkv.view(1, length, -1, head_dim).transpose(1, 2)
    rotated = apply_rope(split[:, :heads + kv_heads], cos, sin)
    expected_keys, expected_values = torch.zeros_like(keys), torch.zeros_like(values)
    expected_keys[:, :, start:start + length] = rotated[:, heads:]
    expected_values[:, :, start:start + length] = split[:, heads + kv_heads:]
    assert q.dtype == torch.float32 and torch.equal(q, rotated[:, :heads])
    assert torch.equal(keys.view(torch.int16), expected_keys.view(torch.int16))
    assert torch.equal(values.view(torch.int16), expected_values.view(torch.int16))
    with pytest.raises(ValueError, match="contiguous fp32 or bf16 cache layer"):
        layer_ops.rope_qkv(qkv, cos, sin, keys.half(), values.half(), start, heads, kv_heads)


def test_rope_qkv_refuses_shapes_and_slots_it_would_read_or_write_past():
    keys, values = torch.zeros(1, 2, 10, 16), torch.zeros(1, 2, 10, 16)
    qkv, cos, sin = torch.zeros(1, 3, 8 * 16), torch.zeros(3, 16), torch.zeros(3, 16)
    with pytest.raises(ValueError, match=r"slots \[8, 11\) outside a 10-slot cache"):
        layer_ops.rope_qkv(qkv, cos, sin, keys, values, 8, 4, 2)
    with pytest.raises(ValueError, match="do not fit 6 \\+ 2 x 2 heads"):
        layer_ops.rope_qkv(qkv, cos, sin, keys, values, 0, 6, 2)
    with pytest.raises(ValueError, match="cos/sin of shapes"):
        layer_ops.rope_qkv(qkv, cos[:2], sin[:2], keys, values, 0, 4, 2)
    with pytest.raises(ValueError, match="RMSNorm weight of shape"):
        layer_ops.rms_norm(torch.zeros(2, 16), torch.zeros(15), 1e-6)


def test_the_plain_c_build_gives_the_native_build_s_bits():
    plain = build_for("x86-64-v2")
    x, weight = rows(70, 1037, seed=6), rows(1, 1037, seed=7)[0]
    assert torch.equal(layer_ops.rms_norm(x, weight, 1e-6), layer_ops.rms_norm(x, weight, 1e-6, library=plain))
    qkv, cos, sin = rows(3, 8 * 36, seed=8).unsqueeze(0), rows(3, 36, seed=9), rows(3, 36, seed=10)
    caches = [(torch.zeros(1, 2, 8, 36), torch.zeros(1, 2, 8, 36)) for _ in range(2)]
    native = layer_ops.rope_qkv(qkv, cos, sin, *caches[0], 4, 4, 2)
    assert torch.equal(native, layer_ops.rope_qkv(qkv, cos, sin, *caches[1], 4, 4, 2, library=plain))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    caches = [(torch.zeros(1, 2, 8, 36, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 36, dtype=torch.bfloat16))
              for _ in range(2)]
    layer_ops.rope_qkv(qkv, cos, sin, *caches[0], 4, 4, 2)
    layer_ops.rope_qkv(qkv, cos, sin, *caches[1], 4, 4, 2, library=plain)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("precision", ["fp32", "int8-row"])
@pytest.mark.parametrize("force_torch", [False, True])
def test_engine_tree_logits_equal_decode_logits_with_either_layer_ops(demo_target, monkeypatch, precision,
                                                                       force_torch):
    assert forced_tree_vs_decode_gap(demo_target, precision, monkeypatch, layer_ops, force_torch)[1] == 0.0


def test_engine_logits_with_the_kernel_stay_close_to_torch_s_ops(demo_target, monkeypatch):
    prompt = list(range(5, 45))
    logits = {}
    for force_torch in (True, False):
        if force_torch:
            monkeypatch.setenv(layer_ops.FORCE_VARIABLE, "torch")
        else:
            monkeypatch.delenv(layer_ops.FORCE_VARIABLE, raising=False)
        layer_ops.clear_cache()
        engine, _ = build_engine(str(demo_target), "fp32", 128)
        logits[force_torch] = torch.stack([engine.prefill(prompt).logits, engine.decode(9).logits])
    layer_ops.clear_cache()
    assert torch.allclose(logits[False], logits[True], rtol=1e-4, atol=1e-4)
