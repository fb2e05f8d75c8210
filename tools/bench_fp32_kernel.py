"""fp32 target: F.linear against the exact fp32 kernels, a prompt, one decode step and tree verification.

    python -m tools.bench_fp32_kernel --target DIR [--trees 2,4,8,16] [--steps 16] [--rounds 3]

Loads the target once per kernel at fp32 (so it needs that many times its fp32 size in RAM:
use a stand-in with few layers, ``inflate.py ... --layers 6``; per-layer costs are what is
compared): ``F.linear``; our row kernel (``cpu_worker.kernels.fp32_rows``, the worker's choice where a
C compiler is found); and MKL's packed sgemm (``cpu_worker.kernels.fp32_packed``) where this torch has
it and its rows pass the load-time check (not on AMD CPUs). Rounds alternate between them (a
shared machine's noise hits all): per round, the ms of a 256-token prefill, the median ms of
``--steps`` decodes after it, and t_verify(T) for each tree size
(``verify_cost.measure_verify_ms``). Prints each kernel's best round, each against F.linear,
and the worst |tree - decode| logit of each (the exact kernels' should be 0).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from cpu_worker.engine import TargetEngine
from cpu_worker.kernels.fp32_packed import pack_fp32_linears
from cpu_worker.kernels.fp32_rows import use_fp32_row_kernel
from cpu_worker.target_loading import load_target_model
from cpu_worker.verify_cost import measure_verify_ms
from tools.bench_kv_dtype import decode_ms
from tools.options import int_list, load_errors_in_one_line, positive_int
from tools.tables import markdown_header, markdown_row

MAX_LEN = 512  # each engine's context
PROMPT = 256  # the prefill's tokens, and the decodes' prefix


def prefill_ms(engine: TargetEngine, context: int, seed: int = 0) -> float:
    """ms of one prefill of a ``context``-token random prompt."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.spec.vocab_size, (context,), generator=generator).tolist()
    started = time.perf_counter()
    engine.prefill(prompt)
    return (time.perf_counter() - started) * 1e3


def tree_vs_decode_gap(engine: TargetEngine, prefix: list[int], size: int = 8) -> float:
    """Worst |logit| gap between a chain verified as a tree and the same tokens decoded one by one."""
    tokens = [(7 * index + 3) % engine.spec.vocab_size for index in range(size)]
    engine.prefill(prefix)
    tree = engine.tree_logits(tokens, [-1] + list(range(size - 1)))[1]
    engine.prefill(prefix)
    worst = 0.0
    for index, token in enumerate(tokens):
        worst = max(worst, float((engine.decode(token).logits - tree[index]).abs().max()))
    engine.reset()
    return worst


def largest_tree_over_decode(row: list[float], sizes: list[int]) -> float:
    """The "verify T=max / decode" column of a row [prefill, decode, verify per size in ``sizes``' order]:
    the largest T's verify, wherever --trees lists it (the last column was the last size given)."""
    return row[2 + sizes.index(max(sizes))] / row[1]


@load_errors_in_one_line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--trees", type=int_list, default=[2, 4, 8, 16], help="tree sizes T to verify")
    parser.add_argument("--steps", type=positive_int, default=16,
                        help=f"decodes per round (after a {PROMPT}-token prompt; at most {MAX_LEN - PROMPT})")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    # The engines' context holds the prompt and the decodes, or the prompt-less prefix and a tree.
    if args.steps > MAX_LEN - PROMPT or max(args.trees) >= MAX_LEN:
        parser.error(f"--steps at most {MAX_LEN - PROMPT} and --trees below {MAX_LEN} (a {MAX_LEN}-token context)")
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = args.trees
    engines = {"F.linear": TargetEngine(load_target_model(args.target), max_len=MAX_LEN)}
    for name, convert in (("dovetail-fp32", use_fp32_row_kernel), ("mkl-packed", pack_fp32_linears)):
        model = load_target_model(args.target)
        if convert(model):
            engines[name] = TargetEngine(model, max_len=MAX_LEN)
        else:
            print(f"{name}: not available here (see the log)", file=sys.stderr)
        del model
    if len(engines) == 1:
        print("neither our row kernel nor MKL packing is available here (see the log): nothing to compare")
        return 1
    best: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        for name, engine in engines.items():
            row = [prefill_ms(engine, PROMPT, seed=round_index),
                   decode_ms(engine, PROMPT, args.steps, seed=round_index)]
            row += measure_verify_ms(engine, sizes)
            best[name] = row if name not in best else [min(a, b) for a, b in zip(best[name], row)]
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    prefix = list(range(1, 65))
    header = ["kernel", f"prefill {PROMPT} ms", "decode ms"] + [f"verify T={size} ms" for size in sizes]
    header += ["verify T=max / decode", "worst |tree - decode| logit"]
    print(markdown_header(header))
    for name, engine in engines.items():
        row = best[name]
        print(markdown_row([name, *(f"{value:.1f}" for value in row), f"{largest_tree_over_decode(row, sizes):.2f}",
                            f"{tree_vs_decode_gap(engine, prefix):.2e}"]))
    for name in list(engines)[1:]:
        ratio = [p / d for p, d in zip(best[name], best["F.linear"])]
        print(markdown_row([f"{name} / F.linear", *(f"{value:.2f}" for value in ratio), "", ""]))
    print(f"threads {torch.get_num_threads()}, target {args.target}, best of {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
