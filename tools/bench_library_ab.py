"""A target's verify passes with its layer loop on two builds of the native library, swapped pass by
pass in one process: an older build (from a git revision's sources, or a built .so) against this
checkout's. On a shared, noisy host the two then see the same load, which separate runs never do.

    python -m tools.bench_library_ab --target PATH --old-rev REV [--precision auto] [--rows 1,2,4,8]
        [--passes 200] [--threads 2]
    python -m tools.bench_library_ab --target PATH --old-library OLD.so ...

Only the decoder layers' call (``dovetail_decoder_layers``) switches library; the rest of a pass (the
embedding, the final norm, the lm_head) runs on this checkout's in both, so the ratio is of whole
passes. A pass verifies a chain of ``rows`` nodes after a 200-token prompt (one row: a decode step's
work). Prints, per row count, the median pass of each build and new / old.
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
import torch

from cpu_worker.native import library as native
from cpu_worker.native_layers import NativeLayers
from tools.options import comma_list, load_errors_in_one_line
from tools.tables import markdown_header, markdown_row

if TYPE_CHECKING:
    from cpu_worker.engine import TargetEngine

NATIVE_FOLDER = "cpu_worker/native"
# What dovetail_decoder_layers reads: a build whose structs or constants differ cannot stand in.
LOOP_ABI_FIELDS = ("linear_size", "layer_size", "shape_size", "segment_size", "layout_rows", "layout_packed",
                   "layout_tiles", "linear_int8", "linear_fp32", "linear_int8_packed", "linear_int8_tiles",
                   "linear_block", "linear_bf16", "block_q8_0", "block_q4_0", "block_q4_1")
PROMPT = list(range(100, 300))
CHECKOUT = Path(__file__).parent.parent


def git(*args: str, repo: Path = CHECKOUT) -> str:
    """A git command's output in ``repo``; ClickException with git's message when it fails."""
    done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=repo)
    if done.returncode != 0:
        raise click.ClickException(f"git {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def sources_at(rev: str, folder: Path, repo: Path = CHECKOUT) -> list[Path]:
    """The native library's C sources and header as of ``rev`` of ``repo``, written into ``folder``;
    the .c files."""
    names = git("ls-tree", "--name-only", f"{rev}:{NATIVE_FOLDER}", repo=repo).split()
    if "dovetail.h" not in names:
        raise click.ClickException(f"{rev} has no {NATIVE_FOLDER}/dovetail.h: no native library to build")
    sources = []
    for name in names:
        if name.endswith((".c", ".h")):
            (folder / name).write_text(git("show", f"{rev}:{NATIVE_FOLDER}/{name}", repo=repo))
            if name.endswith(".c"):
                sources.append(folder / name)
    return sources


def loop_problem(library: ctypes.CDLL) -> str | None:
    """Why ``library`` cannot run this checkout's layer loop descriptors, or None."""
    info = native.read_abi(library)
    if isinstance(info, str):
        return info
    if not hasattr(library, "dovetail_decoder_layers"):
        return "it has no dovetail_decoder_layers"
    missing = [name for name in LOOP_ABI_FIELDS if name not in info]
    if missing:
        return f"it reports no {', '.join(missing)}"
    expected = native.expected_abi()
    changed = [name for name in LOOP_ABI_FIELDS if info[name] != expected[name]]
    return f"{', '.join(changed)} differ from this checkout's" if changed else None


def old_library(rev: str | None, path: str | None, folder: Path) -> ctypes.CDLL:
    """The older build: ``path`` as it is, or ``rev``'s sources compiled into ``folder`` with this
    checkout's flags; checked against the layer loop's structs and declared like this checkout's."""
    if path is None:
        assert rev is not None
        compiler = native.find_compiler()
        if compiler is None:
            raise click.ClickException("no C compiler found to build the older library")
        target = folder / "old.so"
        try:
            native.compile_library(compiler, native.FLAGS, sources_at(rev, folder), target)
        except RuntimeError as error:
            raise click.ClickException(f"building {rev}'s library failed: {error}") from None
        path = str(target)
    try:
        library = ctypes.CDLL(path)
    except OSError as error:
        raise click.ClickException(f"cannot load {path}: {error}") from None
    problem = loop_problem(library)
    if problem is not None:
        raise click.ClickException(f"the older library cannot run this checkout's layer loop: {problem}")
    for name in ("dovetail_decoder_layers", "dovetail_decoder_scratch"):
        function = getattr(library, name)
        function.argtypes, function.restype = native.SIGNATURES[name]
    return library


