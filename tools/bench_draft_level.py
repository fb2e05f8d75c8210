"""A CPU draft's cost per tree level against its bandwidth bound, side by side in one run.

    python -m tools.bench_draft_level --draft HEAD --target TARGET [--threads 2] [--precisions int8,q4_0,fp32]

Every tree level reads every weight of the head once (fusion, decoder layers, lm_head), so on a
CPU a level cannot take less than head bytes / read bandwidth. This loads the head as the
gpu_worker does on a CPU, once per precision (``--draft-dtype``'s CPU formats), times
t_draft(depth) with the worker's own measurement (``gpu_worker.draft_cost``) for each beam width,
the precisions taking turns round after round (best of the rounds), measures the read bandwidth
right after, and prints ms per level (the slope between depth 1 and the deepest) against that bound.
Use a real-cost stand-in head (``tools.bench_real`` caches them under ~/.cache/dovetail/standins).
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import torch

from gpu_worker.checkpoint import load_head
from gpu_worker.draft_cost import measure_draft_ms
from gpu_worker.drafter import Drafter
from tools.options import load_errors_in_one_line
from tools.tables import markdown_header, markdown_row


def read_gbs(megabytes: int = 1024, repeats: int = 3) -> float:
    """Best-of read bandwidth: summing a buffer far larger than the caches."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best / 1e9


def head_bytes(head: torch.nn.Module) -> int:
    """Bytes one level streams: parameters and buffers, plus packed int8 weights (``nbytes``),
    without the embedding (a level reads only its few rows)."""
    total = sum(getattr(module, "nbytes", 0) for module in head.modules())
    for name, tensor in [*head.named_parameters(), *head.named_buffers()]:
        if "embed_tokens" not in name:
            total += tensor.numel() * tensor.element_size()
    return total


@click.command()
@click.option("--draft", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="Draft head folder.")
@click.option("--target", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="Its target folder (the frozen embedding and lm_head come from there).")
@click.option("--precisions", default="int8,q4_0", show_default=True,
              help="Comma list of the draft's CPU formats to compare: int8, q4_0, fp32.")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--depth", type=click.IntRange(min=2, max=10), default=6, show_default=True, help="Deepest tree timed.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@load_errors_in_one_line
def main(draft: Path, target: Path, precisions: str, threads: int, depth: int, repeats: int) -> None:
    torch.set_num_threads(threads)
    names = [name.strip() for name in precisions.split(",") if name.strip()]
    unknown = sorted(set(names) - {"int8", "q4_0", "fp32"})
    if unknown or not names:
        raise click.BadParameter(f"unknown precision(s) {unknown or names}; use int8, q4_0, fp32",
                                 param_hint="--precisions")
    drafters = {name: Drafter(load_head(draft, target, projections=None if name == "fp32" else name), max_len=512,
                              scratch_len=8 * depth) for name in names}
    best: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):  # the precisions take turns, so load drift hits all alike
        for name, drafter in drafters.items():
            for top_k in (4, 8):
                ms = measure_draft_ms(drafter, [1, depth], top_k=top_k, repeats=1)
                kept = best.setdefault((name, top_k), ms)
                best[(name, top_k)] = [min(a, b) for a, b in zip(kept, ms)]
    bandwidth = read_gbs()  # measured right after, on the same machine state
    print(f"{draft.name}: {threads} threads, read bandwidth {bandwidth:.1f} GB/s, best of {repeats} rounds")
    print(markdown_header(["precision", "MB per level", "top_k", "t_draft depth 1 ms", f"depth {depth} ms",
                           "ms per level", "bound ms", "per level / bound"]))
    for (name, top_k), ms in best.items():
        nbytes = head_bytes(drafters[name].head)
        per_level = (ms[1] - ms[0]) / (depth - 1)
        bound = nbytes / (bandwidth * 1e9) * 1e3
        print(markdown_row([name, f"{nbytes / 1e6:.0f}", top_k, f"{ms[0]:.1f}", f"{ms[1]:.1f}", f"{per_level:.1f}",
                            f"{bound:.1f}", f"{per_level / bound:.2f}x"]))

if __name__ == "__main__":
    main()
