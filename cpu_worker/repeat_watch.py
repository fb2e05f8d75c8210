"""Where a sequence's newest token pair repeats an earlier one: where a run of plain steps hands the
sequence back to the coordinator, whose prompt lookup then has a branch to offer (``m.DecodeRun``'s
``stop_at_repeat``; the lookup matches the last 2-4 tokens' earlier occurrence). The coordinator asks
lookup only between calls, so without this a run skipped every copy that began inside it: on a code
answer whose copies are 4-5 tokens long, all of them.

Every token of the sequence passes through the cpu_worker (its prompt, and each token it picks), so
the pairs are kept here rather than sent with each run. A wrong answer costs speed, never a token.
"""

from __future__ import annotations

from collections.abc import Iterable


class RepeatWatch:
    """The token pairs of one sequence so far, and whether the newest repeats an earlier one."""

    def __init__(self) -> None:
        self._pairs: set[tuple[int, int]] = set()
        self._last: int | None = None
        self.repeated = False  # the newest token and the one before it occurred together earlier

    def add(self, tokens: Iterable[int]) -> bool:
        """Append ``tokens``; returns ``repeated`` for the last of them."""
        for token in tokens:
            if self._last is not None:
                pair = (self._last, token)
                self.repeated = pair in self._pairs
                self._pairs.add(pair)
            self._last = token
        return self.repeated
