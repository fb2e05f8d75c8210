"""fp32 target: F.linear against the worker's exact fp32 kernel, one decode step and tree verification.

    python -m tools.bench_fp32_kernel --target DIR [--trees 2,4,8,16] [--steps 16] [--rounds 3]

Loads the target twice at fp32 (so it needs twice its fp32 size in RAM: use a stand-in with
few layers, ``inflate.py ... --layers 6``; per-layer costs are what is compared). One copy
gets the worker's exact kernel: MKL's packed sgemm (``cpu_worker.fp32_packed``), or, where its
rows fail the check (AMD CPUs), our row kernel (``cpu_worker.fp32_rows``). Rounds alternate
between the two (a shared machine's noise hits both): per round, the median ms of ``--steps``
decodes after a 256-token prompt, and t_verify(T) for each tree size
(``verify_cost.measure_verify_ms``). Prints each kernel's best round, exact / F.linear, and
the worst |tree - decode| logit of each (the exact kernel's should be 0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from cpu_worker.engine import TargetEngine
from cpu_worker.fp32_packed import pack_fp32_linears
from cpu_worker.fp32_rows import use_fp32_row_kernel
from cpu_worker.loading import load_target_model
from cpu_worker.verify_cost import measure_verify_ms
from tools.bench_kv_dtype import decode_ms


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--trees", default="2,4,8,16", help="tree sizes T to verify")
    parser.add_argument("--steps", type=int, default=16, help="decodes per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(size) for size in args.trees.split(",")]
    engines = {"F.linear": TargetEngine(load_target_model(args.target), max_len=512)}
    exact_model = load_target_model(args.target)
    if pack_fp32_linears(exact_model):
        exact = "mkl packed"
    elif use_fp32_row_kernel(exact_model):
        exact = "dovetail-fp32"
    else:
        print("neither MKL packing nor our row kernel is available here (see the log): nothing to compare")
        return 1
    engines[exact] = TargetEngine(exact_model, max_len=512)
    best: dict[str, list[float]] = {}
    for round_index in range(args.rounds):
        for name, engine in engines.items():
            row = [decode_ms(engine, 256, args.steps, seed=round_index)] + measure_verify_ms(engine, sizes)
            best[name] = row if name not in best else [min(a, b) for a, b in zip(best[name], row)]
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    prefix = list(range(1, 65))
    header = ["kernel", "decode ms"] + [f"verify T={size} ms" for size in sizes] + ["verify T=max / decode",
                                                                                   "worst |tree - decode| logit"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, engine in engines.items():
        row = best[name]
        print(f"| {name} | " + " | ".join(f"{value:.1f}" for value in row)
              + f" | {row[-1] / row[0]:.2f} | {tree_vs_decode_gap(engine, prefix):.2e} |")
    ratio = [p / d for p, d in zip(best[exact], best["F.linear"])]
    print(f"| {exact} / F.linear | " + " | ".join(f"{value:.2f}" for value in ratio) + " | | |")
    print(f"threads {torch.get_num_threads()}, target {args.target}, best of {args.rounds} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
