"""Int8 weights on our int8 linear (``cpu_worker/native/int8_gemv.c``): whether int8 layers run on
it in this process, the layout a weight is held in, and ``Int8Weights``, which holds one and calls
the kernel. The library itself is built and loaded by ``cpu_worker.native.library``.

Without a C compiler, or if the build fails, int8 layers use fbgemm (slower when decoding,
equally exact) and the log says so once. ``DOVETAIL_INT8_KERNEL=fbgemm`` forces that path (for
comparisons). The measurements behind the rules here: ``docs/kernels.md``, "int8 linear".
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from functools import cache

import torch

from cpu_worker.kernels.huge_pages import empty_on_huge_pages
from cpu_worker.native import library as native

log = logging.getLogger("dovetail.cpu_worker")

FORCE_VARIABLE = "DOVETAIL_INT8_KERNEL"
# From this many rows on, torch's int8 GEMM beats the GEMV kernel on a CPU with AVX512-VNNI (the
# GEMV wins below); without VNNI, torch's int8 GEMM is a slow generic path, so there every call
# stays on the GEMV kernel.
INT_MM_MIN_ROWS = 24
# The GEMV's int32 sums of (q + 128) * w (VNNI and plain C; AVX2 sums q * w) stay exact while
# in_features * 255 * 127 < 2**31.
MAX_IN_FEATURES = (2**31 - 1) // (255 * 127)


@cache
def load() -> ctypes.CDLL | None:
    """The library for int8 layers, or None (fbgemm is used) when forced off, no compiler, or the build fails."""
    if os.environ.get(FORCE_VARIABLE, "").lower() == "fbgemm":
        return None
    library = native.load()
    if library is None:
        return None
    if library.dovetail_int8_simd() == native.SIMD_PLAIN and "fbgemm" in torch.backends.quantized.supported_engines:
        # Neither AVX512-VNNI nor AVX2: the kernel's plain C path is several times slower than fbgemm.
        log.info("int8: this CPU has neither AVX512-VNNI nor AVX2, so int8 layers run on fbgemm")
        return None
    return library


def clear_cache() -> None:
    """Forget the loaded library and the int8 decision (tests change the compiler or flags)."""
    load.cache_clear()
    native.clear_cache()


def kernel_name() -> str:
    """What int8 layers run on in this process: dovetail-amx (AMX tiles; VNNI for what they cannot
    hold), dovetail-vnni, dovetail-avx2, dovetail-portable (plain C, only where torch has no
    fbgemm) or fbgemm."""
    library = load()
    if library is None:
        return "fbgemm"
    if library.dovetail_int8_amx_ready():
        return "dovetail-amx"
    return {native.SIMD_AVX512: "dovetail-vnni", native.SIMD_AVX2: "dovetail-avx2"}.get(
        library.dovetail_int8_simd(), "dovetail-portable")


def weight_offsets(values: torch.Tensor, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """128 * the sum of each int8 weight row (the kernel's correction for its u8 activations)."""
    library = library or load()
    assert library is not None
    out_features, in_features = values.shape
    offsets = torch.empty(out_features, dtype=torch.int32)
    library.dovetail_weight_offsets(values.data_ptr(), offsets.data_ptr(), out_features, in_features)
    return offsets


BLOCK_ROWS, CHUNK_BYTES = 4, 64  # the packed layout: blocks of 4 output rows in 64-byte column chunks
TILE_OUT, TILE_COLUMNS = 16, 64  # the tile layout: blocks of 16 output rows in 1 KB tiles of 64 columns
# On the AVX2 path rows shorter than this stream faster packed, rows of a 4 KB page or more as they
# are. On the VNNI path (without AMX) every shape is packed and every call runs on the GEMV kernel.
# Measured with ``python -m tools.bench_int8_kernel --layouts``: docs/kernels.md, "int8 layouts".
PACK_BELOW_IN_FEATURES = 4096
# TILES_NOTE: with AMX every shape with a tile layout is held in it and every call runs on AMX
# tiles, which stream 1-16 rows at about the cost of one (docs/kernels.md, "int8 layouts").
LAYOUT_VARIABLE = "DOVETAIL_INT8_LAYOUT"  # auto (default), rows, packed or tiles: force a layout for comparisons
# dovetail.h's layout codes, by name (in code order).
LAYOUT_CODES = {"rows": native.LAYOUT_ROWS, "packed": native.LAYOUT_PACKED, "tiles": native.LAYOUT_TILES}
LAYOUTS = tuple(LAYOUT_CODES)


def can_pack(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape has a packed layout (every real model's does)."""
    return out_features % BLOCK_ROWS == 0 and in_features % CHUNK_BYTES == 0


def can_tile(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape has a tile layout (every real model's does)."""
    return out_features % TILE_OUT == 0 and in_features % TILE_COLUMNS == 0


def fits_layout(layout: str, out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape can be held in ``layout`` (rows always can)."""
    if layout == "packed":
        return can_pack(out_features, in_features)
    if layout == "tiles":
        return can_tile(out_features, in_features)
    return True


def default_layout(library: ctypes.CDLL, out_features: int, in_features: int) -> str:
    """How a weight of this shape is held on this library: in tiles where AMX is usable, packed on
    the VNNI path and on AVX2 where rows are shorter than ``PACK_BELOW_IN_FEATURES``, else [N, K]
    rows; or as $DOVETAIL_INT8_LAYOUT forces where the shape allows (rows otherwise)."""
    forced = forced_layout()
    if forced != "auto":
        return forced if fits_layout(forced, out_features, in_features) else "rows"
    if library.dovetail_int8_amx_ready():
        # AMX streams 1-16 rows at the cost of one: see TILES_NOTE. A shape without tiles stays
        # [N, K], where torch's int8 GEMM (oneDNN, AMX) takes its large calls.
        return "tiles" if can_tile(out_features, in_features) else "rows"
    if not can_pack(out_features, in_features):
        return "rows"
    if library.dovetail_int8_simd() == native.SIMD_AVX512:
        return "packed"
    return "packed" if in_features < PACK_BELOW_IN_FEATURES else "rows"


def forced_layout() -> str:
    """$DOVETAIL_INT8_LAYOUT: auto, rows, packed or tiles; anything else is auto, said once."""
    value = os.environ.get(LAYOUT_VARIABLE, "auto").strip().lower() or "auto"
    if value not in ("auto", *LAYOUTS):
        _warn_layout_once(value)
        return "auto"
    return value


@cache
def _warn_layout_once(value: str) -> None:
    log.warning("%s=%r is not auto, rows, packed or tiles; int8 weights take the automatic layout",
                LAYOUT_VARIABLE, value)


def pack_blocks(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] int8 -> the kernel's packed layout, flat: each block of 4 output rows one contiguous
    run of 64-byte chunks, row r's columns [64c, 64c + 64) at 256c + 64r within its block; into
    ``out`` (flat int8 of the same size: a weight's huge pages) where given."""
    out_features, in_features = values.shape
    blocks = values.view(out_features // BLOCK_ROWS, BLOCK_ROWS, in_features // CHUNK_BYTES, CHUNK_BYTES)
    if out is None:
        return blocks.transpose(1, 2).contiguous().view(-1)
    out.view(out_features // BLOCK_ROWS, in_features // CHUNK_BYTES, BLOCK_ROWS, CHUNK_BYTES).copy_(
        blocks.transpose(1, 2))
    return out


def unpack_blocks(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of ``pack_blocks``: a new [N, K] tensor."""
    blocks = packed.view(out_features // BLOCK_ROWS, in_features // CHUNK_BYTES, BLOCK_ROWS, CHUNK_BYTES)
    return blocks.transpose(1, 2).reshape(out_features, in_features)


def pack_tiles(values: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> the kernel's tile layout, flat: each block of 16 output rows one contiguous
    run of 1 KB tiles, one per 64 columns, w[16b + j, 64c + 4g + i] at byte 64g + 4j + i of tile c
    (AMX's B operand, int8_gemv.c)."""
    out_features, in_features = values.shape
    groups = values.view(out_features // TILE_OUT, TILE_OUT, in_features // TILE_COLUMNS, TILE_COLUMNS // 4, 4)
    return groups.permute(0, 2, 3, 1, 4).contiguous().view(-1)


def pack_tiles_natively(values: torch.Tensor, library: ctypes.CDLL, out: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_tiles`` by the library (4 bytes a copy; torch's permuted copy took 7 s of a 7B load),
    into ``out`` (flat int8 of the same size: a weight's huge pages) where given."""
    out_features, in_features = values.shape
    tiles = torch.empty(out_features * in_features, dtype=torch.int8) if out is None else out
    assert tiles.dtype == torch.int8 and tiles.is_contiguous() and tiles.numel() == out_features * in_features
    library.dovetail_pack_tiles(values.contiguous().data_ptr(), tiles.data_ptr(), out_features, in_features,
                                torch.get_num_threads())
    return tiles


def unpack_tiles(tiles: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of ``pack_tiles``: a new [N, K] tensor."""
    groups = tiles.view(out_features // TILE_OUT, in_features // TILE_COLUMNS, TILE_COLUMNS // 4, TILE_OUT, 4)
    return groups.permute(0, 3, 1, 2, 4).reshape(out_features, in_features)


class Int8Weights:
    """An int8 weight [N, K] with its scales, offsets and bias, and their addresses, kept for
    the layer's lifetime: a forward is then one foreign call and one output tensor.

    The weight is held in the layout ``default_layout`` picks (``layout`` forces one: benchmarks,
    tests): in tiles (AMX) or packed (``pack_blocks``: each thread then reads one sequential
    stream instead of four short ones), every call runs on our kernel. A weight held [N, K] on a
    VNNI CPU sends calls of ``INT_MM_MIN_ROWS`` rows or more to torch's int8 GEMM instead."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 library: ctypes.CDLL | None = None, layout: str | None = None):
        library = library or load()
        assert library is not None
        self._library = library
        values = values.contiguous()
        self.out_features, self.in_features = values.shape
        self.scales = scales.to(torch.float32).contiguous()
        self.offsets = weight_offsets(values, library)
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self._forward = library.dovetail_int8_forward
        if layout is None:
            layout = default_layout(library, self.out_features, self.in_features)
        if layout not in LAYOUTS:
            raise ValueError(f"unknown int8 layout {layout!r} (one of {', '.join(LAYOUTS)})")
        if not fits_layout(layout, self.out_features, self.in_features):
            raise ValueError(f"a {self.out_features}x{self.in_features} weight cannot be held {layout} "
                             f"(packed needs out % {BLOCK_ROWS} == 0, tiles out % {TILE_OUT} == 0, "
                             f"and both in % {CHUNK_BYTES} == 0)")
        # What the kernel reads: [N, K], packed or tiles flat; on huge pages, as a stream
        # (huge_pages.py), written there directly.
        stored = empty_on_huge_pages((values.numel(),) if layout != "rows" else tuple(values.shape), torch.int8)
        if layout == "tiles":
            pack_tiles_natively(values, library, stored)
        elif layout == "packed":
            pack_blocks(values, stored)
        else:
            stored.copy_(values)
        self._hold(stored, layout)

    def _hold(self, stored: torch.Tensor, layout: str) -> None:
        """Keep ``stored`` (the weight's bytes in ``layout``) and the addresses a call passes."""
        self.layout = layout
        self.layout_code = LAYOUT_CODES[layout]
        # None: every call on our kernel (packed or tiles; CPUs without VNNI, see INT_MM_MIN_ROWS).
        vnni = self._library.dovetail_int8_simd() == native.SIMD_AVX512
        self.matmul_min_rows = INT_MM_MIN_ROWS if vnni and layout == "rows" else None
        self.stored = stored
        self._pointers = (self.stored.data_ptr(), self.scales.data_ptr(), self.offsets.data_ptr(),
                          None if self.bias is None else self.bias.data_ptr())

    @classmethod
    def concatenate(cls, parts: Sequence[Int8Weights]) -> Int8Weights:
        """The parts' output rows stacked, in order (a decoder layer's q/k/v, gate/up). Why not from
        their values: each layout keeps a block of rows (4 packed, 16 in tiles) as one contiguous
        run, so where every part has the fused shape's layout and whole blocks, the fused bytes
        are the parts' bytes one after another; unpacking and packing them again took 7 s of a
        7B load. Otherwise (parts held in different layouts, or a fused shape this CPU would hold
        in another) it is built from their values."""
        first = parts[0]
        if any(part.in_features != first.in_features or part._library is not first._library for part in parts):
            raise ValueError("only weights of one input width, on one library, can be concatenated")
        scales = torch.cat([part.scales for part in parts])
        biases = [part.bias for part in parts]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(part.out_features, dtype=torch.float32)
             for b, part in zip(biases, parts)])
        out_features = sum(part.out_features for part in parts)
        layout = first.layout
        block = {"rows": 1, "packed": BLOCK_ROWS, "tiles": TILE_OUT}[layout]
        joinable = all(part.layout == layout and part.out_features % block == 0 for part in parts) \
            and default_layout(first._library, out_features, first.in_features) == layout
        if not joinable:
            return cls(torch.cat([part.values for part in parts]), scales, bias, first._library)
        fused = cls.__new__(cls)
        fused._library = first._library
        fused._forward = first._forward
        fused.out_features, fused.in_features = out_features, first.in_features
        fused.scales = scales
        fused.offsets = torch.cat([part.offsets for part in parts])
        fused.bias = bias
        shape = (out_features * first.in_features,) if layout != "rows" else (out_features, first.in_features)
        stored = empty_on_huge_pages(shape, torch.int8)
        flat, start = stored.view(-1), 0
        for part in parts:
            flat[start:start + part.stored.numel()].copy_(part.stored.view(-1))
            start += part.stored.numel()
        fused._hold(stored, layout)
        return fused

    @property
    def values(self) -> torch.Tensor:
        """The int8 weight [N, K] (a new tensor when held packed or in tiles)."""
        if self.layout == "packed":
            return unpack_blocks(self.stored, self.out_features, self.in_features)
        if self.layout == "tiles":
            return unpack_tiles(self.stored, self.out_features, self.in_features)
        return self.stored

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """[M, K] fp32 contiguous rows -> [M, N]."""
        count = rows.shape[0]
        if self.matmul_min_rows is not None and count >= self.matmul_min_rows:
            return self._matmul(rows)
        out = torch.empty(count, self.out_features, dtype=torch.float32)
        status = self._forward(rows.data_ptr(), *self._pointers, out.data_ptr(), count, self.out_features,
                               self.in_features, self.layout_code, torch.get_num_threads())
        if status == native.BAD_SHAPE:  # unreachable: the constructor only takes layouts the shape has
            raise ValueError(f"int8 linear: {self.out_features}x{self.in_features} has no {self.layout} layout")
        if status != 0:
            raise MemoryError(f"int8 linear: no memory for {count} x {self.in_features} quantized rows")
        return out

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """Many rows (prefill, large trees): the same quantized rows and the same integer sums
        from torch's int8 GEMM (oneDNN: AMX or VNNI), which is compute-bound where the GEMV
        kernel is not, then the same float epilogue in the same order, so a row's bits do not
        depend on which path its call took."""
        count = rows.shape[0]
        quantized = torch.empty(count, self.in_features, dtype=torch.uint8)
        row_scales = torch.empty(count, 1, dtype=torch.float32)
        self._library.dovetail_quantize_rows(rows.data_ptr(), quantized.data_ptr(), row_scales.data_ptr(), count,
                                             self.in_features)
        signed = quantized.view(torch.int8).bitwise_xor_(-128)  # u = q + 128 back to q
        out = torch._int_mm(signed, self.values.t()).to(torch.float32).mul_(row_scales).mul_(self.scales)
        return out.add_(self.bias) if self.bias is not None else out
