"""When a request alone should stop drafting: plain decode steps where trees do not pay.

A tree pays when its cycle emits more tokens per second than a plain decode step would. Where the
target's step costs little beside the draft's step and the round trips (a 135M model on two cores:
~4.4 ms a step, a cycle of the smallest useful tree ~8 ms), trees emit fewer tokens per second than
``--mode ar`` whatever the text: the demo's pair ran at 0.53-0.78x of ar.

Two conditions, both needed. The costs must leave trees little room: every shape would need most of
its possible tokens to break even (``TreePlanner.trees_hopeless``); where they have room (the 7B
stand-in), a hard patch of text keeps its trees, as the rest of the answer pays. And the recent solo
cycles (tokens and wall time, decaying by ``RECENT_DECAY`` a cycle; the planner's long-lived
acceptance estimates play no part) must emit clearly fewer tokens per second than plain steps
(``CLEARLY_SLOWER``), over at least ``PLAIN_EVIDENCE`` cycles. Then the request decodes plainly,
timing its plain steps (the planner's estimate of one is all it has before), and every
``probe_every`` steps verifies the smallest tree (``TreePlanner.plain_probe``): one that clearly
pays by itself ends the plain stretch at once. A stretch of trees that turns plain again soon
doubles the probe interval (up to ``PROBE_EVERY_MAX``); one that holds sets it back to ``PROBE_EVERY``.

No torch here: the coordinator runs this.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .plain_runs import LONGEST_RUN

PLAIN_EVIDENCE = 12  # solo tree cycles the verdict needs (since the start or the last plain stretch)
# Plain only where the trees are clearly slower: their recent rate, over ~10 cycles of 1-4 tokens,
# moves by ~5% with the luck of the draws alone.
CLEARLY_SLOWER = 0.9
RECENT_DECAY = 0.9  # per cycle: the verdict reads about the last ten cycles
PROBE_EVERY = 16  # plain steps between two probe trees, at first
PROBE_EVERY_MAX = 256
GAP = 3.0  # the time between two plain steps' asks counts as a step only up to this many steps' worth
SMOOTHING = 0.2  # one step's weight in the decaying mean of a plain step's time


class PlainFallback:
    """Whether a request alone decodes plainly now, from the recent cycles' rate against a plain step's."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.plain = False
        self.settled = False  # plain for good (``settle_plain``)
        self.probe_every = PROBE_EVERY
        self._tokens = 0.0  # decayed sums over recent solo tree cycles
        self._ms = 0.0
        self._cycles = 0  # tree cycles since the start or since the last plain stretch ended
        self._taken = 0  # plain steps taken alone in the current stretch (``stepped``)
        self._taken_at_ask = 0  # ... when ``step_plain`` was last asked
        self._probe_at = PROBE_EVERY - 1  # a probe tree once this many are taken, then every PROBE_EVERY
        self._probed = False  # the trees now running came back on a probe
        self._step_ms: float | None = None  # what the plain steps took, wall time (decaying mean)
        self._last_step: float | None = None  # when the last plain step was asked for
        self._estimate: float | None = None  # the planner's latest estimate of a plain step

    def step_plain(self) -> bool:
        """Asked before each call while plain: True for plain steps (at most ``run_cap()`` in the call;
        each one taken is told to ``stepped``), False where a probe tree is due. The time between two
        asks, a step's share of it, is a plain step's whole cost: the one thing the verdict must not
        guess (the planner's estimate ran 25% over at the demo's 4.3 ms a step)."""
        now = self.clock()
        reference = self._step_ms or self._estimate
        steps = self._taken - self._taken_at_ask
        if self._last_step is not None and steps > 0:
            took = (now - self._last_step) * 1e3 / steps
            # Far longer than a step: a gap (the request ended, the next one's prompt ran), not a step.
            if reference is None or took <= GAP * reference:
                weight = 1.0 - (1.0 - SMOOTHING) ** steps  # a run weighs as its steps one a call would
                self._step_ms = took if self._step_ms is None else self._step_ms + weight * (took - self._step_ms)
        plain = self.settled or self._taken < self._probe_at
        if not plain:
            self._probe_at += self.probe_every
        self._last_step = now if plain else None
        self._taken_at_ask = self._taken
        return plain

    def stepped(self, steps: int = 1) -> None:
        """A lone sequence took ``steps`` plain steps (counted toward the next probe, wherever the
        stretch goes: a batch forming, the request ending)."""
        self._taken += steps

    def run_cap(self) -> int:
        """The most plain steps the call just allowed may take: those before the next probe is due
        (any number once settled)."""
        return LONGEST_RUN if self.settled else max(1, self._probe_at - self._taken)

    def settle_plain(self) -> None:
        """Plain from now on, without probes: the costs leave no tree a chance
        (``TreePlanner.trees_futile``), so no stretch of poor cycles need say so first, and no probe
        could say otherwise (a request's first draft step reads its kept prompt: not timed)."""
        self.plain, self.settled = True, True

    def interrupt(self) -> None:
        """Something other than a plain step comes next (a batch formed): do not time it as one."""
        self._last_step = None

    def plain_step_ms(self, estimate: float) -> float:
        """What a plain step costs: as timed, once plain steps have run; ``estimate`` (the planner's) before."""
        self._estimate = estimate
        return self._step_ms or estimate

    def observe(self, tokens: int, cycle_ms: float, plain_step_ms: float,
                hopeless: Callable[[], bool] = lambda: True) -> None:
        """A solo tree cycle that emitted ``tokens`` in ``cycle_ms``; ``plain_step_ms``: a plain decode
        step's cost (``plain_step_ms``); ``hopeless()``: whether trees need near-perfect acceptance to pay
        here at all (``TreePlanner.trees_hopeless``, asked only when the recent cycles say plain): only
        then do poor recent cycles turn plain."""
        if cycle_ms <= 0 or plain_step_ms <= 0:
            return
        if self.plain:
            if CLEARLY_SLOWER * tokens * plain_step_ms > cycle_ms:  # the probe paid: trees again, judged afresh
                self.plain, self._probed = False, True
                self._tokens, self._ms, self._cycles = float(tokens), cycle_ms, 1
            return
        self._tokens = self._tokens * RECENT_DECAY + tokens
        self._ms = self._ms * RECENT_DECAY + cycle_ms
        self._cycles += 1
        slower = self._cycles >= PLAIN_EVIDENCE and self._tokens * plain_step_ms < CLEARLY_SLOWER * self._ms
        if slower and hopeless():
            if self._probed:
                # Trees a probe brought back that lasted about one verdict's worth of cycles: probe
                # half as often this time; trees that held for longer: as often as at first.
                quick = self._cycles < 2 * PLAIN_EVIDENCE
                self.probe_every = min(2 * self.probe_every, PROBE_EVERY_MAX) if quick else PROBE_EVERY
            self.plain, self._taken, self._taken_at_ask, self._probe_at = True, 0, 0, self.probe_every - 1

    def describe(self) -> str:
        state = ("plain (no tree can pay here)" if self.settled
                 else f"plain (a probe tree every {self.probe_every} steps)" if self.plain else "trees")
        rate = f", recent trees {self._tokens / self._ms * 1e3:.1f} tokens/s" if self._ms > 0 else ""
        step = f", plain steps {1e3 / self._step_ms:.1f} tokens/s" if self._step_ms else ""
        return state + rate + step
