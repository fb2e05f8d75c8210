"""Which format a draft head's projections take on the CPU: fp32, int8 or q4_0 (``head_formats``).

A big head is memory-bound (int8 reads a quarter of fp32's bytes, q4_0 an eighth), a tiny one
overhead-bound, so the choice is measured: a decoder layer's projections on a tree level's worth
of rows, in each format, one random matrix at a time (before the head loads, so the measurement
never holds a whole fp32 layer). The verdict depends on the layer's shape and the machine only;
it is cached with the draft costs (``draft_format.json``), so every start on a machine picks the
same format (one measured under load once would otherwise flip it, and with it the cost cache's key).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from cpu_worker.model import LlamaSpec, block_kernels_available
from ipc.cost_cache import CostCache, cpu_model, sources_digest

from .head_formats import projection_maker

log = logging.getLogger(__name__)

FORMATS = ("fp32", "int8", "q4_0")  # cached as slots 1, 2, 3 of the entry
BLOCK = 32  # q4_0's block: every input width must be a multiple of it
# q4_0 ranks a tree's candidates a little less as the float head would (held-out chat tau of the real
# pair's head, 16/6/8: fp32 3.114, int8 3.105, q4_0 3.064), so it wins only where it is clearly
# faster than the others (the 7B-wide demo head: ~0.6x int8's time a level).
Q4_0_EDGE = 0.85


class DraftFormatCache(CostCache):
    """{cache key: {slot: ms per layer}}, slot i + 1 for FORMATS[i]."""

    FILE = "draft_format.json"


def layer_shapes(spec: LlamaSpec, attention_input: int | None = None) -> list[tuple[int, int]]:
    """(out, in) of a decoder layer's projections; ``attention_input``: the width q/k/v read (an
    EAGLE-3 layer's is 2H; default H)."""
    d, q_out, kv_out = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    a = attention_input or d
    return [(q_out, a), (kv_out, a), (kv_out, a), (d, q_out),
            (spec.intermediate_size, d), (spec.intermediate_size, d), (d, spec.intermediate_size)]


def candidate_formats(shapes: list[tuple[int, int]], formats: tuple[str, ...] = FORMATS) -> tuple[str, ...]:
    """``formats`` this layer can take: q4_0 needs every input width a multiple of 32, and the native
    library (its block kernel has no torch path: without a C compiler, timing it failed the draft's start)."""
    blocks_fit = all(in_features % BLOCK == 0 for _, in_features in shapes)
    blocks_fit = blocks_fit and "q4_0" in formats and block_kernels_available()
    return tuple(name for name in formats if name != "q4_0" or blocks_fit)


@torch.inference_mode()
def time_layer_formats(shapes: list[tuple[int, int]], formats: tuple[str, ...], rows: int = 8,
                       repeats: int = 5) -> dict[str, float]:
    """Milliseconds a layer's projections take per call in each format."""
    totals = dict.fromkeys(formats, 0.0)
    for out_features, in_features in shapes:
        weight = torch.empty(out_features, in_features).uniform_(-1.0, 1.0)
        x = torch.randn(rows, in_features)
        runs = {name: partial(F.linear, x, weight) if name == "fp32"
                else partial(projection_maker(name)(weight, None, "layer"), x) for name in formats}
        for name, run in runs.items():
            run()  # warm-up: first calls pay one-off setup
            started = time.perf_counter()
            for _ in range(repeats):
                run()
            totals[name] += (time.perf_counter() - started) / repeats * 1e3
        del weight, runs
    return totals


def format_key(shapes: list[tuple[int, int]], formats: tuple[str, ...]) -> str:
    """What the timing depends on: the shapes, the machine, its placement, torch and this code."""
    parts = [repr(shapes), ",".join(formats), cpu_model(), str(torch.get_num_threads()),
             ",".join(map(str, sorted(os.sched_getaffinity(0)))), torch.__version__,
             sources_digest(Path(__file__).parent, ("cpu_format.py", "head_formats.py"))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def fastest_cpu_format(spec: LlamaSpec, attention_input: int | None = None,
                       formats: tuple[str, ...] = FORMATS, cache: CostCache | None = None) -> str | None:
    """The fastest of ``formats`` for this head's layers on this machine: None for fp32, else the
    projection format (``head_formats``). Read from the cache, else measured and cached."""
    shapes = layer_shapes(spec, attention_input)
    formats = candidate_formats(shapes, formats)
    cache = cache or DraftFormatCache()
    key = format_key(shapes, formats)
    slots = list(range(1, len(formats) + 1))
    cached = cache.get(key, slots)
    if cached is None:
        times = time_layer_formats(shapes, formats)
        cache.put(key, slots, [times[name] for name in formats])
    else:
        times = dict(zip(formats, cached))
    best = min(formats, key=lambda name: times[name] / Q4_0_EDGE if name == "q4_0" else times[name])
    log.info("draft layer projections on the CPU (%s): %s ms per layer; %s", "cached" if cached else "measured",
             ", ".join(f"{name} {ms:.2f}" for name, ms in times.items()), best)
    return None if best == "fp32" else best
