"""Which draft tree to verify next: ``--tree-tokens auto``.

A cycle emits E[accepted + 1] tokens and costs t_draft(depth, top_k) + t_verify(T) + t_ipc, so
the planner picks the (T, depth, top_k) maximising E[accepted + 1 | T, depth, top_k] /
(t_draft + t_verify + t_ipc); top_k is ``--tree-top-k`` or half of it (a narrower beam reaches
deeper for the same T).

- t_verify(T) and t_draft(depth) are measured by the workers at startup (the target's
  timings cached on disk); once cycles of a size (a depth) have been seen, their observed
  mean replaces the measurement, and unseen ones are rescaled by how observed cycles
  compare with the measurement (a busy machine makes everything slower); t_ipc is the
  observed rest of a cycle. A tree never costs less than a smaller one, and a shared host
  only ever makes a timing slower, so each size is rated at the least that it or any larger
  size costs (``cheapest_from_here``): one size timed during a busy spell cannot price the
  sizes above it at its own cost (they would look free). What this cannot tell apart: a large
  tree's cycles timed in a quiet spell price the smaller sizes down to them.
- E[accepted | T, depth] is learnt online, and one verified tree answers it for every smaller
  tree: the drafter returns nodes in selection order, so the tree for (T', d') is the root
  plus the first T' - 1 nodes no deeper than d' (``gpu_worker.tree``), and its accepted path
  is the part of the verified path that lies inside it. Exact for greedy decoding; for
  sampling a close estimate (a smaller tree can accept a token the larger one rejected).
  This holds per beam width only: a top_k 4 tree is not part of the top_k 8 one (their beams
  keep different nodes), so each top_k learns from its own trees.
- The first cycles verify the deepest tree whose measured cycle costs at most ``PROBE_BUDGET``
  times the cheapest one (``first_shape``): as large as it can be without paying much for it.
- Larger trees are learnt by probing: every ``explore_every``-th cycle verifies a larger
  tree (alternately one and two sizes up, one and two levels deeper, or the largest tree that
  costs at most ``PROBE_BUDGET`` times the best cycle when that is larger; every other pair of
  probes with the other beam width), so the choice can move up when deeper drafts start paying.
  Every estimate fades (``decay`` per cycle), so one that no recent cycle could observe is
  forgotten rather than trusted forever.
- Alone, where the costs leave trees little room (``trees_hopeless``) and the recent cycles
  emitted clearly fewer tokens per second than plain decode steps would, the planner says one
  node (plain steps), with its smallest tree now and then as a probe (``plain_fallback``); where
  they leave no tree a chance even at ``OPTIMISTIC_ACCEPTANCE`` (``trees_futile``), from the first
  step and for the run, batches included (a probe could not change the verdict: its draft step
  reads the kept prompt, so it is not timed); in a batch, ``batch_shape`` decides.

No torch here: the coordinator runs this.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ipc.tree import TreeShape, children_by_token, tree_depths

from .plain_fallback import PlainFallback
from .plain_runs import LONGEST_RUN

log = logging.getLogger(__name__)

# Tree sizes the planner chooses from (T, root included) and the target measures (1 is a
# plain decode step: the --mode ar baseline).
TREE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SEEN_ENOUGH = 2.0  # observed cycles of a size (or depth) before their mean replaces the measurement
SEEN_DECAY = 0.9
PROBE_BUDGET = 1.3  # a probe may cost up to this many times the best shape's cycle
# A request alone decodes plainly on poor recent cycles only where every tree would need this share of
# its most tokens (depth + 1) to break even: the demo's 135M pair on 2 cores, 68% at best (4/3/4: a 12 ms
# cycle for at most 4 tokens against 4.4 ms plain steps); the 7B stand-in, 45% (8/4/4: 243 ms for at
# most 5 tokens against 107 ms), where a hard patch of text must keep its trees (the rest of the
# answers pays: 1.1-1.5x of ar over the same prompts).
HOPELESS_SHARE = 0.6
# The acceptance per drafted token no head of ours beats, on which a request alone judges whether any tree
# could pay before trying (``trees_futile``): EAGLE-3 reports 0.7-0.8 a position on chat with GPU-scale
# training, the real pair's head 0.4-0.6. Where no tree would out-emit plain steps even at this rate (a
# 135M target on AVX2: the smallest tree's cycle costs two plain steps), a request decodes plainly from
# its first step.
OPTIMISTIC_ACCEPTANCE = 0.8
# What one sequence's share of a batched draft step costs, as a share of its solo step, until batched
# cycles say: the gpu_worker runs the batch's drafts in one head forward per tree level, and on
# 2 cores a sequence's share measured 0.53-0.78 at 2 sequences and 0.22-0.66 at 4 (heads of the
# 9M, 135M and 7B pairs); a GPU's is far smaller (kernel launches, not arithmetic).
BATCH_DRAFT_SHARE = 0.75


@dataclass(frozen=True)
class AutoTree:
    """The bounds ``--tree-tokens auto`` chooses within."""

    max_tree_tokens: int = 64
    max_depth: int = 10
    top_k: int = 8

    def __post_init__(self) -> None:
        if self.max_tree_tokens < 2 or self.max_depth < 1 or self.top_k < 1:
            raise ValueError(f"auto tree bounds must allow a draft token: {self}")

    @property
    def tree_sizes(self) -> list[int]:
        return [size for size in TREE_SIZES if size <= self.max_tree_tokens]

    @property
    def top_ks(self) -> list[int]:
        """The beam widths tried: ``top_k`` and half of it."""
        return sorted({self.top_k, max(1, self.top_k // 2)})

    @property
    def envelope(self) -> TreeShape:
        """The largest shape the planner may ask for (sizes caches and rings)."""
        largest = self.tree_sizes[-1]
        return TreeShape.clamped(largest, min(self.max_depth, largest - 1), self.top_k)


class ShapePlanner(Protocol):
    """What the cycle asks: the next tree's shape, and what came of it."""

    @property
    def envelope(self) -> TreeShape: ...

    def shape(self, batch: int = 1) -> TreeShape:
        """The next tree of a sequence whose cycle is verified with ``batch - 1`` others."""
        ...

    def trees_may_pay(self, batch: int) -> bool:
        """Whether a tree may pay at this load (asking changes nothing): False where the sequence
        would decode plainly from its first cycle (so its draft need not read its prompt yet)."""
        ...

    def plain_run_cap(self) -> int:
        """The most plain steps a lone sequence's next call may take (``plain_runs``): 1 while trees run."""
        ...

    def plain_stepped(self) -> None:
        """A lone sequence took a plain step (each step of a run, a lookup step)."""
        ...

    def observe(self, shape: TreeShape, tokens: Sequence[int], parents: Sequence[int], accepted: Sequence[int],
                draft_ms: float, verify_ms: float, cycle_ms: float, batch: int = 1, timed: bool = True,
                drafted: int | None = None) -> None: ...

    def branch_terms(self, shape: TreeShape, batch: int = 1) -> BranchTerms | None:
        """What a lookup branch grafted onto this tree is weighed against; None: graft it whole."""
        ...


