"""t_verify(T): what one tree verification of T nodes costs this target on these cores.

The tree planner (dovetail_runtime.tree_planner) needs it for T from 1 to 64. Measuring a
7B target takes tens of seconds, so results are cached on disk per model (path, size and
modification time of its files), precision, threads, cores, CPU, torch version and the
engine's own code (a faster kernel or a fused layer changes every T's cost).

The cached curve is not trusted forever: one measured on a busy machine (t_verify(1) 1471 ms
instead of 315 at a 7B stand-in) would mis-size every later tree. ``OnlineCurve`` follows the
verifications a worker actually runs, per tree size the lower quartile of its last five minutes'
one-second medians, the seconds without one counting at the cached value, and writes it back; sizes
no cycle used move by the observed sizes' typical ratio. A curve measured under load thus comes down
at the first quiet second and stays corrected for the next start, while a busy spell during a run
(a build, a test suite beside it) does not raise it unless it lasts most of the five minutes.
A measurement taken while other processes shared the cores (``ipc.core_load``) is also marked in
the cache, so that the next start measures again instead of trusting it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from cpu_worker.engine import TargetEngine
from ipc.cost_cache import CostCache, OnlineCurve, cache_dir, cpu_model, files_signature, sources_digest

__all__ = ["VerifyCostCache", "OnlineCurve", "cache_dir", "cache_key", "measure_verify_ms"]

CACHE_FILE = "verify_cost.json"
# A prefix like a short prompt's: attention is a small part of a verification at real sizes.
PREFIX_TOKENS = 128


# The engine's sources whose changes change what a verification costs.
ENGINE_SOURCES = ("engine.py", "model/llama.py", "kernels/int8.py", "kernels/int8_kernel.py", "native/int8_gemv.c",
                  "native/fp32_rows.c", "native/attention.c", "kernels/exact_attention.py", "native/layer_ops.c",
                  "kernels/layer_ops.py", "model/fusion.py", "kernels/fp32_packed.py", "kernels/fp32_rows.py",
                  "precision.py", "native/decoder_layers.c", "native_layers.py", "native/dovetail.h", "native/abi.c",
                  "native/library.py", "native/block_gemv.c", "kernels/attention.py", "kernels/linear.py",
                  "target_loading.py", "model/native_views.py")


def _engine_code_digest() -> str:
    return sources_digest(Path(__file__).parent, ENGINE_SOURCES)


def cache_key(model_dir: str | Path, precision: str, threads: int, cores: Sequence[int]) -> str:
    """Everything a measurement depends on, hashed: change any of it and it is measured again."""
    parts = [files_signature(model_dir), precision, str(threads), ",".join(map(str, cores)), cpu_model(),
             torch.__version__, str(PREFIX_TOKENS), _engine_code_digest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def measurement_tree(size: int) -> list[int]:
    """Parents of a T-node tree shaped like a drafted one: four interleaved chains below the
    root, so depth grows as T/4 (a chain of 64 would overstate attention's share)."""
    return [-1] + [max(0, index - 4) for index in range(1, size)]


@torch.inference_mode()
def measure_verify_ms(engine: TargetEngine, tree_sizes: Sequence[int], repeats: int = 2) -> list[float]:
    """Milliseconds of one tree forward per size (the best of ``repeats``), over a random
    prefix. Leaves the engine empty (any sequence it held is gone)."""
    largest = max(tree_sizes)
    prefix = max(1, min(PREFIX_TOKENS, engine.max_len - largest))
    if prefix + largest > engine.max_len:
        raise ValueError(f"a context of {engine.max_len} tokens cannot hold a {largest}-node tree to measure")
    generator = torch.Generator().manual_seed(0)
    vocab = engine.spec.vocab_size
    engine.prefill(torch.randint(vocab, (prefix,), generator=generator).tolist())
    tokens = torch.randint(vocab, (largest,), generator=generator).tolist()
    engine.tree_logits(tokens[:2], measurement_tree(2))  # warm-up: first calls pay for allocation
    results = []
    for size in tree_sizes:
        parents = measurement_tree(size)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            engine.tree_logits(tokens[:size], parents)
            best = min(best, (time.perf_counter() - started) * 1e3)
        results.append(best)
    engine.reset()
    return results


class VerifyCostCache(CostCache):
    """{cache key: {T: ms}} in verify_cost.json."""

    FILE = CACHE_FILE
