"""The int8 target's costs, measured side by side (numbers for cpu_worker/kernels/int8.py's choices).

    python -m tools.bench_int8 [--threads 2] [--target demo/target-code-9m] [--tree-target DIR]

1. One linear layer (--dim x --dim, default 4096): ms per call at 1 / 8 / 16 rows for the
   per-row W8A8 layer, torch's per-tensor dynamic int8 (the batch-dependent one it replaced)
   and fp32.
2. --target's decode, fp32 against int8, ms per token.
3. With --tree-target (e.g. a llama2-7b stand-in from tools/bench_real's cache): one tree
   verification at int8 with exact (row-by-row) attention against the batched masked call,
   ms per T, after a 256-token prefill.
Each pair is timed interleaved, median of --repeats.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import click
import torch
from torch import nn

from cpu_worker.engine import TargetEngine
from cpu_worker.kernels.int8 import RowwiseInt8Linear
from cpu_worker.precision import activation_dtype
from cpu_worker.target_loading import load_target_model
from tools.options import load_errors_in_one_line
from tools.tables import markdown_header, markdown_row

DEMO_TARGET = Path(__file__).resolve().parents[1] / "demo" / "target-code-9m"


def interleaved_ms(candidates: dict[str, Callable[[], object]], repeats: int, calls: int = 1) -> dict[str, float]:
    """Median ms per call of each candidate, the candidates taking turns (noise hits all alike)."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for run in candidates.values():
        run()  # warm-up
    for _ in range(repeats):
        for name, run in candidates.items():
            started = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - started) / calls * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def per_tensor_int8(layer: nn.Linear) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_dynamic(nn.Sequential(layer), {nn.Linear}, dtype=torch.qint8)


@torch.inference_mode()
def linear_table(dim: int, repeats: int) -> None:
    reference = nn.Linear(dim, dim, bias=False)
    layers = {"W8A8 per-row": RowwiseInt8Linear(reference.weight), "int8 per-tensor": per_tensor_int8(reference),
              "fp32": reference}
    print(f"\nms per {dim}x{dim} call\n" + markdown_header(["rows", *layers]))
    for rows in (1, 8, 16):
        x = torch.randn(rows, dim)
        timings = interleaved_ms({name: functools.partial(layer, x) for name, layer in layers.items()},
                                 repeats, calls=20)
        print(markdown_row([rows, *(f"{timings[name]:.3f}" for name in layers)]))


def decode_table(target: Path, repeats: int, tokens: int = 64) -> None:
    engines = {precision: TargetEngine(load_target_model(target, precision), max_len=512,
                                       activation_dtype=activation_dtype(precision))
               for precision in ("fp32", "int8-row")}
    prompt = list(range(3, 259))

    def decode(engine: TargetEngine) -> None:
        engine.prefill(prompt)
        token = 5
        for _ in range(tokens):
            token = int(engine.decode(token).logits.argmax())

    # The prompt's prefill, timed alone beside them, is taken out: a decode step is what this table is about.
    timings = interleaved_ms({**{name: functools.partial(decode, engine) for name, engine in engines.items()},
                              **{f"{name} prefill": functools.partial(engine.prefill, prompt)
                                 for name, engine in engines.items()}}, repeats)
    print(f"\n{target.name} decode, ms per token (after a 256-token prompt, {tokens} tokens): "
          + ", ".join(f"{name} {(timings[name] - timings[f'{name} prefill']) / tokens:.2f}" for name in engines))


@torch.inference_mode()
def tree_table(target: Path, repeats: int) -> None:
    model = load_target_model(target, "int8-row")
    prompt = [(index * 37) % 8000 + 3 for index in range(256)]
    engines = {"exact": TargetEngine(model, max_len=400, exact_tree=True),
               "batched": TargetEngine(model, max_len=400, exact_tree=False)}
    print(f"\n{target.name} int8 tree verification, ms (prefix 256, balanced binary trees)\n"
          + markdown_header(["T", "exact (row by row)", "batched masked"]))
    for size in (4, 8, 16):
        parents = [-1] + [(index - 1) // 2 for index in range(1, size)]
        tokens = prompt[:size]
        for engine in engines.values():
            engine.prefill(prompt)  # tree_logits leaves its KV in scratch slots: the prefix stays
        timings = interleaved_ms({name: functools.partial(engine.tree_logits, tokens, parents)
                                  for name, engine in engines.items()}, repeats)
        print(markdown_row([size, f"{timings['exact']:.0f}", f"{timings['batched']:.0f}"]))


@click.command()
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="torch intra-op threads.")
@click.option("--dim", type=click.IntRange(min=16), default=4096, show_default=True, help="Linear layer size.")
@click.option("--target", type=click.Path(exists=True, file_okay=False, path_type=Path), default=DEMO_TARGET,
              show_default=True, help="Target for the decode comparison.")
@click.option("--tree-target", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Target for exact vs batched tree verification at int8 (skipped when not given).")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
@load_errors_in_one_line
def main(threads: int, dim: int, target: Path, tree_target: Path | None, repeats: int) -> None:
    torch.set_num_threads(threads)
    linear_table(dim, repeats)
    decode_table(target, repeats)
    if tree_target is not None:
        tree_table(tree_target, max(repeats // 2, 1))


if __name__ == "__main__":
    main()
