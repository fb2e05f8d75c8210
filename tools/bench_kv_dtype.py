"""Decode speed of a CPU target with an fp32 vs a bf16 KV cache, at several context lengths.

    python -m tools.bench_kv_dtype --target DIR [--dtype int8] [--contexts 256,2000] [--steps 24] [--rounds 3]

For each context length the engine is prefilled to that length once per KV dtype, then runs
``--steps`` one-token decodes; the rounds alternate between the dtypes (a shared machine's noise
hits both) and the table keeps each one's best round (median ms per step within the round).
A bf16 cache reads half the bytes per step; attention then runs in bf16 (queries rounded),
which costs or pays depending on the CPU's bf16 support: this prints which.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from cpu_worker.engine import TargetEngine
from cpu_worker.loading import load_target_model
from cpu_worker.precision import activation_dtype


def decode_ms(engine: TargetEngine, context: int, steps: int, seed: int = 0) -> float:
    """Median ms of ``steps`` decodes continuing a ``context``-token random prompt."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.spec.vocab_size, (context,), generator=generator).tolist()
    step = engine.prefill(prompt)
    times = []
    for _ in range(steps):
        token = int(step.logits.argmax())
        started = time.perf_counter()
        step = engine.decode(token)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--dtype", default="int8", help="target precision (fp32, int8, bf16)")
    parser.add_argument("--contexts", default="256,2000")
    parser.add_argument("--kv", default="fp32,bf16", help="KV dtypes to compare")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    kv_dtypes = {name: {"fp32": torch.float32, "bf16": torch.bfloat16}[name] for name in args.kv.split(",")}
    model = load_target_model(args.target, args.dtype)
    max_len = max(contexts) + args.steps + 1
    engines = {name: TargetEngine(model, max_len=max_len, activation_dtype=activation_dtype(args.dtype),
                                  kv_dtype=dtype) for name, dtype in kv_dtypes.items()}
    best: dict[tuple[int, str], float] = {}
    for context in contexts:
        for _ in range(args.rounds):
            for name, engine in engines.items():
                ms = decode_ms(engine, context, args.steps)
                best[context, name] = min(best.get((context, name), float("inf")), ms)
    print(f"command: python -m tools.bench_kv_dtype {' '.join(sys.argv[1:])}"
          f"  (torch threads {torch.get_num_threads()})")
    print("| context | KV dtype | KV bytes read per step MB | decode ms/step (best round, median) | tok/s |")
    print("|---|---|---|---|---|")
    spec = model.spec
    for context in contexts:
        for name, engine in engines.items():
            per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * engine.cache.keys.element_size()
            ms = best[context, name]
            print(f"| {context} | {name} | {per_token * context / 1e6:.1f} | {ms:.2f} | {1e3 / ms:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
