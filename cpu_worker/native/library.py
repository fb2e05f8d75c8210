"""The native kernel library: this folder's C sources (``dovetail.h`` declares what they export),
built for this CPU on first use, cached, loaded, its foreign functions declared, and its
interface checked against this module's mirror of ``dovetail.h``.

Why compiled here: it is built with ``-march=native`` (AVX512-VNNI and AMX where the CPU has
them) and links to the OpenMP runtime torch already loaded, so its threads are torch's. A C
compiler is the only requirement; without one, or if the build fails, ``load()`` is None and
every kernel module takes its torch path (the log says so once).

The check: ``dovetail_abi`` reports the header's ABI version, the size of every struct Python
passes by pointer and every shared constant; they must equal this module's. A library that
disagrees (a stale or hand-made file in the cache) is rebuilt once; one that still disagrees is
an ``AbiMismatch`` naming what differs.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from ipc import cost_cache
from ipc.placement import cpu_flags

log = logging.getLogger("dovetail.cpu_worker")

DIRECTORY = Path(__file__).parent
HEADER = DIRECTORY / "dovetail.h"
SOURCES = tuple(DIRECTORY / name for name in ("int8_gemv.c", "fp32_rows.c", "attention.c", "layer_ops.c",
                                              "decoder_layers.c", "block_gemv.c", "weight_quant.c",
                                              "block_rows.c", "abi.c"))
# -ffp-contract=off: no fused multiply-add in the epilogue, so every path rounds the same way.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
KERNEL_DIR_VARIABLE = "DOVETAIL_KERNEL_DIR"  # where built libraries are cached (default: cache_dir())

# dovetail.h's constants, mirrored (dovetail_abi reports the library's; check() compares).
ABI_VERSION = 16
LAYOUT_ROWS, LAYOUT_PACKED, LAYOUT_TILES = 0, 1, 2  # an int8 weight's layout
# a Linear's kind
LINEAR_INT8, LINEAR_FP32, LINEAR_INT8_PACKED, LINEAR_INT8_TILES, LINEAR_BLOCK, LINEAR_BF16 = 0, 1, 2, 3, 4, 5
DTYPE_FP32, DTYPE_FP16, DTYPE_BF16 = 0, 1, 2  # a weight's source dtype for the quantizer
SIMD_PLAIN, SIMD_AVX2, SIMD_AVX512 = 0, 1, 2  # dovetail_int8_simd, dovetail_fp32_simd
NO_MEMORY, BAD_SHAPE = -1, -2  # statuses
BLOCK_Q8_0, BLOCK_Q4_0, BLOCK_Q4_1 = 0, 1, 2  # a block-quantized weight's type
FUSION_DGF, FUSION_FC = 0, 1  # a draft head's fusion (dovetail_draft_fusion)


# What runs without the library. int8 and the GGUF formats are block-quantized: they have no other path.
WITHOUT_LIBRARY = ("int8-row layers run on fbgemm (slower decoding), fp32 ones on MKL or F.linear, tree attention "
                   "row by row, and the block-quantized targets (int8, q8_0, q4_0, q4_1: a GGUF's default) and "
                   "a q4_0 draft cannot run")


class AbiMismatch(RuntimeError):
    """The built library and this module disagree on the interface (after a rebuild)."""


class Linear(ctypes.Structure):
    """dovetail_linear: one linear layer as its module holds it."""

    _fields_ = [("kind", ctypes.c_int64), ("weight", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("offsets", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("n_out", ctypes.c_int64),
                ("k", ctypes.c_int64), ("block_scales", ctypes.c_void_p), ("block_minimums", ctypes.c_void_p),
                ("block_type", ctypes.c_int64), ("planes", ctypes.c_int64)]


class Layer(ctypes.Structure):
    """dovetail_layer: a decoder layer's norms and linears."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", Linear), ("o", Linear),
                ("gate_up", Linear), ("down", Linear)]


