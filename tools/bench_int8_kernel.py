"""The int8 kernel in this working tree against the same file at a git revision, side by side.

    python -m tools.bench_int8_kernel [--baseline HEAD] [--rows 1,2,3,4,8,16,32] [--shapes OUTxIN,...] [--threads 2]
    python -m tools.bench_int8_kernel --layouts [--rows 1] [--shapes ...]   # this tree: [N, K], packed, tiles

For kernel work (``cpu_worker/native/int8_gemv.c``): both versions are built for this CPU and called
the way a layer calls them (``dovetail_int8_forward``: quantize the rows, then the linear) on
llama2-7b's matrix shapes by default, each weight in the layout that version holds it in (the
baseline is that revision's C sources built into a library of their own, declared here; only its
linear is called, so any revision with an int8_gemv.c works, before the native folder too). Each
shape cycles through enough distinct matrices (>= 96 MB) that the weights stream from memory as
in a real model rather than from the last-level cache. The two versions take turns on every
repeat (a shared machine's noise hits both) and must give the same bits; prints the median ms
per call and the first / each other. ``--layouts`` instead compares this tree's kernel on weights
held as [N, K], packed and in tiles (the last where this CPU has AMX: the measurements behind
``int8_kernel.PACK_BELOW_IN_FEATURES`` and ``TILES_NOTE``, in docs/kernels.md).
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import click
import torch

from cpu_worker.kernels import int8_kernel
from cpu_worker.kernels.huge_pages import on_huge_pages
from cpu_worker.native import library as native
from tools.bench_attention import parse_sizes
from tools.tables import markdown_header, markdown_row

REPO = Path(__file__).resolve().parents[1]
# (out, in): llama2-7b's attention, MLP up/gate, MLP down; llama-1b's fused qkv and gate/up, down.
SHAPES = "4096x4096,11008x4096,4096x11008"
SHAPES_1B = "6144x2048,11264x2048,2048x5632"
STREAMED_BYTES = 96 << 20  # the matrices a call cycles through: at least three times a 32 MB last-level cache
LAYOUT_NAMES = {"rows": "[N, K]", "packed": "packed", "tiles": "tiles"}
# Where int8_gemv.c lived: the native folder, and cpu_worker/ itself before it (until adb11ab).
SOURCE_FOLDERS = ("cpu_worker/native", "cpu_worker")


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise click.ClickException(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def baseline_sources(revision: str, directory: Path) -> list[Path]:
    """The kernel library's C sources as they were at ``revision`` (every .c and .h of the folder
    that held int8_gemv.c: the library was always all of them), written under ``directory``;
    returns the .c files, int8_gemv.c first."""
    names = set(_git("ls-tree", "-r", "--name-only", revision, "--", "cpu_worker").split())
    folder = next((folder for folder in SOURCE_FOLDERS if f"{folder}/int8_gemv.c" in names), None)
    if folder is None:
        raise click.ClickException(f"no int8_gemv.c at {revision}")
    files = sorted(name for name in names if name.rpartition("/")[0] == folder and name.endswith((".c", ".h")))
    files.sort(key=lambda name: not name.endswith("/int8_gemv.c"))
    out = directory / "baseline"
    out.mkdir(parents=True, exist_ok=True)
    for name in files:  # .h beside the .c files: their #include "..." finds it there
        (out / Path(name).name).write_text(_git("show", f"{revision}:{name}"))
    return [out / Path(name).name for name in files if name.endswith(".c")]


def layouts_of(source: Path) -> tuple[str, ...]:
    """The layouts a version of int8_gemv.c takes (before the packed layout: [N, K] only, and no
    layout argument)."""
    text = source.read_text()
    return int8_kernel.LAYOUTS if "int layout" in text else ("rows", "packed") if "int packed" in text else ("rows",)


def build_baseline(compiler: str, revision: str, directory: Path) -> tuple[ctypes.CDLL, Path]:
    """``revision``'s kernel library built for this CPU (its sources, this tree's flags), with the
    one function the bench calls declared as that version defines it; and its int8_gemv.c."""
    sources = baseline_sources(revision, directory)
    target = directory / "baseline" / "dovetail-kernels-baseline.so"
    native.compile_library(compiler, native.FLAGS, sources, target)
    library = ctypes.CDLL(str(target))
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    layout = [ctypes.c_int] if len(layouts_of(sources[0])) > 1 else []
    library.dovetail_int8_forward.argtypes = [pointer] * 6 + [i64, i64, i64, *layout, ctypes.c_int]
    library.dovetail_int8_forward.restype = ctypes.c_int
    return library, sources[0]


class Kernel:
    """One build of the kernel, called the way ``int8_kernel.Int8Weights`` calls it: with the
    weight in the layout that version would hold it in (versions before the packed layout take
    [N, K] and have no layout argument; versions before the tile layout held [N, K] where AMX is).
    ``this_tree``: this tree's library, whose rule chooses the layout."""

    def __init__(self, library: ctypes.CDLL, source: Path, this_tree: ctypes.CDLL, layout: str | None = None):
        self.library = library
        self.this_tree = this_tree
        self.layouts = layouts_of(source)
        self.layout = layout  # None: as Int8Weights chooses

    def layout_for(self, out_features: int, in_features: int) -> str:
        """The layout this version holds such a weight in (as Int8Weights would, unless forced)."""
        if self.layout is not None:
            return self.layout
        # The choice is this tree's rule for this CPU (an older version may lack the layout it picks).
        chosen = int8_kernel.default_layout(self.this_tree, out_features, in_features)
        return chosen if chosen in self.layouts else "rows"

    def forward(self, x: torch.Tensor, weight: dict[str, torch.Tensor], out: torch.Tensor, threads: int) -> None:
        rows, k = x.shape
        n = weight["scales"].shape[0]
        layout = self.layout_for(n, k)
        code = (int8_kernel.LAYOUT_CODES[layout],) if len(self.layouts) > 1 else ()
        if self.library.dovetail_int8_forward(x.data_ptr(), weight[layout].data_ptr(), weight["scales"].data_ptr(),
                                              weight["offsets"].data_ptr(), None, out.data_ptr(), rows, n, k, *code,
                                              threads) != 0:
            raise MemoryError("int8 forward: no scratch memory")