@dataclass(frozen=True)
class BranchTerms:
    """A cycle's tree as a grafted branch must beat it (``BranchPolicy.choose_grafted``): the tokens
    it is expected to emit, its cycle's ms, and the verify pass's extra ms for so many more rows."""

    tree_tokens: float
    tree_ms: float
    extra_ms: Callable[[int], float]


class FixedTree:
    """A fixed ``--tree-tokens N``: the same shape every cycle."""

    def __init__(self, shape: TreeShape):
        self.envelope = shape

    def shape(self, batch: int = 1) -> TreeShape:
        return self.envelope

    def trees_may_pay(self, batch: int) -> bool:
        return self.envelope.tree_tokens > 1

    def plain_run_cap(self) -> int:
        return LONGEST_RUN if self.envelope.tree_tokens == 1 else 1

    def plain_stepped(self) -> None:
        pass

    def observe(self, shape: TreeShape, tokens: Sequence[int], parents: Sequence[int], accepted: Sequence[int],
                draft_ms: float, verify_ms: float, cycle_ms: float, batch: int = 1, timed: bool = True,
                drafted: int | None = None) -> None:
        pass

    def branch_terms(self, shape: TreeShape, batch: int = 1) -> BranchTerms | None:
        return None  # no costs known: a fixed tree takes the whole branch


