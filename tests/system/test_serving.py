"""dovetail_runtime.serving against a real client socket, with a stand-in coordinator.

The stand-in generates by what the prompt says ("block": until cancelled or released, "hang":
a worker computing without a cycle, ...) and records what ran and how it ended, so turns,
cancels, deadlines, drops and shutdown are checked exactly, without models or timing bets.
tests/system/test_runtime_serving.py checks the same behaviours through real processes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
import types
from collections.abc import Callable

import pytest
import zmq
from click.testing import CliRunner

from dovetail_runtime import cli
from dovetail_runtime.admission import KvBudget
from dovetail_runtime.batching import Batcher
from dovetail_runtime.client import DovetailClient, HandshakeError
from dovetail_runtime.coordinator import TooManyRestarts
from dovetail_runtime.generation import Call, PromptTooLong
from dovetail_runtime.metrics import ServerMetrics
from dovetail_runtime.serving import ServeLimits, Serving
from dovetail_runtime.workers import WorkerFailed
from ipc import messages as m
from ipc.channels import Channel, RouterServer, connect_client
from ipc.codec import encode

WAIT_S = 10.0


class StandInTokenizer:
    def max_chars_per_token(self) -> int:
        return 4


class StandInCpu:
    """A cpu_worker that answers every decode step (alone or batched) with token 0, and fails
    (WorkerFailed) while its coordinator says the workers are down."""

    def __init__(self, coordinator: StandInCoordinator | None = None):
        self.coordinator = coordinator

    def request(self, message, expect):
        if self.coordinator is not None and not self.coordinator.workers_up:
            raise WorkerFailed("cpu_worker died")
        if isinstance(message, m.StepBatch):
            return m.StepBatchResult(items=[m.DecodeResult(seq_id=item.seq_id, token=0) for item in message.items])
        return m.DecodeResult(seq_id=message.seq_id, token=0)

    def send(self, message) -> None:
        pass


class StandInStarted:
    def __init__(self, request: m.GenerateRequest, seq_id: int, loop):
        self.request, self.seq_id, self.loop, self.uses_gpu = request, seq_id, loop, False
        self.prompt_ids = [0] * len(request.prompt or "")  # a token per character
        self.ids: list[int] = []


class StandInCoordinator:
    """What Serving uses of a Coordinator; no workers. Each request's loop makes one (stand-in)
    decode step per token, so requests run side by side up to ``max_batch``."""

    def __init__(self, max_batch: int = 1, budget: KvBudget | None = None) -> None:
        self.settings = types.SimpleNamespace(max_batch=max_batch)
        self.budget = budget
        self.while_waiting: Callable[[], None] | None = None
        self.tokenizer: StandInTokenizer | None = None
        self.max_len = 100  # so prompts of more than 400 characters cannot fit
        self.release = threading.Event()
        self.ran: list[str] = []
        self.ended: dict[str, str] = {}
        self.start_hook: Callable[[], None] | None = None
        self.restart_hook: Callable[[], None] | None = None
        self.workers_up = True
        self.draft_dead = False  # the gpu_worker alone is dead
        self.metrics = ServerMetrics()
        self._seq_ids = itertools.count(1)

    def start(self) -> None:
        if self.start_hook is not None:
            self.start_hook()
        self.tokenizer = StandInTokenizer()

    def recover(self) -> None:
        if not self.workers_up or self.draft_dead:
            if self.restart_hook is not None:
                self.restart_hook()
            self.workers_up, self.draft_dead = True, False

    def draft_worker_dead(self) -> bool:
        return self.draft_dead

    def workers_ready(self) -> bool:
        return self.tokenizer is not None and self.workers_up

    def max_prompt_chars(self) -> int | None:
        return None if self.tokenizer is None else self.max_len * self.tokenizer.max_chars_per_token()

    def batcher(self) -> Batcher:
        return Batcher(StandInCpu(self), None)

    def kv_budget(self) -> KvBudget | None:
        return self.budget

    def begin(self, request: m.GenerateRequest, on_text) -> StandInStarted:
        self.ran.append(request.request_id)
        if request.prompt == "boom":
            raise RuntimeError("boom")
        if request.prompt == "give up":
            raise TooManyRestarts("cpu_worker died 4 times in 10 minutes; giving up")
        seq_id = next(self._seq_ids)
        started = StandInStarted(request, seq_id, None)
        started.loop = self._loop(started, on_text)
        return started

    def _loop(self, started: StandInStarted, on_text):
        request, kind = started.request, started.request.prompt
        if kind.startswith("too long") and len(started.prompt_ids) >= self.max_len:  # as Context.check_prompt
            raise PromptTooLong(f"prompt of {len(started.prompt_ids)} tokens leaves no room")
        if kind == "hang":  # one long worker step: only the wait hook runs meanwhile
            while not self.release.wait(0.005):
                self.while_waiting()
        finish = "length"
        for index in range(request.max_new_tokens):
            yield Call("cpu", m.DecodeRequest(seq_id=started.seq_id, token=0), m.DecodeResult)
            started.ids.append(index % 50)
            if on_text([index % 50], "x" * (200 if kind == "flood" else 1), []):
                finish = "cancelled"
                break
            if kind == "block":
                if self.release.is_set():
                    break
                time.sleep(0.005)
        self.ended[request.request_id] = finish
        return finish, None

    def conclude(self, started: StandInStarted, outcome) -> m.GenerateDone | m.ErrorReply:
        if isinstance(outcome, PromptTooLong):  # as Coordinator.conclude answers it
            return m.ErrorReply(request_id=started.request.request_id, code="prompt_too_long", message=str(outcome))
        if isinstance(outcome, WorkerFailed):
            return m.ErrorReply(request_id=started.request.request_id, code="worker_failed", message=str(outcome))
        if isinstance(outcome, BaseException):
            raise outcome
        return m.GenerateDone(request_id=started.request.request_id, token_ids=started.ids,
                              text="x" * len(started.ids), finish_reason=outcome[0])


class Harness:
    def __init__(self, tmp_path, limits: ServeLimits, coordinator: StandInCoordinator | None = None):
        self.ctx = zmq.Context()
        self.server = RouterServer(f"ipc://{tmp_path}/serve.sock", ctx=self.ctx)
        self.coordinator = coordinator or StandInCoordinator()
        self.stop = threading.Event()
        self.serving = Serving(self.coordinator, self.server, limits, should_stop=self.stop.is_set)  # type: ignore[arg-type]
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.clients: list[Channel] = []

    def _run(self) -> None:
        try:
            self.serving.run(ready=lambda _bound: self.ready.set())
        except BaseException as error:
            self.error = error

    def client(self) -> Channel:
        channel = connect_client(self.server.endpoint, ctx=self.ctx)
        self.clients.append(channel)
        return channel

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.005)

    def close(self) -> None:
        self.coordinator.release.set()
        self.stop.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()
        for channel in self.clients:
            channel.close()
        self.server.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def serve(tmp_path):
    made: list[Harness] = []

    def make(limits: ServeLimits | None = None, coordinator: StandInCoordinator | None = None) -> Harness:
        harness = Harness(tmp_path, limits or ServeLimits(), coordinator)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


def send(client: Channel, request_id: str, prompt: str = "x", **fields) -> None:
    client.send(m.GenerateRequest(request_id=request_id, prompt=prompt, **fields), timeout_ms=2000)


def final(client: Channel, request_id: str | None = None) -> m.GenerateDone | m.ErrorReply:
    """The next final answer on this client (chunks and pongs skipped)."""
    while True:
        reply = client.recv(timeout_ms=WAIT_S * 1000)
        assert reply is not None, "no answer"
        if isinstance(reply, (m.GenerateDone, m.ErrorReply)):
            assert request_id is None or reply.request_id == request_id, reply
            return reply


def start_blocker(harness: Harness, stream: bool = True) -> Channel:
    """A request that runs until cancelled: everything sent after it has to wait."""
    blocker = harness.client()
    send(blocker, "blocker", "block", max_new_tokens=1 << 20, stream=stream)
    harness.wait_for(lambda: harness.coordinator.ran == ["blocker"], "the blocker to run")
    return blocker


def test_a_flooding_client_waits_for_its_own_turn(serve):
    harness = serve()
    blocker = start_blocker(harness)
    flood, single = harness.client(), harness.client()
    for index in range(6):
        send(flood, f"flood-{index}", max_new_tokens=3)
    harness.wait_for(lambda: len(harness.serving.queue) == 6, "the flood to be queued")
    send(single, "single", max_new_tokens=3)
    harness.wait_for(lambda: len(harness.serving.queue) == 7, "the single request to be queued")
    blocker.send(m.Cancel(request_id="blocker"))
    assert final(blocker, "blocker").finish_reason == "cancelled"
    assert final(single, "single").finish_reason == "length"
    for index in range(6):
        assert final(flood, f"flood-{index}").finish_reason == "length"
    # One flood request was taken before the single one, then the rest: round-robin.
    assert harness.coordinator.ran == ["blocker", "flood-0", "single"] + [f"flood-{i}" for i in range(1, 6)]


def test_a_user_on_many_connections_takes_one_turn_between_them(serve):
    harness = serve()
    blocker = start_blocker(harness)
    connections = [harness.client() for _ in range(3)]
    for index, connection in enumerate(connections):  # one user, a connection a request (as HTTP's)
        send(connection, f"crowd-{index}", max_new_tokens=3, user="crowd")
    harness.wait_for(lambda: len(harness.serving.queue) == 3, "the user's requests to be queued")
    single = harness.client()
    send(single, "single", max_new_tokens=3)
    other = harness.client()
    send(other, "named", max_new_tokens=3, user="someone else")
    harness.wait_for(lambda: len(harness.serving.queue) == 5, "the others to be queued")
    blocker.send(m.Cancel(request_id="blocker"))
    assert final(blocker, "blocker").finish_reason == "cancelled"
    for connection, request_id in [*((c, f"crowd-{i}") for i, c in enumerate(connections)), (single, "single"),
                                   (other, "named")]:
        assert final(connection, request_id).finish_reason == "length"
    assert harness.coordinator.ran == ["blocker", "crowd-0", "single", "named", "crowd-1", "crowd-2"]


def test_beyond_the_queue_bounds_requests_are_refused_busy_at_once(serve):
    harness = serve(ServeLimits(max_queue=3, max_queue_per_client=2))
    blocker = start_blocker(harness)
    a, b = harness.client(), harness.client()
    for index in range(3):
        send(a, f"a{index}")
    busy = final(a, "a2")
    assert isinstance(busy, m.ErrorReply) and busy.code == "busy" and "per client" in busy.message
    send(b, "b0")
    send(b, "b1")
    busy = final(b, "b1")
    assert isinstance(busy, m.ErrorReply) and busy.code == "busy" and "server's limit" in busy.message
    blocker.send(m.Cancel(request_id="blocker"))
    assert final(a, "a0").finish_reason == final(b, "b0").finish_reason == final(a, "a1").finish_reason == "length"
    assert harness.coordinator.ran == ["blocker", "a0", "b0", "a1"]


def test_cancels_of_waiting_and_running_requests_are_answered(serve):
    harness = serve()
    blocker = start_blocker(harness)
    client = harness.client()
    send(client, "a0")
    send(client, "a1")
    harness.wait_for(lambda: len(harness.serving.queue) == 2, "two queued")
    client.send(m.Cancel(request_id="a0"))
    done = final(client, "a0")
    assert isinstance(done, m.GenerateDone) and done.finish_reason == "cancelled" and done.token_ids == []
    client.send(m.Cancel(request_id="nobody-knows-me"))  # ignored
    blocker.send(m.Cancel(request_id="blocker"))
    assert final(blocker, "blocker").finish_reason == "cancelled"
    assert final(client, "a1").finish_reason == "length"
    assert harness.coordinator.ran == ["blocker", "a1"]


def test_deadlines_end_waiting_and_running_requests(serve):
    harness = serve(ServeLimits(request_timeout_s=30.0))
    blocker = start_blocker(harness)
    client = harness.client()
    send(client, "waits-too-long", deadline_ms=50)
    late = final(client, "waits-too-long")
    assert isinstance(late, m.ErrorReply) and late.code == "deadline_exceeded" and "waited its turn" in late.message
    blocker.send(m.Cancel(request_id="blocker"))
    final(blocker, "blocker")
    send(client, "runs-too-long", "block", max_new_tokens=1 << 20, stream=True, deadline_ms=100)
    late = final(client, "runs-too-long")
    assert isinstance(late, m.ErrorReply) and late.code == "deadline_exceeded" and "stopped after" in late.message
    assert harness.coordinator.ended["runs-too-long"] == "cancelled"
    assert "waits-too-long" not in harness.coordinator.ran


def test_the_server_wide_request_timeout_applies_without_a_deadline_of_its_own(serve):
    harness = serve(ServeLimits(request_timeout_s=0.1))
    client = harness.client()
    send(client, "r", "block", max_new_tokens=1 << 20, deadline_ms=60_000)
    late = final(client, "r")
    assert isinstance(late, m.ErrorReply) and late.code == "deadline_exceeded"


def test_a_client_that_leaves_has_its_requests_cancelled(serve):
    harness = serve()
    leaver = harness.client()
    send(leaver, "leaver-0", "block", max_new_tokens=1 << 20)  # not streaming: nothing is sent meanwhile
    send(leaver, "leaver-1")
    harness.wait_for(lambda: harness.coordinator.ran == ["leaver-0"], "the leaver's request to run")
    stayer = harness.client()
    send(stayer, "stayer")
    harness.wait_for(lambda: len(harness.serving.queue) == 2, "both queued")
    leaver.close()
    assert final(stayer, "stayer").finish_reason == "length"
    assert harness.coordinator.ended["leaver-0"] == "cancelled"
    assert harness.coordinator.ran == ["leaver-0", "stayer"]
    # Both of the leaver's requests counted as cancelled, though nothing was sent (GET /metrics shows it).
    assert harness.coordinator.metrics.finished == {"cancelled": 2, "length": 1}


def test_a_client_that_stops_reading_is_dropped_and_nobody_else_notices(serve, caplog):
    harness = serve()
    silent = harness.client()
    send(silent, "flood", "flood", max_new_tokens=1 << 20, stream=True)  # chunks nobody reads
    send(silent, "silent-1")
    harness.wait_for(lambda: harness.coordinator.ran == ["flood"], "the flood to run")
    other = harness.client()
    send(other, "other", max_new_tokens=5)
    assert final(other, "other").finish_reason == "length"
    assert harness.coordinator.ended["flood"] == "cancelled"
    assert harness.coordinator.ran == ["flood", "other"]  # the silent client's second request was dropped
    # The one in flight and the dropped waiting one: both cancelled.
    assert harness.coordinator.metrics.finished == {"cancelled": 2, "length": 1}
    assert any("is not reading its replies: dropped, 1 waiting request(s) and the one in flight cancelled"
               in record.getMessage() for record in caplog.records)
    other.send(m.Ping(nonce=3))
    assert other.recv(timeout_ms=WAIT_S * 1000) == m.Pong(nonce=3)


def test_pings_are_answered_while_a_worker_step_takes_long(serve):
    harness = serve()
    busy = harness.client()
    send(busy, "hung", "hang", max_new_tokens=2)
    harness.wait_for(lambda: harness.coordinator.ran == ["hung"], "the long step")
    pinger = harness.client()
    pinger.send(m.Ping(nonce=11))
    assert pinger.recv(timeout_ms=WAIT_S * 1000) == m.Pong(nonce=11)
    assert "hung" not in harness.coordinator.ended  # answered during the step, not after it
    harness.coordinator.release.set()
    assert final(busy, "hung").finish_reason == "length"


def test_a_prompt_too_long_for_the_context_is_refused_without_tokenizing(serve):
    harness = serve()
    client = harness.client()
    send(client, "huge", "y" * 401)
    refused = final(client, "huge")
    assert isinstance(refused, m.ErrorReply) and refused.code == "prompt_too_long"
    assert "401 characters" in refused.message and "not tokenized" in refused.message
    send(client, "fits", "y" * 400, max_new_tokens=2)
    assert final(client, "fits").finish_reason == "length"
    assert harness.coordinator.ran == ["fits"]


def test_one_requests_bug_is_answered_internal_and_serving_goes_on(serve):
    harness = serve()
    client = harness.client()
    send(client, "bad", "boom")
    error = final(client, "bad")
    assert isinstance(error, m.ErrorReply) and error.code == "internal" and "boom" in error.message
    send(client, "good", max_new_tokens=2)
    assert final(client, "good").finish_reason == "length"


def test_a_stop_answers_the_running_and_every_waiting_request(serve):
    harness = serve()
    blocker = start_blocker(harness)
    a, b = harness.client(), harness.client()
    send(a, "a0")
    send(a, "a1")
    send(b, "b0")
    harness.wait_for(lambda: len(harness.serving.queue) == 3, "three queued")
    harness.stop.set()
    for client, request_id in ((blocker, "blocker"), (a, "a0"), (a, "a1"), (b, "b0")):
        reply = final(client, request_id)
        assert isinstance(reply, m.ErrorReply) and reply.code == "shutting_down", reply
    harness.thread.join(WAIT_S)
    assert not harness.thread.is_alive() and harness.error is None
    assert harness.coordinator.ran == ["blocker"]


def test_giving_up_on_workers_answers_everyone_worker_failed(serve):
    harness = serve()
    blocker = start_blocker(harness)
    a, b = harness.client(), harness.client()
    send(a, "doomed", "give up")
    send(a, "a1")
    send(b, "b0")
    harness.wait_for(lambda: len(harness.serving.queue) == 3, "three queued")
    blocker.send(m.Cancel(request_id="blocker"))
    final(blocker, "blocker")
    for client, request_id in ((a, "doomed"), (b, "b0"), (a, "a1")):
        reply = final(client, request_id)
        assert isinstance(reply, m.ErrorReply) and reply.code == "worker_failed" and "giving up" in reply.message
    harness.thread.join(WAIT_S)
    assert isinstance(harness.error, TooManyRestarts)


def test_clients_are_read_while_the_workers_start(serve):
    coordinator = StandInCoordinator()
    started = threading.Event()

    def loading() -> None:  # what WorkerHandle.wait_ready does: wait in slices, calling back
        started.set()
        while not coordinator.release.wait(0.005):
            coordinator.while_waiting()

    coordinator.start_hook = loading
    harness = serve(coordinator=coordinator)
    assert started.wait(WAIT_S)
    client = harness.client()
    client.send(m.Ping(nonce=5))
    assert client.recv(timeout_ms=WAIT_S * 1000) == m.Pong(nonce=5, ready=False)  # answered, not ready
    send(client, "early")
    harness.wait_for(lambda: len(harness.serving.queue) == 1, "the early request to be queued")
    harness.stop.set()  # a stop during start: the request still gets its answer
    reply = final(client, "early")
    assert isinstance(reply, m.ErrorReply) and reply.code == "shutting_down"
    harness.thread.join(WAIT_S)
    assert harness.error is None and not harness.ready.is_set()


@pytest.mark.parametrize("failure,code,says", [
    (WorkerFailed("cpu_worker failed to start: out of memory"), "worker_failed", "could not be started"),
    (ValueError("--max-len 999999 exceeds this model's context of 2048 tokens"), "shutting_down", "could not start"),
], ids=["worker-failed", "bad-setting"])
def test_a_failed_start_answers_what_arrived_meanwhile(serve, failure, code, says):
    coordinator = StandInCoordinator()

    def failing() -> None:
        while not coordinator.release.wait(0.005):
            coordinator.while_waiting()
        raise failure

    coordinator.start_hook = failing
    harness = serve(coordinator=coordinator)
    client = harness.client()
    send(client, "early")
    harness.wait_for(lambda: len(harness.serving.queue) == 1, "the early request to be queued")
    coordinator.release.set()
    reply = final(client, "early")
    assert isinstance(reply, m.ErrorReply) and reply.code == code and f"{says}: {failure}" in reply.message
    harness.thread.join(WAIT_S)
    assert isinstance(harness.error, type(failure))


def test_a_worker_that_dies_while_idle_is_restarted_at_once_and_pings_say_not_ready_meanwhile(serve):
    coordinator = StandInCoordinator()
    restarting = threading.Event()

    def restart() -> None:  # what Coordinator.recover does: a new worker loads, clients are read meanwhile
        restarting.set()
        while not coordinator.release.wait(0.005):
            coordinator.while_waiting()

    coordinator.restart_hook = restart
    harness = serve(coordinator=coordinator)
    client = harness.client()
    client.send(m.Ping(nonce=1))
    assert client.recv(timeout_ms=WAIT_S * 1000) == m.Pong(nonce=1, ready=True)
    coordinator.workers_up = False  # a worker died; no request comes to find it dead
    assert restarting.wait(WAIT_S), "the idle loop did not restart the dead worker"
    client.send(m.Ping(nonce=2))
    assert client.recv(timeout_ms=WAIT_S * 1000) == m.Pong(nonce=2, ready=False)
    coordinator.release.set()
    harness.wait_for(lambda: coordinator.workers_up, "the restart to end")
    client.send(m.Ping(nonce=3))
    assert client.recv(timeout_ms=WAIT_S * 1000) == m.Pong(nonce=3, ready=True)


def test_up_to_max_batch_requests_run_side_by_side_and_end_on_their_own(serve):
    harness = serve(coordinator=StandInCoordinator(max_batch=3))
    clients = [harness.client() for _ in range(4)]
    for index, client in enumerate(clients[:3]):
        send(client, f"b{index}", "block", max_new_tokens=1 << 20, stream=True,
             deadline_ms=1000 if index == 2 else None)  # long enough for a loaded CI machine
    # Three clients' sockets: the server may take their first messages in any order.
    harness.wait_for(lambda: sorted(harness.coordinator.ran) == ["b0", "b1", "b2"], "three to run at once")
    send(clients[3], "waits", max_new_tokens=3)
    harness.wait_for(lambda: len(harness.serving.queue) == 1, "the fourth to wait")
    late = final(clients[2], "b2")  # its deadline ends it alone
    assert isinstance(late, m.ErrorReply) and late.code == "deadline_exceeded"
    assert final(clients[3], "waits").finish_reason == "length"  # took the free place
    clients[0].send(m.Cancel(request_id="b0"))
    assert final(clients[0], "b0").finish_reason == "cancelled"
    assert "b1" not in harness.coordinator.ended  # still running
    clients[1].close()  # its client leaves: cancelled, nobody answered
    harness.wait_for(lambda: harness.coordinator.ended.get("b1") == "cancelled", "the leaver's request to end")
    assert harness.serving.active == [] and harness.coordinator.ran[3:] == ["waits"]


def test_a_stop_answers_every_running_request_of_a_batch(serve):
    harness = serve(coordinator=StandInCoordinator(max_batch=2))
    a, b, c = harness.client(), harness.client(), harness.client()
    send(a, "a", "block", max_new_tokens=1 << 20)
    send(b, "b", "block", max_new_tokens=1 << 20)
    harness.wait_for(lambda: len(harness.serving.active) == 2, "two to run")
    send(c, "c")
    harness.wait_for(lambda: len(harness.serving.queue) == 1, "the third to wait")
    harness.stop.set()
    for client, request_id in ((a, "a"), (b, "b"), (c, "c")):
        reply = final(client, request_id)
        assert isinstance(reply, m.ErrorReply) and reply.code == "shutting_down", reply
    harness.thread.join(WAIT_S)
    assert harness.error is None


def kv_budget_of(tokens: int) -> KvBudget:
    """A budget of ``tokens`` tokens' KV cache (a byte each), in a context of 100."""
    return KvBudget(tokens, bytes_per_token=1.0, max_len=100)