def streamed_bytes() -> int:
    """``STREAMED_BYTES``, or three times this CPU's last-level cache where that is larger (a
    Xeon's can be hundreds of MB: weights cycled through it would not come from memory)."""
    largest = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = size.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            largest = max(largest, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(STREAMED_BYTES, 3 * largest)


def compare(libraries: dict[str, Kernel], shape: tuple[int, int], row_counts: list[int], repeats: int,
            threads: int) -> list[tuple[int, dict[str, float]]]:
    n, k = shape
    generator = torch.Generator().manual_seed(0)
    count = max(1, -(-streamed_bytes() // (n * k)))
    weights = []
    held = {kernel.layout_for(n, k) for kernel in libraries.values()}
    arrange = {"rows": lambda v: v, "packed": int8_kernel.pack_blocks, "tiles": int8_kernel.pack_tiles}
    for _ in range(count):
        values = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        weight = {layout: on_huge_pages(arrange[layout](values)) for layout in held}
        weight["scales"] = torch.rand(n, generator=generator) / 100 + 1e-3
        weight["offsets"] = int8_kernel.weight_offsets(values, next(iter(libraries.values())).this_tree)
        weights.append(weight)
    results = []
    for rows in row_counts:
        x = torch.randn(rows, k, generator=generator)
        outs = {name: torch.empty(rows, n) for name in libraries}
        times: dict[str, list[float]] = {name: [] for name in libraries}
        calls = 0
        for repeat in range(repeats + 1):
            for name, library in libraries.items():
                # Every call takes the least recently used matrix, so no version reads one the other just cached.
                weight = weights[calls % count]
                calls += 1
                started = time.perf_counter()
                library.forward(x, weight, outs[name], threads)
                if repeat:  # the first round warms up
                    times[name].append((time.perf_counter() - started) * 1e3)
        # Same weights for a bit-for-bit check (the timed calls rotate through different ones).
        for name, library in libraries.items():
            library.forward(x, weights[0], outs[name], threads)
        first, *others = outs.values()
        if any(not torch.equal(first, other) for other in others):
            raise click.ClickException(f"{n}x{k}, {rows} rows: the kernels give different bits")
        results.append((rows, {name: statistics.median(values) for name, values in times.items()}))
    return results


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--baseline", default="HEAD", show_default=True, help="git revision whose int8_gemv.c is compared")
@click.option("--rows", default="1,2,3,4,8,16,32", show_default=True, help="rows per call (comma-separated)")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--shapes", default=SHAPES, show_default=True,
              help=f"weight shapes OUTxIN, comma-separated (llama-1b's: {SHAPES_1B})")
@click.option("--repeats", type=click.IntRange(min=3), default=24, show_default=True,
              help="timed calls per version, shape and row count")
@click.option("--layouts", is_flag=True,
              help="Compare this tree's kernel on [N, K], packed and (with AMX) tile weights instead of two "
                   "revisions.")
def main(baseline: str, rows: str, shapes: str, threads: int, repeats: int, layouts: bool) -> None:
    row_counts = parse_sizes(rows, "--rows")
    try:
        weight_shapes = [(int(out), int(in_)) for out, in_ in (shape.lower().split("x") for shape in shapes.split(","))]
    except ValueError:
        raise click.BadParameter(f"expected OUTxIN,OUTxIN...; got {shapes!r}", param_hint="--shapes") from None
    compiler = native.find_compiler()
    if compiler is None:
        raise click.ClickException("no C compiler (set CC or install gcc): nothing to build")
    torch.set_num_threads(threads)
    if layouts and (unpackable := [shape for shape in weight_shapes if not int8_kernel.can_pack(*shape)]):
        raise click.BadParameter(f"{unpackable} have no packed layout (out % 4, in % 64)", param_hint="--shapes")
    with tempfile.TemporaryDirectory() as scratch:
        this_tree = native.build(compiler, native.FLAGS, Path(scratch))
        if layouts:
            held = ["rows", "packed"]
            if this_tree.dovetail_int8_amx_ready() and all(int8_kernel.can_tile(*shape) for shape in weight_shapes):
                held.append("tiles")
            source = native.DIRECTORY / "int8_gemv.c"
            libraries = {LAYOUT_NAMES[layout]: Kernel(this_tree, source, this_tree, layout) for layout in held}
            command = f"--layouts --rows {rows} --shapes {shapes} --threads {threads}"
        else:
            old, old_source = build_baseline(compiler, baseline, Path(scratch))
            libraries = {f"baseline ({baseline})": Kernel(old, old_source, this_tree),
                         "this tree": Kernel(this_tree, native.DIRECTORY / "int8_gemv.c", this_tree)}
            command = f"--baseline {baseline} --rows {rows} --shapes {shapes} --threads {threads}"
        simd = "AMX" if this_tree.dovetail_int8_amx_ready() else \
            {2: "AVX512-VNNI", 1: "AVX2"}.get(this_tree.dovetail_int8_simd(), "plain C")
        names = list(libraries)
        print(f"int8 kernel, {simd} path, {threads} threads, median of {repeats} calls; ms per call")
        print(f"python -m tools.bench_int8_kernel {command}")
        print(markdown_header(["shape (out x in)", "layouts", "rows", *(f"{name} ms" for name in names),
                               *(f"{names[0]} / {name}" for name in names[1:])]))
        for shape in weight_shapes:
            held_as = ", ".join(LAYOUT_NAMES[kernel.layout_for(*shape)] for kernel in libraries.values())
            for count, medians in compare(libraries, shape, row_counts, repeats, threads):
                first, *others = medians.values()
                print(markdown_row([f"{shape[0]}x{shape[1]}", held_as, count,
                                    *(f"{value:.2f}" for value in medians.values()),
                                    *(f"{first / other:.2f}x" for other in others)]), flush=True)


if __name__ == "__main__":
    main()
