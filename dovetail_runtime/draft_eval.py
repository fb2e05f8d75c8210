"""Tau of a draft head, in process (TargetEngine + Drafter, no IPC), per DESIGN.md section 10:
what ``dovetail-train eval`` measures.

Protocol: prompt = the first ``prompt_tokens`` tokens of each file (the tokenizer's start
token included; files shorter than that plus one token are skipped), greedy decoding of up
to ``new_tokens`` tokens (stopping at the end token, like the runtime), tree (T, depth,
top_k). tau = tokens emitted by draft/verify cycles / cycles; the prefill's first token is
not counted. Every output is checked against the target's own greedy decode (lossless); a
divergence is accepted only at a near-tie of the reference (top-2 logit gap < 1e-4,
DESIGN.md section 6) and is reported.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from cpu_worker.engine import TargetEngine
from dovetail_runtime.generation import Job, generate_dovetail
from dovetail_runtime.local_workers import local_workers
from gpu_worker.drafter import Drafter
from gpu_worker.train.corpus import read_corpus_text
from ipc.messages import Sampling, TokenLogprob
from ipc.tree import TreeShape

NEAR_TIE = 1e-4


class LosslessError(AssertionError):
    """Speculative output differs from the target's greedy decode away from a near-tie."""


@dataclass
class TauResult:
    tree_tokens: int
    depth: int
    top_k: int
    files: int = 0
    cycles: int = 0
    cycle_tokens: int = 0
    accepted_hist: list[int] = field(default_factory=list)  # cycles that accepted k drafts, k = 0..depth
    near_ties: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return self.cycle_tokens / self.cycles if self.cycles else 0.0

    def reach(self) -> list[float]:
        """Fraction of cycles that accepted at least d drafts, d = 1..depth."""
        total = max(self.cycles, 1)
        return [sum(self.accepted_hist[d:]) / total for d in range(1, len(self.accepted_hist))]

    def conditional(self) -> list[float]:
        """Acceptance at depth d given depth d-1 was accepted, d = 1..depth."""
        reach = [1.0] + self.reach()
        return [reach[d] / reach[d - 1] if reach[d - 1] else 0.0 for d in range(1, len(reach))]

    def as_dict(self) -> dict[str, Any]:
        return {"tree_tokens": self.tree_tokens, "depth": self.depth, "top_k": self.top_k, "files": self.files,
                "cycles": self.cycles, "cycle_tokens": self.cycle_tokens, "tau": round(self.tau, 4),
                "accepted_hist": self.accepted_hist, "reach_per_depth": [round(r, 4) for r in self.reach()],
                "accept_per_depth": [round(r, 4) for r in self.conditional()], "near_ties": self.near_ties,
                "seconds": round(self.seconds, 1)}


def reference_greedy(engine: TargetEngine, prompt: Sequence[int], new_tokens: int,
                     eos: int | None) -> tuple[list[int], list[float]]:
    """The target's greedy decode and the top-2 logit gap at each emitted position."""
    step = engine.prefill(list(prompt))
    tokens: list[int] = []
    gaps: list[float] = []
    while True:
        top = torch.topk(step.logits, 2).values
        gaps.append(float(top[0] - top[1]))
        token = int(step.logits.argmax())
        tokens.append(token)
        if len(tokens) >= new_tokens or token == eos:
            return tokens, gaps
        step = engine.decode(token)


def speculative_greedy(engine: TargetEngine, drafter: Drafter, prompt: Sequence[int], new_tokens: int,
                       eos: int | None, tree_tokens: int, depth: int, top_k: int,
                       result: TauResult) -> list[int]:
    """The runtime's own draft/verify cycle (generation.generate_dovetail over in-process
    workers); adds its cycles and the tokens they emitted to ``result``."""
    shape = TreeShape.clamped(tree_tokens, depth, top_k)
    job = Job(seq_id=1, prompt_ids=list(prompt), max_new_tokens=new_tokens, sampling=Sampling(),
              eos_token_ids=frozenset() if eos is None else frozenset({eos}), max_len=engine.max_len)
    out: list[int] = []

    def keep(tokens: list[int], _logprobs: list[TokenLogprob]) -> bool:
        out.extend(tokens)
        return False  # never stop early

    with local_workers(engine, drafter, shape) as (cpu, gpu):
        assert gpu is not None
        _, stats = generate_dovetail(cpu, gpu, job, shape, keep)
    result.cycles += stats.cycles
    result.cycle_tokens += len(out) - 1  # every kept token but the prefill's
    for accepted, count in enumerate(stats.accept_per_depth):
        result.accepted_hist[accepted] += count
    return out


