"""t_verify(T): what one tree verification of T nodes costs this target on these cores.

The tree planner (dovetail_runtime.tree_planner) needs it for T from 1 to 64. Measuring a
7B target takes tens of seconds, so results are cached on disk per model (path, size and
modification time of its files), precision, threads, cores, CPU, torch version and the
engine's own code (a faster kernel or a fused layer changes every T's cost).

The cached curve is not trusted forever: one measured on a busy machine (t_verify(1) 1471 ms
instead of 315 at a 7B stand-in) would mis-size every later tree. ``OnlineCurve`` follows the
verifications a worker actually runs, a decaying average per tree size seeded with the cached
value, and writes it back; sizes no cycle used move by the observed sizes' typical ratio. A
wrong curve thus corrects itself within a few cycles and stays corrected for the next start.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from cpu_worker.engine import TargetEngine

CACHE_FILE = "verify_cost.json"
# A prefix like a short prompt's: attention is a small part of a verification at real sizes.
PREFIX_TOKENS = 128


def cache_dir() -> Path:
    """DOVETAIL_CACHE_DIR, else $XDG_CACHE_HOME/dovetail, else ~/.cache/dovetail."""
    explicit = os.environ.get("DOVETAIL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dovetail"


# The engine's sources whose changes change what a verification costs.
ENGINE_SOURCES = ("engine.py", "model/llama.py", "kernels/int8.py", "kernels/int8_kernel.py", "native/int8_gemv.c",
                  "native/fp32_rows.c", "native/attention.c", "kernels/exact_attention.py", "native/layer_ops.c",
                  "kernels/layer_ops.py", "model/fusion.py", "kernels/fp32_packed.py", "kernels/fp32_rows.py",
                  "precision.py", "native/decoder_layers.c", "native_layers.py", "native/dovetail.h", "native/abi.c",
                  "native/library.py", "native/block_gemv.c", "kernels/attention.py", "kernels/linear.py",
                  "target_loading.py")


def _engine_code_digest() -> str:
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in ENGINE_SOURCES)).hexdigest()[:16]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(model_dir: str | Path, precision: str, threads: int, cores: Sequence[int]) -> str:
    """Everything a measurement depends on, hashed: change any of it and it is measured again."""
    folder = Path(model_dir).resolve()
    paths = [folder] if folder.is_file() else [path for path in folder.iterdir() if path.is_file()]  # a GGUF file
    files = sorted((path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in paths)
    parts = [str(folder), repr(files), precision, str(threads), ",".join(map(str, cores)), _cpu_model(),
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


class VerifyCostCache:
    """{cache key: {T: ms}} in one JSON file; written atomically, unreadable files ignored."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir() / CACHE_FILE

    def _load(self) -> dict[str, dict[str, float]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str, tree_sizes: Sequence[int]) -> list[float] | None:
        entry = self._load().get(key)
        if not isinstance(entry, dict) or not all(str(size) in entry for size in tree_sizes):
            return None
        values = [entry[str(size)] for size in tree_sizes]
        return [float(v) for v in values] if all(isinstance(v, int | float) and v > 0 for v in values) else None

    def entry(self, key: str) -> dict[int, float]:
        """Every size's cached ms for ``key`` (empty when none or unreadable)."""
        entry = self._load().get(key)
        if not isinstance(entry, dict):
            return {}
        return {int(size): float(value) for size, value in entry.items()
                if size.isdigit() and isinstance(value, int | float) and value > 0}

    def put(self, key: str, tree_sizes: Sequence[int], ms: Sequence[float]) -> None:
        data = self._load()
        entry = data.get(key)
        if not isinstance(entry, dict):
            entry = {}
        entry.update({str(size): round(value, 3) for size, value in zip(tree_sizes, ms)})
        data[key] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(data, indent=1, sort_keys=True))
            scratch.replace(self.path)
        except OSError:
            pass  # a read-only home: measure again next time


class OnlineCurve:
    """t_verify(T) as the verifications of this target measure it, written back to the cache.

    Each observed size's estimate is the median of its last ``window`` cycles, the cached value
    standing in twice until cycles displace it: a curve measured under load comes down after
    three cycles, while one cycle that shared the CPU with something else moves it not at all.
    On ``save`` the observed sizes are written, and every other cached size is scaled by the
    geometric mean of estimate / cached over the observed sizes: a machine that got slower or
    faster did so for every T."""

    def __init__(self, cache: VerifyCostCache, key: str, window: int = 5, save_every: int = 256):
        self.cache = cache
        self.key = key
        self.window = window
        self.save_every = save_every
        self.start = cache.entry(key)  # the curve as cached when this worker started (or last saved)
        self.recent: dict[int, list[float]] = {}
        self.pending = 0

    def observe(self, size: int, ms: float) -> None:
        if size not in self.recent:
            self.recent[size] = [self.start[size]] * 2 if size in self.start else []
        values = self.recent[size]
        values.append(ms)
        del values[:-self.window]
        self.pending += 1
        if self.pending >= self.save_every:
            self.save()

    def estimate(self, size: int) -> float:
        return statistics.median(self.recent[size])

    def curve(self) -> dict[int, float]:
        """The corrected curve: observed sizes' estimates, the rest of the cached ones rescaled."""
        estimates = {size: self.estimate(size) for size in self.recent}
        ratios = [math.log(estimates[size] / self.start[size]) for size in estimates if size in self.start]
        scale = math.exp(sum(ratios) / len(ratios)) if ratios else 1.0
        corrected = {size: ms * scale for size, ms in self.start.items()}
        corrected.update(estimates)
        return corrected

    def save(self) -> None:
        if self.pending == 0:
            return
        curve = self.curve()
        sizes = sorted(curve)
        self.cache.put(self.key, sizes, [curve[size] for size in sizes])
        self.start = dict(curve)
        self.pending = 0
