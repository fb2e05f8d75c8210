"""The int8 kernel in this working tree against the same file at a git revision, side by side.

    python -m tools.bench_int8_kernel [--baseline HEAD] [--rows 1,2,3,4,8,16,32] [--shapes OUTxIN,...] [--threads 2]
    python -m tools.bench_int8_kernel --layouts [--rows 1] [--shapes ...]   # this tree: [N, K], packed, tiles

For kernel work (``cpu_worker/native/int8_gemv.c``): both versions are built for this CPU and called
the way a layer calls them (``dovetail_int8_forward``: quantize the rows, then the linear) on
llama2-7b's matrix shapes by default, each weight in the layout that version holds it in (the
baseline's int8_gemv.c links with this tree's other sources; only its linear is called). Each
shape cycles through enough distinct matrices (>= 96 MB) that the weights stream from memory as
in a real model rather than from the last-level cache. The two versions take turns on every
repeat (a shared machine's noise hits both) and must give the same bits; prints the median ms
per call and the first / each other. ``--layouts`` instead compares this tree's kernel on weights
held as [N, K], packed and in tiles (the last where this CPU has AMX: the measurements behind
``int8_kernel.PACK_BELOW_IN_FEATURES`` and ``TILES_NOTE``).
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
from tools.bench_attention import parse_sizes

REPO = Path(__file__).resolve().parents[1]
# (out, in): llama2-7b's attention, MLP up/gate, MLP down; llama-1b's fused qkv and gate/up, down.
SHAPES = "4096x4096,11008x4096,4096x11008"
SHAPES_1B = "6144x2048,11264x2048,2048x5632"
STREAMED_BYTES = 96 << 20  # the matrices a call cycles through: at least three times a 32 MB last-level cache
LAYOUT_NAMES = {"rows": "[N, K]", "packed": "packed", "tiles": "tiles"}


def baseline_source(revision: str, directory: Path) -> Path:
    """``int8_gemv.c`` as it was at ``revision``, written under ``directory``."""
    relative = int8_kernel.SOURCE.relative_to(REPO).as_posix()
    done = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{relative}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise click.ClickException(f"cannot read {relative} at {revision}: {done.stderr.strip()}")
    path = directory / "baseline" / "int8_gemv.c"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(done.stdout)
    return path


def baseline_sources(old_source: Path) -> tuple[Path, ...]:
    """The library's sources with ``old_source`` as its int8_gemv.c; without this tree's
    fp32_rows.c where the old file still held the fp32 kernel (before 2026-12), so no symbol is
    defined twice."""
    others: tuple[Path, ...] = int8_kernel.SOURCES[1:]
    if "dovetail_fp32_linear" in old_source.read_text():
        others = tuple(source for source in others if source != int8_kernel.FP32_SOURCE)
    return (old_source, *others)


class Kernel:
    """One build of the kernel, called the way ``int8_kernel.Int8Weights`` calls it: with the
    weight in the layout that version would hold it in (versions before the packed layout take
    [N, K] and have no layout argument; versions before the tile layout held [N, K] where AMX is)."""

    def __init__(self, library: ctypes.CDLL, source: Path, layout: str | None = None):
        self.library = library
        text = source.read_text()
        self.layouts = int8_kernel.LAYOUTS if "int layout" in text else ("rows", "packed") if "int packed" in text \
            else ("rows",)
        self.layout = layout  # None: as Int8Weights chooses
        if len(self.layouts) == 1:  # the argument types of a version before layouts
            pointer, i64 = ctypes.c_void_p, ctypes.c_int64
            library.dovetail_int8_forward.argtypes = [pointer] * 6 + [i64, i64, i64, ctypes.c_int]

    def layout_for(self, out_features: int, in_features: int) -> str:
        """The layout this version holds such a weight in (as Int8Weights would, unless forced)."""
        if self.layout is not None:
            return self.layout
        # The choice is this tree's rule for this CPU (an older library may lack what it asks).
        chosen = int8_kernel.default_layout(int8_kernel.load_library() or self.library, out_features, in_features)
        return chosen if chosen in self.layouts else "rows"

    def forward(self, x: torch.Tensor, weight: dict[str, torch.Tensor], out: torch.Tensor, threads: int) -> None:
        rows, k = x.shape
        n = weight["scales"].shape[0]
        layout = self.layout_for(n, k)
        code = (int8_kernel.LAYOUTS.index(layout),) if len(self.layouts) > 1 else ()
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
        weight["offsets"] = int8_kernel.weight_offsets(values, next(iter(libraries.values())).library)
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
    compiler = int8_kernel.find_compiler()
    if compiler is None:
        raise click.ClickException("no C compiler (set CC or install gcc): nothing to build")
    torch.set_num_threads(threads)
    if layouts and (unpackable := [shape for shape in weight_shapes if not int8_kernel.can_pack(*shape)]):
        raise click.BadParameter(f"{unpackable} have no packed layout (out % 4, in % 64)", param_hint="--shapes")
    with tempfile.TemporaryDirectory() as scratch:
        this_tree = int8_kernel.build(compiler, int8_kernel.FLAGS, Path(scratch))
        if layouts:
            held = ["rows", "packed"]
            if this_tree.dovetail_int8_amx_ready() and all(int8_kernel.can_tile(*shape) for shape in weight_shapes):
                held.append("tiles")
            libraries = {LAYOUT_NAMES[layout]: Kernel(this_tree, int8_kernel.SOURCE, layout) for layout in held}
            command = f"--layouts --rows {rows} --shapes {shapes} --threads {threads}"
        else:
            old_source = baseline_source(baseline, Path(scratch))
            libraries = {f"baseline ({baseline})": Kernel(int8_kernel.build(
                compiler, int8_kernel.FLAGS, Path(scratch), baseline_sources(old_source)), old_source),
                "this tree": Kernel(this_tree, int8_kernel.SOURCE)}
            command = f"--baseline {baseline} --rows {rows} --shapes {shapes} --threads {threads}"
        simd = "AMX" if this_tree.dovetail_int8_amx_ready() else \
            {2: "AVX512-VNNI", 1: "AVX2"}.get(this_tree.dovetail_int8_simd(), "plain C")
        names = list(libraries)
        print(f"int8 kernel, {simd} path, {threads} threads, median of {repeats} calls; ms per call")
        print(f"python -m tools.bench_int8_kernel {command}")
        print("| shape (out x in) | layouts | rows | " + " | ".join(f"{name} ms" for name in names) + " | "
              + " | ".join(f"{names[0]} / {name}" for name in names[1:]) + " |")
        print("|---" * (3 + 2 * len(names) - 1) + "|")
        for shape in weight_shapes:
            held_as = ", ".join(LAYOUT_NAMES[kernel.layout_for(*shape)] for kernel in libraries.values())
            for count, medians in compare(libraries, shape, row_counts, repeats, threads):
                first, *others = medians.values()
                print(f"| {shape[0]}x{shape[1]} | {held_as} | {count} | "
                      + " | ".join(f"{value:.2f}" for value in medians.values()) + " | "
                      + " | ".join(f"{first / other:.2f}x" for other in others) + " |", flush=True)


if __name__ == "__main__":
    main()
