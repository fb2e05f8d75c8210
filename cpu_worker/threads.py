"""CPU placement of the target worker: intra-op thread count and the cores every thread may use."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from cpu_worker.cores import CoreSpecError

log = logging.getLogger(__name__)


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
    intra-op thread count (default: one per allowed core)."""
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
    union: set[int] = set()
    tids = _thread_ids()
    for tid in tids:
        try:
            union.update(os.sched_getaffinity(tid))
        except OSError:
            pass
    return Placement(intra_op_threads=torch.get_num_threads(), cores=sorted(union), thread_count=len(tids))
