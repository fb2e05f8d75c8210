"""One request's decoding loop, driven by the coordinator over the two workers.

dovetail mode: prefill (cpu) -> [draft (gpu) -> verify (cpu)] ... ; ar mode: prefill ->
decode -> decode ... on the cpu_worker alone. Tokens go to ``emit`` as soon as they are
accepted; ``emit`` returns True to stop (a stop string, a client that went away).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ipc import messages as m

Emit = Callable[[list[int]], bool]


class Worker(Protocol):
    """What the cycle needs of a worker: a WorkerHandle (a process) or a LocalWorker."""

    def request(self, message: Any, expect: type) -> Any: ...

    def send(self, message: Any) -> None: ...


class PromptTooLong(ValueError):
    """The prompt leaves no room in the context for a new token."""


@dataclass(frozen=True)
class Job:
    """What one request asks of the workers."""

    seq_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: m.Sampling
    eos_token_id: int | None
    max_len: int


@dataclass(frozen=True)
class TreeSettings:
    tree_tokens: int = 16
    depth: int = 6
    top_k: int = 8

    def fitted(self, room: int) -> "TreeSettings":
        """The largest tree no bigger than this one that fits in ``room`` cache slots."""
        size = min(self.tree_tokens, room)
        return TreeSettings(size, min(self.depth, size - 1), self.top_k)


@dataclass
class Stats:
    new_tokens: int = 0
    cycles: int = 0  # draft/verify cycles (dovetail) or decode steps (ar); prefill not counted
    cycle_tokens: int = 0  # tokens those cycles emitted (all but the prefill's token)
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    wall_ms: float = 0.0
    accept_per_depth: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        compute = self.prefill_ms + self.draft_ms + self.verify_ms
        seconds = self.wall_ms / 1e3
        return {
            "new_tokens": self.new_tokens,
            "cycles": self.cycles,
            "tau": self.cycle_tokens / self.cycles if self.cycles else 0.0,
            "tokens_per_s": self.new_tokens / seconds if seconds > 0 else 0.0,
            "prefill_ms": round(self.prefill_ms, 3),
            "draft_ms": round(self.draft_ms, 3),
            "verify_ms": round(self.verify_ms, 3),
            # Time not spent computing in a worker: messages, ring copies, coordinator work.
            "ipc_ms": round(max(self.wall_ms - compute, 0.0), 3),
            "wall_ms": round(self.wall_ms, 3),
            "accept_per_depth": list(self.accept_per_depth),
        }


class Budget:
    """Cuts emitted tokens at max_new_tokens and after EOS; says when to stop."""

    def __init__(self, max_new_tokens: int, eos_token_id: int | None, emit: Emit, stats: Stats):
        self.left = max_new_tokens
        self.eos = eos_token_id
        self.emit = emit
        self.stats = stats
        self.finish_reason: str | None = None

    def push(self, tokens: Sequence[int]) -> bool:
        kept = list(tokens[: self.left])
        if self.eos is not None and self.eos in kept:
            kept = kept[: kept.index(self.eos) + 1]
            self.finish_reason = "stop"
        self.left -= len(kept)
        self.stats.new_tokens += len(kept)
        if self.left == 0 and self.finish_reason is None:
            self.finish_reason = "length"
        if kept and self.emit(kept) and self.finish_reason is None:
            self.finish_reason = "stop"
        return self.finish_reason is not None


def check_prompt(prompt_ids: Sequence[int], max_len: int) -> None:
    if not prompt_ids:
        raise PromptTooLong("the prompt is empty after tokenization")
    if len(prompt_ids) >= max_len:
        raise PromptTooLong(f"prompt of {len(prompt_ids)} tokens leaves no room in the context of {max_len} tokens")


def generate_ar(cpu: Worker, job: Job, emit: Emit) -> tuple[str, Stats]:
    seq_id, max_len = job.seq_id, job.max_len
    stats = Stats()
    budget = Budget(job.max_new_tokens, job.eos_token_id, emit, stats)
    started = time.perf_counter()
    try:
        check_prompt(job.prompt_ids, max_len)
        result = cpu.request(m.PrefillRequest(seq_id=seq_id, token_ids=job.prompt_ids, sampling=job.sampling,
                                              return_features=False), m.PrefillResult)
        stats.prefill_ms = result.compute_ms
        token = result.token
        length = len(job.prompt_ids) + 1
        while not budget.push([token]):
            if length >= max_len:
                budget.finish_reason = "length"
                break
            result = cpu.request(m.DecodeRequest(seq_id=seq_id, token=token), m.DecodeResult)
            stats.verify_ms += result.compute_ms
            stats.cycles += 1
            stats.cycle_tokens += 1
            token = result.token
            length += 1
    finally:
        stats.wall_ms = (time.perf_counter() - started) * 1e3
        cpu.send(m.ReleaseSequence(seq_id=seq_id))
    return budget.finish_reason or "stop", stats


def generate_dovetail(cpu: Worker, gpu: Worker, job: Job, tree: TreeSettings,
                      emit: Emit) -> tuple[str, Stats]:
    seq_id, prompt_ids, max_len = job.seq_id, job.prompt_ids, job.max_len
    stats = Stats(accept_per_depth=[0] * (tree.depth + 1))
    budget = Budget(job.max_new_tokens, job.eos_token_id, emit, stats)
    started = time.perf_counter()
    try:
        check_prompt(prompt_ids, max_len)
        prefill = cpu.request(m.PrefillRequest(seq_id=seq_id, token_ids=prompt_ids, sampling=job.sampling),
                              m.PrefillResult)
        stats.prefill_ms = prefill.compute_ms
        # Draft pairs: feature of position i with token i+1; the first new token closes the prompt.
        pair_tokens = prompt_ids[1:] + [prefill.token]
        features: m.RingRef | m.InlineBlock = prefill.features
        reset = True
        length = len(prompt_ids) + 1  # tokens in the sequence; the last one is not cached yet
        if budget.push([prefill.token]):
            return budget.finish_reason, stats
        while True:
            room = max_len - (length - 1)
            if room <= 0:
                budget.finish_reason = "length"
                break
            shape = tree.fitted(room)
            draft = gpu.request(m.DraftRequest(seq_id=seq_id, tokens=pair_tokens, features=features,
                                               tree_tokens=shape.tree_tokens, depth=shape.depth,
                                               top_k=shape.top_k, reset=reset), m.DraftResult)
            reset = False
            verified = cpu.request(m.VerifyRequest(seq_id=seq_id, tokens=draft.tokens, parents=draft.parents),
                                   m.VerifyResult)
            stats.draft_ms += draft.compute_ms
            stats.verify_ms += verified.compute_ms
            stats.cycles += 1
            stats.cycle_tokens += len(verified.accepted_tokens)
            stats.accept_per_depth[len(verified.accepted_tokens) - 1] += 1
            length += len(verified.accepted_tokens)
            pair_tokens = verified.accepted_tokens
            features = verified.features
            if budget.push(verified.accepted_tokens):
                break
    finally:
        stats.wall_ms = (time.perf_counter() - started) * 1e3
        cpu.send(m.ReleaseSequence(seq_id=seq_id))
        gpu.send(m.ReleaseSequence(seq_id=seq_id))
    return budget.finish_reason, stats