def metrics(client: Channel) -> m.MetricsReply:
    client.send(m.MetricsRequest())
    while True:
        reply = client.recv(timeout_ms=WAIT_S * 1000)
        if isinstance(reply, m.MetricsReply):
            return reply


def test_a_request_whose_kv_cache_does_not_fit_waits_at_the_head_of_the_line(serve):
    harness = serve(coordinator=StandInCoordinator(max_batch=4, budget=kv_budget_of(80)))
    big, held, small = harness.client(), harness.client(), harness.client()
    send(big, "big", "block", max_new_tokens=55)  # 5 + 55 = 60 of 80 tokens
    harness.wait_for(lambda: harness.coordinator.ran == ["big"], "the first to run")
    send(held, "held", "x", max_new_tokens=30)  # 31: does not fit beside it
    harness.wait_for(lambda: harness.serving._held is not None, "the second to be held")
    send(small, "small", "x", max_new_tokens=3)  # 4 would fit, but must not jump the held one
    harness.wait_for(lambda: len(harness.serving.queue) == 1, "the third to wait")
    seen = metrics(small)
    assert (seen.running, seen.queue_depth) == (1, 2)
    assert harness.coordinator.ran == ["big", "held"] and "held" not in harness.coordinator.ended
    big.send(m.Cancel(request_id="big"))
    assert final(big, "big").finish_reason == "cancelled"
    assert final(held, "held").finish_reason == "length"
    assert final(small, "small").finish_reason == "length"
    assert harness.coordinator.ran == ["big", "held", "small"]
    assert harness.serving.budget is not None and harness.serving.budget.reserved_bytes == 0


