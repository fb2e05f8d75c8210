"""The requests waiting to run: one queue per user, taken round-robin, with bounds.

A user that sends a hundred requests gets one turn per round like everybody else: a user with
one request waits for at most one request of each other user. A user is the request's ``user``
where it names one (OpenAI's field; the HTTP front end also gives a request's n choices one
between them), else its client, whatever hashable key the front end uses (a ZeroMQ routing id
here): one connection is one user. Bounds per client and in total keep the memory a flood can
take small; beyond them :meth:`FairQueue.push` raises :class:`QueueFull` and the caller answers
``busy`` at once.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable
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

    @property
    def user(self) -> Hashable:
        """Whose turn in the rotation it waits for: its named user's, else its client's."""
        return ("user", self.request.user) if self.request.user is not None else ("client", self.client)


class QueueFull(Exception):
    """No room for one more request; the message says which bound was hit."""


class FairQueue(Generic[C]):
    def __init__(self, max_total: int, max_per_client: int):
        if max_total < 1 or max_per_client < 1:
            raise ValueError("queue bounds must be at least 1")
        self.max_total = max_total
        self.max_per_client = max_per_client
        # Insertion order is the rotation: the first user is served next, then moved last.
        self._by_user: dict[Hashable, collections.deque[Pending[C]]] = {}
        self._per_client: collections.Counter[C] = collections.Counter()  # waiting, for the bound
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, item: Pending[C]) -> None:
        waiting = self._per_client[item.client]
        if waiting >= self.max_per_client:
            raise QueueFull(f"this client already has {waiting} requests waiting (the limit per client)")
        if self._size >= self.max_total:
            raise QueueFull(f"{self._size} requests are waiting (the server's limit)")
        self._by_user.setdefault(item.user, collections.deque()).append(item)
        self._per_client[item.client] += 1
        self._size += 1

    def pop(self) -> Pending[C] | None:
        """The next request, round-robin over users; None when nothing waits."""
        for user, waiting in self._by_user.items():
            item = waiting.popleft()
            del self._by_user[user]
            if waiting:
                self._by_user[user] = waiting  # back of the rotation
            self._taken([item])
            return item
        return None

    def remove(self, client: C, request_id: str) -> Pending[C] | None:
        """Take out one waiting request (a cancel); None when it is not waiting."""
        taken = self._take(lambda item: item.client == client and item.request.request_id == request_id)
        return taken[0] if taken else None

    def waiting(self, client: C, request_id: str) -> bool:
        """Whether ``client`` has a request ``request_id`` waiting."""
        return any(item.client == client and item.request.request_id == request_id
                   for waiting in self._by_user.values() for item in waiting)

    def drop_client(self, client: C) -> list[Pending[C]]:
        """Take out every request of one client (it left, or stopped reading)."""
        return self._take(lambda item: item.client == client) if self._per_client[client] else []

    def expired(self, now: float) -> list[Pending[C]]:
        """Take out every request whose deadline has passed."""
        return self._take(lambda item: item.deadline is not None and item.deadline <= now)

    def drain(self) -> list[Pending[C]]:
        """Take out everything, in the order it would have run."""
        items = []
        while (item := self.pop()) is not None:
            items.append(item)
        return items

    def clients(self) -> list[C]:
        """Every client with a request waiting, the first waiting first."""
        return list(dict.fromkeys(item.client for waiting in self._by_user.values() for item in waiting))

    def _take(self, chosen: Callable[[Pending[C]], bool]) -> list[Pending[C]]:
        """Take out every waiting request ``chosen`` says, in rotation order; a user left with
        none leaves the rotation, the others keep their places."""
        taken: list[Pending[C]] = []
        for user in list(self._by_user):
            waiting = self._by_user[user]
            if not any(chosen(item) for item in waiting):
                continue
            taken.extend(item for item in waiting if chosen(item))
            keep = collections.deque(item for item in waiting if not chosen(item))
            if keep:
                self._by_user[user] = keep
            else:
                del self._by_user[user]
        self._taken(taken)
        return taken

    def _taken(self, items: list[Pending[C]]) -> None:
        for item in items:
            self._per_client[item.client] -= 1
            if not self._per_client[item.client]:
                del self._per_client[item.client]
        self._size -= len(items)
