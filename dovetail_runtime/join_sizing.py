"""How many prompt tokens a sequence joining a busy batch takes per round (``--join-chunk auto``).

A prompt chunk rides in the running streams' round (``batching``) and lengthens it by what its
rows cost, so a chunk sized to about one round's own cost delays them by about one cycle per
round, while the joining prompt still goes in as fast as that allows. Both costs are measured as
rounds run (their wall time: the target's pass, the draft's reading of the rows, the messages):
a round of running streams without prompt work is their cycle, and a round with a chunk, less a
cycle, is what its rows add. A chunk grows at most twofold from one round to the next, so one noisy
round cannot stall the others for a whole ``--prefill-chunk``.

Only for a target whose prompt bits do not depend on how the prompt is cut
(``TargetInfo.chunk_invariant``): these sizes follow the load, a request's tokens must not.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_ROWS = 8  # a chunk's rows before any round with a chunk has been measured
SMOOTHING = 0.3  # the newest round's weight in the running averages


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


@dataclass
class JoinSizer:
    """The rows of the next joining chunk, from the rounds observed so far."""

    limit: int  # never more rows than this (--prefill-chunk)
    cycle_ms: float | None = None  # a round of running streams without prompt work
    row_ms: float | None = None  # what one prompt row adds to a round
    last_rows: int = 0  # the last measured chunk's rows

    def rows(self) -> int:
        if self.cycle_ms is None or self.row_ms is None:
            return max(1, min(FIRST_ROWS, self.limit))
        fitting = int(self.cycle_ms / self.row_ms) if self.row_ms > 0 else self.limit
        return max(1, min(self.limit, 2 * self.last_rows, fitting))

    def observe(self, round_ms: float, steps: int, chunk_rows: int, prompt_work: bool) -> None:
        """One round: its wall time, how many running streams' steps it made (decode steps, trees,
        draft steps), its prompt chunk's rows (0: none) and whether it did any prompt work (a
        chunk, or the draft reading one)."""
        if steps == 0:  # only prompts ran: no one was held up, and no cycle to compare with
            return
        if not prompt_work:
            self.cycle_ms = _average(self.cycle_ms, round_ms)
        elif chunk_rows > 0 and self.cycle_ms is not None:
            self.row_ms = _average(self.row_ms, max(round_ms - self.cycle_ms, 0.0) / chunk_rows)
            self.last_rows = chunk_rows

    def describe(self) -> str:
        if self.cycle_ms is None or self.row_ms is None:
            return f"{self.rows()} rows (not measured yet)"
        return f"{self.rows()} rows (cycle {self.cycle_ms:.1f} ms, {self.row_ms:.2f} ms a prompt row)"
