"""t_draft as a cycle sees it: each measured draft step comes after the idle a verify pass leaves."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from gpu_worker.draft_cost import IDLE_MS, measure_draft_ms


class WakingDrafter:
    """A drafter whose step (absorb, then propose) costs ``cold_ms`` when it comes after nearly ``IDLE_MS``
    or more of idle since its last step, and ``warm_ms`` when it follows sooner: as a head whose threads
    went to sleep while the target verified."""

    def __init__(self, warm_ms: float = 0.5, cold_ms: float = 20.0):
        self.head = SimpleNamespace(spec=SimpleNamespace(vocab_size=16))
        self.feature_size, self.max_len, self.scratch_len, self.length = 4, 64, 64, 0
        self.warm_ms, self.cold_ms = warm_ms, cold_ms
        self.last_step = time.perf_counter()

    def reset(self) -> None:
        self.length = 0

    def extend(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        idle_ms = (time.perf_counter() - self.last_step) * 1e3
        busy_until = time.perf_counter() + (self.cold_ms if idle_ms >= 0.9 * IDLE_MS else self.warm_ms) / 1e3
        while time.perf_counter() < busy_until:
            pass
        self.length += len(tokens)

    def propose(self, shape) -> None:
        self.last_step = time.perf_counter()


def test_each_step_is_timed_after_a_cycles_idle():
    ms = measure_draft_ms(WakingDrafter(), [1, 2, 3], top_k=4)
    assert all(value >= 20.0 for value in ms), ms  # every timed step paid the wake-up
    back_to_back = measure_draft_ms(WakingDrafter(), [1, 2, 3], top_k=4, idle_ms=0)
    assert all(value < 10.0 for value in back_to_back), back_to_back  # what the measurement took before
