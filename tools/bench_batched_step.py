"""What several sequences' decode steps cost in one target forward (``cpu_worker.batched``), against
the same steps one sequence at a time, measured side by side in one process.

    python -m tools.bench_batched_step --target PATH [--precision auto] [--sequences 1,2,4,8] [--threads 2]

Each sequence holds a 64-token prompt; a step decodes one token for every sequence. Prints the
median ms of a batched step, of the solo steps it replaces, and the aggregate speed-up.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click
import torch

from cpu_worker.batched import SequenceStep, run_steps
from cpu_worker.engine import TargetEngine
from cpu_worker.server import build_engine
from dovetail_runtime.coordinator import target_precision
from ipc.dtypes import TARGET_PRECISIONS
from tools.options import comma_list, load_errors_in_one_line
from tools.tables import markdown_header, markdown_row


def one_step_ms(engines: list[TargetEngine], token: int, together: bool) -> float:
    """ms to decode one token for every engine: in one forward, or one engine at a time."""
    started = time.perf_counter()
    if together:
        run_steps([SequenceStep(engine, [token]) for engine in engines])
    else:
        for engine in engines:
            engine.decode(token)
    return (time.perf_counter() - started) * 1e3


@click.command()
@click.option("--target", required=True, help="a model folder or GGUF file")
@click.option("--precision", type=click.Choice(["auto", *TARGET_PRECISIONS]), default="auto", show_default=True,
              help="as dovetail-run's --target-dtype")
@click.option("--sequences", default="1,2,4,8", show_default=True, callback=comma_list(int, minimum=1),
              help="comma list of sequence counts")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch threads (default: torch's)")
@click.option("--repeats", type=click.IntRange(min=3), default=10, show_default=True)
@load_errors_in_one_line
def main(target: str, precision: str, sequences: list[int], threads: int | None, repeats: int) -> None:
    if threads:
        torch.set_num_threads(threads)
    chosen = target_precision(Path(target)) if precision == "auto" else precision
    engine, kernel = build_engine(target, chosen, 1024)
    counts = sequences
    engines = [engine.sibling() for _ in range(max(counts))]
    for sibling in engines:
        sibling.prefill(list(range(100, 164)))
    print(f"{target}: {chosen} ({kernel}), {torch.get_num_threads()} threads")
    print(markdown_header(["sequences", "one forward, ms", "one at a time, ms", "aggregate speed-up"]))
    for count in counts:
        chosen_engines = engines[:count]
        times: dict[bool, list[float]] = {True: [], False: []}
        for repeat in range(repeats):  # the two ways alternate, so machine noise hits both alike
            for together in (True, False):
                times[together].append(one_step_ms(chosen_engines, 200 + repeat, together))
        batched, alone = statistics.median(times[True]), statistics.median(times[False])
        print(markdown_row([count, f"{batched:.2f}", f"{alone:.2f}", f"{alone / batched:.2f}x"]), flush=True)


if __name__ == "__main__":
    main()
