"""How much of this process's cores other processes took while it timed something.

A worker measures its step costs once and caches them (``ipc.cost_cache``); a measurement taken
while something else ran on the same cores (a test suite, a build, another model) overstates every
cost and, cached, mis-sizes the trees of every later start. ``CoreLoadProbe`` reads the kernel's
per-core busy time (/proc/stat) around the measurement and takes off this process's own CPU time:
what is left ran for someone else (steal included: a virtual machine's host ran another guest).
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from pathlib import Path
from types import TracebackType

# Busy columns of a /proc/stat cpuN line: user nice system idle iowait irq softirq steal (guest
# time is already inside user and nice).
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
# A measurement shorter than this many core-seconds, or seconds of wall time, is not judged: each
# core's counter ticks 100 times a second, so a short one's share would be mostly rounding.
MIN_CORE_SECONDS = 0.5
MIN_WALL_SECONDS = 0.25


def busy_core_seconds(cores: Collection[int], stat_path: Path = Path("/proc/stat")) -> float | None:
    """Seconds the kernel counts as busy on ``cores`` since boot, or None where it does not say
    (not Linux, a core missing from the file)."""
    try:
        lines = stat_path.read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{core}" for core in cores}
    ticks = 0
    found = 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            try:
                ticks += sum(int(fields[1 + column]) for column in _BUSY_COLUMNS if 1 + column < len(fields))
            except ValueError:
                return None
            found += 1
    if found != len(wanted):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


class CoreLoadProbe:
    """``with CoreLoadProbe() as probe: measure()``; then ``probe.others_share``: the fraction of
    the cores' time (this process's allowed cores) that other processes used meanwhile, or None
    where it cannot be told (no /proc/stat, too short to judge)."""

    def __init__(self, cores: Collection[int] | None = None, stat_path: Path = Path("/proc/stat")):
        self.cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
        self.stat_path = stat_path
        self.others_share: float | None = None
        self._busy: float | None = None  # the cores' busy seconds, this process's CPU seconds, the clock: at entry
        self._own = 0.0
        self._wall = 0.0

    def __enter__(self) -> CoreLoadProbe:
        self._busy = busy_core_seconds(self.cores, self.stat_path)
        self._own = time.process_time()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        busy = busy_core_seconds(self.cores, self.stat_path)
        own = time.process_time() - self._own
        wall = time.perf_counter() - self._wall
        capacity = wall * len(self.cores)
        if busy is None or self._busy is None or capacity < MIN_CORE_SECONDS or wall < MIN_WALL_SECONDS:
            return
        others = max(0.0, (busy - self._busy) - own)
        self.others_share = min(1.0, others / capacity)

    def describe(self) -> str:
        cores = ",".join(map(str, self.cores))
        share = "an unknown share" if self.others_share is None else f"{self.others_share:.0%}"
        return f"other processes used {share} of cores {cores}"
