"""How many prompt tokens a sequence joining a busy batch takes per round (``--join-chunk auto``).

A prompt chunk rides in the running streams' round (``batching``) and lengthens it by what its
rows cost, so a chunk sized to about one round's own cost delays them by about one cycle per
round, while the joining prompt still goes in as fast as that allows. Both costs are measured as
rounds run (their wall time: the target's pass, the draft's reading of the rows, the messages):
a round of running streams without prompt work is their cycle (kept per number of streams, as a
round's cost follows its size), and a round with a chunk, less the cycle, is what its rows add.
A chunk grows at most twofold from one round to the next, so one noisy round cannot stall the
others for a whole ``--prefill-chunk``. While every round carries prompt work no cycle could be
measured, so the batch holds a prompt's chunk back for a round when it has never seen a clean
round of that many streams, and again every ``PROBE_EVERY`` chunks (so one odd round does not
size a whole prompt's chunks, and the cycle follows the streams' trees as they change). The
sizes lag the rounds by one: a chunk is asked for before its round runs (a prompt's first chunk
when it arrives: one that arrives while another prompt prefills, with no stream decoding yet,
takes a whole ``--prefill-chunk`` first).

Only for a target whose prompt bits do not depend on how the prompt is cut
(``TargetInfo.chunk_invariant``): these sizes follow the load, a request's tokens must not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_ROWS = 8  # a chunk's rows before any round with a chunk has been measured
SMOOTHING = 0.3  # the newest round's weight in the running averages
# A round whose draft read more prompt rows than this many times its chunk's (a prompt that ran
# alone until now, its rows read at once; a first draft step) says little about a row's cost.
DRAFT_ROWS_RATIO = 2
PROBE_EVERY = 16  # chunk rounds between two rounds held clean of prompt work (the joining prompt: ~6% later)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


@dataclass
class JoinSizer:
    """The rows of the next joining chunk, from the rounds observed so far."""

    limit: int  # never more rows than this (--prefill-chunk)
    cycles_ms: dict[int, float] = field(default_factory=dict)  # running streams -> a round without prompt work
    row_ms: float | None = None  # what one prompt row adds to a round
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

    def rows(self, streams: int) -> int:
        """The next chunk's rows while ``streams`` streams run."""
        cycle = self.cycle_ms(streams)
        if cycle is None or self.row_ms is None:
            return max(1, min(FIRST_ROWS, self.limit))
        # (row_ms may be 0 or tiny after noisy rounds: then the growth cap and the limit decide.)
        fitting = self.limit if self.row_ms * self.limit <= cycle else int(cycle / self.row_ms)
        return max(1, min(self.limit, 2 * self.last_rows, fitting))

    def observe(self, round_ms: float, streams: int, chunk_rows: int, draft_rows: int, prompt_work: bool) -> None:
        """One round: its wall time, how many running streams stepped in it (decode steps, trees,
        draft steps), its prompt chunk's rows (0: none), the prompt rows the draft read in it, and
        whether it did any prompt work (a chunk, the draft reading prompt rows)."""
        if streams == 0:  # only prompts ran: no one was held up, and no cycle to compare with
            return
        if not prompt_work:
            self.cycles_ms[streams] = _average(self.cycles_ms.get(streams), round_ms)
            self.chunks_since_clean = 0
            return
        self.chunks_since_clean += chunk_rows > 0
        cycle = self.cycle_ms(streams)
        if chunk_rows > 0 and cycle is not None and draft_rows <= DRAFT_ROWS_RATIO * chunk_rows:
            self.row_ms = _average(self.row_ms, max(round_ms - cycle, 0.0) / chunk_rows)
            self.last_rows = chunk_rows

    def describe(self, streams: int) -> str:
        cycle = self.cycle_ms(streams)
        if cycle is None or self.row_ms is None:
            return f"{self.rows(streams)} rows (not measured yet)"
        return f"{self.rows(streams)} rows (cycle {cycle:.1f} ms, {self.row_ms:.2f} ms a prompt row)"
