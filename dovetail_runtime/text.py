"""Turning streamed token ids into text: incremental decoding and stop strings.

Text is decoded the way the tokenizer means it: starting from the prompt, so that a
sentencepiece (Llama-2, Mistral) tokenizer keeps the space before the first new word
(``'The capital is'`` + ``▁Paris`` gives ``' Paris'``, where decoding the new tokens alone
gives ``'Paris'``), and in windows, so that each chunk costs decoding its own tokens and the
previous chunk's, never the whole completion again.

The window scheme is the classic one (transformers' TextStreamer, vLLM, tokenizers'
DecodeStream): ``prefix`` and ``read`` are offsets into the ids; the text of
``ids[prefix:read]`` was already shown, so the new text is what ``ids[prefix:]`` decodes to
beyond it. We run it over our own ``Tokenizer.decode`` (not DecodeStream) so that the
tokenizer's clean-up rules and ``skip_special_tokens`` apply exactly as in a full decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded with the first new tokens: enough context for any decoder rule that
# looks at the token before (a word-start marker, a byte sequence the prompt began).
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so a decode that still ends in U+FFFD this many tokens
# after it started holding back is a real U+FFFD, not an incomplete character: show it.
MAX_HELD_TOKENS = 64


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDecoder:
    """Decodes a growing list of ids piece by piece; the pieces add up to one full decode."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        self._held_from: int | None = None  # where the ids that end in an incomplete character began
        self._early = 0  # characters shown beyond ``_prefix_text`` while a character was incomplete

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add ids; return the text they complete ("" while a character is still incomplete)."""
        before = len(self._ids)
        self._ids.extend(token_ids)
        text = self._decode(self._prefix)
        if text.endswith("\ufffd"):
            self._held_from = before if self._held_from is None else self._held_from
            if len(self._ids) - self._held_from < MAX_HELD_TOKENS:
                # An incomplete UTF-8 sequence: show the text before it, wait for the tokens that finish it.
                delta = text.rstrip("\ufffd")[len(self._prefix_text) + self._early:]
                self._early += len(delta)
                return delta
        return self._advance(text)

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character shows as U+FFFD)."""
        return self._advance(self._decode(self._prefix)) if self._read < len(self._ids) else ""

    def _advance(self, text: str) -> str:
        # A decoder that rewrote the shown text cannot take it back; like vLLM, show what follows it.
        delta = text[len(self._prefix_text) + self._early:]
        self._prefix, self._read = self._read, len(self._ids)
        self._held_from, self._early = None, 0
        self._prefix_text = self._decode(self._prefix, self._read)
        if self._prefix > 4 * MAX_HELD_TOKENS:  # keep the id list short: windows never look back further
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta


class TextStream:
    """Accumulates new tokens; ``push`` returns the text that is now final to show.

    Text is held back while it ends in an incomplete UTF-8 sequence or in what could be the
    start of a stop string; a stop string cuts the text before it and ends the request.
    ``prompt_ids`` give the decoder its starting context (see the module docstring).
    """

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = (), prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.stopped = False
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids, skip_special_tokens)
        self._shown: list[str] = []  # the final text so far, in pieces (joining each time would be quadratic)
        # Decoded text not shown yet: it could be the start of a stop string. Never longer than
        # the longest stop string, so searching it costs the same for every chunk.
        self._pending = ""

    @property
    def text(self) -> str:
        """The final text so far (after a stop: cut before the stop string)."""
        if len(self._shown) > 1:
            self._shown = ["".join(self._shown)]
        return self._shown[0] if self._shown else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly final text ("" when nothing is final yet). With stop strings the
        tokens go in one at a time, and those after the one that completes a stop string are not taken
        (``token_ids`` ends there, as a decode one token at a time would have)."""
        if self.stopped:
            return ""
        if not self.stop:
            self.token_ids.extend(token_ids)
            return self._release(self._decoder.push(token_ids), final=False)
        shown = []
        for token in token_ids:
            self.token_ids.append(token)
            shown.append(self._release(self._decoder.push([token]), final=False))
            if self.stopped:
                break
        return "".join(shown)

    def finish(self) -> str:
        """At the end of the request: whatever was held back (no stop string completed)."""
        if self.stopped:
            return ""
        return self._release(self._decoder.flush(), final=True)

    def _release(self, new_text: str, final: bool) -> str:
        pending = self._pending + new_text
        cut = self._first_stop(pending)
        if cut is not None:
            self.stopped = True
            shown, self._pending = pending[:cut], ""
        else:
            keep = 0 if final else self._held_back(pending)
            shown, self._pending = pending[: len(pending) - keep], pending[len(pending) - keep:]
        if shown:
            self._shown.append(shown)
        return shown

    def _first_stop(self, text: str) -> int | None:
        # The shown text never holds the start of a stop string (it would have been held back),
        # so a stop string can only begin in the pending text.
        positions = [index for index in (text.find(s) for s in self.stop) if index >= 0]
        return min(positions) if positions else None

    def _held_back(self, text: str) -> int:
        """Length of the longest end of ``text`` that could begin a stop string."""
        held = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held
