"""Learning-rate schedule: linear warmup, then cosine decay to ``min_ratio`` x the peak."""

from __future__ import annotations

import math


def lr_at(step: int, total_steps: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
