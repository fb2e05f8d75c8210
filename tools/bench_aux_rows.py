"""What EAGLE-3's three-layer rows cost the target: a tree verification and a prefill with
last-layer rows (every other head) and with aux rows (an EAGLE-3 head), the same weights,
the two engines alternating call by call so machine noise hits both alike; and the ring round
trip of a cycle's rows at both widths. ``--layers ''`` times the last-layer engine alone (runs
on code without aux rows too, for a before/after of the existing heads' path).

    python -m tools.bench_aux_rows [--target demo/target-code-9m] [--layers 1,3,4] [--repeats 200]
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import click
import torch

from cpu_worker.engine import TargetEngine
from cpu_worker.target_loading import load_target_model
from ipc.shm_ring import ShmRing, get_block, slot_bytes_for
from tools.options import comma_list, load_errors_in_one_line


def alternate(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """ms per call of each run, the runs taking turns (and turns in both orders)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for index in range(repeats):
        for name in names if index % 2 else reversed(names):
            started = time.perf_counter()
            runs[name]()
            times[name].append((time.perf_counter() - started) * 1e3)
    return times


def round_trip(ring: ShmRing, block: torch.Tensor) -> torch.Tensor:
    return get_block(ring.write(block), {ring.name: ring})


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    return f"min {ordered[0]:.2f} / p25 {ordered[len(ordered) // 4]:.2f} / median {statistics.median(ordered):.2f} ms"


MAX_LEN = 2048  # each engine's context


def parse_layers(context: click.Context, parameter: click.Parameter, text: str) -> list[int]:
    """Whole numbers >= 0, or none ('')."""
    return comma_list(int, minimum=0)(context, parameter, text) if text.strip(", ") else []


@click.command()
@click.option("--target", default="demo/target-code-9m", show_default=True)
@click.option("--layers", default="1,3,4", show_default=True, callback=parse_layers,
              help="the aux layers ('' = last-layer engine only)")
# A tree of 1 sends no rows through the ring (a ring of 0 bytes); prompt and tree share the 2048-token context.
@click.option("--tree-tokens", type=click.IntRange(2, MAX_LEN // 2), default=16, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(1, MAX_LEN // 2), default=256, show_default=True)
@click.option("--repeats", type=click.IntRange(1), default=200, show_default=True)
@load_errors_in_one_line
def main(target: str, layers: list[int], tree_tokens: int, prompt_tokens: int, repeats: int) -> None:
    torch.manual_seed(0)
    model = load_target_model(target)
    aux_layers = layers
    engines = {"last-layer": TargetEngine(model, max_len=MAX_LEN)}
    if aux_layers:
        try:
            engines["aux"] = TargetEngine(model, max_len=MAX_LEN, aux_layers=aux_layers)
        except ValueError as error:  # layers this target lacks: the engine says which it has
            raise click.BadParameter(str(error), param_hint="'--layers'") from None
    vocab = model.spec.vocab_size
    prompt = torch.randint(vocab, (prompt_tokens,)).tolist()
    tokens = torch.randint(vocab, (tree_tokens,)).tolist()
    parents = [-1] + [(i - 1) // 2 for i in range(1, tree_tokens)]
    prefill_calls = max(10, repeats // 10)  # a prefill costs many verifies: fewer of them
    print(f"target {target}, aux layers {aux_layers or 'none'}, {torch.get_num_threads()} threads, "
          f"{repeats} verify calls and {prefill_calls} prefills each")
    with torch.inference_mode():
        prefills = alternate({name: functools.partial(engine.prefill, prompt) for name, engine in engines.items()},
                             prefill_calls)
        # tree_logits is verify's forward; the prefix stays as it is between calls.
        verifies = alternate({name: functools.partial(engine.tree_logits, tokens, parents)
                              for name, engine in engines.items()}, repeats)
    for name in engines:
        print(f"{name:>10}: verify T={tree_tokens}: {summary(verifies[name])}")
        print(f"{'':>10}  prefill {prompt_tokens}: {summary(prefills[name])}")
    hidden = model.spec.hidden_size
    rows = tree_tokens // 2
    for width in (hidden, 3 * hidden):
        ring = ShmRing.create(slot_bytes_for(rows, width, "float32"), 4)
        try:
            block = torch.randn(rows, width)
            trip = alternate({"ring": functools.partial(round_trip, ring, block)}, 500)["ring"]
            print(f"ring write + read of [{rows}, {width}] fp32: median {statistics.median(trip) * 1e3:.0f} us")
        finally:
            ring.close()


if __name__ == "__main__":
    main()
