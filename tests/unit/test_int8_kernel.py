"""Our int8 kernel (cpu_worker/native/int8_gemv.c, and torch's int8 GEMM from 24 rows on): exact
integer arithmetic against a torch reference, rows independent of their call-mates across both
paths, the same bits from the AVX512-VNNI and the portable build, and a clear fallback to
fbgemm when it cannot be built."""

from __future__ import annotations

import ctypes
import logging
import shlex
import shutil
import subprocess

import pytest
import torch
from test_int8 import worst_tree_vs_decode_gap

from cpu_worker.engine import TargetEngine
from cpu_worker.kernels import int8_kernel
from cpu_worker.kernels.int8 import RowwiseInt8Linear, _quantize_per_row, _torch_quantize_rows
from cpu_worker.native import library as native_library
from cpu_worker.precision import activation_dtype
from cpu_worker.target_loading import load_target_model
from ipc.placement import cpu_flags

from conftest import build_for, flags_for


def reference(rows: torch.Tensor, layer: RowwiseInt8Linear) -> torch.Tensor:
    """The kernel's arithmetic in torch: symmetric per-row int8 activations, int32 sums, then
    the same float epilogue in the same order."""
    return integer_reference(rows, layer._int8.values, layer._int8.scales, layer.bias)


def integer_reference(rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    maxima = rows.abs().amax(dim=1, keepdim=True)
    # A true division, as the kernel's: torch's ``127.0 / tensor`` is a reciprocal times 127, which
    # rounds differently now and then (a 70.5 tie where the kernel has 70.500008: one in ~200 draws).
    inverse = torch.where(maxima > 0, torch.full_like(maxima, 127.0) / maxima, torch.zeros_like(maxima))
    quantized = torch.round(rows * inverse).clamp(-127, 127).to(torch.int64)
    sums = (quantized @ values.to(torch.int64).T).to(torch.int32)
    out = sums.to(torch.float32) * (maxima / 127.0) * scales
    return out + bias if bias is not None else out


@pytest.mark.parametrize("arch", ["native", "x86-64-v3", "icelake-server"])
def test_the_built_dot_kernels_keep_their_software_prefetches(arch, tmp_path):
    """A helper whose only effect is a prefetch looks const to GCC, which then deletes its calls:
    every prefetch of the int8 kernel was silently gone for a while (1.16x on a 1B decode's
    linears). The assembly the build flags give must still prefetch (AVX2, and VNNI)."""
    compiler = native_library.find_compiler()
    assert compiler is not None, "no C compiler: the int8 kernel cannot be built"
    flags = [flag for flag in flags_for(arch) if flag != "-shared"] + ["-S"]
    assembly = tmp_path / "int8_gemv.s"
    subprocess.run([*shlex.split(compiler), *flags, str(native_library.DIRECTORY / "int8_gemv.c"), "-o", str(assembly)],
                   check=True, capture_output=True)
    assert "prefetcht0" in assembly.read_text()


@pytest.fixture(scope="module")
def kernel() -> str:
    name = int8_kernel.kernel_name()
    assert name != "fbgemm", "no int8 kernel on this machine (it needs a C compiler and AVX2 or AVX512-VNNI)"
    return name


@pytest.mark.parametrize("in_features", [64, 100, 256, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_computes_exactly_the_integer_reference(kernel, in_features, bias):
    torch.manual_seed(in_features)
    layer = RowwiseInt8Linear(torch.randn(301, in_features) * 0.05, torch.randn(301) if bias else None)
    assert layer.kernel == kernel
    rows = torch.randn(37, in_features) * 3
    rows[5] = 0.0  # an all-zero row (scale 0) gives exactly the bias
    out = layer(rows)  # 37 rows: torch's int8 GEMM on a VNNI CPU, else the GEMV (INT_MM_MIN_ROWS); 9: the GEMV
    assert rows.shape[0] >= int8_kernel.INT_MM_MIN_ROWS > 9
    assert torch.equal(out, reference(rows, layer))
    assert torch.equal(layer._int8._matmul(rows), out)  # the int8 GEMM path, whichever this CPU takes
    assert torch.equal(layer(rows[:9]), reference(rows[:9], layer))
    assert torch.equal(out[5], layer.bias if bias else torch.zeros(301))
    dense = rows @ (layer._int8.values.float() * layer._int8.scales[:, None]).T + (layer.bias if bias else 0)
    assert (out - dense).abs().max() < 0.05 * dense.abs().max()  # int8 rounding of the activations only


def test_a_row_gets_the_same_bits_whatever_shares_its_call(kernel):
    torch.manual_seed(0)
    layer = RowwiseInt8Linear(torch.randn(515, 768) * 0.02, torch.randn(515))
    rows = torch.randn(64, 768)
    alone = torch.cat([layer(rows[index:index + 1]) for index in range(64)])
    for count in (2, 3, 7, 16, 33, 64):
        assert torch.equal(layer(rows[:count]), alone[:count]), f"a call of {count} rows changed a row"


def test_a_row_gets_the_same_bits_whatever_shares_its_call_with_packed_weights(kernel):
    generator = torch.Generator().manual_seed(5)
    values = torch.randint(-127, 128, (516, 768), dtype=torch.int8, generator=generator)
    weights = int8_kernel.Int8Weights(values, torch.rand(516, generator=generator) / 100 + 1e-4,
                                      torch.randn(516, generator=generator), layout="packed")
    rows = torch.randn(40, 768, generator=generator)
    alone = torch.cat([weights(rows[index:index + 1]) for index in range(40)])
    for count in (2, 3, 7, 16, 33, 40):
        assert torch.equal(weights(rows[:count]), alone[:count]), f"a call of {count} rows changed a row"


def test_the_avx2_and_plain_c_builds_give_the_native_build_s_bits(kernel):
    """On a CPU with AVX512-VNNI (this machine) the native build is the VNNI path, so this
    compares all three code paths: AVX2 (-march=x86-64-v3, built where the CPU can run it) and
    plain C (-march=x86-64-v2) against it; elsewhere, the paths this CPU has."""
    native = int8_kernel.load()
    assert native is not None and native.dovetail_int8_has_vnni() == (kernel in ("dovetail-vnni", "dovetail-amx"))
    builds = {"x86-64-v2": 0}
    if "avx2" in cpu_flags():
        builds["x86-64-v3"] = 1
    torch.manual_seed(1)
    layer = RowwiseInt8Linear(torch.randn(130, 200) * 0.05, torch.randn(130))  # 200: 32-byte steps and a tail
    rows = torch.randn(9, 200)  # under INT_MM_MIN_ROWS: the GEMV kernel of each build; pairs and a single
    # 200 columns: the AVX2 paths' 32-byte steps and an 8-column tail
    expected = int8_kernel.Int8Weights(layer._int8.values, layer._int8.scales, layer.bias, native)(rows)
    for arch, simd in builds.items():
        library = build_for(arch)
        assert library.dovetail_int8_simd() == simd and library.dovetail_int8_has_vnni() == 0
        got = int8_kernel.Int8Weights(layer._int8.values, layer._int8.scales, layer.bias, library)(rows)
        assert torch.equal(got, expected), arch


@pytest.mark.parametrize("rows_in_call", [1, 2, 3, 5])
@pytest.mark.parametrize(("in_features", "out_features", "layout"),
                         [(1000, 11, "rows"), (1024, 12, "packed"), (1024, 32, "tiles")])
def test_extreme_operands_stay_exact(kernel, rows_in_call, in_features, out_features, layout):
    """The AVX2 paths sum two products in int16 (|w| * |q| * 2 <= 128 * 127 * 2): weights at
    -128 and 127 against activations at +-127, the bound, must not saturate anywhere, in either
    weight layout (1024 columns and 12 outputs: packable; 32: in tiles) and with a tail (1000 and 11: not)."""
    generator = torch.Generator().manual_seed(2)
    # 1000: 31 steps of 32 and a tail of 8; 11 outputs: a last block of 3
    values = torch.where(torch.rand(out_features, in_features, generator=generator) < 0.5,
                         torch.tensor(-128, dtype=torch.int8), torch.tensor(127, dtype=torch.int8))
    values[1] = -128  # one row all -128, one all 127: the largest same-sign pair sums
    values[2] = 127
    signs = torch.where(torch.rand(rows_in_call, in_features, generator=generator) < 0.5, -1.0, 1.0)
    rows = signs * 3.0  # every activation quantizes to +-127
    rows[0] = torch.where(values[1] < 0, -3.0, 3.0)  # row 0 against weight row 1: every product +128 * 127
    scales = torch.full((out_features,), 1e-3)
    out = int8_kernel.Int8Weights(values, scales, None, layout=layout)(rows)
    sums = (rows.sign().to(torch.int64) * 127) @ values.to(torch.int64).T
    assert int(sums[0, 1]) == 128 * 127 * in_features
    assert torch.equal(out, sums.to(torch.int32).to(torch.float32) * (3.0 / 127.0) * scales)


def test_a_cpu_without_vnni_or_avx2_uses_fbgemm(monkeypatch, tmp_path, caplog):
    """The plain C path is several times slower than fbgemm, so a build that has nothing better
    hands int8 to fbgemm (where torch has it), and says so."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    build = native_library.build
    plain = [flag for flag in native_library.FLAGS if flag != "-march=native"] + ["-march=x86-64-v2"]
    monkeypatch.setattr(native_library, "build", lambda compiler, flags, directory: build(compiler, plain, tmp_path))
    int8_kernel.clear_cache()
    try:
        with caplog.at_level(logging.INFO, logger="dovetail.cpu_worker"):
            assert int8_kernel.kernel_name() == "fbgemm"
        assert "neither AVX512-VNNI nor AVX2" in caplog.text
    finally:
        int8_kernel.clear_cache()


def test_int8_tree_logits_equal_decode_logits_on_the_kernel(kernel, demo_target):
    model = load_target_model(demo_target, "int8-row")
    assert {module.kernel for module in model.modules() if isinstance(module, RowwiseInt8Linear)} == {kernel}
    engine = TargetEngine(model, max_len=128, activation_dtype=activation_dtype("int8-row"))
    assert engine.exact_tree
    assert worst_tree_vs_decode_gap(engine) == 0.0


def test_without_a_compiler_int8_falls_back_to_fbgemm_and_says_so(monkeypatch, caplog):
    int8_kernel.clear_cache()
    try:
        monkeypatch.setenv("CC", "/nonexistent/cc")
        with caplog.at_level(logging.WARNING, logger="dovetail.cpu_worker"):
            assert int8_kernel.kernel_name() == "fbgemm"
        assert "int8-row layers run on fbgemm" in caplog.text and "(int8, q8_0, q4_0, q4_1" in caplog.text
        layer = RowwiseInt8Linear(torch.randn(300, 256) * 0.02)
        assert layer.kernel == "fbgemm"
        rows = torch.randn(8, 256)
        alone = torch.cat([layer(rows[index:index + 1]) for index in range(8)])
        assert torch.equal(layer(rows), alone)  # the fbgemm path keeps the per-row rule
        int8_kernel.clear_cache()
        monkeypatch.setenv("CC", "")
        monkeypatch.setenv(int8_kernel.FORCE_VARIABLE, "fbgemm")
        assert int8_kernel.kernel_name() == "fbgemm"
    finally:
        int8_kernel.clear_cache()


def test_a_layer_too_wide_for_exact_int32_sums_uses_fbgemm(kernel):
    wide = int8_kernel.MAX_IN_FEATURES + 1
    layer = RowwiseInt8Linear(torch.randn(8, wide) * 0.01)
    assert layer.kernel == "fbgemm"
    rows = torch.randn(3, wide)
    alone = torch.cat([layer(rows[index:index + 1]) for index in range(3)])
    assert torch.equal(layer(rows), alone)
    assert RowwiseInt8Linear(torch.randn(8, wide - 1) * 0.01).kernel == kernel


# ---- the packed weight layout (int8_gemv.c, block_row; int8_kernel.pack_blocks) ----

def test_pack_blocks_lays_each_block_s_rows_out_in_64_byte_chunks_in_turn():
    out_features, in_features = 8, 192
    values = (torch.arange(out_features * in_features) % 251 - 125).to(torch.int8).reshape(out_features, in_features)
    packed = int8_kernel.pack_blocks(values)
    assert packed.shape == (out_features * in_features,)
    for row in range(out_features):
        for column in range(in_features):
            block, r, chunk, byte = row // 4, row % 4, column // 64, column % 64
            assert packed[block * 4 * in_features + chunk * 256 + r * 64 + byte] == values[row, column]
    assert torch.equal(int8_kernel.unpack_blocks(packed, out_features, in_features), values)


def _forward(library, rows: torch.Tensor, stored: torch.Tensor, weights: int8_kernel.Int8Weights,
             layout: str) -> torch.Tensor:
    out = torch.empty(rows.shape[0], weights.out_features)
    status = library.dovetail_int8_forward(rows.data_ptr(), stored.data_ptr(), weights.scales.data_ptr(),
                                           weights.offsets.data_ptr(), weights.bias.data_ptr(), out.data_ptr(),
                                           rows.shape[0], weights.out_features, weights.in_features,
                                           int8_kernel.LAYOUT_CODES[layout], 2)
    assert status == 0
    return out


def _row_layout_case(seed: int, out_features: int, rows_in_call: int
                     ) -> tuple[ctypes.CDLL, torch.Tensor, int8_kernel.Int8Weights, torch.Tensor, torch.Tensor]:
    """A random [out_features, 320] weight held [N, K] on the native build, rows for it, and the
    native build's output, itself checked against the integer reference."""
    native = int8_kernel.load()
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-128, 128, (out_features, 320), dtype=torch.int8, generator=generator)
    weights = int8_kernel.Int8Weights(values, torch.rand(out_features, generator=generator) / 50 + 1e-3,
                                      torch.randn(out_features, generator=generator), native, layout="rows")
    rows = torch.randn(rows_in_call, 320, generator=generator) * 2
    expected = _forward(native, rows, values, weights, "rows")
    assert torch.equal(expected, integer_reference(rows, values, weights.scales, weights.bias))
    return native, values, weights, rows, expected


@pytest.mark.parametrize("rows_in_call", [1, 2, 3, 8, 9])
def test_packed_weights_give_the_row_layout_s_bits_on_every_build(kernel, rows_in_call):
    """Every build (native, and AVX2 / plain C where the CPU runs them) with the weight packed
    gives the bits of the native build with it as [N, K]: single rows, pairs and both mixed.
    Called directly, so the VNNI path's packed loops are checked too where this CPU has VNNI."""
    native, values, weights, rows, expected = _row_layout_case(3, 12, rows_in_call)  # 3 blocks, 5 chunks
    packed = int8_kernel.pack_blocks(values)
    libraries = {"native": native, "x86-64-v2": build_for("x86-64-v2")}
    if "avx2" in cpu_flags():
        libraries["x86-64-v3"] = build_for("x86-64-v3")
    for arch, library in libraries.items():
        assert torch.equal(_forward(library, rows, packed, weights, "packed"), expected), arch
        assert torch.equal(_forward(library, rows, values, weights, "rows"), expected), arch


def test_the_library_quantizes_weights_as_torch_does(kernel):
    """The loader's quantizer (C) gives torch.quantize_per_channel's int8 values and scales bit
    for bit: random rows, an all-zero row, a row whose products land on .5 (ties to even), an
    outlier row, negative maxima, and fp16 and bf16 sources, which it reads as they are."""
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(70, 333, generator=generator) * 0.02
    weight[3] = 0.0
    weight[4] = torch.arange(333) * 0.5 - 80.0  # scale 127/127 = 1: every other product a tie, to even
    weight[4, 0] = -127.0
    weight[5, 7] = 40.0  # one outlier
    weight[6] = -weight[6].abs()
    for source in (weight, weight.half(), weight.bfloat16()):
        values, scales = _quantize_per_row(source)
        expected_values, expected_scales = _torch_quantize_rows(source.float())
        assert values.dtype == torch.int8 and scales.dtype == torch.float64
        assert torch.equal(values, expected_values) and torch.equal(scales, expected_scales), source.dtype
        with pytest.MonkeyPatch.context() as patch:  # no library: torch's, on fp32 chunks of 32 rows
            patch.setattr(native_library, "load", lambda: None)
            chunked_values, chunked_scales = _quantize_per_row(source, rows_per_chunk=32)
        assert torch.equal(chunked_values, expected_values) and torch.equal(chunked_scales, expected_scales)
    assert values[3].abs().sum() == 0


def test_every_fp16_value_widens_as_torch_widens_it_on_every_build(kernel):
    """The quantizer reads fp16 checkpoints as they are: F16C where the build has it, a plain C
    conversion elsewhere (and for a row's last values). All 65536 halves: normals, subnormals,
    zeros and infinities bit for bit, NaNs as NaNs (F16C quiets a signalling one)."""
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    expected = halves.float()
    for library in (native_library.load(), build_for("x86-64-v2")):
        widened = torch.empty(halves.numel(), dtype=torch.float32)
        library.dovetail_widen_half(halves.data_ptr(), widened.data_ptr(), halves.numel())
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(widened), nan)
        assert torch.equal(widened[~nan].view(torch.int32), expected[~nan].view(torch.int32))


@pytest.mark.parametrize("layout", ["rows", "packed", "tiles"])
def test_a_call_of_no_rows_returns_no_rows(kernel, layout):
    values = torch.randint(-127, 128, (32, 128), dtype=torch.int8, generator=torch.Generator().manual_seed(10))
    weights = int8_kernel.Int8Weights(values, torch.rand(32) + 0.01, None, layout=layout)
    assert weights(torch.empty(0, 128)).shape == (0, 32)


def test_the_library_packs_tiles_as_torch_does(kernel):
    values = torch.randint(-128, 128, (48, 320), dtype=torch.int8, generator=torch.Generator().manual_seed(8))
    assert torch.equal(int8_kernel.pack_tiles_natively(values, native_library.load()),
                       int8_kernel.pack_tiles(values))


def test_tiles_hold_the_weight_and_unpack_to_it():
    values = torch.arange(32 * 128, dtype=torch.int32).remainder(251).sub(125).to(torch.int8).view(32, 128)
    tiles = int8_kernel.pack_tiles(values)
    # w[16b + j, 64c + 4g + i] at byte 1024 * (b * chunks + c) + 64g + 4j + i (AMX's B operand)
    for n, k in [(0, 0), (5, 3), (17, 64 + 4 * 7 + 2), (31, 127)]:
        b, j, c, g, i = n // 16, n % 16, k // 64, (k % 64) // 4, k % 4
        assert tiles[1024 * (b * 2 + c) + 64 * g + 4 * j + i] == values[n, k]
    assert torch.equal(int8_kernel.unpack_tiles(tiles, 32, 128), values)


@pytest.mark.parametrize("rows_in_call", [1, 2, 3, 4, 5, 8, 16, 17, 33])
def test_tiled_weights_give_the_row_layout_s_bits_on_every_build(kernel, rows_in_call):
    """Every path over the tile layout gives the bits of the native build on [N, K] weights: AMX
    (one call, 16-row groups, a padded last group) where this CPU has it, the VNNI loop (native
    with AMX turned off, or an icelake-server build), AVX2 and plain C builds (the portable loop).
    48 outputs: an odd block after a pair; 320 columns: 5 tiles per block."""
    native, values, weights, rows, expected = _row_layout_case(6, 48, rows_in_call)
    tiles = int8_kernel.pack_tiles(values)
    assert torch.equal(_forward(native, rows, tiles, weights, "tiles"), expected), "native"
    native.dovetail_int8_tiles_amx_from(1 << 30)  # the VNNI (or portable) loop even where AMX is
    try:
        assert torch.equal(_forward(native, rows, tiles, weights, "tiles"), expected), "native without AMX"
    finally:
        native.dovetail_int8_tiles_amx_from(1)
    libraries = {"x86-64-v2": build_for("x86-64-v2")}
    if "avx2" in cpu_flags():
        libraries["x86-64-v3"] = build_for("x86-64-v3")
    if {"avx512_vnni", "avx512bw"} <= cpu_flags():
        libraries["icelake-server"] = build_for("icelake-server")
    for arch, library in libraries.items():
        assert not library.dovetail_int8_amx_ready(), arch
        assert torch.equal(_forward(library, rows, tiles, weights, "tiles"), expected), arch


def test_an_unknown_layout_setting_takes_the_automatic_layout_and_says_so(kernel, monkeypatch, caplog):
    monkeypatch.setenv(int8_kernel.LAYOUT_VARIABLE, "pakced")
    with caplog.at_level(logging.WARNING, logger="dovetail.cpu_worker"):
        assert int8_kernel.forced_layout() == "auto"
    assert "'pakced' is not auto, rows, packed or tiles" in caplog.text


def test_weights_are_tiled_with_amx_packed_on_vnni_and_where_rows_are_short_and_calls_stay_on_our_kernel(
        kernel, monkeypatch):
    library = int8_kernel.load()
    generator = torch.Generator().manual_seed(4)

    def weights(out_features: int, in_features: int, **kwargs) -> int8_kernel.Int8Weights:
        values = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
        held = int8_kernel.Int8Weights(values, torch.rand(out_features, generator=generator) + 0.01, None, library,
                                       **kwargs)
        assert torch.equal(held.values, values)  # [N, K] whichever layout holds it
        return held

    short, long = int8_kernel.PACK_BELOW_IN_FEATURES - 64, int8_kernel.PACK_BELOW_IN_FEATURES
    vnni, amx = library.dovetail_int8_simd() == 2, bool(library.dovetail_int8_amx_ready())
    assert amx == (kernel == "dovetail-amx")
    if amx:  # every shape with tiles in them; the others [N, K], where oneDNN's AMX GEMM takes large calls
        assert weights(16, short).layout == weights(16, long).layout == "tiles"
        assert weights(8, long).layout == "rows"
    else:  # VNNI: every shape packed; AVX2: rows under PACK_BELOW_IN_FEATURES
        assert weights(16, short).layout == weights(8, short).layout == "packed"
        assert weights(8, long).layout == ("packed" if vnni else "rows")
    assert weights(6, short).layout == weights(8, short + 32).layout == "rows"  # shapes with no other layout
    with pytest.raises(ValueError, match="cannot be held packed"):
        weights(6, short, layout="packed")
    with pytest.raises(ValueError, match="cannot be held tiles"):
        weights(8, short, layout="tiles")
    with pytest.raises(ValueError, match="unknown int8 layout"):
        weights(8, short, layout="columns")
    monkeypatch.setenv(int8_kernel.LAYOUT_VARIABLE, "rows")
    assert weights(16, short).layout == "rows"
    monkeypatch.setenv(int8_kernel.LAYOUT_VARIABLE, "packed")
    assert weights(8, long).layout == "packed" and weights(6, long).layout == "rows"
    monkeypatch.setenv(int8_kernel.LAYOUT_VARIABLE, "tiles")
    assert weights(16, long).layout == "tiles" and weights(8, long).layout == "rows"
    for layout in ("packed", "tiles"):
        held = weights(16, long, layout=layout)
        as_rows = int8_kernel.Int8Weights(held.values, held.scales, None, library, layout="rows")
        # Packed or tiles: every call on our kernel; [N, K] on a VNNI CPU: many rows on torch's int8 GEMM. Same bits.
        assert held.matmul_min_rows is None
        assert as_rows.matmul_min_rows == (int8_kernel.INT_MM_MIN_ROWS if vnni else None)
        for count in (3, int8_kernel.INT_MM_MIN_ROWS + 6):
            rows = torch.randn(count, long, generator=generator)
            assert torch.equal(held(rows), as_rows(rows)), (layout, count)


@pytest.mark.parametrize(("layout", "out_features", "in_features"), [("packed", 6, 128), ("packed", 8, 100),
                                                                      ("tiles", 8, 128), ("tiles", 16, 100)])
def test_the_kernel_refuses_a_call_of_a_shape_its_layout_cannot_hold(kernel, layout, out_features, in_features):
    library = int8_kernel.load()
    x, weight = torch.randn(1, in_features), torch.zeros(out_features * in_features, dtype=torch.int8)
    scales, offsets = torch.ones(out_features), torch.zeros(out_features, dtype=torch.int32)
    out = torch.full((1, out_features), 7.0)
    assert library.dovetail_int8_forward(x.data_ptr(), weight.data_ptr(), scales.data_ptr(), offsets.data_ptr(),
                                         None, out.data_ptr(), 1, out_features, in_features,
                                         int8_kernel.LAYOUT_CODES[layout], 1) == native_library.BAD_SHAPE
    assert torch.equal(out, torch.full((1, out_features), 7.0))  # nothing written


@pytest.mark.parametrize("layout", int8_kernel.LAYOUTS)
def test_concatenated_weights_join_their_bytes_and_equal_weights_built_whole(kernel, monkeypatch, layout):
    """A decoder layer's q/k/v (gate/up) fused at load: the parts' held bytes joined in order
    equal a weight built from the stacked values (bytes, scales, offsets, bias, every output);
    parts held in different layouts are rebuilt from their values instead, with the same result."""
    monkeypatch.setenv(int8_kernel.LAYOUT_VARIABLE, layout)
    generator = torch.Generator().manual_seed(11)
    outs = (32, 16, 48)
    values = [torch.randint(-127, 128, (out, 128), dtype=torch.int8, generator=generator) for out in outs]
    scales = [torch.rand(out, generator=generator) / 50 + 1e-3 for out in outs]
    biases = [torch.randn(outs[0], generator=generator), None, torch.randn(outs[2], generator=generator)]
    parts = [int8_kernel.Int8Weights(v, s, b) for v, s, b in zip(values, scales, biases)]
    assert all(part.layout == layout for part in parts)
    with monkeypatch.context() as patch:  # joined as held: no part is unpacked to its values
        patch.setattr(int8_kernel.Int8Weights, "values", property(lambda self: pytest.fail("unpacked")))
        fused = int8_kernel.Int8Weights.concatenate(parts)
    whole = int8_kernel.Int8Weights(torch.cat(values), torch.cat(scales),
                                    torch.cat([biases[0], torch.zeros(outs[1]), biases[2]]))
    assert fused.layout == whole.layout == layout and fused.out_features == sum(outs)
    assert torch.equal(fused.stored, whole.stored) and torch.equal(fused.offsets, whole.offsets)
    assert torch.equal(fused.scales, whole.scales) and torch.equal(fused.bias, whole.bias)
    rows = torch.randn(5, 128, generator=generator)
    assert torch.equal(fused(rows), whole(rows))
    assert torch.equal(fused(rows), torch.cat([part(rows) for part in parts], dim=1))
    other = "rows" if layout != "rows" else "packed"
    mixed = [parts[0], int8_kernel.Int8Weights(values[1], scales[1], None, layout=other), parts[2]]
    rebuilt = int8_kernel.Int8Weights.concatenate(mixed)
    assert rebuilt.layout == layout and torch.equal(rebuilt.stored, whole.stored)
    assert torch.equal(rebuilt(rows), whole(rows))
