"""t_draft(depth): what one draft step costs (absorb a cycle's accepted pairs, propose a tree).

Measured for the tree planner (dovetail_runtime.tree_planner) on random features: a draft
step's cost depends on the head, its device and precision and the tree's depth and beam, not
on the values it computes. Each beam's curve takes 0.5-1 s to measure on a CPU, so, like
t_verify (cpu_worker.verify_cost), it is cached per head and target files, device, precision,
threads, cores, torch and the drafter's code, and kept current from the draft steps the worker
runs (``ipc.cost_cache.OnlineCurve``): a second start reads it instead of measuring.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from cpu_worker.model import kernel_digest
from ipc.cost_cache import CostCache, cpu_model, files_signature, sources_digest
from ipc.tree import TreeShape

from .drafter import Drafter

ACCEPTED_PAIRS = 3  # a typical cycle's accepted tokens + bonus
# In a cycle the draft waits out the target's verify pass before each step, and a step after such a wait
# costs more than one right after another (its threads asleep, OpenMP's waits being passive or short): the
# real pair's head at depth 1 (2 cores, Zen 3) took 1.2-2.0 ms back to back, 2.4-3.0 ms (best) after 8 ms
# idle, and in the runtime's cycles 2.5 ms (the online curve's lower quartile) to 3.7 ms. Each timed step
# comes after this long idle.
IDLE_MS = 10.0
# The drafter's sources whose changes change what a draft step costs (this file: how it is measured).
DRAFT_SOURCES = ("drafter.py", "head.py", "eagle3.py", "tree.py", "head_placer.py", "draft_cost.py")


class DraftCostCache(CostCache):
    """{cache key: {depth: ms}} in draft_cost.json."""

    FILE = "draft_cost.json"


def device_name(device: torch.device) -> str:
    """The hardware a draft step runs on: the GPU's name, or the CPU's model."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def draft_cost_key(drafter: Drafter, draft_dir: str | Path, target_dir: str | Path | None, precision: str,
                   threads: int, cores: Sequence[int]) -> str:
    """Everything a draft-step measurement depends on but its beam, hashed (``beam_key`` adds it)."""
    parts = [files_signature(draft_dir), files_signature(target_dir) if target_dir else "", str(drafter.device),
             device_name(drafter.device), precision, str(threads), ",".join(map(str, cores)),
             str(measuring_prefix(drafter)), torch.__version__, sources_digest(Path(__file__).parent, DRAFT_SOURCES),
             kernel_digest() if drafter.device.type == "cpu" else ""]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def beam_key(key: str, top_k: int) -> str:
    return f"{key}/top_k={top_k}"


def measuring_prefix(drafter: Drafter) -> int:
    """The sequence a measurement drafts after: a short prompt's, within the context."""
    return max(1, min(64, drafter.max_len // 4))


@torch.inference_mode()
def measure_draft_ms(drafter: Drafter, depths: Sequence[int], top_k: int, repeats: int = 2,
                     idle_ms: float = IDLE_MS) -> list[float]:
    """Milliseconds per draft step (the best of ``repeats``) for each depth, with beam
    ``top_k``, each step after ``idle_ms`` idle (as in a cycle). Leaves the drafter empty (any
    sequence it held is gone)."""
    spec = drafter.head.spec
    generator = torch.Generator().manual_seed(0)
    prefix = measuring_prefix(drafter)

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
            time.sleep(idle_ms / 1e3)
            began = time.perf_counter()
            drafter.extend(features, tokens)
            drafter.propose(shape)  # ends with a copy to the CPU: synchronised on CUDA too
            elapsed = (time.perf_counter() - began) * 1e3
            if attempt or depth != depths[0]:
                best = min(best, elapsed)
        results.append(best)
    drafter.reset()
    return results