class Eagle3(ctypes.Structure):
    """dovetail_eagle3: a draft head's EAGLE-3 layer (gated: dgf-eagle3's gate in w1, w2, wz)."""

    _fields_ = [("input_norm", ctypes.c_void_p), ("hidden_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear), ("gated", ctypes.c_int64),
                ("w1", Linear), ("w2", Linear), ("wz", Linear)]


class Fusion(ctypes.Structure):
    """dovetail_fusion: a draft head's fusion (DGF's input_norm, w1, w2, wz; or EAGLE-1/2's fc)."""

    _fields_ = [("kind", ctypes.c_int64), ("input_norm", ctypes.c_void_p), ("w1", Linear), ("w2", Linear),
                ("wz", Linear), ("fc", Linear)]


class Capture(ctypes.Structure):
    """dovetail_capture: the residual streams dovetail_decoder_layers_capturing copies out."""

    _fields_ = [("count", ctypes.c_int64), ("layers", ctypes.c_void_p), ("out", ctypes.c_void_p)]


class Shape(ctypes.Structure):
    """dovetail_shape: a model's sizes as dovetail_decoder_layers reads them."""

    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("max_len", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class Segment(ctypes.Structure):
    """dovetail_segment: one sequence's rows in a dovetail_decoder_layers call."""

    _fields_ = [("rows", ctypes.c_int64), ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                ("start", ctypes.c_int64), ("shared", ctypes.c_int64), ("extra", ctypes.c_void_p),
                ("extra_start", ctypes.c_void_p)]


# In dovetail_abi_info's order; new fields go at the end (an older build reports a prefix).
_ABI_FIELDS = ("version", "linear_size", "layer_size", "shape_size", "segment_size", "layout_rows", "layout_packed",
               "layout_tiles",
               "linear_int8", "linear_fp32", "linear_int8_packed", "linear_int8_tiles", "linear_block", "linear_bf16",
               "dtype_fp32", "dtype_fp16",
               "dtype_bf16", "simd_plain", "simd_avx2", "simd_avx512", "no_memory", "bad_shape", "block_q8_0",
               "block_q4_0", "block_q4_1", "eagle3_size", "fusion_size", "capture_size", "fusion_dgf", "fusion_fc")


class AbiInfo(ctypes.Structure):
    """dovetail_abi_info: what dovetail_abi reports."""

    _fields_ = [(name, ctypes.c_int64) for name in _ABI_FIELDS]


def expected_abi() -> dict[str, int]:
    """What dovetail_abi must report for this module's mirror (read at each check: tests swap a mirror)."""
    return {"version": ABI_VERSION, "linear_size": ctypes.sizeof(Linear), "layer_size": ctypes.sizeof(Layer),
            "shape_size": ctypes.sizeof(Shape), "segment_size": ctypes.sizeof(Segment),
            "eagle3_size": ctypes.sizeof(Eagle3), "fusion_size": ctypes.sizeof(Fusion),
            "capture_size": ctypes.sizeof(Capture), "layout_rows": LAYOUT_ROWS,
            "layout_packed": LAYOUT_PACKED,
            "layout_tiles": LAYOUT_TILES, "linear_int8": LINEAR_INT8, "linear_fp32": LINEAR_FP32,
            "linear_int8_packed": LINEAR_INT8_PACKED, "linear_int8_tiles": LINEAR_INT8_TILES,
            "linear_block": LINEAR_BLOCK, "linear_bf16": LINEAR_BF16,
            "dtype_fp32": DTYPE_FP32, "dtype_fp16": DTYPE_FP16, "dtype_bf16": DTYPE_BF16, "simd_plain": SIMD_PLAIN,
            "simd_avx2": SIMD_AVX2, "simd_avx512": SIMD_AVX512, "no_memory": NO_MEMORY, "bad_shape": BAD_SHAPE,
            "block_q8_0": BLOCK_Q8_0, "block_q4_0": BLOCK_Q4_0, "block_q4_1": BLOCK_Q4_1, "fusion_dgf": FUSION_DGF,
            "fusion_fc": FUSION_FC}


_P, _I64, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# Every exported function: (argtypes, restype), in dovetail.h's order.
SIGNATURES: dict[str, tuple[list[type], type | None]] = {
    "dovetail_abi": ([_P, _I64], _I64),
    "dovetail_int8_has_vnni": ([], _INT),
    "dovetail_int8_simd": ([], _INT),
    "dovetail_int8_amx_ready": ([], _INT),
    "dovetail_int8_tiles_amx_from": ([_INT], None),
    "dovetail_quantize_rows": ([_P, _P, _P, _I64, _I64], None),
    "dovetail_widen_half": ([_P, _P, _I64], None),
    "dovetail_quantize_weight_rows": ([_P, _INT, _P, _P, _I64, _I64, _INT], _INT),
    "dovetail_quantize_weight_layout": ([_P, _INT, _INT, _P, _P, _P, _I64, _I64, _INT], _INT),
    "dovetail_pack_tiles": ([_P, _P, _I64, _I64, _INT], None),
    "dovetail_weight_offsets": ([_P, _P, _I64, _I64], None),
    "dovetail_int8_linear": ([_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT], _INT),
    "dovetail_int8_forward": ([_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT], _INT),
    "dovetail_fp32_simd": ([], _INT),
    "dovetail_fp32_linear": ([_P, _P, _P, _P, _I64, _I64, _I64, _INT], None),
    "dovetail_bf16_linear": ([_P, _P, _P, _P, _I64, _I64, _I64, _INT], None),
    "dovetail_exp_nonpositive": ([_P, _I64], None),
    "dovetail_dot_fixed": ([_P, _P, _I64], _FLOAT),
    "dovetail_attention": ([_P, _P, _P, _INT, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _FLOAT, _INT], _INT),
    "dovetail_attention_causal": ([_P, _P, _P, _INT, _I64, _I64, _P, _I64, _I64, _I64, _I64, _FLOAT, _INT], _INT),
    "dovetail_rms_norm": ([_P, _P, _P, _I64, _I64, _FLOAT, _INT], None),
    "dovetail_rope_qkv": ([_P, _P, _P, _P, _P, _P, _INT, _I64, _I64, _I64, _I64, _I64, _I64, _INT], None),
    "dovetail_silu_mul": ([_P, _P, _I64, _P, _I64, _I64, _INT], None),
    "dovetail_block_simd": ([], _INT),
    "dovetail_block_amx_ready": ([], _INT),
    "dovetail_block_amx_from": ([_INT], None),
    "dovetail_quantize_blocks": ([_P, _P, _P, _P, _I64, _I64, _INT, _INT], None),
    "dovetail_block_linear": ([_P, _P, _P, _I64, _INT, _P, _P, _P, _INT, _P, _P, _I64, _I64, _INT], _INT),
    "dovetail_dequantize_rows": ([_P, _INT, _I64, _P, _I64, _P], _INT),
    "dovetail_decoder_scratch": ([_P, _I64], _I64),
    "dovetail_decoder_finish": ([_P, _P, _FLOAT, _P, _I64, _I64, _P, _I64, _P, _P, _INT], _INT),
    "dovetail_decoder_layers": ([_P, _P, _I64, _P, _P, _P, _P, _I64, _INT, _I64, _P, _INT], _INT),
    "dovetail_decoder_layers_capturing": ([_P, _P, _I64, _P, _P, _P, _P, _I64, _INT, _I64, _P, _P, _INT], _INT),
    "dovetail_eagle3_scratch": ([_P, _I64], _I64),
    "dovetail_eagle3_layer": ([_P, _P, _P, _P, _P, _P, _P, _I64, _INT, _I64, _P, _INT], _INT),
    "dovetail_fusion_scratch": ([_I64, _I64], _I64),
    "dovetail_draft_fusion": ([_P, _P, _P, _P, _I64, _FLOAT, _I64, _P, _INT], _INT),
}


def cache_dir() -> Path:
    """DOVETAIL_KERNEL_DIR, else kernels/ in the cost caches' folder (DOVETAIL_CACHE_DIR, else
    $XDG_CACHE_HOME/dovetail, else ~/.cache/dovetail): one setting moves every cache."""
    explicit = os.environ.get(KERNEL_DIR_VARIABLE)
    return Path(explicit) if explicit else cost_cache.cache_dir() / "kernels"


def find_compiler() -> str | None:
    """$CC (a command line: the compiler and any words before or after it), else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compiler_command(compiler: str) -> list[str]:
    """$CC's words ("ccache gcc", "gcc -m64"), as make reads it; RuntimeError (a failed build: torch's
    paths, said in the log) where they are no command line (an unclosed quote raised ValueError)."""
    try:
        words = shlex.split(compiler)
    except ValueError as error:
        raise RuntimeError(f"CC={compiler!r} is not a command line: {error}") from None
    if not words:
        raise RuntimeError("CC is blank")
    return words


def compile_library(compiler: str, flags: Sequence[str], sources: Sequence[Path], target: Path) -> None:
    """``sources`` into the shared library ``target``, replacing it atomically (a concurrent worker
    sees the whole library or none). RuntimeError with the compiler's message when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        done = subprocess.run([*compiler_command(compiler), *flags, *map(str, sources), "-o", str(built), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-1500:] or f"{compiler} exited {done.returncode}")
        os.replace(built, target)


def target_path(compiler: str, flags: Sequence[str], directory: Path) -> Path:
    """Where the library for these sources, flags, compiler and CPU is cached under ``directory``."""
    # The CPU's flags are in the key: -march=native builds for this CPU only.
    parts = [path.read_bytes() for path in (HEADER, *SOURCES)]
    parts += [" ".join(flags).encode(), " ".join(sorted(cpu_flags())).encode(), compiler.encode()]
    return directory / f"dovetail-kernels-{hashlib.sha256(b''.join(parts)).hexdigest()[:16]}.so"


def read_abi(library: ctypes.CDLL) -> dict[str, int] | str:
    """What ``library``'s dovetail_abi reports, by field: every field of this module's mirror for a build
    of these sources, the first ones for an older build (its shorter report is a prefix); or why it
    cannot say (a few words)."""
    try:
        report = library.dovetail_abi
    except AttributeError:
        return "it has no dovetail_abi (built from sources older than dovetail.h)"
    report.argtypes, report.restype = SIGNATURES["dovetail_abi"]
    info = AbiInfo()
    size = report(ctypes.byref(info), ctypes.sizeof(info))
    if 0 < size < ctypes.sizeof(info) and size % 8 == 0:  # an older build: it fills its own size, no more
        size = report(ctypes.byref(info), size)
    if not 0 < size <= ctypes.sizeof(info) or size % 8 != 0:
        return f"dovetail_abi_info is {size} bytes in the library, {ctypes.sizeof(info)} in library.py"
    return {name: getattr(info, name) for name in _ABI_FIELDS[:size // 8]}


def abi_problem(library: ctypes.CDLL) -> str | None:
    """What in ``library`` disagrees with this module's mirror of dovetail.h, in a few words; None
    when nothing does."""
    info = read_abi(library)
    if isinstance(info, str):
        return info
    for name, expected in expected_abi().items():
        if name not in info:
            return f"it reports no {name} (an older dovetail_abi_info)"
        if info[name] != expected:
            return f"{name} is {info[name]} in the library, {expected} in library.py"
    missing = [name for name in SIGNATURES if not hasattr(library, name)]
    return f"it lacks {', '.join(missing)}" if missing else None


def declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """Every function's argument and result types, from ``SIGNATURES``."""
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    return library


def _open(path: Path, again: bool = False) -> ctypes.CDLL:
    """``path`` loaded. ``again``: this process already loaded an older file of that name, which
    the loader would hand back, so a private copy of the new one is loaded (and unlinked)."""
    if not again:
        return ctypes.CDLL(str(path))
    private = path.with_name(f"{path.stem}-{uuid.uuid4().hex[:8]}.so")
    shutil.copyfile(path, private)
    try:
        return ctypes.CDLL(str(private))
    finally:
        private.unlink()


def build(compiler: str, flags: Sequence[str], directory: Path) -> ctypes.CDLL:
    """The library for these flags and this compiler, compiled into ``directory`` unless already
    there, loaded and declared. A cached file that does not load or fails the ABI check is rebuilt
    once; AbiMismatch if the rebuilt one fails it too."""
    target = target_path(compiler, flags, directory)
    again = False
    if target.exists():
        try:
            library = _open(target)
        except OSError as error:  # not a library (truncated, overwritten): it never loads, so rebuild it
            log.warning("the kernel library %s cannot be loaded (%s): rebuilding it", target, error)
        else:
            problem = abi_problem(library)
            if problem is None:
                return declare(library)
            log.warning("the kernel library %s does not match this code (%s): rebuilding it", target, problem)
            again = True
    compile_library(compiler, flags, SOURCES, target)
    library = _open(target, again)
    problem = abi_problem(library)
    if problem is not None:
        raise AbiMismatch(f"the kernel library built from {DIRECTORY} with {' '.join(flags)} does not match "
                          f"its Python mirror: {problem}")
    return declare(library)


def writable(directory: Path) -> bool:
    """Whether ``directory`` exists, or can be made, and takes new files."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


def build_somewhere(compiler: str, flags: Sequence[str], directory: Path) -> ctypes.CDLL:
    """``build`` in the cache ``directory``; where it cannot be written (a read-only or missing home),
    in a private temporary folder instead, removed once the library is loaded: a build at every start
    (seconds) rather than torch's slower paths, which verify fp32 trees only to float tolerance."""
    try:
        return build(compiler, flags, directory)
    except OSError as error:
        if writable(directory):
            raise
        log.warning("cannot write the kernel cache %s (%s): building the kernels in a temporary folder at "
                    "every start; set %s to a writable folder to keep them", directory, error, KERNEL_DIR_VARIABLE)
    with tempfile.TemporaryDirectory(prefix="dovetail-kernels-") as scratch:
        return build(compiler, flags, Path(scratch))


@cache
def load() -> ctypes.CDLL | None:
    """The built library, or None when there is no compiler or the build fails (AbiMismatch,
    a disagreement between this folder's files, is raised)."""
    compiler = find_compiler()
    if compiler is None:
        log.warning("no C compiler found, so %s; install gcc for the faster, exact kernels", WITHOUT_LIBRARY)
        return None
    try:
        return build_somewhere(compiler, FLAGS, cache_dir())
    except AbiMismatch:
        raise
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("building %s failed, so %s: %s", " and ".join(source.name for source in SOURCES),
                    WITHOUT_LIBRARY, error)
        return None


def clear_cache() -> None:
    """Forget the loaded library (tests change the compiler or flags)."""
    load.cache_clear()
