"""Decode steps and tree verifications of the cpu_worker's engine with its decoder layers in one
foreign call (``cpu_worker/native_layers.py``) against the Python layers, side by side.

    python -m tools.bench_layer_loop --target DIR [--dtype int8-row] [--context 256] [--steps 40] [--trees 3,8,16]

One engine (built as the cpu_worker builds it) is prefilled with a random prompt; then it takes
turns, step by step, with the C loop on and off (which goes first alternates), so a shared
machine's noise hits both alike. Decode steps continue one sequence (each path adds a token per
step); each tree size is verified ``--steps`` times without committing. Both paths give the
same bits (tests/unit/test_native_layers.py), which this checks again on every tree. The table gives
each path's median ms and the median of the per-step ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from cpu_worker.engine import TargetEngine
from cpu_worker.server import build_engine
from cpu_worker.verify_cost import measurement_tree
from ipc.dtypes import KV_DTYPES, TARGET_PRECISIONS
from tools.options import int_list, load_errors_in_one_line, positive_int
from tools.tables import markdown_header, markdown_row

T = TypeVar("T")


def timed(action: Callable[..., T], *args: object) -> tuple[float, T]:
    started = time.perf_counter()
    result = action(*args)
    return (time.perf_counter() - started) * 1e3, result


def compare(engine: TargetEngine, steps: int, trees: list[int]) -> dict[str, tuple[list[float], list[float]]]:
    """ms per decode step and per tree verification, (C loop, Python layers) in turns."""
    loop = engine.model.layer_loop
    results: dict[str, tuple[list[float], list[float]]] = {}
    token = 7
    native: list[float] = []
    python: list[float] = []
    for step in range(steps):
        for use_loop in ((True, False) if step % 2 == 0 else (False, True)):
            engine.model.layer_loop = loop if use_loop else None
            ms, result = timed(engine.decode, token)
            (native if use_loop else python).append(ms)
            token = int(result.logits.argmax())
    results["decode"] = (native, python)
    for size in trees:
        parents = measurement_tree(size)  # the shape the tree planner times
        tokens = [(token + node) % engine.spec.vocab_size for node in range(size)]
        native, python = [], []
        for step in range(steps):
            outputs: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
            for use_loop in ((True, False) if step % 2 == 0 else (False, True)):
                engine.model.layer_loop = loop if use_loop else None
                ms, outputs[use_loop] = timed(engine.tree_logits, tokens, parents)
                (native if use_loop else python).append(ms)
            if not all(torch.equal(a, b) for a, b in zip(outputs[True], outputs[False], strict=True)):
                raise AssertionError(f"the C loop and the Python layers disagree on a {size}-node tree")
        results[f"tree T={size}"] = (native, python)
    engine.model.layer_loop = loop
    return results


def tree_sizes(text: str) -> list[int]:
    """argparse ``type=``: whole numbers >= 1, or nothing (decode only)."""
    return int_list(text) if text.strip(", ") else []


@load_errors_in_one_line
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--dtype", default="int8-row", choices=TARGET_PRECISIONS, metavar="DTYPE",
                        help="target precision: int8-row or fp32 (the loop's kernels)")
    parser.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES)
    parser.add_argument("--context", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument("--trees", type=tree_sizes, default=[3, 8, 16],
                        help="tree sizes to verify (empty: decode only)")
    parser.add_argument("--threads", type=positive_int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    trees = args.trees
    # Each step adds a token on either path, and the largest tree sits past them.
    max_len = args.context + 2 * args.steps + max(trees, default=1) + 1
    engine, kernel = build_engine(str(args.target), args.dtype, max_len, args.kv_dtype)
    if engine.model.layer_loop is None:
        print(f"the C loop does not apply to this engine ({args.dtype}, linears on {kernel}); nothing to compare")
        return 1
    prompt = torch.randint(0, engine.spec.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    engine.prefill(prompt.tolist())
    print(f"command: python -m tools.bench_layer_loop {' '.join(sys.argv[1:])}  (torch threads "
          f"{torch.get_num_threads()}; linears on {kernel}; KV {str(engine.kv_dtype).removeprefix('torch.')})")
    print(markdown_header(["call", "C loop ms (median)", "Python layers ms (median)",
                           "Python / C loop, per-step median"]))
    for name, (native, python) in compare(engine, args.steps, trees).items():
        ratio = statistics.median(p / n for n, p in zip(native, python, strict=True))
        print(markdown_row([name, f"{statistics.median(native):.2f}", f"{statistics.median(python):.2f}",
                            f"{ratio:.3f}x"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
