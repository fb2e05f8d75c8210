"""t_draft(depth): what one draft step costs (absorb a cycle's accepted pairs, propose a tree).

Measured at startup for the tree planner (dovetail_runtime.tree_planner) on random features:
a draft step's cost depends on the head, its device and precision and the tree's depth and
beam, not on the values it computes. Cheap enough (tens of milliseconds per depth even at 7B
shapes) to measure every start instead of caching.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ipc.tree import TreeShape

from .drafter import Drafter

ACCEPTED_PAIRS = 3  # a typical cycle's accepted tokens + bonus


@torch.inference_mode()
def measure_draft_ms(drafter: Drafter, depths: Sequence[int], top_k: int, repeats: int = 2) -> list[float]:
    """Milliseconds per draft step (the best of ``repeats``) for each depth, with beam
    ``top_k``. Leaves the drafter empty (any sequence it held is gone)."""
    spec = drafter.head.spec
    generator = torch.Generator().manual_seed(0)
    prefix = max(1, min(64, drafter.max_len // 4))

    def pairs(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(count, drafter.feature_size, generator=generator),
                torch.randint(spec.vocab_size, (count,), generator=generator))

    def start() -> None:
        drafter.reset()
        drafter.extend(*pairs(prefix))

    start()
    results = []
    for depth in depths:
        shape = TreeShape.clamped(min(1 + depth * top_k, 64), depth, top_k)
        if shape.scratch_slots > drafter.scratch_len:
            raise ValueError(f"depth {depth} with top_k {top_k} needs {shape.scratch_slots} scratch slots, "
                             f"the drafter has {drafter.scratch_len}")
        best = float("inf")
        for attempt in range(repeats + (1 if depth == depths[0] else 0)):  # one warm-up first
            if drafter.length + ACCEPTED_PAIRS > drafter.max_len:
                start()
            features, tokens = pairs(ACCEPTED_PAIRS)
            began = time.perf_counter()
            drafter.extend(features, tokens)
            drafter.propose(shape)  # ends with a copy to the CPU: synchronised on CUDA too
            elapsed = (time.perf_counter() - began) * 1e3
            if attempt or depth != depths[0]:
                best = min(best, elapsed)
        results.append(best)
    drafter.reset()
    return results
