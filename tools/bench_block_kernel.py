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


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--shapes", default="4096x4096,11008x4096", show_default=True, help="NxK list (outputs x inputs).")
@click.option("--rows", default="1,2,4,8,16", show_default=True, help="Rows per call.")
@click.option("--kinds", default=",".join(KINDS), show_default=True)
@click.option("--rounds", type=click.IntRange(1), default=7, show_default=True)
@click.option("--bytes-per-set", type=float, default=1.5, show_default=True, help="GB of weights cycled per kind.")
@click.option("--threads", type=click.IntRange(1), default=None)
@click.option("--amx-from", type=click.IntRange(1), default=None,
              help="Activation planes (rows x 1 or 2) from which calls take the AMX path (default: the kernel's).")
def main(shapes: str, rows: str, kinds: str, rounds: int, bytes_per_set: float, threads: int | None,
         amx_from: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    if amx_from:
        block_quant.library().dovetail_block_amx_from(amx_from)
    wanted = kinds.split(",")
    print(f"block kernel: {block_quant.kernel_name()}, {torch.get_num_threads()} threads\n")
    print(markdown_header(["shape", "rows", *(f"{kind} ms" for kind in wanted), *(f"{kind} GB/s" for kind in wanted)]))
    for text in shapes.split(","):
        n_out, k = map(int, text.split("x"))
        count = max(2, int(bytes_per_set * 1e9 / (n_out * k)))
        sets = {kind: layers_for(kind, (n_out, k), count) for kind in wanted}
        for row_count in map(int, rows.split(",")):
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
