"""Block-quantized linears (Q8_0, Q4_0, Q4_1 weights; activations per block of 32 at 8 or 16 bits):
a row's bits never depend on its call-mates, every build gives the same bits, and the result is the
dequantized product."""

from __future__ import annotations

import pytest
import torch

from cpu_worker.kernels import block_quant
from ipc.placement import cpu_flags
from tools import quant_reference

from conftest import build_for

# (-march and other -m flags' arguments, the x86 flags a CPU needs to run that build, dovetail_block_simd's answer)
BUILDS = [(("x86-64-v2",), set(), 0),
          (("x86-64-v3",), {"avx2", "fma", "f16c", "bmi2", "movbe"}, 1),
          (("x86-64-v3", "-mavxvnni"), {"avx2", "fma", "f16c", "bmi2", "movbe", "avx_vnni"}, 2),
          (("x86-64-v4", "-mavx512vnni"), {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}, 2),
          (("sapphirerapids",), {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"}, 2)]
KINDS = list(block_quant.TYPES)


def runnable_builds() -> list[tuple[str, object]]:
    """Each build of ``BUILDS`` this CPU can run (compiled once per test session)."""
    built = []
    for arch, needs, simd in BUILDS:
        if needs <= cpu_flags():
            library = build_for(*arch)
            assert library.dovetail_block_simd() == simd, arch
            built.append((" ".join(arch), library))
    return built


def per_block_int8(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """The activations as the kernel rounds them: per 32 values, fp32 scale max|x| / 127 (8 bits)
    or max|x| / 32512 (16)."""
    top = 127 if bits == 8 else 32512
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.full_like(amax, top) / amax  # a true division, as the kernel's (``top / tensor`` is not)
    q = torch.round(blocks * torch.where(amax > 0, inverse, 0)).clamp(-top, top)
    return (q * (amax / top)).reshape(x.shape)


def test_16_bit_activations_are_two_int8_digits_of_the_rounded_value():
    x = torch.randn(3, 96) * torch.logspace(-3, 3, 3).unsqueeze(1)
    x[1, 32:64] = 0.0
    x[2, 5] = -x[2, 64:96].abs().max() * 2  # the block's extreme, negative: v = -32512
    planes, scales, sums = block_quant.quantize_activations(x, 2)
    high, low = planes[:, 0].int(), planes[:, 1].int()
    assert int(high.abs().max()) <= 127 and int(low.abs().max()) <= 127  # VNNI's sign trick needs |digit| <= 127
    value = 255 * high + low
    amax = x.reshape(3, 3, 32).abs().amax(-1, keepdim=True)
    expected = torch.round(x.reshape(3, 3, 32) * torch.where(amax > 0, 32512 / amax, 0)).clamp(-32512, 32512)
    assert torch.equal(value.reshape(3, 3, 32), expected.int()) and int(value.min()) == -32512
    assert torch.equal(sums, value.reshape(3, 3, 32).sum(-1))
    assert not value[1, 32:64].any() and scales[1, 1] == 0
    torch.testing.assert_close(value.float().reshape(3, 3, 32) * scales.unsqueeze(-1), x.reshape(3, 3, 32),
                               rtol=0, atol=float(x.abs().max()) / 32512)


def test_every_builds_activation_quantizer_gives_the_plain_c_bits_at_any_thread_count():
    """The activations' quantizer (8 lanes at a time on AVX2 builds, blocks split over threads)
    against the plain C build: exact halves of the rounding, both digits' extremes, zero and
    subnormal blocks, blocks whose scale's inverse overflows beside zeros, NaN and infinite inputs
    (a product that is NaN is quantized to 0 on every path), at 8 and 16 bits, on one thread and two."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(6, 1024, generator=generator) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[0, :32] = 0.0
    x[0, 32:64] = torch.arange(-16, 16) + 0.5  # max 15.5: scaled values near halves at 8 bits
    x[0, 64:96] = torch.arange(-16, 16) * (127 / 32)  # max 63.5 (-16 * 127/32): whole and half steps at 8 bits
    x[1, :32] = torch.arange(32) * 255.0  # 16 bits: a whole number of 255s where the block's extreme is
    x[1, 64] = -x[1, 64:96].abs().max() * 3  # the block's extreme, negative: v = -32512, h = -127
    x[2, 96:128] *= 1e-40  # subnormal: the inverse overflows
    x[2, 128:160] = 0.0
    x[2, 130] = 3e-38  # a normal value whose inverse overflows, beside zeros (0 x inf is NaN)
    x[3, 200] = float("nan")
    x[4, 300] = float("inf")
    x[5, 400] = -float("inf")
    x = x.repeat(4, 1)  # 24 rows: 24576 activations, past the quantizer's threshold for threads
    builds = runnable_builds()
    plain = builds[0][1]  # the plain C build
    for name, library in builds:
        for planes in (1, 2):
            for threads in (1, 2):
                got = [torch.empty(x.shape[0], planes, x.shape[1], dtype=torch.int8),
                       torch.empty(x.shape[0], x.shape[1] // 32),
                       torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.int32)]
                expected = [part.clone() for part in got]
                for lib, out, count in ((library, got, threads), (plain, expected, 1)):
                    lib.dovetail_quantize_blocks(x.data_ptr(), out[0].data_ptr(), out[1].data_ptr(), out[2].data_ptr(),
                                                 x.shape[0], x.shape[1], planes, count)
                assert torch.equal(got[0], expected[0]), (name, planes, threads)
                assert torch.equal(got[1].view(torch.int32), expected[1].view(torch.int32)), (name, planes, threads)
                assert torch.equal(got[2], expected[2]), (name, planes, threads)
                assert int(got[0].int().abs().max()) <= 127
                assert not got[0][3, :, 200].any() and got[0][3, 0, 192:224].any()  # the NaN alone is 0
                overflowed = got[0][2, :, 128:160].int()  # 3e-38 among zeros: the top value, and zeros
                assert overflowed[:, 2].tolist() == [127] * planes and not overflowed[:, 3:].any()


@pytest.fixture
def use_library(monkeypatch):
    def use(library):
        monkeypatch.setattr(block_quant, "library", lambda: library)
    return use


@pytest.mark.parametrize("kind", KINDS)
def test_weights_round_as_llama_cpp_and_keep_ggufs_byte_layout(kind):
    weight = torch.randn(32, 256) * torch.logspace(-3, 1, 32).unsqueeze(1)
    weight[0, :32] = 0.0
    weight[1, :32] = 0.0
    weight[1, :6] = torch.tensor([127.0, 40.5, -2.5, 0.5, -0.5, 1.5])  # exact halves at Q8_0 (d = 1)
    blocks = block_quant.BlockWeights.quantize(weight, kind)
    assert torch.equal(blocks.dequantize(), getattr(quant_reference, kind)(weight))
    gguf = blocks.gguf_blocks()
    assert gguf.shape == (32, 256 if kind == "q8_0" else 128)
    assert blocks.nbytes == {"q8_0": 34, "q4_0": 18, "q4_1": 20}[kind] * 32 * 256 // 32  # GGUF's block sizes
    minimums = None if blocks.minimums is None else block_quant.ungroup(blocks.minimums, 32)
    again = block_quant.BlockWeights.from_blocks(kind, gguf, block_quant.ungroup(blocks.scales, 32), minimums, 256)
    assert torch.equal(again.data, blocks.data) and torch.equal(again.dequantize(), blocks.dequantize())


def test_every_builds_quantizer_gives_the_torch_paths_bits(use_library):
    """The load-time quantizer in C (fp16/bf16 rows read as stored, written straight into the kernel's
    layout; 8 lanes at a time on AVX2 builds, plain C on the others) against the torch ops it replaced:
    ties for the largest magnitude, zero blocks of either sign, exact halves, subnormal scales (whose
    inverse overflows), every dtype, every build this CPU runs."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(40, 320, generator=generator) * torch.logspace(-4, 2, 40).unsqueeze(1)
    weight[0, :32] = 0.0
    weight[0, 40] = -0.0  # a block with a signed zero among its values
    weight[1, :6] = torch.tensor([127.0, 40.5, -2.5, 0.5, -0.5, 1.5])
    weight[2, :32] = -2.0
    weight[2, 7] = 2.0  # +2 and -2 tie for Q4_0's largest magnitude: the first one sets the sign
    weight[3, 32:64] = torch.linspace(-1, 1, 32)
    weight[4] *= 1e-38
    weight[5, 64:96] = -weight[5, 64:96].abs()  # all negative: Q4_1's maximum below zero
    weight[5, 70] = -0.0  # ... and then a zero of either sign as the maximum
    weight[5, 75] = 0.0
    first: dict[tuple[str, torch.dtype, str], block_quant.BlockWeights] = {}
    for name, library in runnable_builds():  # the plain C build first
        use_library(library)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            source = weight.to(dtype)
            for kind in KINDS:
                native = block_quant.BlockWeights.quantize(source, kind)  # 40 rows: a last group of 8 padded with zeros
                reference = block_quant.BlockWeights._torch_quantize_rows(source, kind)
                assert torch.equal(native.data, reference.data), (name, dtype, kind)
                assert torch.equal(native.scales, reference.scales), (name, dtype, kind)
                assert (native.minimums is None) == (reference.minimums is None)
                if native.minimums is not None and reference.minimums is not None:
                    assert torch.equal(native.minimums, reference.minimums), (name, dtype, kind)
                # Every build the plain C's bits, signed zeros included (torch picks a zero's sign its own way),
                # and on a block with a NaN (where torch's answer differs: the AVX2 path defers to the plain loop).
                poisoned = source.clone()
                poisoned[6, 100] = float("nan")
                for case, blocks in (("clean", native), ("nan", block_quant.BlockWeights.quantize(poisoned, kind))):
                    plain = first.setdefault((case, dtype, kind), blocks)
                    assert torch.equal(blocks.data, plain.data), (name, case, dtype, kind)
                    for part in ("scales", "minimums"):
                        ours, theirs = getattr(blocks, part), getattr(plain, part)
                        assert ours is None or theirs is None or \
                            torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), (name, case, dtype, kind)


def test_the_kernel_layout_keeps_every_value_and_pads_a_last_group():
    for kind in KINDS:
        values = torch.randint(-127 if kind == "q8_0" else 0, 128 if kind == "q8_0" else 16, (13, 96),
                               dtype=torch.int16)
        laid = block_quant.interleave(kind, values)
        assert laid.shape == (1, 3 * (512 if kind == "q8_0" else 256))  # 16 rows: 3 padded with zeros
        assert torch.equal(block_quant.deinterleave(kind, laid, 13, 96), values)
        assert not block_quant.deinterleave(kind, laid, 16, 96)[13:].any()


@pytest.mark.parametrize("bits", [8, 16])
def test_every_build_gives_a_row_its_bits_alone_and_the_dequantized_product(use_library, bits):
    builds = runnable_builds()
    assert builds[0][0] == "x86-64-v2"
    generator = torch.Generator().manual_seed(0)
    planes = block_quant.ACTIVATION_PLANES[bits]
    for kind in KINDS:
        for n_out, k in ((37, 256), (5, 32), (64, 4096)):
            weight = torch.randn(n_out, k, generator=generator) * 0.05
            weight[1] *= 2e-3  # scales below fp16's normal range: F16C and the plain conversion must agree
            blocks = block_quant.BlockWeights.quantize(weight, kind)
            assert (block_quant.ungroup(blocks.scales, n_out)[1].float().abs() < 6.1e-5).any()
            bias = torch.randn(n_out, generator=generator)
            rows = torch.randn(11, k, generator=generator) * torch.logspace(-2, 2, 11).unsqueeze(1)
            rows[3, :32] = 0.0  # a zero block
            first = None
            for name, library in builds:
                use_library(library)
                alone = torch.cat([block_quant.block_linear(rows[i:i + 1], blocks, bias, planes=planes)
                                   for i in range(11)])
                for count in range(2, 12):
                    assert torch.equal(block_quant.block_linear(rows[:count], blocks, bias, planes=planes),
                                       alone[:count]), (name, kind, k, count)
                assert torch.equal(block_quant.block_linear(rows, blocks, bias, threads=1, planes=planes), alone)
                if first is None:
                    first = alone
                assert torch.equal(alone, first), (name, kind, k)
            exact = per_block_int8(rows, bits).double() @ blocks.dequantize().double().T + bias.double()
            torch.testing.assert_close(first.double(), exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))


@pytest.mark.parametrize("bits", [8, 16])
def test_every_build_sums_the_largest_products_without_overflow(use_library, bits):
    """Weights at their extreme integers (Q8_0 +-127, and -128, which a GGUF file may hold though
    llama.cpp never writes it; 4-bit nibbles all 15 or all 0) against activation digits at +-127 in
    every block: the integer sums at their largest (AVX2 adds a 4-bit block's pair sums in 16 bits, up
    to 30480; AVX-512 offsets Q8_0's activations to x + 128) still give the exact product."""
    planes = block_quant.ACTIVATION_PLANES[bits]
    k, n_out = 512, 32
    signs = torch.where(torch.arange(k) % 3 == 0, -1.0, 1.0)
    rows = torch.stack([torch.ones(k), -torch.ones(k), signs, -signs])
    for kind in KINDS:
        if kind == "q8_0":
            values = (127 * torch.stack([signs] * (n_out // 2) + [torch.ones(k)] * (n_out // 2))).to(torch.int16)
            values[n_out // 4: n_out // 2] = torch.where(signs < 0, -128, 127).to(torch.int16)
        else:
            values = torch.cat([torch.full((n_out // 2, k), 15), torch.zeros(n_out // 2, k)]).to(torch.int16)
        scales = torch.ones(n_out, k // 32)
        blocks = block_quant.BlockWeights.from_values(kind, values, scales, scales if kind == "q4_1" else None)
        exact = per_block_int8(rows, bits).double() @ blocks.dequantize().double().T
        for name, library in runnable_builds():
            use_library(library)
            out = block_quant.block_linear(rows, blocks, planes=planes)
            assert torch.allclose(out.double(), exact, rtol=1e-6, atol=1e-6), (name, kind)


@pytest.mark.parametrize("bits", [8, 16])
def test_the_amx_path_gives_the_vnni_paths_bits(bits):
    """The machine's own build: on a CPU with AMX, every row count through the tiles (from 1 plane
    up) equals the same rows through VNNI, bit for bit, partial tiles and groups included (without
    AMX both calls take VNNI, and the build says it has no AMX path)."""
    library = block_quant.library()
    assert bool(library.dovetail_block_amx_ready()) == ({"amx_tile", "amx_int8"} <= cpu_flags())
    generator = torch.Generator().manual_seed(1)
    planes = block_quant.ACTIVATION_PLANES[bits]
    for kind in KINDS:
        weight = torch.randn(37, 4096, generator=generator) * 0.05
        blocks = block_quant.BlockWeights.quantize(weight, kind)
        rows = torch.randn(40, 4096, generator=generator) * 3
        bias = torch.randn(37, generator=generator)
        try:
            for count in (1, 2, 3, 7, 8, 9, 16, 17, 33, 40):
                library.dovetail_block_amx_from(1 << 30)
                vnni = block_quant.block_linear(rows[:count], blocks, bias, planes=planes)
                library.dovetail_block_amx_from(1)
                amx = block_quant.block_linear(rows[:count], blocks, bias, planes=planes)
                assert torch.equal(amx, vnni), (kind, count)
        finally:
            library.dovetail_block_amx_from(8)


@pytest.mark.parametrize("bits", [8, 16])
def test_a_block_linear_layer_matches_its_weights_and_says_it_is_row_invariant(bits):
    linear = torch.nn.Linear(64, 12)
    layer = block_quant.BlockQuantLinear.from_linear(linear, "q4_1", activation_bits=bits)
    assert layer.row_invariant
    x = torch.randn(2, 3, 64)
    expected = torch.nn.functional.linear(per_block_int8(x.reshape(-1, 64), bits), layer.weights.dequantize(),
                                          linear.bias.detach())
    torch.testing.assert_close(layer(x), expected.reshape(2, 3, 12), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="8 or 16 bits"):
        block_quant.BlockQuantLinear.from_linear(linear, "q4_1", activation_bits=4)


def test_widths_off_the_block_and_unknown_types_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        block_quant.BlockWeights.quantize(torch.ones(2, 40), "q8_0")
    with pytest.raises(ValueError, match="unknown block type"):
        block_quant.BlockWeights.quantize(torch.ones(2, 64), "q5_k")


def test_without_the_library_the_refusal_names_the_precisions_that_run(monkeypatch):
    """No C compiler: a GGUF target's default (and int8) failed to start with 'install nothing, try nothing'
    advice, while fp32, bf16 and int8-row run without the library."""
    monkeypatch.setattr(block_quant.native, "load", lambda: None)
    with pytest.raises(RuntimeError, match="need the native kernel library") as raised:
        block_quant.library()
    assert "--target-dtype fp32, bf16 or int8-row" in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("precision", ["int8", "q8_0", "q4_0", "q4_1", "q4_1-a16"])
def test_a_block_target_verifies_trees_bit_exactly_and_loads_as_it_converts(demo_target, precision):
    from test_int8 import worst_tree_vs_decode_gap

    from cpu_worker.engine import TargetEngine
    from cpu_worker.precision import apply_precision
    from cpu_worker.target_loading import load_target_model

    streamed = load_target_model(demo_target, precision)  # quantized tensor by tensor, then fused
    converted, dtype = apply_precision(load_target_model(demo_target), precision)  # quantized in place
    engine = TargetEngine(streamed, max_len=128, activation_dtype=dtype)
    assert engine.exact_tree and engine.kernels.row_invariant_linears
    assert worst_tree_vs_decode_gap(engine) == 0.0
    prompt = [1, 450, 1200, 33, 7, 901]
    other = TargetEngine(converted, max_len=128, activation_dtype=dtype)
    assert torch.equal(engine.prefill(prompt).logits, other.prefill(prompt).logits)
    # int8: Q8_0 weights x 16-bit activations; q4_1-a16: Q4_1's x 16-bit
    kind, bits = {"int8": ("q8_0", 16), "q4_1-a16": ("q4_1", 16)}.get(precision, (precision, 8))
    head_kind = "q8_0" if precision.startswith("q4") else kind  # 4-bit targets keep the lm_head at 8 bits
    assert streamed.lm_head.weights.kind == converted.lm_head.weights.kind == head_kind
    assert streamed.layers[0].mlp.down_proj.weights.kind == kind
    assert {module.activation_bits for module in streamed.modules()
            if isinstance(module, block_quant.BlockQuantLinear)} == {bits}
    fused = [module for module in streamed.modules() if isinstance(module, block_quant.BlockQuantLinear)]
    assert streamed.layers[0].self_attn.qkv_proj in fused and streamed.layers[0].mlp.gate_up_proj in fused


def test_fused_block_layers_give_the_separate_layers_bits():
    parts = [block_quant.BlockQuantLinear.from_linear(torch.nn.Linear(64, n), "q4_1") for n in (24, 8, 13)]
    fused = block_quant.BlockQuantLinear.concatenate(parts)
    x = torch.randn(5, 64)
    assert torch.equal(fused(x), torch.cat([part(x) for part in parts], dim=-1))
    with pytest.raises(ValueError, match="one type"):
        block_quant.BlockWeights.concatenate([parts[0].weights,
                                              block_quant.BlockWeights.quantize(torch.randn(4, 64), "q8_0")])


@pytest.mark.parametrize("kind", KINDS)
def test_whole_groups_join_as_they_lie_and_gguf_bytes_are_only_moved(kind):
    """The fast paths give the bytes of the slow ones: parts of whole 16-output groups (and any last part)
    joined without unpacking equal the joined values laid out anew; a GGUF's bytes moved into the layout
    equal its values unpacked and interleaved, a last partial group padded alike."""
    parts = [block_quant.BlockWeights.quantize(torch.randn(n, 96), kind) for n in (32, 48, 21)]
    joined = block_quant.BlockWeights.concatenate(parts)
    minimums = None if kind != "q4_1" else torch.cat([block_quant.ungroup(p.minimums, p.out_features) for p in parts])
    expected = block_quant.BlockWeights.from_values(kind, torch.cat([p.values() for p in parts]),
                                                    torch.cat([block_quant.ungroup(p.scales, p.out_features)
                                                               for p in parts]), minimums)
    for name in ("data", "scales", "minimums"):
        assert (getattr(joined, name) is None and getattr(expected, name) is None) or \
            torch.equal(getattr(joined, name), getattr(expected, name)), name
    assert (joined.out_features, joined.in_features) == (101, 96)
    slow = block_quant.BlockWeights.concatenate([parts[2], parts[0]])  # a partial group first: values re-laid
    assert torch.equal(slow.values(), torch.cat([parts[2].values(), parts[0].values()]))
    last = parts[2]
    minimums = None if last.minimums is None else block_quant.ungroup(last.minimums, 21)
    moved = block_quant.BlockWeights.from_blocks(kind, last.gguf_blocks(), block_quant.ungroup(last.scales, 21),
                                                 minimums, 96)
    assert torch.equal(moved.data, last.data) and torch.equal(moved.dequantize(), last.dequantize())


@pytest.mark.parametrize("kind", KINDS)
def test_a_tall_matrix_quantized_in_row_chunks_has_the_bytes_of_one_pass(kind, monkeypatch):
    """The torch path (sources the library does not read: float64 here) goes QUANTIZE_ROWS rows at a time
    (a vocabulary-sized lm_head's float temporaries were GBs): the chunks, a short last one included,
    give exactly the one-pass bytes, and the library's one pass over the fp32 copy gives them too."""
    weight = torch.randn(16 * 7 + 5, 96, dtype=torch.float64)
    whole = block_quant.BlockWeights.quantize(weight, kind)
    monkeypatch.setattr(block_quant, "QUANTIZE_ROWS", 32)
    chunked = block_quant.BlockWeights.quantize(weight, kind)
    for name in ("data", "scales", "minimums"):
        assert (getattr(chunked, name) is None and getattr(whole, name) is None) or \
            torch.equal(getattr(chunked, name), getattr(whole, name)), name
    assert (chunked.out_features, chunked.in_features) == (117, 96)
    native = block_quant.BlockWeights.quantize(weight.float(), kind)
    for name in ("data", "scales", "minimums"):
        assert (getattr(native, name) is None and getattr(whole, name) is None) or \
            torch.equal(getattr(native, name), getattr(whole, name)), name
