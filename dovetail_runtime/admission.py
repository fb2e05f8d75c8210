"""Admission by KV-cache memory: a request starts only when the target KV cache its context can
grow to still fits the server's budget.

Each sequence's cache is committed as it fills (``cpu_worker.model.llama.KVCache``), so what a
request can take is its prompt plus ``max_new_tokens`` (at most the context) times the bytes a
token's keys and values take in every layer. That much is reserved when the request starts and
returned when it ends, so the running requests can never together outgrow the budget however
long they run. A request that waits for memory holds the head of the line (the next one does not
jump it); one that could not fit even alone is refused at once.
"""

from __future__ import annotations

from collections.abc import Hashable


class KvBudget:
    def __init__(self, budget_bytes: int, bytes_per_token: float, max_len: int):
        if budget_bytes <= 0 or bytes_per_token <= 0 or max_len < 1:
            raise ValueError(f"a KV budget needs positive sizes, got {budget_bytes} B, {bytes_per_token} B "
                             f"per token, a context of {max_len}")
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self.max_len = max_len
        self._reserved: dict[Hashable, int] = {}

    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values())

    def need(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Bytes the request's cache can grow to."""
        return int(min(self.max_len, prompt_tokens + max_new_tokens) * self.bytes_per_token)

    def ever_fits(self, need: int) -> bool:
        return need <= self.budget_bytes

    def fits(self, need: int) -> bool:
        return self.reserved_bytes + need <= self.budget_bytes

    def reserve(self, key: Hashable, need: int) -> None:
        self._reserved[key] = need

    def release(self, key: Hashable) -> None:
        self._reserved.pop(key, None)

    def refusal(self, need: int) -> str:
        """Why a request that can never fit is refused, in one line."""
        per_token = self.bytes_per_token
        return (f"the request's KV cache can grow to {size_text(need)} ({need / per_token:.0f} tokens x "
                f"{size_text(per_token)}), more than the server's KV budget of {size_text(self.budget_bytes)} "
                f"(--kv-memory): ask for fewer max_new_tokens or a shorter prompt")


def size_text(size: float) -> str:
    """Bytes in GB, MB or kB, whichever shows three significant digits: a small model's budget and
    need were both "0.00 GB" (and a token's "0.01 MB"), which told the user nothing."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.0f} B"
