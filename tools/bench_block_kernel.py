"""The block kernels (Q8_0, Q4_0, Q4_1 weights; activations per block at 8 bits, or at 16 with the
suffix ``-a16``) against the per-row int8 W8A8 kernel, side by side in one run: ms per matrix and
GB/s of weights read, per row count.

Matrices are distinct and cycled (more bytes than the last-level cache holds), so one row's
time is a stream from memory, as in decoding; rounds alternate between the kernels (these
machines are shared and noisy) and the table gives medians::

    python -m tools.bench_block_kernel --shapes 4096x4096,11008x4096 --rows 1,4,8,16 --threads 2
"""

from __future__ import annotations

import statistics
import time

import click
import torch

from cpu_worker.kernels import block_quant
from cpu_worker.kernels.int8 import RowwiseInt8Linear
from tools.options import comma_list
from tools.tables import markdown_header, markdown_row

KINDS = ("int8-row", "q8_0-a16", "q8_0", "q4_0", "q4_0-a16", "q4_1")  # q8_0-a16: the int8 precision


def layers_for(kind: str, shape: tuple[int, int], count: int) -> tuple[list[torch.nn.Module], int]:
    """``count`` random layers of ``kind`` and the bytes one of them holds."""
    generator = torch.Generator().manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(count):
        weight = torch.randn(shape, generator=generator) * 0.02
        if kind == "int8-row":
            layers.append(RowwiseInt8Linear(weight))
        else:
            block_kind, _, wide = kind.partition("-a")
            layers.append(block_quant.BlockQuantLinear(block_quant.BlockWeights.quantize(weight, block_kind),
                                                       activation_bits=int(wide or 8)))
    held = getattr(layers[0], "nbytes", 0) or shape[0] * shape[1]
    return layers, held


def time_round(layers: list[torch.nn.Module], x: torch.Tensor) -> float:
    """ms per call over one pass through every layer."""
    started = time.perf_counter()
    for layer in layers:
        layer(x)
    return (time.perf_counter() - started) * 1e3 / len(layers)


def parse_shapes(_context: click.Context, _parameter: click.Parameter, text: str) -> list[tuple[int, int]]:
    """``NxK,...`` as (N, K) pairs of whole numbers >= 1 (a typo was a ValueError traceback)."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        n_out, _, k = item.lower().partition("x")
        if not (n_out.isdigit() and k.isdigit() and int(n_out) > 0 and int(k) > 0):
            raise click.BadParameter(f"{item!r}: expected NxK, e.g. 4096x4096")
        shapes.append((int(n_out), int(k)))
    if not shapes:
        raise click.BadParameter("give at least one shape")
    return shapes


def parse_kinds(_context: click.Context, _parameter: click.Parameter, text: str) -> list[str]:
    """int8-row or TYPE[-a8|-a16]; an unknown one failed in the quantizer after the table's header."""
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    for kind in kinds:
        block, _, wide = kind.partition("-a")
        if kind != "int8-row" and (block not in block_quant.TYPES or wide not in ("", "8", "16")):
            raise click.BadParameter(f"{kind!r}: expected int8-row or one of {', '.join(block_quant.TYPES)}, "
                                     "each with -a16 or not")
    if not kinds:
        raise click.BadParameter("give at least one kind")
    return kinds


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--shapes", default="4096x4096,11008x4096", show_default=True, callback=parse_shapes,
              help="NxK list (outputs x inputs).")
@click.option("--rows", default="1,2,4,8,16", show_default=True, callback=comma_list(int, minimum=1),
              help="Rows per call.")
@click.option("--kinds", default=",".join(KINDS), show_default=True, callback=parse_kinds,
              help="int8-row, or a block type (q8_0, q4_0, q4_1) with -a16 for 16-bit activations.")
@click.option("--rounds", type=click.IntRange(1), default=7, show_default=True)
@click.option("--bytes-per-set", type=float, default=1.5, show_default=True, help="GB of weights cycled per kind.")
@click.option("--threads", type=click.IntRange(1), default=None)
@click.option("--amx-from", type=click.IntRange(1), default=None,
              help="Activation planes (rows x 1 or 2) from which calls take the AMX path (default: the kernel's).")
def main(shapes: list[tuple[int, int]], rows: list[int], kinds: list[str], rounds: int, bytes_per_set: float,
         threads: int | None, amx_from: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    if amx_from:
        block_quant.library().dovetail_block_amx_from(amx_from)
    wanted = kinds
    print(f"block kernel: {block_quant.kernel_name()}, {torch.get_num_threads()} threads\n")
    print(markdown_header(["shape", "rows", *(f"{kind} ms" for kind in wanted), *(f"{kind} GB/s" for kind in wanted)]))
    for n_out, k in shapes:
        text = f"{n_out}x{k}"
        count = max(2, int(bytes_per_set * 1e9 / (n_out * k)))
        sets = {kind: layers_for(kind, (n_out, k), count) for kind in wanted}
        for row_count in rows:
            x = torch.randn(row_count, k)
            for layers, _ in sets.values():
                time_round(layers, x)  # warm-up
            times: dict[str, list[float]] = {kind: [] for kind in wanted}
            for _ in range(rounds):
                for kind, (layers, _) in sets.items():
                    times[kind].append(time_round(layers, x))
            medians = {kind: statistics.median(values) for kind, values in times.items()}
            rates = {kind: sets[kind][1] / (medians[kind] * 1e-3) / 1e9 for kind in wanted}
            print(markdown_row([text, row_count, *(f"{medians[kind]:.3f}" for kind in wanted),
                                *(f"{rates[kind]:.1f}" for kind in wanted)]), flush=True)


if __name__ == "__main__":
    main()
