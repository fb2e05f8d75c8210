"""How many plain decode steps a sequence decoding alone asks the cpu_worker for in one call.

Why: every call is a round trip through the coordinator, the cpu_worker and their threads waking
one another; on two shared cores it costs ~0.5-1 ms beside a 135M target's ~4 ms step
(docs/performance.md). A sequence that decodes plainly and alone (``--mode ar``, lookup mode
between branches, a dovetail request where no tree can pay) asks for as many steps as fit in
``RUN_MS`` of the target's time (``m.DecodeRun``): the same tokens, one round trip. With prompt
lookup a run also ends where lookup may have a branch to offer (``cpu_worker.repeat_watch``). A
request that joins, or a cancel, waits at most about that long. A 7B target's step (~150 ms) is a
run of one: nothing changes there.

No torch here: the coordinator runs this.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

RUN_MS = 20.0  # the target's time one run may take
# A run's steps at most (a tiny target's steps are well under a millisecond); the protocol allows
# m.MAX_RUN_STEPS.
LONGEST_RUN = 16
RUN_MS_VARIABLE = "DOVETAIL_RUN_MS"  # another run length in ms, for comparisons (0: a call per step)
SMOOTHING = 0.2  # each step's weight in the running estimate of a step's cost


def configured_run_ms() -> float:
    """``$DOVETAIL_RUN_MS`` where it is a number >= 0, else ``RUN_MS`` (an invalid value is said)."""
    value = os.environ.get(RUN_MS_VARIABLE, "").strip()
    if not value:
        return RUN_MS
    try:
        run_ms = float(value)
    except ValueError:
        run_ms = -1.0
    if not run_ms >= 0.0 or run_ms == float("inf"):
        log.warning("%s=%r is not a number of ms >= 0: runs of %.0f ms", RUN_MS_VARIABLE, value, RUN_MS)
        return RUN_MS
    return run_ms


class RunSizer:
    """A run's length: the steps of a sequence's plain stretch that fit in ``run_ms`` at the cost of a
    step as timed so far (a decaying mean of the worker's compute time), at most ``cap()`` (1 where the
    sequence is not alone, or a tree is due: no run); one step before any step is timed."""

    def __init__(self, cap: Callable[[], int], run_ms: float | None = None):
        self.cap = cap
        self.run_ms = configured_run_ms() if run_ms is None else run_ms
        self.step_ms: float | None = None

    def observe(self, steps: int, compute_ms: float) -> None:
        """``steps`` decode steps took ``compute_ms`` of the worker's time (a fake or failed timing,
        zero, teaches nothing)."""
        if steps < 1 or not compute_ms > 0.0:
            return
        each = compute_ms / steps
        self.step_ms = each if self.step_ms is None else self.step_ms + SMOOTHING * (each - self.step_ms)

    def steps(self, limit: int) -> int:
        """The next call's steps, at most ``limit`` (the tokens the answer and the context have left)."""
        if limit < 2 or self.step_ms is None or self.run_ms <= 0.0:
            return 1
        return max(1, min(limit, self.cap(), LONGEST_RUN, int(self.run_ms / self.step_ms)))
