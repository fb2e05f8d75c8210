"""Where a worker process runs: the cores users name (``0-3,8``), the CPU's instruction-set flags,
and the placement both workers apply at startup (every thread pinned to the named cores, torch's
intra-op thread count). Core lists and flags need no torch: the CLI checks core lists before any
worker starts, and the kernels' builds read the flags; ``apply_placement`` imports torch itself."""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class CoreSpecError(ValueError):
    """A core list the user typed that cannot be used."""


CGROUP_ROOT = Path("/sys/fs/cgroup")
MAX_CORE_NUMBER = 65536  # Linux's NR_CPUS tops out at 8192; anything far past it is a typo


def parse_core_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; refuses malformed or empty lists."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise CoreSpecError(f"empty entry in core list {text!r}; use e.g. 0-3,8")
        low_text, dash, high_text = part.partition("-")
        try:
            low = int(low_text)
            high = int(high_text) if dash else low
        except ValueError:
            raise CoreSpecError(f"{part!r} in core list {text!r} is not a core number or a range like 0-3") from None
        if low < 0 or high < low:
            raise CoreSpecError(f"bad range {part!r} in core list {text!r}")
        if high >= MAX_CORE_NUMBER:  # checked before the range is expanded: 0-4294967295 would fill memory
            raise CoreSpecError(f"core {high} in {text!r}: no machine has that many cores (at most "
                                f"{MAX_CORE_NUMBER - 1})")
        cores.update(range(low, high + 1))
    return sorted(cores)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(flag for line in text.splitlines() if line.startswith("flags") for flag in line.split()[2:])


def cpu_quota(root: Path = CGROUP_ROOT) -> int | None:
    """The CPUs this process's container may keep busy at once (cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), rounded up; None where there is no quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        parts, per = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return max(1, math.ceil(parts / per)) if parts > 0 and per > 0 else None


def _thread_ids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


@dataclass(frozen=True)
class Placement:
    """What took effect, read back from the OS and torch."""

    intra_op_threads: int
    cores: list[int]
    thread_count: int


def apply_placement(threads: int | None, cores: list[int] | None) -> Placement:
    """Pin every thread of this process (existing and future) to ``cores`` and set torch's
    intra-op thread count (default: one per allowed core, at most its container's CPU quota)."""
    import torch

    available = sorted(os.sched_getaffinity(0))
    if cores:
        unknown = [core for core in cores if core not in available]
        if unknown:
            raise CoreSpecError(f"cores {unknown} are not available to this process; available: {available}")
        # New threads inherit the creating thread's mask; existing pool threads must be set one by one.
        for tid in _thread_ids():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                pass  # a thread that exited meanwhile
    if threads is not None:
        if threads < 1:
            raise CoreSpecError(f"thread count must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    elif cores:
        torch.set_num_threads(len(cores))
    elif "OMP_NUM_THREADS" not in os.environ and (quota := cpu_quota()) is not None and quota < torch.get_num_threads():
        # torch counts the cores this process may run on, not its container's CPU time (docker --cpus 2 on a
        # 64-core host: 64 threads sharing 2 CPUs' time, each waiting for the others at every step).
        torch.set_num_threads(quota)
    # Run one op so the intra-op pool exists, then pin any thread it created.
    torch.ones(64, 64) @ torch.ones(64, 64)
    if cores:
        for tid in _thread_ids():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                pass
    placement = read_placement()
    log.info("cpu placement: %d intra-op threads, cores %s, %d OS threads",
             placement.intra_op_threads, placement.cores, placement.thread_count)
    return placement


def read_placement() -> Placement:
    import torch

    union: set[int] = set()
    tids = _thread_ids()
    for tid in tids:
        try:
            union.update(os.sched_getaffinity(tid))
        except OSError:
            pass
    return Placement(intra_op_threads=torch.get_num_threads(), cores=sorted(union), thread_count=len(tids))