def accepted_path(tokens: Sequence[int], parents: Sequence[int], accepted: Sequence[int]) -> list[int]:
    """The accepted nodes below the root, found from the accepted tokens (the last one is the
    target's bonus token, not a node); siblings carry distinct tokens."""
    children = children_by_token(tokens, parents)
    path, node = [], 0
    for token in accepted[:-1]:
        node = children[node][int(token)]
        path.append(node)
    return path


def draft_path(tokens: Sequence[int], parents: Sequence[int], accepted: Sequence[int], drafted: int) -> list[int]:
    """The accepted nodes as far as they are the draft's own: among the tree's first ``drafted`` nodes
    (prompt lookup grafts its nodes after them, ``lookup.graft``; a path that enters them stays there)."""
    path = accepted_path(tokens, parents, accepted)
    return path[:next((index for index, node in enumerate(path) if node >= drafted), len(path))]


def interpolate(points: Mapping[int, float], x: int) -> float:
    """Piecewise-linear through measured points (flat beyond the ends)."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    for low, high in zip(xs, xs[1:]):
        if x <= high:
            return points[low] + (points[high] - points[low]) * (x - low) / (high - low)
    return points[xs[-1]]


def extrapolate(points: Mapping[int, float], x: int) -> float:
    """``interpolate`` within the measured sizes, continued in proportion past the largest (a verify
    pass's rows' arithmetic dominates there): a row beyond the curve is never free."""
    largest = max(points)
    return interpolate(points, x) if x <= largest else points[largest] * x / largest


def cheapest_from_here(costs: Mapping[int, float]) -> dict[int, float]:
    """Each size's cost as the least of its own and every larger size's: non-decreasing, as a
    tree's cost is, and robust to the error a shared host makes (a timing taken during a busy
    spell is too high, never too low). The running maximum kept before let one slow timing of
    T = 2 in the cache (157 ms against 132 for T = 3, the 7B chat stand-in on 2 cores) price T = 2,
    3 and 4 alike, 21 ms under T = 6: the planner started at 6/3/8 and often settled on 6-node
    trees (docs/performance.md, 2026-12-06 eleventh session)."""
    cheapest, least = {}, float("inf")
    for size in sorted(costs, reverse=True):
        least = min(least, costs[size])
        cheapest[size] = least
    return dict(sorted(cheapest.items()))


Cell = tuple[int, int, int]  # (T, depth, top_k)


def draft_capacity(depth: int, top_k: int) -> int:
    """Draft nodes a tree of this depth and beam width can offer (``gpu_worker.tree``: top_k
    children of the root, then top_k**2 per further level); a larger T cannot be filled."""
    return top_k + (depth - 1) * top_k * top_k


@dataclass(frozen=True)
class Costs:
    """What the planner rates cycles by: t_verify per tree size, t_draft per beam width and depth (ms)."""

    verify: dict[int, float]
    draft: dict[int, dict[int, float]]


class TreePlanner:
    """``draft_ms``: t_draft per depth at ``bounds.top_k``; ``draft_ms_by_top_k`` gives it per
    beam width where measured (else the widest beam's cost stands in until cycles are seen)."""

    def __init__(self, bounds: AutoTree, verify_ms: Mapping[int, float], draft_ms: Mapping[int, float],
                 explore_every: int = 8, min_samples: float = 3.0, decay: float = 0.99, smoothing: float = 0.1,
                 draft_ms_by_top_k: Mapping[int, Mapping[int, float]] | None = None):
        self.bounds = bounds
        self.envelope = bounds.envelope
        # Measured on a busy machine a larger tree can time faster than a smaller one: the smaller
        # one's timing is the wrong one (cheapest_from_here).
        self.verify_ms = cheapest_from_here(verify_ms)
        self.draft_ms = {top_k: cheapest_from_here(draft_ms) for top_k in bounds.top_ks}
        for top_k, measured in (draft_ms_by_top_k or {}).items():
            if top_k in self.draft_ms and measured:
                self.draft_ms[top_k] = cheapest_from_here(measured)
        self.explore_every = explore_every
        self.min_samples = min_samples
        self.decay = decay  # per cycle: acceptance changes with the text, old cycles count less
        self.smoothing = smoothing
        self.cells: list[Cell] = [(size, depth, top_k) for top_k in bounds.top_ks
                                  for size in bounds.tree_sizes if size >= 2
                                  for depth in range(1, min(size - 1, bounds.max_depth) + 1)
                                  if size - 1 <= draft_capacity(depth, top_k)]
        # The least tree of each depth and beam: the cheapest way to its most tokens (depth + 1).
        self.leanest: list[Cell] = [min(cell for cell in self.cells if cell[1:] == (depth, top_k))
                                    for depth, top_k in sorted({cell[1:] for cell in self.cells})]
        self.weight: dict[Cell, float] = dict.fromkeys(self.cells, 0.0)
        self.accepted_sum: dict[Cell, float] = dict.fromkeys(self.cells, 0.0)
        self.verify_scale = 1.0
        self.draft_scale = 1.0
        self.batch_draft_share = BATCH_DRAFT_SHARE  # learnt from batched cycles (observe)
        # Observed cost per tree size / per (depth, top_k): (decayed count, decayed total ms).
        self.seen_verify: dict[int, tuple[float, float]] = {}
        self.seen_draft: dict[tuple[int, int], tuple[float, float]] = {}
        self._costs: Costs | None = None  # what the above make of each size and depth, until they change
        self.ipc_ms = 0.0
        self.cycles = 0
        self.best: Cell = self.first_shape()
        self.chosen: Counter[Cell] = Counter()
        self.fallback = PlainFallback()
        self._futile: tuple[Costs, bool] | None = None  # trees_futile's verdict, and the costs it judged
        self._said_futile = False

    def first_shape(self) -> Cell:
        """Where to start before any acceptance is known: the deepest, then largest, tree of the
        widest beam whose measured cycle costs at most ``PROBE_BUDGET`` times the cheapest one.
        One verified tree rates every smaller tree of its beam, so the first cycles rate the
        whole affordable region; a fixed large start (EAGLE-2's T = 16, depth 6) would instead
        spend its first cycles at 2-3x a decode step where verification grows steeply with T
        (2 EPYC cores, int8), and where it is nearly flat (MKL's packed fp32 on a Xeon) it starts
        large and deep."""
        budget = PROBE_BUDGET * min(self.cycle_ms(cell) for cell in self.cells)
        affordable = [cell for cell in self.cells if cell[2] == self.bounds.top_k and self.cycle_ms(cell) <= budget]
        if not affordable:  # a beam too narrow for any cell of its width: the cheapest cell
            return min(self.cells, key=self.cycle_ms)
        return max(affordable, key=lambda cell: (cell[1], cell[0]))

    # --- the model -------------------------------------------------------------------------

    def cycle_ms(self, cell: Cell) -> float:
        """What a cycle of this shape costs (``costs``)."""
        size, depth, top_k = cell
        costs = self.costs()
        verify = costs.verify.get(size)  # a planner's size; else one cut to the context, or a tree and a branch
        return costs.draft[top_k][depth] + (verify if verify is not None else extrapolate(costs.verify, size)) \
            + self.ipc_ms

    def costs(self) -> Costs:
        """t_verify per tree size and t_draft per beam width and depth: what such cycles took, where
        seen often enough, else the startup measurement rescaled (a measurement taken on a busy
        machine can be off for one size; the cycles themselves are not); then each at the least
        of its own and every larger size's (``cheapest_from_here``: cycles seen during a busy
        spell are no better than a measurement taken in one)."""
        if self._costs is None:
            verify = {size: self._seen(self.seen_verify, size, self.verify_scale * interpolate(self.verify_ms, size))
                      for size in self.bounds.tree_sizes}
            draft = {top_k: cheapest_from_here({
                depth: self._seen(self.seen_draft, (depth, top_k), self.draft_scale * interpolate(by_depth, depth))
                for depth in range(1, self.bounds.max_depth + 1)}) for top_k, by_depth in self.draft_ms.items()}
            self._costs = Costs(cheapest_from_here(verify), draft)
        return self._costs

    @staticmethod
    def _seen(table: Mapping[Any, tuple[float, float]], key: Any, measured: float) -> float:
        """The mean of the cycles seen for ``key`` where seen often enough, else ``measured``."""
        weight, total = table.get(key, (0.0, 0.0))
        return total / weight if weight >= SEEN_ENOUGH else measured

    @staticmethod
    def _see(table: dict[Any, tuple[float, float]], key: Any, ms: float) -> None:
        weight, total = table.get(key, (0.0, 0.0))
        table[key] = (weight * SEEN_DECAY + 1.0, total * SEEN_DECAY + ms)

    def expected_tokens(self, cell: Cell) -> float | None:
        """E[accepted + 1] for a tree of this shape, None until seen often enough."""
        if self.weight[cell] < self.min_samples:
            return None
        return self.accepted_sum[cell] / self.weight[cell] + 1.0

    def rate(self, cell: Cell) -> float | None:
        """Expected tokens per second."""
        tokens = self.expected_tokens(cell)
        return None if tokens is None else tokens / self.cycle_ms(cell) * 1e3

    def branch_terms(self, shape: TreeShape, batch: int = 1) -> BranchTerms:
        """A grafted branch's bar (``BranchTerms``) for a tree of two nodes or more: the tree's rated
        tokens, else as many as break even with plain steps (its rows must then pay at least as those
        do), its cycle at the costs as rated now; in a batch of ``batch`` the batch's cycle and tokens
        (its extra rows lengthen the one pass every sequence waits on)."""
        size = shape.tree_tokens
        cell = (size, shape.depth, shape.top_k)
        tokens = self.expected_tokens(cell) if cell in self.weight else None  # a shape cut to the context: unrated
        if batch > 1:
            rows, ms = batch * size, self.batch_cycle_ms(batch, cell)
            base = self.batch_verify_ms(rows)
            return BranchTerms(batch * (tokens or ms * self.plain_rate(batch)), ms,
                               lambda extra: self.batch_verify_ms(rows + extra) - base)
        ms, verify = self.cycle_ms(cell), self.costs().verify
        base = extrapolate(verify, size)
        return BranchTerms(tokens or ms / self.plain_step_ms(), ms,
                           lambda extra: extrapolate(verify, size + extra) - base)

    def plain_step_ms(self) -> float:
        """What a plain decode step should cost, until plain steps are timed (``plain_fallback``):
        t_verify(1) as the planner rates it (``costs``), and half the rest of a cycle (a cycle makes two
        round trips, a plain step one; with the whole rest the estimate ran ~25% over at the demo)."""
        return self.costs().verify[1] + self.ipc_ms / 2

    # --- choosing ------------------------------------------------------------------------

    def shape(self, batch: int = 1) -> TreeShape:
        """The next tree; one node (decode plainly) alone where trees do not pay now
        (``plain_fallback``; each plain step taken is told to ``plain_stepped``), in a batch where the
        load says so (``batch_shape``)."""
        self.cycles += 1
        if batch > 1:
            self.fallback.interrupt()
            return self.batch_shape(batch)
        if not self.fallback.settled and self.trees_futile():
            self.fallback.settle_plain()
        if self.fallback.plain:
            if self.fallback.step_plain():
                return TreeShape.clamped(1, 1, self.bounds.top_k)
            cell = self.plain_probe()
        else:
            cell = self.probe() if self.cycles % self.explore_every == 0 else self.best
        self.chosen[cell] += 1
        return TreeShape.clamped(*cell)

    def plain_run_cap(self) -> int:
        """While plain alone, the steps before the next probe tree (``PlainFallback.run_cap``); else 1."""
        return self.fallback.run_cap() if self.fallback.plain else 1

    def plain_stepped(self) -> None:
        """Counted toward the fallback's next probe while it is plain (``PlainFallback.stepped``)."""
        if self.fallback.plain:
            self.fallback.stepped()

    def trees_hopeless(self, plain_ms: float) -> bool:
        """Whether every tree shape needs at least ``HOPELESS_SHARE`` of its most tokens (depth + 1) to
        emit as fast as plain steps of ``plain_ms`` each: where the target's step is cheap beside the
        draft's and the round trips. Only there does a request alone decode plainly on a stretch of
        poor cycles; where trees have room, a hard patch of text keeps its trees."""
        return all(self.cycle_ms(cell) >= HOPELESS_SHARE * (cell[1] + 1) * plain_ms for cell in self.cells)

    def trees_futile(self) -> bool:
        """Whether no tree shape, alone, would emit more tokens per second than plain steps even with
        each drafted token accepted at ``OPTIMISTIC_ACCEPTANCE`` (expected tokens 1 + a + ... + a^depth).
        Costs alone decide, before any acceptance is seen: a request then never pays the dozen poor
        cycles the fallback's verdict needs (the real pair on a Zen 3 ran 0.68-0.92x of ar on chat so).
        A plain step is the planner's estimate, not the fallback's wall time between steps: a cycle's
        estimate holds only the overhead seen in tree cycles (none, while plain), so the two compare
        like with like."""
        if self._futile is None or self._futile[0] is not self.costs():  # once per change of the costs
            plain_ms = self.plain_step_ms()
            futile = all(optimistic_tokens(cell[1]) * plain_ms <= self.cycle_ms(cell) for cell in self.cells)
            self._futile = (self.costs(), futile)
            if futile:
                self._say_futile()
        return self._futile[1]

    def _say_futile(self) -> None:
        if self._said_futile:
            return
        self._said_futile = True
        cell = min(self.cells, key=lambda cell: self.cycle_ms(cell) / optimistic_tokens(cell[1]))
        log.info("tree: no draft tree can beat plain decode steps here (a plain step %.1f ms; the likeliest to pay, "
                 "T=%d depth %d, costs %.1f ms a cycle for %.2f tokens even at %.0f%% acceptance a token): "
                 "decoding plainly (with prompt lookup's branches) for this run; the next start judges its "
                 "costs again",
                 self.plain_step_ms(), cell[0], cell[1], self.cycle_ms(cell),
                 optimistic_tokens(cell[1]), 100 * OPTIMISTIC_ACCEPTANCE)

    def plain_probe(self) -> Cell:
        """The tree that asks, during plain steps, whether drafting pays again: the smallest one (one
        draft token, the widest beam). Its cycle costs least, so it pays by itself whenever the
        draft's best guess is right and a tree can pay at all; a large tree pays by itself only when
        most of its depth is accepted (a 12/3/8 tree at the 7B stand-in needs all 3)."""
        return min(self.cells, key=lambda cell: (cell[0], cell[1], -cell[2]))

    def batch_shape(self, batch: int) -> TreeShape:
        """The tree for a sequence verified with ``batch - 1`` others (load-aware speculation): the
        rated shape with the most tokens per second when every sequence of the batch drafts one
        (their drafts together, each at ``batch_draft_share`` of its solo cost; their trees' rows in
        one pass: t_verify(batch x T)), or
        no draft tokens at all (T = 1: the batch decodes plainly) when that is faster, as it is
        where many rows cost nearly as much each as one (AVX2) and the batch already fills the
        pass over the weights. Where no tree could beat plain steps at this load even with every
        drafted token accepted (a 135M target's batch of 4 on two cores), one node at once: from the
        first cycle, before any shape is rated, not after a round of trees that learns it. Before any
        rating otherwise, the solo choice. No probing: the rates come from solo cycles."""
        plain = self.plain_rate(batch)
        one_node = TreeShape.clamped(1, 1, self.bounds.top_k)
        if self.best_case_rate(batch) <= plain or self.trees_futile():  # futile alone: in a batch too
            return one_node
        rated = [(tokens / self.batch_cycle_ms(batch, cell), cell) for cell in self.cells
                 if (tokens := self.expected_tokens(cell)) is not None]
        if not rated:  # nothing rated yet: the solo choice, until cycles rate the shapes
            return TreeShape.clamped(*self.best)
        rate, cell = max(rated)
        if rate <= plain:
            return one_node
        self.chosen[cell] += 1
        return TreeShape.clamped(*cell)

    def trees_may_pay(self, batch: int) -> bool:
        """Not where the costs make every tree futile alone (``trees_futile``: then in a batch too, where
        rows cost no less and drafts no less than half); else alone, always (the fallback decides as
        cycles come); in a batch, unless even trees whose every drafted token were accepted would emit
        fewer tokens per second than plain steps."""
        return not self.trees_futile() and (batch <= 1 or self.best_case_rate(batch) > self.plain_rate(batch))

    def plain_rate(self, batch: int) -> float:
        """Tokens per ms of a sequence decoding plainly in a batch of ``batch``."""
        return 1.0 / (self.batch_verify_ms(batch) + self.ipc_ms)

    def best_case_rate(self, batch: int) -> float:
        """Tokens per ms of the leanest trees in a batch of ``batch`` with every drafted token accepted."""
        return max((cell[1] + 1) / self.batch_cycle_ms(batch, cell) for cell in self.leanest)

    def batch_cycle_ms(self, batch: int, cell: Cell) -> float:
        """A cycle in which ``batch`` sequences each draft a tree of this shape (their drafts together,
        each at ``batch_draft_share`` of its solo cost) and the target verifies all their rows in one pass."""
        size, depth, top_k = cell
        draft = self.batch_draft_share * self.draft_scale * interpolate(self.draft_ms[top_k], depth)
        return batch * draft + self.batch_verify_ms(batch * size) + self.ipc_ms

    def batch_verify_ms(self, rows: int) -> float:
        """t_verify of ``rows`` rows in one pass: the measured curve, continued in proportion past its
        largest size (the rows' arithmetic dominates there)."""
        return self.verify_scale * extrapolate(self.verify_ms, rows)

    def probe(self) -> Cell:
        """Larger than the best: alternately one tree size up and one level deeper, and two and
        two (acceptance need not grow smoothly along single steps); every other pair of probes
        with the other beam width, which only its own trees can rate. Where a much larger tree
        costs little more (a flat t_verify), the largest one within ``PROBE_BUDGET`` of the best
        cycle's cost instead: one verified tree rates every smaller tree of its beam, so no
        shape of the region goes unrated while the choice sits on a small one."""
        size, depth, top_k = self.best
        probes = self.cycles // self.explore_every
        steps = 1 + probes % 2
        if (probes // 2) % 2 == 1:
            top_k = next((k for k in self.bounds.top_ks if k != top_k), top_k)
        larger = [s for s in self.bounds.tree_sizes if s > size][:steps]
        next_size = larger[-1] if larger else size
        next_depth = min(depth + steps, next_size - 1, self.bounds.max_depth)
        # A narrow, shallow beam cannot fill a large tree: probe the largest it can.
        fillable = [s for s in self.bounds.tree_sizes if 2 <= s <= next_size
                    and s - 1 <= draft_capacity(next_depth, top_k)]
        probe_size = fillable[-1] if fillable else 2
        local: Cell = (probe_size, min(next_depth, probe_size - 1), top_k)
        budget = PROBE_BUDGET * self.cycle_ms(self.best)
        affordable = [cell for cell in self.cells if cell[2] == top_k and self.cycle_ms(cell) <= budget]
        # Deepest first: a deep tree rates the shallow trees inside it, a wide shallow one no deeper ones.
        return max([local, *affordable], key=lambda cell: (cell[1], cell[0]))

    def _choose(self) -> None:
        rated = [(rate, cell) for cell in self.cells if (rate := self.rate(cell)) is not None]
        if rated:
            self.best = max(rated)[1]

    # --- learning ------------------------------------------------------------------------

    def observe(self, shape: TreeShape, tokens: Sequence[int], parents: Sequence[int], accepted: Sequence[int],
                draft_ms: float, verify_ms: float, cycle_ms: float, batch: int = 1, timed: bool = True,
                drafted: int | None = None) -> None:
        """Learn from one verified tree (its first ``drafted`` nodes, all by default, in selection
        order as the drafter sends them, then any grafted by prompt lookup: the draft is rated, and
        judged against plain steps, on its own nodes; the verify time counts for the whole tree's
        size); from a batched cycle (``batch`` > 1) its acceptance, and its share of the batch's draft
        time against its solo cost (``batch_draft_share``): its other times are the batch's; nothing
        but acceptance where ``timed`` is False (a sequence's first cycle, whose draft step also read
        the whole prompt: 2-3x a cycle's draft time at the 7B stand-in)."""
        size = len(tokens)
        drafted = size if drafted is None else drafted
        if drafted < 2:
            return
        path = draft_path(tokens, parents, accepted, drafted)
        self._rate(shape, tree_depths(parents)[:drafted], path)
        top_k = shape.top_k
        predicted_draft = interpolate(self.draft_ms.get(top_k, self.draft_ms[self.bounds.top_k]), shape.depth)
        alpha = self.smoothing
        if batch > 1 or not timed:
            if timed and predicted_draft > 0 and draft_ms > 0:
                share = draft_ms / (self.draft_scale * predicted_draft)
                self.batch_draft_share += alpha * (share - self.batch_draft_share)
            self._choose()
            return
        self._costs = None
        predicted_verify = interpolate(self.verify_ms, size)
        if predicted_verify > 0 and verify_ms > 0:
            self.verify_scale += alpha * (verify_ms / predicted_verify - self.verify_scale)
        if predicted_draft > 0 and draft_ms > 0:
            self.draft_scale += alpha * (draft_ms / predicted_draft - self.draft_scale)
        self.ipc_ms += alpha * (max(cycle_ms - draft_ms - verify_ms, 0.0) - self.ipc_ms)
        self._see(self.seen_verify, size, verify_ms)
        self._see(self.seen_draft, (shape.depth, top_k), draft_ms)
        if self.fallback.plain or (shape.tree_tokens, shape.depth, top_k) == self.best:
            # A probe during plain steps, or the best tree: whether it pays, not what exploring costs.
            plain_ms = self.fallback.plain_step_ms(self.plain_step_ms())
            # The draft's own tokens: prompt lookup's ride on plain steps as well (generation.plain_steps),
            # so they argue for neither.
            self.fallback.observe(len(path) + 1, cycle_ms, plain_ms, lambda: self.trees_hopeless(plain_ms))
        self._choose()

    def _rate(self, shape: TreeShape, depths: Sequence[int], path: Sequence[int]) -> None:
        """Every cell this tree holds (its nodes' ``depths``, root first, in selection order) learns how
        many of the accepted ``path``'s nodes it would have held; older cycles count less."""
        for cell in self.cells:
            self.weight[cell] *= self.decay
            self.accepted_sum[cell] *= self.decay
        for depth_limit in range(1, shape.depth + 1):
            # Rank of each node among the nodes no deeper than depth_limit.
            rank_within, count = {}, 0
            for node in range(1, len(depths)):
                if depths[node] <= depth_limit:
                    rank_within[node] = count
                    count += 1
            for cell_size in self.bounds.tree_sizes:
                cell = (cell_size, depth_limit, shape.top_k)
                if cell not in self.weight or cell_size - 1 > count:
                    continue  # a larger tree than this one holds: not observable here
                inside = 0
                for node in path:
                    if node not in rank_within or rank_within[node] >= cell_size - 1:
                        break
                    inside += 1
                self.weight[cell] += 1.0
                self.accepted_sum[cell] += inside

    def describe(self) -> str:
        size, depth, top_k = self.best
        tokens = self.expected_tokens(self.best)
        expected = f"{tokens:.2f} tokens per cycle" if tokens is not None else "no acceptance data yet"
        costs = self.costs()
        draft, verify = costs.draft[top_k][depth], costs.verify[size]
        return (f"T={size} depth={depth} top_k={top_k} ({expected}; draft {draft:.1f} ms, "
                f"verify {verify:.1f} ms, other {self.ipc_ms:.1f} ms per cycle); alone: {self.fallback.describe()}")


def optimistic_tokens(depth: int) -> float:
    """A cycle's expected tokens with ``depth`` draft levels each accepted at ``OPTIMISTIC_ACCEPTANCE``."""
    return sum(OPTIMISTIC_ACCEPTANCE ** level for level in range(depth + 1))


def drafting_cannot_pay(verify_ms: Mapping[int, float], draft_ms: Mapping[int, float],
                        bounds: AutoTree) -> str | None:
    """A message when even a draft whose every token were accepted could not beat plain
    decoding with the measured costs; else None."""
    plain = interpolate(verify_ms, 1)
    best_rate, best_cell = 0.0, (2, 1)
    for depth in range(1, bounds.max_depth + 1):
        sizes = [size for size in bounds.tree_sizes if size >= depth + 1]
        if not sizes:
            break
        cost = interpolate(draft_ms, depth) + interpolate(verify_ms, sizes[0])
        if (depth + 1) / cost > best_rate:
            best_rate, best_cell = (depth + 1) / cost, (sizes[0], depth)
    if best_rate * plain >= 1.0:
        return None
    size, depth = best_cell
    return (f"drafting cannot pay on this machine: a plain decode step costs {plain:.1f} ms, and even if every "
            f"drafted token were accepted the best tree (T={size}, depth {depth}: draft "
            f"{interpolate(draft_ms, depth):.1f} ms + verify {interpolate(verify_ms, size):.1f} ms) would emit "
            f"{best_rate * 1e3:.0f} tokens/s against {1e3 / plain:.0f} for --mode ar. Use --mode ar, or a draft "
            f"on a GPU (--draft-device cuda), or a larger target")
