"""The requests waiting to run: one queue per client, taken round-robin, with bounds.

A client that sends a hundred requests gets one turn per round like everybody else: a client
with one request waits for at most one request of each other client. Bounds per client and
in total keep the memory a flood can take small; beyond them :meth:`FairQueue.push` raises
:class:`QueueFull` and the caller answers ``busy`` at once.

A client is whatever hashable key the front end uses (a ZeroMQ routing id here).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ipc import messages as m

C = TypeVar("C", bound=Hashable)


@dataclass
class Pending(Generic[C]):
    """A request, who sent it, when it must be answered by (time.monotonic(), or None) and when it
    arrived."""

    client: C
    request: m.GenerateRequest
    deadline: float | None = None
    arrived: float = field(default_factory=time.monotonic)


class QueueFull(Exception):
    """No room for one more request; the message says which bound was hit."""


class FairQueue(Generic[C]):
    def __init__(self, max_total: int, max_per_client: int):
        if max_total < 1 or max_per_client < 1:
            raise ValueError("queue bounds must be at least 1")
        self.max_total = max_total
        self.max_per_client = max_per_client
        # Insertion order is the rotation: the first client is served next, then moved last.
        self._by_client: dict[C, collections.deque[Pending[C]]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, item: Pending[C]) -> None:
        waiting = self._by_client.get(item.client)
        if waiting is not None and len(waiting) >= self.max_per_client:
            raise QueueFull(f"this client already has {len(waiting)} requests waiting (the limit per client)")
        if self._size >= self.max_total:
            raise QueueFull(f"{self._size} requests are waiting (the server's limit)")
        if waiting is None:
            waiting = self._by_client[item.client] = collections.deque()
        waiting.append(item)
        self._size += 1

    def pop(self) -> Pending[C] | None:
        """The next request, round-robin over clients; None when nothing waits."""
        for client, waiting in self._by_client.items():
            item = waiting.popleft()
            del self._by_client[client]
            if waiting:
                self._by_client[client] = waiting  # back of the rotation
            self._size -= 1
            return item
        return None

    def remove(self, client: C, request_id: str) -> Pending[C] | None:
        """Take out one waiting request (a cancel); None when it is not waiting."""
        waiting = self._by_client.get(client)
        if waiting is None:
            return None
        for item in waiting:
            if item.request.request_id == request_id:
                waiting.remove(item)
                self._forget_if_empty(client)
                self._size -= 1
                return item
        return None

    def waiting(self, client: C, request_id: str) -> bool:
        """Whether ``client`` has a request ``request_id`` waiting."""
        return any(item.request.request_id == request_id for item in self._by_client.get(client, ()))

    def drop_client(self, client: C) -> list[Pending[C]]:
        """Take out every request of one client (it left, or stopped reading)."""
        waiting = self._by_client.pop(client, None) or collections.deque()
        self._size -= len(waiting)
        return list(waiting)

    def expired(self, now: float) -> list[Pending[C]]:
        """Take out every request whose deadline has passed."""
        late: list[Pending[C]] = []
        for client in list(self._by_client):
            waiting = self._by_client[client]
            if not any(item.deadline is not None and item.deadline <= now for item in waiting):
                continue
            keep = collections.deque(item for item in waiting if item.deadline is None or item.deadline > now)
            late.extend(item for item in waiting if item.deadline is not None and item.deadline <= now)
            self._size -= len(waiting) - len(keep)
            self._by_client[client] = keep
            self._forget_if_empty(client)
        return late

    def drain(self) -> list[Pending[C]]:
        """Take out everything, in the order it would have run."""
        items = []
        while (item := self.pop()) is not None:
            items.append(item)
        return items

    def clients(self) -> list[C]:
        return list(self._by_client)

    def _forget_if_empty(self, client: C) -> None:
        if not self._by_client.get(client, True):
            del self._by_client[client]
