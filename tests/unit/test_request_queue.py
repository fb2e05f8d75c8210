"""dovetail_runtime.request_queue: round-robin over clients, bounds, cancels, deadlines."""

from __future__ import annotations

import pytest

from dovetail_runtime.request_queue import FairQueue, Pending, QueueFull
from ipc import messages as m


def item(client: str, request_id: str, deadline: float | None = None) -> Pending[str]:
    return Pending(client, m.GenerateRequest(request_id=request_id, prompt="x"), deadline)


def order(queue: FairQueue[str]) -> list[str]:
    return [pending.request.request_id for pending in queue.drain()]


def test_a_flooding_client_waits_for_its_turn():
    queue: FairQueue[str] = FairQueue(max_total=100, max_per_client=50)
    for index in range(5):
        queue.push(item("flood", f"f{index}"))
    queue.push(item("one", "o0"))
    queue.push(item("two", "t0"))
    queue.push(item("two", "t1"))
    assert len(queue) == 8
    assert order(queue) == ["f0", "o0", "t0", "f1", "t1", "f2", "f3", "f4"]
    assert len(queue) == 0 and queue.pop() is None and queue.clients() == []


def test_a_client_that_comes_back_joins_the_end_of_the_round():
    queue: FairQueue[str] = FairQueue(max_total=10, max_per_client=10)
    queue.push(item("a", "a0"))
    queue.push(item("b", "b0"))
    assert queue.pop().request.request_id == "a0"
    queue.push(item("a", "a1"))  # a had nothing waiting: it goes after b
    queue.push(item("c", "c0"))
    assert order(queue) == ["b0", "a1", "c0"]


def test_bounds_per_client_and_in_total():
    queue: FairQueue[str] = FairQueue(max_total=3, max_per_client=2)
    queue.push(item("a", "a0"))
    queue.push(item("a", "a1"))
    with pytest.raises(QueueFull, match="per client"):
        queue.push(item("a", "a2"))
    queue.push(item("b", "b0"))
    with pytest.raises(QueueFull, match="server's limit"):
        queue.push(item("c", "c0"))
    assert len(queue) == 3
    queue.pop()
    queue.push(item("c", "c0"))  # room again
    assert order(queue) == ["b0", "a1", "c0"]
    with pytest.raises(ValueError):
        FairQueue(max_total=0, max_per_client=1)


def test_remove_drop_and_expire():
    queue: FairQueue[str] = FairQueue(max_total=10, max_per_client=10)
    queue.push(item("a", "a0", deadline=5.0))
    queue.push(item("a", "a1"))
    queue.push(item("b", "b0", deadline=1.0))
    queue.push(item("c", "c0"))
    queue.push(item("c", "c1", deadline=9.0))
    assert queue.remove("a", "nope") is None and queue.remove("zz", "a0") is None
    assert queue.remove("a", "a1").request.request_id == "a1"
    assert [p.request.request_id for p in queue.expired(now=5.0)] == ["a0", "b0"]
    assert queue.clients() == ["c"] and len(queue) == 2
    assert [p.request.request_id for p in queue.drop_client("c")] == ["c0", "c1"]
    assert len(queue) == 0 and queue.drop_client("c") == []


def named(client: str, request_id: str, user: str, deadline: float | None = None) -> Pending[str]:
    return Pending(client, m.GenerateRequest(request_id=request_id, prompt="x", user=user), deadline)


def test_a_named_user_takes_one_turn_whatever_connections_it_comes_by():
    queue: FairQueue[str] = FairQueue(max_total=100, max_per_client=1)
    for index in range(4):  # a connection a request, as the HTTP front end sends them
        queue.push(named(f"http-{index}", f"u{index}", user="ann"))
    queue.push(item("zmq", "z0"))
    queue.push(named("http-9", "b0", user="bob"))
    queue.push(item("zmq-2", "z1"))  # another unnamed connection is another user
    assert order(queue) == ["u0", "z0", "b0", "z1", "u1", "u2", "u3"]


def test_the_bound_per_client_is_per_connection_and_cancels_find_named_requests():
    queue: FairQueue[str] = FairQueue(max_total=100, max_per_client=2)
    queue.push(named("a", "a0", user="ann"))
    queue.push(named("a", "a1", user="ann"))
    with pytest.raises(QueueFull, match="per client"):
        queue.push(named("a", "a2", user="ann"))
    queue.push(named("b", "b0", user="ann", deadline=1.0))  # the same user, another connection: room
    queue.push(named("c", "c0", user="cid"))
    assert queue.waiting("b", "b0") and not queue.waiting("a", "b0")
    assert queue.remove("b", "a1") is None and queue.remove("a", "a1").request.request_id == "a1"
    queue.push(named("a", "a2", user="ann"))  # a's room came back with the cancel
    assert [p.request.request_id for p in queue.expired(now=1.0)] == ["b0"]
    assert queue.clients() == ["a", "c"]
    assert [p.request.request_id for p in queue.drop_client("a")] == ["a0", "a2"]
    assert len(queue) == 1 and queue.clients() == ["c"] and order(queue) == ["c0"]
