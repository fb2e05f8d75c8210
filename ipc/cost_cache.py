"""What a worker's steps cost on this machine, cached on disk and kept current by use.

Both workers measure their step costs for the tree planner (``cpu_worker.verify_cost``:
t_verify(T); ``gpu_worker.draft_cost``: t_draft(depth)) and file them here under a key of
everything a measurement depends on, so that the next start reads them instead of measuring.
``OnlineCurve`` keeps a cached curve current from the steps a worker actually runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """DOVETAIL_CACHE_DIR, else $XDG_CACHE_HOME/dovetail, else ~/.cache/dovetail."""
    explicit = os.environ.get("DOVETAIL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dovetail"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sources_digest(folder: Path, names: Sequence[str]) -> str:
    """A short hash of the sources whose changes change what a step costs."""
    return hashlib.sha256(b"".join((folder / name).read_bytes() for name in names)).hexdigest()[:16]


def files_signature(model_dir: str | Path) -> str:
    """A model folder (or a single GGUF file) by its resolved path and its files' names, sizes
    and modification times: a changed or replaced model is measured again."""
    folder = Path(model_dir).resolve()
    paths = [folder] if folder.is_file() else [path for path in folder.iterdir() if path.is_file()]
    files = sorted((path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in paths)
    return f"{folder}\n{files!r}"


# Per size of an entry, the count of its measurements in a row taken while other processes took
# more than LOADED_SHARE of the cores (``ipc.core_load``), under the entry's LOADED key: such a
# timing serves its run and the next start that needs it measures again, until the TRUST_LOADED-th
# such measurement (a machine always this busy costs what it costs: measuring it at every start
# would only add minutes to each). Per size, since one entry holds every size any start asked for
# (a tree planner's T = 1, 2, 3, 4, 6, ..., lookup's 1 .. 5): a quiet measurement of some clears
# only theirs.
LOADED = "measured_under_load"
LOADED_SHARE = 0.2
TRUST_LOADED = 3


class CostCache:
    """{cache key: {size: ms}} in one JSON file (``FILE`` in the cache folder unless a path is
    given); written atomically, unreadable files ignored."""

    FILE = "costs.json"

    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir() / self.FILE

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str, tree_sizes: Sequence[int]) -> list[float] | None:
        entry = self._load().get(key)
        if not isinstance(entry, dict) or not all(str(size) in entry for size in tree_sizes):
            return None
        if 0 < _loaded(entry, tree_sizes) < TRUST_LOADED:
            return None  # measured while the cores were shared: measure again
        values = [entry[str(size)] for size in tree_sizes]
        return [float(v) for v in values] if all(isinstance(v, int | float) and v > 0 for v in values) else None

    def entry(self, key: str) -> dict[int, float]:
        """Every size's cached ms for ``key`` (empty when none or unreadable)."""
        entry = self._load().get(key)
        if not isinstance(entry, dict):
            return {}
        return {int(size): float(value) for size, value in entry.items()
                if size.isdigit() and isinstance(value, int | float) and value > 0}

    def loaded_count(self, key: str, sizes: Sequence[int] | None = None) -> int:
        """The most measurements in a row of any of ``sizes`` (None: every size) of ``key`` taken on
        shared cores (0: none's last one was)."""
        entry = self._load().get(key)
        return _loaded(entry, sizes) if isinstance(entry, dict) else 0

    def put_measured(self, key: str, tree_sizes: Sequence[int], ms: Sequence[float],
                     others_share: float | None) -> int:
        """A new measurement, ``others_share`` of the cores used by other processes meanwhile (None:
        unknown, taken as quiet). Returns how many measurements in a row of these sizes were taken on
        shared cores: 0 (quiet), under TRUST_LOADED (the next start measures again), or more (kept)."""
        loaded = others_share is not None and others_share > LOADED_SHARE

        def mark(entry: dict[str, Any]) -> None:
            marks = entry.get(LOADED)
            marks = dict(marks) if isinstance(marks, dict) else {}
            for size in map(str, tree_sizes):
                count = marks.pop(size, 0)
                if loaded:
                    marks[size] = (count if isinstance(count, int) and count > 0 else 0) + 1
            if marks:
                entry[LOADED] = marks
            else:
                entry.pop(LOADED, None)

        self.put(key, tree_sizes, ms, mark)
        return self.loaded_count(key, tree_sizes) if loaded else 0

    def put(self, key: str, tree_sizes: Sequence[int], ms: Sequence[float],
            change: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Store ``ms`` per size (any marks kept: a curve's online corrections), then ``change`` the
        entry (``put_measured``'s marks)."""
        data = self._load()
        entry = data.get(key)
        if not isinstance(entry, dict):
            entry = {}
        entry.update({str(size): round(value, 3) for size, value in zip(tree_sizes, ms)})
        if change is not None:
            change(entry)
        data[key] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(data, indent=1, sort_keys=True))
            scratch.replace(self.path)
        except OSError:
            pass  # a read-only home: measure again next time


def loaded_note(what: str, count: int, probe_description: str) -> str | None:
    """The warning a worker logs after measuring ``what`` (``put_measured``'s count), or None."""
    if count == 0:
        return None
    if count < TRUST_LOADED:
        return (f"{what} was measured while {probe_description}: this run uses it (and corrects it as it runs), "
                "the next start measures it again")
    return (f"{what} was measured while {probe_description}, at {count} starts in a row: kept as this machine's "
            "costs (delete the cache file to measure again on a quiet machine)")


def _loaded(entry: dict[str, Any], sizes: Sequence[int] | None) -> int:
    marks = entry.get(LOADED)
    if not isinstance(marks, dict):
        return 0
    counts = [marks.get(str(size), 0) for size in sizes] if sizes is not None else list(marks.values())
    return max([count for count in counts if isinstance(count, int) and count > 0], default=0)


# OnlineCurve's memory of a size's timings: bins of BIN_SECONDS (each its median), those of the last
# WINDOW_SECONDS; the estimate is their LOW_QUANTILE, the seconds of the window no cycle of the size
# ran counting at the cached value. A shared host only ever makes a step slower, so a spell of load
# must fill more than 1 - LOW_QUANTILE of the window to raise a size's cost, while a lasting change
# (a neighbour that stays) raises it within that much of the window, and a quiet second lowers it.
BIN_SECONDS = 1.0
WINDOW_SECONDS = 300.0
LOW_QUANTILE = 0.25


def low_quantile(values: list[float]) -> float:
    return sorted(values)[int(LOW_QUANTILE * (len(values) - 1))]


class _SizeTimings:
    """One size's recent timings: closed bins (start time, median), the open bin's values."""

    def __init__(self) -> None:
        self.bins: deque[tuple[float, float]] = deque()
        self.open: list[float] = []
        self.open_since = 0.0

    def add(self, ms: float, now: float) -> None:
        if self.open and now - self.open_since >= BIN_SECONDS:
            self.bins.append((self.open_since, statistics.median(self.open)))
            self.open = []
        if not self.open:
            self.open_since = now
        self.open.append(ms)
        while self.bins and self.bins[0][0] < now - WINDOW_SECONDS:
            self.bins.popleft()

    def estimate(self, cached: float | None) -> float:
        """The low quantile of the window's bins; with a ``cached`` value, the least of that with the
        cached value as one more bin (a quiet second brings a curve measured under load down) and
        that with it in every second of the window no bin holds (a busy spell after a start or an
        idle stretch is not the window)."""
        observed = [ms for _, ms in self.bins] + ([statistics.median(self.open)] if self.open else [])
        if cached is None:
            return low_quantile(observed)
        unseen = max(int(WINDOW_SECONDS / BIN_SECONDS) - len(observed), 0)
        return min(low_quantile([*observed, cached]), low_quantile(observed + [cached] * unseen))


class OnlineCurve:
    """A cached cost curve (t_verify(T), t_draft(depth)) as the steps this worker runs measure it,
    written back to the cache.

    A size's estimate is the lower quartile of the medians of its last five minutes' one-second
    bins of cycles, the seconds without one counting at the cached value. A shared host only makes
    steps slower: a curve measured under load comes down at the first quiet second, a busy spell
    raises it only if it fills three quarters of the window (a host that stays busier does), even
    right after a start or an idle stretch, and the cache the next start reads is what this machine
    costs when the cores are its own.
    On ``save`` the observed sizes are written, and every other cached size is scaled by the
    geometric mean of estimate / cached over the observed sizes: a machine that got slower or
    faster did so for every T."""

    def __init__(self, cache: CostCache, key: str, save_every: int = 256,
                 clock: Callable[[], float] = time.monotonic):
        self.cache = cache
        self.key = key
        self.save_every = save_every
        self.clock = clock
        self.start = cache.entry(key)  # the curve as cached when this worker started (or last saved)
        self.recent: dict[int, _SizeTimings] = {}
        self.pending = 0

    def observe(self, size: int, ms: float) -> None:
        now = self.clock()
        self.recent.setdefault(size, _SizeTimings()).add(ms, now)
        self.pending += 1
        if self.pending >= self.save_every:
            self.save()

    def observed_sizes(self) -> set[int]:
        return set(self.recent)

    def estimate(self, size: int) -> float:
        return self.recent[size].estimate(self.start.get(size))

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
