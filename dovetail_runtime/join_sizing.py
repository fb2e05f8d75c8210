"""How many prompt tokens a sequence joining a busy batch takes per round (``--join-chunk auto``).

A prompt chunk rides in the running streams' round (``batching``) and lengthens it by what its
rows cost, so a chunk sized to about one round's own cost delays them by about one cycle per
round, while the joining prompt still goes in as fast as that allows. Both costs are measured as
rounds run (their wall time: the target's pass, the draft's reading of the rows, the messages):
a round of running streams without prompt work is their cycle (kept per number of streams, as a
round's cost follows its size), and a round with a chunk, less the cycle, is what the chunk adds.
Its average per row sizes the next chunk: were part of it fixed (the draft's call to read the rows,
the messages), a chunk sized so settles where the fixed part and the rows together make one cycle.
Where the fixed part is a cycle or more, no size can, and sized per row the chunks would shrink to
one row, each still paying it (seen before the chunk rode in the native layer loop: 8 ms of a 135M
target's Python layers beside a 6 ms cycle, 40-token prompts in one-row chunks and the batch at half
its speed). So the fixed part is fitted apart too (``ChunkCost``, a line through the chunk rounds),
and the line only ever lifts a chunk: to the rows that fit beside the fixed part in a cycle, or
where that part is over half a cycle, to rows that cost at least as much as it (each round then
delays the others by about twice that fixed part). A chunk grows at most twofold from one round
to the next, so one noisy round cannot stall the others for a whole ``--prefill-chunk``. While
every round carries prompt work no cycle could be measured, so the batch holds a prompt's chunk back
for a round when it has never seen a clean round of that many streams, and again every
``PROBE_EVERY`` chunks (so one odd round does not size a whole prompt's chunks, and the cycle
follows the streams' trees as they change). The sizes lag the rounds by one: a chunk is asked for
before its round runs (a prompt's first chunk when it arrives: one that arrives while another prompt
prefills, with no stream decoding yet, takes a whole ``--prefill-chunk`` first).

Chunks sized so only for a target whose prompt bits do not depend on how the prompt is cut
(``TargetInfo.chunk_invariant``): these sizes follow the load, a request's tokens must not. For
one whose bits do (fp32, bf16) the sizer measures the cycle alone: a ``--prefill-chunk`` piece that
runs apart goes that many ms of its layers a round (``part_budget_ms``; ``cpu_worker.prompt_parts``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FIRST_ROWS = 8  # a chunk's rows before any round with a chunk has been measured
SMOOTHING = 0.3  # the newest round's weight in the running averages
# A round whose draft read more prompt rows than this many times its chunk's (a prompt that ran
# alone until now, its rows read at once; a first draft step) says little about a row's cost.
DRAFT_ROWS_RATIO = 2
PROBE_EVERY = 16  # chunk rounds between two rounds held clean of prompt work (the joining prompt: ~6% later)
MIN_FIT_ROUNDS = 4  # chunk rounds before a fitted fixed part is believed
FIRST_PART_MS = 1e-3  # a piece's part before any cycle is measured: one layer


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


@dataclass
class ChunkCost:
    """What a prompt chunk adds to its round: the average time per row, and a line ``fixed_ms +
    row_ms * rows`` fitted through the chunk rounds (least squares, each new round weighing
    ``SMOOTHING``: exponentially weighted means, variance and covariance of rows and added time)."""

    count: int = 0
    mean_rows: float = 0.0
    mean_ms: float = 0.0
    var_rows: float = 0.0
    cov: float = 0.0
    fitted: tuple[float, float] | None = None  # (fixed_ms, row_ms) when the rows last differed enough

    def add(self, rows: int, ms: float) -> None:
        if self.count == 0:
            self.mean_rows, self.mean_ms = float(rows), ms
        else:
            d_rows, d_ms = rows - self.mean_rows, ms - self.mean_ms
            self.mean_rows += SMOOTHING * d_rows
            self.mean_ms += SMOOTHING * d_ms
            self.var_rows = (1 - SMOOTHING) * (self.var_rows + SMOOTHING * d_rows * d_rows)
            self.cov = (1 - SMOOTHING) * (self.cov + SMOOTHING * d_rows * d_ms)
        self.count += 1
        if self.var_rows >= max(0.05, 0.01 * self.mean_rows ** 2):  # sizes far enough apart to tell
            row_ms = max(self.cov / self.var_rows, 0.0)
            fixed_ms = self.mean_ms - row_ms * self.mean_rows
            self.fitted = (fixed_ms, row_ms) if fixed_ms >= 0.0 else (0.0, self.mean_ms / self.mean_rows)

    def per_row_ms(self) -> float | None:
        """The chunks' added time over their rows (averages); None before any chunk round."""
        return self.mean_ms / self.mean_rows if self.count else None


