"""Turning streamed token ids into text: incremental decoding and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    """Accumulates new tokens; ``push`` returns the text that is now final to show.

    Text is held back while it ends in an incomplete UTF-8 sequence (the tokenizer shows
    U+FFFD) or in what could be the start of a stop string; a stop string cuts the text
    before it and ends the request.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.text = ""  # the final text so far (after a stop: cut before the stop string)
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly final text ("" when nothing is final yet)."""
        self.token_ids.extend(token_ids)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._first_stop(full)
        if cut is not None:
            self.stopped = True
            final = full[:cut]
        else:
            final = full[: len(full) - self._held_back(full)]
        if not final.startswith(self.text):  # a tokenizer that rewrites earlier text: resend nothing twice
            return ""
        delta = final[len(self.text):]
        self.text = final
        return delta

    def finish(self) -> str:
        """At the end of the request: whatever was held back (no stop string completed)."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full if full.startswith(self.text) else self.text
        return delta

    def _first_stop(self, text: str) -> int | None:
        found = (text.find(s, max(len(self.text) - len(s), 0)) for s in self.stop)
        positions = [index for index in found if index >= 0]
        return min(positions) if positions else None

    def _held_back(self, text: str) -> int:
        held = 0
        if text.endswith("\ufffd"):
            held = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held
