"""Decode speed of a CPU target with an fp32 vs a bf16 KV cache, at several context lengths.

    python -m tools.bench_kv_dtype --target DIR [--dtype int8] [--contexts 256,1024,2000] [--steps 40]

For each context length one engine per KV dtype is prefilled with the same random prompt, then
they decode ``--steps`` tokens step by step in turn (the order alternating each step), so a
shared machine's noise hits both alike; the table gives each one's median ms per step and the
median of the per-step ratios to the first dtype. A bf16 cache reads half the bytes per step.
With the native library (a C compiler) attention reads it on our exact kernel, widening each
row to fp32 (cheap on any x86 CPU); without it, torch's attention runs in bf16 (queries
rounded), which costs or pays depending on the CPU's bf16 support. This prints which it was.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from cpu_worker.engine import TargetEngine
from cpu_worker.kernels import exact_attention
from cpu_worker.precision import activation_dtype
from cpu_worker.target_loading import load_target_model
from ipc.dtypes import TARGET_PRECISIONS
from tools.options import int_list, load_errors_in_one_line, name_list, positive_int
from tools.tables import markdown_header, markdown_row


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


def interleaved_ms(engines: dict[str, TargetEngine], context: int, steps: int, seed: int = 0
                   ) -> dict[str, list[float]]:
    """ms of each of ``steps`` decodes per engine, continuing one ``context``-token random prompt,
    the engines taking turns every step (first one first on even steps, last one first on odd)."""
    generator = torch.Generator().manual_seed(seed)
    some = next(iter(engines.values()))
    prompt = torch.randint(0, some.spec.vocab_size, (context,), generator=generator).tolist()
    tokens = {}
    for name, engine in engines.items():
        engine.reset()
        tokens[name] = int(engine.prefill(prompt).logits.argmax())
    times: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(steps):
        order = list(engines) if step % 2 == 0 else list(reversed(engines))
        for name in order:
            started = time.perf_counter()
            result = engines[name].decode(tokens[name])
            times[name].append((time.perf_counter() - started) * 1e3)
            tokens[name] = int(result.logits.argmax())
    return times


KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


kv_list = name_list(list(KV_DTYPES))  # a typo was a KeyError after loading the model


@load_errors_in_one_line
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--dtype", default="int8", choices=TARGET_PRECISIONS, metavar="DTYPE",
                        help=f"target precision: {', '.join(TARGET_PRECISIONS)}")
    parser.add_argument("--contexts", type=int_list, default=[256, 1024, 2000])
    parser.add_argument("--kv", type=kv_list, default="fp32,bf16",
                        help=f"KV dtypes to compare (the first is the reference): {', '.join(KV_DTYPES)}")
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument("--threads", type=positive_int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = args.contexts
    kv_dtypes = {name: KV_DTYPES[name] for name in args.kv}
    model = load_target_model(args.target, args.dtype)
    max_len = max(contexts) + args.steps + 1
    engines = {name: TargetEngine(model, max_len=max_len, activation_dtype=activation_dtype(args.dtype),
                                  kv_dtype=dtype) for name, dtype in kv_dtypes.items()}
    reference = next(iter(engines))
    attention = "the exact kernel" if exact_attention.available() else "torch's (no library, or forced)"
    print(f"command: python -m tools.bench_kv_dtype {' '.join(sys.argv[1:])}"
          f"  (torch threads {torch.get_num_threads()}; attention on {attention})")
    print(markdown_header(["context", "KV dtype", "KV bytes read per step MB", "decode ms/step (median)", "tok/s",
                           f"{reference}/this, per-step median"]))
    spec = model.spec
    for context in contexts:
        times = interleaved_ms(engines, context, args.steps)
        for name, engine in engines.items():
            per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * engine.cache.keys.element_size()
            ms = statistics.median(times[name])
            ratio = statistics.median(ref / this for ref, this in zip(times[reference], times[name]))
            print(markdown_row([context, name, f"{per_token * context / 1e6:.1f}", f"{ms:.2f}", f"{1e3 / ms:.1f}",
                                f"{ratio:.3f}x"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
