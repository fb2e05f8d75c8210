"""How much of prompt lookup's branch a ``--mode lookup`` step verifies.

Without a draft head a step verifies the target's next token plus a branch copied from earlier in the
text (``lookup.PromptLookup``). Each branch row costs what a verified row costs here: nearly nothing
where a pass is a read of the weights (a 7B model on a CPU with VNNI or AMX), close to a whole step
where it is arithmetic (a 135M model, or any model on AVX2 alone: the real pair's 2 rows cost 1.23x
one row on a Zen 3, 4 rows 2.2x). Verifying the whole branch every time lost 3% against plain
decoding on chat prompts there, where a 2-gram match's next token is right about a third of the time.

``BranchPolicy`` keeps, per branch position i, how often token i was accepted when the i - 1 before
it were (a decaying count, so a request that turns to copying is followed within a few steps; a
position seldom tried leans on the one before it, so a branch that keeps being accepted grows), and
verifies the prefix whose expected tokens per millisecond, from the measured t_verify(T), beat a
plain step's; none where no prefix does, but then every ``PROBE_EVERY``-th branch's first token, so
that a text that starts repeating is noticed. The tokens never change: a step emits what the target
picks, whatever the branch.

A branch grafted onto a draft tree (``choose_grafted``) is weighed the same way against the tree's
own cycle: its first tokens may follow the tree's nodes (free), each later one adds a row, and the
tokens it can add are the ones accepted past those. Grafting whole branches cost the 7B chat
stand-in at 16-bit activations on AVX2 (a row ~0.45 of a step) 900 ms cycles for 2 tokens against
370 ms for 1.4 without them, on chat where copies were seldom right.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .tree_planner import cheapest_from_here, interpolate

PRIOR_ACCEPTANCE = 0.5  # the first position's before any step: a guess worth PRIOR_WEIGHT observations
PRIOR_WEIGHT = 2.0  # a later position's prior is the estimate of the one before it, worth as much
DECAY = 0.9  # an observation's weight after each newer one at the same position (~10 steps remembered)
PROBE_EVERY = 8  # branches skipped before one's first token is verified anyway


class BranchPolicy:
    """Per request: ``choose(branch)`` before a step, ``observe(accepted)`` after it."""

    def __init__(self, verify_ms: Mapping[int, float]):
        if 1 not in verify_ms or max(verify_ms) < 2:
            raise ValueError("the policy needs t_verify(1), a plain step's cost, and of at least one larger T")
        # Non-decreasing (a timing taken in a busy spell is too high, never too low), and sizes between
        # measured ones interpolated: a tree planner's curve measures T = 1, 2, 3, 4, 6, 8, ...
        measured = cheapest_from_here(verify_ms)
        self.longest = max(measured) - 1
        self.cost = {size: interpolate(measured, size) for size in range(1, self.longest + 2)}
        self.hits = [0.0] * (self.longest + 1)  # index i: branch position i (1-based), decayed counts
        self.tries = [0.0] * (self.longest + 1)
        self.offered = 0  # branch tokens the last choice kept
        self.skipped = 0  # branches not verified since the last one that was

    def survivals(self, count: int) -> list[float]:
        """For branch positions 1..``count`` (at most ``longest``): the chance that the branch is
        accepted through it. Position i's acceptance: its counts, with the estimate of position
        i - 1 as the prior."""
        chances, survive, acceptance = [], 1.0, PRIOR_ACCEPTANCE
        for position in range(1, min(count, self.longest) + 1):
            acceptance = (self.hits[position] + PRIOR_WEIGHT * acceptance) / (self.tries[position] + PRIOR_WEIGHT)
            survive *= acceptance
            chances.append(survive)
        return chances

    def choose(self, branch: Sequence[int]) -> list[int]:
        """The prefix of ``branch`` a plain step verifies: the one with the most expected tokens a millisecond."""
        best, best_rate, expected = 0, 1.0 / self.cost[1], 1.0
        for length, survive in enumerate(self.survivals(len(branch)), start=1):  # only as far as the branch
            expected += survive
            rate = expected / self.cost[length + 1]
            if rate > best_rate:
                best, best_rate = length, rate
        return self._offer(branch, 0, best)

    def choose_grafted(self, branch: Sequence[int], shared: int, tree_tokens: float, tree_ms: float,
                       extra_ms: Callable[[int], float]) -> list[int]:
        """The prefix of ``branch`` to graft onto a draft tree whose cycle is expected to emit
        ``tree_tokens`` in ``tree_ms``: its first ``shared`` tokens follow the tree's own nodes
        (free: kept), each later one is a new row, ``extra_ms(rows)`` the verify pass's extra time for
        so many. A new row's token adds a token where the branch is accepted through it (the draft
        has no node there): the prefix with the most expected tokens a millisecond."""
        best, best_rate, gained = shared, tree_tokens / tree_ms, 0.0
        for length, survive in enumerate(self.survivals(len(branch)), start=1):
            if length <= shared:
                continue
            gained += survive
            rate = (tree_tokens + gained) / (tree_ms + extra_ms(length - shared))
            if rate > best_rate:
                best, best_rate = length, rate
        return self._offer(branch, shared, best)

    def _offer(self, branch: Sequence[int], free: int, best: int) -> list[int]:
        """``branch[:best]``, or one row past the ``free`` tokens every ``PROBE_EVERY``-th branch that
        would add none (so a text that starts repeating is noticed)."""
        if best == free and len(branch) > free:
            self.skipped += 1
            if self.skipped >= PROBE_EVERY:
                best = free + 1
        if best > free:
            self.skipped = 0
        self.offered = best
        return list(branch[:best])

    def observe(self, accepted: int) -> None:
        """The last chosen branch's tokens that were accepted (0 .. offered)."""
        for position in range(1, min(accepted + 1, self.offered, self.longest) + 1):
            self.tries[position] = self.tries[position] * DECAY + 1.0
            self.hits[position] = self.hits[position] * DECAY + (1.0 if position <= accepted else 0.0)
        self.offered = 0
