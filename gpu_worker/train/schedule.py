"""Learning-rate schedule: linear warmup, then cosine decay to ``min_ratio`` x the peak; and the
check that stops a run whose updates have diverged."""

from __future__ import annotations

import math


def lr_at(step: int, total_steps: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class TrainingDiverged(ValueError):
    """A step whose loss or gradient is not finite: its update would fill the head with NaNs."""


def check_finite(step: int, lr: float, loss: float, grad_norm: float) -> None:
    """Refuse the update of step ``step`` (1-based) when its loss or gradient norm is NaN or infinite.
    Training on wrote a head of NaNs (a --lr of 1e9 did) and said "head written"."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainingDiverged(f"training diverged at step {step} (loss {loss}, gradient norm {grad_norm} at "
                               f"learning rate {lr:.3g}): lower --lr; this step was not applied, and the head and "
                               "state of the last checkpoint stand")