def pass_ms(engine: TargetEngine, rows: int) -> float:
    """ms of one verify pass of a ``rows``-node chain after the prompt."""
    tokens, parents = list(range(500, 500 + rows)), [-1, *range(rows - 1)]
    started = time.perf_counter()
    engine.tree_logits(tokens, parents)
    return (time.perf_counter() - started) * 1e3


def compare(engine: TargetEngine, libraries: dict[str, ctypes.CDLL], rows: int, passes: int) -> dict[str, float]:
    """Median pass ms per build, the builds taking turns (each order half the time)."""
    loop = engine.model.layer_loop
    assert isinstance(loop, NativeLayers)
    times: dict[str, list[float]] = {name: [] for name in libraries}
    for index in range(passes):
        for name in (list(libraries) if index % 2 else list(libraries)[::-1]):
            loop.library = libraries[name]
            pass_ms(engine, rows)  # the first pass after a swap warms the build's code
            times[name].append(pass_ms(engine, rows))
    return {name: statistics.median(values) for name, values in times.items()}


@click.command()
@click.option("--target", required=True, help="a model folder or GGUF file")
@click.option("--precision", default="auto", show_default=True, help="as dovetail-run's --target-dtype")
@click.option("--old-rev", default=None, help="a git revision whose native sources make the older build")
@click.option("--old-library", "old_library_path", default=None, help="an older build's .so, instead of --old-rev")
@click.option("--rows", default="1,2,4,8", show_default=True, callback=comma_list(int, minimum=1),
              help="comma list of tree sizes (1: a decode step's rows)")
@click.option("--passes", type=click.IntRange(min=3), default=200, show_default=True, help="timed passes a build")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch threads (default: torch's)")
@load_errors_in_one_line
def main(target: str, precision: str, old_rev: str | None, old_library_path: str | None, rows: list[int],
         passes: int, threads: int | None) -> None:
    if (old_rev is None) == (old_library_path is None):
        raise click.UsageError("give one of --old-rev and --old-library")
    from cpu_worker.server import build_engine
    from dovetail_runtime.coordinator import target_precision

    if threads:
        torch.set_num_threads(threads)
    chosen = target_precision(Path(target)) if precision == "auto" else precision
    engine, kernel = build_engine(target, chosen, 1024)
    loop = engine.model.layer_loop
    if not isinstance(loop, NativeLayers):
        raise click.ClickException(f"{target} at {chosen} runs no native layer loop: nothing to swap")
    if max(rows) > loop.max_rows or len(PROMPT) + max(rows) > engine.max_len:
        # More rows than the loop takes would run the Python layers on both builds alike.
        raise click.ClickException(f"--rows at most {min(loop.max_rows, engine.max_len - len(PROMPT))} here")
    with tempfile.TemporaryDirectory(prefix="dovetail-ab-") as folder:
        libraries = {"old": old_library(old_rev, old_library_path, Path(folder)), "new": loop.library}
        # On this checkout's build, before any swap: a prompt chunk's causal segment (extra NULL, ABI 15)
        # would crash a build before it; the swapped builds only run trees.
        engine.prefill(PROMPT)
        print(f"{target}: {chosen} ({kernel}), {torch.get_num_threads()} threads; old: {old_rev or old_library_path}")
        print(markdown_header(["rows", "old ms", "new ms", "new / old"]))
        try:
            for count in rows:
                medians = compare(engine, libraries, count, passes)
                print(markdown_row([count, f"{medians['old']:.3f}", f"{medians['new']:.3f}",
                                    f"{medians['new'] / medians['old']:.3f}"]), flush=True)
        finally:
            loop.library = libraries["new"]


if __name__ == "__main__":
    main()