@dataclass
class JoinSizer:
    """The rows of the next joining chunk, from the rounds observed so far."""

    limit: int  # never more rows than this (--prefill-chunk)
    cycles_ms: dict[int, float] = field(default_factory=dict)  # running streams -> a round without prompt work
    cost: ChunkCost = field(default_factory=ChunkCost)  # what a chunk adds to a round
    last_rows: int = 0  # the last measured chunk's rows
    chunks_since_clean: int = 0  # rounds with a chunk since the last round without prompt work

    def wants_clean_round(self, streams: int) -> bool:
        """Whether the next round should run without a prompt chunk, to measure the cycle of
        ``streams`` running streams: never measured, or not for ``PROBE_EVERY`` chunks."""
        return streams not in self.cycles_ms or self.chunks_since_clean >= PROBE_EVERY

    def cycle_ms(self, streams: int) -> float | None:
        """A round of ``streams`` running streams: measured, else the nearest size measured."""
        if not self.cycles_ms:
            return None
        nearest = min(self.cycles_ms, key=lambda size: (abs(size - streams), -size))
        return self.cycles_ms[nearest]

    def part_budget_ms(self, streams: int) -> float:
        """The ms of layers a piece that runs apart may take in a round beside ``streams`` running
        streams: one of their cycles (one layer before any is measured)."""
        cycle = self.cycle_ms(streams)
        return FIRST_PART_MS if cycle is None else cycle

    def target_rows(self, streams: int) -> int | None:
        """The largest chunk that adds at most about one cycle of ``streams`` streams to a round, or
        where a chunk's fixed part is over half a cycle, the smallest whose rows cost as much as it:
        None before both a cycle and a chunk are measured."""
        cycle, per_row = self.cycle_ms(streams), self.cost.per_row_ms()
        if cycle is None or per_row is None:
            return None
        # (per_row may be 0 or tiny after noisy rounds: then the growth cap and the limit decide.)
        rows = self.limit if per_row * self.limit <= cycle else max(1, int(cycle / per_row + 1e-9))
        # Sized per row, a fixed part keeps chunks smaller than they need be (at a cycle or more, one
        # row): the fitted line lifts them, never lowers them (not from the first few rounds, whose
        # noise can show a fixed part that is not there).
        if self.cost.fitted is not None and self.cost.count >= MIN_FIT_ROUNDS:
            fixed_ms, row_ms = self.cost.fitted
            if row_ms > 0.0:
                fitting = (math.ceil(fixed_ms / row_ms - 1e-9) if fixed_ms > cycle / 2
                           else int((cycle - fixed_ms) / row_ms + 1e-9))
                rows = max(rows, fitting)
        return min(rows, self.limit)

    def rows(self, streams: int) -> int:
        """The next chunk's rows while ``streams`` streams run."""
        target = self.target_rows(streams)
        if target is None:
            return max(1, min(FIRST_ROWS, self.limit))
        return max(1, min(target, 2 * self.last_rows))

    def observe(self, round_ms: float, streams: int, chunk_rows: int, draft_rows: int, prompt_work: bool,
                part: bool = False) -> None:
        """One round: its wall time, how many running streams stepped in it (decode steps, trees,
        draft steps), its prompt chunk's rows (0: none), the prompt rows the draft read in it,
        whether it did any prompt work (a chunk, the draft reading prompt rows), and whether that
        was part of a chunk's layers (``Job.join_budget``: only the cycle is measured then)."""
        if streams == 0:  # only prompts ran: no one was held up, and no cycle to compare with
            return
        if not prompt_work:
            self.cycles_ms[streams] = _average(self.cycles_ms.get(streams), round_ms)
            self.chunks_since_clean = 0
            return
        self.chunks_since_clean += chunk_rows > 0 or part
        cycle = self.cycle_ms(streams)
        if chunk_rows > 0 and cycle is not None and draft_rows <= DRAFT_ROWS_RATIO * chunk_rows:
            self.cost.add(chunk_rows, max(round_ms - cycle, 0.0))
            self.last_rows = chunk_rows

    def describe(self, streams: int) -> str:
        target, cycle, per_row = self.target_rows(streams), self.cycle_ms(streams), self.cost.per_row_ms()
        if target is None or cycle is None or per_row is None:
            return "not measured yet"
        fitted = self.cost.fitted
        fixed = "" if fitted is None else f"; fitted: {fitted[0]:.2f} ms a chunk and {fitted[1]:.2f} ms a row"
        return f"{target} rows (cycle {cycle:.1f} ms, {per_row:.2f} ms a prompt row{fixed})"