def test_a_request_that_could_never_fit_the_kv_budget_is_refused_and_others_run(serve):
    harness = serve(coordinator=StandInCoordinator(max_batch=4, budget=kv_budget_of(50)))
    client = harness.client()
    send(client, "huge", "x", max_new_tokens=60)  # 61 tokens > 50
    refused = final(client, "huge")
    assert isinstance(refused, m.ErrorReply) and refused.code == "kv_budget_exceeded"
    assert "--kv-memory" in refused.message and "max_new_tokens" in refused.message
    send(client, "fits", "x", max_new_tokens=40)
    assert final(client, "fits").finish_reason == "length"


@pytest.mark.parametrize("how", ["cancel", "deadline", "leave"])
def test_a_request_held_for_kv_memory_can_be_cancelled_expire_or_leave(serve, how):
    harness = serve(coordinator=StandInCoordinator(max_batch=4, budget=kv_budget_of(80)))
    big, held = harness.client(), harness.client()
    send(big, "big", "block", max_new_tokens=55, stream=True)
    harness.wait_for(lambda: harness.coordinator.ran == ["big"], "the first to run")
    send(held, "held", "x", max_new_tokens=30, deadline_ms=100 if how == "deadline" else None)
    harness.wait_for(lambda: harness.serving._held is not None, "the second to be held")
    if how == "cancel":
        held.send(m.Cancel(request_id="held"))
        done = final(held, "held")
        assert isinstance(done, m.GenerateDone) and done.finish_reason == "cancelled" and done.token_ids == []
    elif how == "deadline":
        late = final(held, "held")
        assert isinstance(late, m.ErrorReply) and late.code == "deadline_exceeded" and "KV memory" in late.message
    else:
        held.close()
        harness.wait_for(lambda: harness.serving._held is None and len(harness.serving.active) == 1,
                         "the leaver to be let go")
    harness.wait_for(lambda: harness.serving._held is None, "the held one to be let go")
    assert "held" not in harness.coordinator.ended  # it never ran a step
    assert "big" not in harness.coordinator.ended  # the running one went on
    big.send(m.Cancel(request_id="big"))
    assert final(big, "big").finish_reason == "cancelled"