def check_lossless(name: str, got: list[int], want: list[int], gaps: list[float]) -> dict[str, Any] | None:
    if got == want:
        return None
    index = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    gap = gaps[index] if index < len(gaps) else float("inf")
    if gap < NEAR_TIE:
        return {"file": name, "position": index, "top2_gap": gap}
    raise LosslessError(f"{name}: speculative output differs from greedy at new token {index} "
                        f"(reference top-2 gap {gap:.3g} >= {NEAR_TIE})")


Speculate = Callable[[TargetEngine, Drafter, Sequence[int], int, "int | None", int, int, int, TauResult], list[int]]


def measure_tau(engine: TargetEngine, drafter: Drafter, prompts: list[tuple[str, list[int]]], new_tokens: int,
                eos: int | None, settings: Sequence[tuple[int, int, int]], progress: bool = True,
                speculate: Speculate | None = None) -> list[TauResult]:
    """One ``TauResult`` per (T, depth, top_k); the target's reference decode runs once per prompt.
    ``speculate``: the speculative decode to measure (default: the runtime's cycle,
    ``speculative_greedy``; EAGLE-3 heads pass theirs)."""
    speculate = speculate or speculative_greedy
    results = []
    for tree_tokens, depth, top_k in settings:
        depth = max(1, min(depth, tree_tokens - 1))  # as dovetail-run: no path deeper than T - 1
        results.append(TauResult(tree_tokens, depth, top_k, accepted_hist=[0] * (depth + 1)))
    for name, prompt in tqdm(prompts, desc="tau", unit="file", disable=not progress, dynamic_ncols=True):
        want, gaps = reference_greedy(engine, prompt, new_tokens, eos)
        for result in results:
            started = time.perf_counter()
            got = speculate(engine, drafter, prompt, new_tokens, eos, result.tree_tokens, result.depth,
                            result.top_k, result)
            result.seconds += time.perf_counter() - started
            tie = check_lossless(name, got, want, gaps)
            if tie:
                result.near_ties.append(tie)
            result.files += 1
    return results


def file_prompts(files: Sequence[Any], tokenizer: Any, prompt_tokens: int, limit: int | None,
                 root: Any = None) -> list[tuple[str, list[int]]]:
    """(name, first ``prompt_tokens`` ids) for files long enough, in order, at most ``limit``."""
    prompts = []
    for path in files:
        ids = tokenizer(read_corpus_text(path, strict=False))["input_ids"]  # as features reads text
        if len(ids) <= prompt_tokens:
            continue
        name = path.relative_to(root).as_posix() if root is not None else str(path)
        prompts.append((name, list(ids[:prompt_tokens])))
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def format_table(results: list[TauResult]) -> str:
    width = max(r.depth for r in results)
    head = f"{'T':>3} {'depth':>5} {'top_k':>5} {'files':>5} {'cycles':>6} {'tau':>6}  " + \
        " ".join(f"{'a' + str(d):>5}" for d in range(1, width + 1))
    lines = [head]
    for r in results:
        rates = " ".join(f"{rate:5.3f}" for rate in r.conditional())
        lines.append(f"{r.tree_tokens:>3} {r.depth:>5} {r.top_k:>5} {r.files:>5} {r.cycles:>6} {r.tau:6.3f}  {rates}")
    lines.append("a<d>: acceptance at depth d given depth d-1 was accepted")
    return "\n".join(lines)