def test_a_worker_that_dies_is_restarted_before_the_request_held_for_kv_memory_starts(serve):
    coordinator = StandInCoordinator(max_batch=4, budget=kv_budget_of(80))
    restarts: list[float] = []
    coordinator.restart_hook = lambda: restarts.append(time.monotonic())
    harness = serve(coordinator=coordinator)
    big, held = harness.client(), harness.client()
    send(big, "big", "block", max_new_tokens=55)
    harness.wait_for(lambda: coordinator.ran == ["big"], "the first to run")
    send(held, "held", "x", max_new_tokens=30)
    harness.wait_for(lambda: harness.serving._held is not None, "the second to be held")
    coordinator.workers_up = False  # the cpu_worker dies under the running request
    failed = final(big, "big")
    assert isinstance(failed, m.ErrorReply) and failed.code == "worker_failed"
    assert final(held, "held").finish_reason == "length"  # started on the restarted worker
    assert len(restarts) == 1


def next_error(client: Channel) -> m.ErrorReply:
    """The next ErrorReply on this client, within WAIT_S (a running request's chunks skipped)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        reply = client.recv(timeout_ms=100)
        if isinstance(reply, m.ErrorReply):
            return reply
        assert not isinstance(reply, m.GenerateDone), reply
    raise AssertionError("no ErrorReply")


def test_a_request_id_in_use_on_the_connection_is_refused_and_the_first_runs_on(serve):
    harness = serve()
    client = start_blocker(harness)
    send(client, "blocker", max_new_tokens=3)  # running: its replies could not be told apart
    refused = next_error(client)
    assert isinstance(refused, m.ErrorReply) and refused.code == "bad_message" and refused.request_id is None
    assert "'blocker' is already running or waiting" in refused.message
    send(client, "waits", max_new_tokens=3)
    harness.wait_for(lambda: len(harness.serving.queue) == 1, "one queued")
    send(client, "waits", max_new_tokens=3)  # waiting: refused the same way
    refused = next_error(client)
    assert isinstance(refused, m.ErrorReply) and refused.request_id is None and "'waits'" in refused.message
    other = harness.client()
    send(other, "blocker", max_new_tokens=2)  # the same id on another connection is another request
    client.send(m.Cancel(request_id="blocker"))
    answers = [final(client, "blocker"), final(client, "waits"), final(other, "blocker")]
    assert [getattr(answer, "finish_reason", answer) for answer in answers] == ["cancelled", "length", "length"]
    assert harness.coordinator.ran == ["blocker", "waits", "blocker"]
    send(client, "waits", max_new_tokens=1)  # answered: the id may be used again
    assert getattr(final(client, "waits"), "finish_reason", None) == "length"


def test_the_python_client_cancels_a_request_it_stops_waiting_for(serve):
    harness = serve()
    with DovetailClient(harness.server.endpoint, timeout_s=WAIT_S) as client:
        for _chunk in client.stream("block", request_id="left", max_new_tokens=1 << 20):
            break  # a stream left early
        harness.wait_for(lambda: harness.coordinator.ended.get("left") == "cancelled", "the left stream to stop")
        client.timeout_ms = 200
        with pytest.raises(TimeoutError, match="within 0.2 s"):  # nothing is sent while a non-streamed one runs
            client.generate("block", request_id="timed-out", max_new_tokens=1 << 20)
        harness.wait_for(lambda: harness.coordinator.ended.get("timed-out") == "cancelled", "the timed-out one to stop")
        client.timeout_ms = WAIT_S * 1000
        assert client.generate("x", max_new_tokens=2).finish_reason == "length"  # the next one runs at once
        assert [event.request_id for event in client.events("x", request_id="whole", max_new_tokens=1)] == ["whole"] * 2
    assert harness.coordinator.metrics.finished == {"cancelled": 2, "length": 2}


def hang_up(listener: socket.socket) -> None:
    """Accept connections and close them at once, until the listener is closed."""
    with contextlib.suppress(OSError):
        while True:
            listener.accept()[0].close()


def test_the_python_client_says_at_once_when_nobody_serves_an_ipc_path(tmp_path):
    stale = tmp_path / "stale.sock"  # what a killed server leaves: a socket file nobody listens on
    socket.socket(socket.AF_UNIX).bind(str(stale))
    foreign = tmp_path / "foreign.sock"  # a listener that is not a ZMQ server
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(foreign))
    listener.listen(8)
    threading.Thread(target=hang_up, args=(listener,), daemon=True).start()
    for path, says in ((stale, "no answer from"), (tmp_path / "none.sock", "no answer from"),
                       (foreign, "not a Dovetail server?")):
        started = time.monotonic()
        with pytest.raises(HandshakeError, match=says) as raised:
            DovetailClient(str(path), connect_timeout_s=0.5)
        assert time.monotonic() - started < 5 and "API key" not in str(raised.value)
    listener.close()


def test_dovetail_client_ends_streamed_text_with_a_newline_before_an_error(serve):
    harness = serve()
    args = ["--connect", harness.server.endpoint, "--prompt", "block", "--max-new-tokens", "1000000",
            "--deadline", "0.2"]
    result = CliRunner().invoke(cli.client_main, args)
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith("x") and result.stdout.endswith("x\n")  # the partial line is ended
    assert result.stderr.startswith("error: deadline_exceeded")


def test_the_python_client_keeps_the_replies_of_requests_read_in_turns(serve):
    harness = serve(coordinator=StandInCoordinator(max_batch=2))
    with DovetailClient(harness.server.endpoint, timeout_s=3) as client:
        a = client.events("x", request_id="a", max_new_tokens=5)
        b = client.events("x", request_id="b", max_new_tokens=7)
        got: dict[str, list] = {"a": [next(a)], "b": [next(b)]}
        assert client.ping()  # read meanwhile: the chunks that came are kept, not dropped
        for one, other in itertools.zip_longest(a, b):
            got["a"] += [one] if one is not None else []
            got["b"] += [other] if other is not None else []
    for request_id, count in (("a", 5), ("b", 7)):
        *chunks, done = got[request_id]
        assert isinstance(done, m.GenerateDone) and done.token_ids == list(range(count))
        assert [token for chunk in chunks for token in chunk.token_ids] == done.token_ids


def test_a_client_that_sends_on_and_never_reads_is_one_warning_not_one_per_message(serve, caplog):
    caplog.set_level(logging.DEBUG, logger="dovetail_runtime.serving")
    harness = serve()
    silent = harness.ctx.socket(zmq.DEALER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.setsockopt(zmq.RCVHWM, 1)
    silent.setsockopt(zmq.RCVBUF, 1024)
    silent.connect(harness.server.endpoint)
    ping = encode(m.Ping(nonce=1))
    for _ in range(20_000):  # every Pong beyond the socket's buffers fails
        silent.send(ping)

    def drops() -> list[logging.LogRecord]:
        return [record for record in caplog.records if "is not reading its replies" in record.getMessage()]

    harness.wait_for(lambda: len(drops()) >= 1000, "the Pongs to fail")
    assert [record.levelno for record in drops()].count(logging.WARNING) == 1
    other = harness.client()
    other.send(m.Ping(nonce=2))
    assert other.recv(timeout_ms=WAIT_S * 1000) == m.Pong(nonce=2)
    silent.close(0)


def test_deadlines_of_waiting_requests_are_counted_in_the_metrics(serve):
    harness = serve()
    blocker = start_blocker(harness)
    client = harness.client()
    send(client, "waits-too-long", deadline_ms=50)
    late = final(client, "waits-too-long")
    assert isinstance(late, m.ErrorReply) and late.code == "deadline_exceeded"
    assert metrics(client).errors == {"deadline_exceeded": 1}  # GET /metrics shows it, as a running one's
    blocker.send(m.Cancel(request_id="blocker"))
    final(blocker, "blocker")


@pytest.mark.parametrize("budget", [80, 120])
def test_a_prompt_too_long_for_the_context_is_refused_at_once_not_held_for_kv_memory(serve, budget):
    # Its KV need is counted as the whole context: it was refused kv_budget_exceeded (budget 80), or
    # held at the head of the line until the running request ended, only to be refused then (120).
    harness = serve(coordinator=StandInCoordinator(max_batch=4, budget=kv_budget_of(budget)))
    big, long, small = harness.client(), harness.client(), harness.client()
    send(big, "big", "block", max_new_tokens=55, stream=True)  # 60 tokens reserved
    harness.wait_for(lambda: harness.coordinator.ran == ["big"], "the first to run")
    send(long, "long", "too long".ljust(150, "x"), max_new_tokens=5)  # 150 tokens: more than the context of 100
    refused = final(long, "long")
    assert isinstance(refused, m.ErrorReply) and refused.code == "prompt_too_long", refused
    send(small, "small", "x", max_new_tokens=3)  # not held up behind it either
    assert final(small, "small").finish_reason == "length"
    assert "big" not in harness.coordinator.ended
    big.send(m.Cancel(request_id="big"))
    assert final(big, "big").finish_reason == "cancelled"
    assert harness.serving.budget is not None and harness.serving.budget.reserved_bytes == 0


def test_a_dead_gpu_worker_is_restarted_while_ar_requests_run_on(serve):
    # The batch's ar requests outlive a gpu_worker's death (Batcher); it was restarted only once
    # nothing ran, so every dovetail request admitted meanwhile failed at its first draft step.
    coordinator = StandInCoordinator(max_batch=2)  # the stand-in's requests are ar: they never draft
    restarts: list[float] = []
    coordinator.restart_hook = lambda: restarts.append(time.monotonic())
    harness = serve(coordinator=coordinator)
    client = start_blocker(harness)
    coordinator.draft_dead = True
    harness.wait_for(lambda: restarts, "the gpu_worker to be restarted")
    assert "blocker" not in coordinator.ended  # ran on meanwhile
    client.send(m.Cancel(request_id="blocker"))
    assert final(client, "blocker").finish_reason == "cancelled"
    assert len(restarts) == 1
