"""Serving clients: take their messages, run their requests (up to --max-batch side by side,
their steps batched: ``dovetail_runtime.batching``), answer every one.

The loop reads the client socket whenever it can: while idle, between two rounds of the
requests in flight, and while a worker computes, loads or restarts (the workers call back
through ``Coordinator.while_waiting`` every ~100 ms). So Pings are answered, cancels and
disconnects take effect, and new requests are queued or refused at once, even while a worker
hangs (it is then killed after --worker-timeout, and its request fails with worker_failed).

Requests wait in a FairQueue (round-robin over users: a request's ``user``, else its connection;
bounded: beyond it ``busy``). A prompt
that cannot fit the context is refused by its length in characters before it is tokenized.
A request has a deadline when it asks for one (``deadline_ms``) or the server sets one
(--request-timeout): past it, the request ends with ``deadline_exceeded``, waiting or running.

Every accepted request gets exactly one final answer, or none when its client is gone: a
client that disconnects (ipc.peers notices) or stops reading (a send would block: its queue
at the socket is full) is dropped, and its requests are cancelled; serving goes on. When
serving ends (a stop signal, too many worker restarts, a failed start, a bug), each request
still in flight or waiting gets an ErrorReply (``shutting_down``, ``worker_failed``,
``internal``) before the loop returns or raises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import zmq

from ipc import messages as m
from ipc.channels import ChannelTimeout, RouterServer
from ipc.codec import ProtocolError

from .admission import KvBudget
from .batching import Batcher, Stream
from .batching import Outcome as LoopOutcome
from .coordinator import Coordinator, OnText, Started, TooManyRestarts, error_reply, refuse_untokenized
from .request_queue import FairQueue, Pending, QueueFull
from .workers import WorkerFailed

log = logging.getLogger(__name__)

IDLE_POLL_MS = 200
# Messages taken per read: a flood of them cannot hold up the request in flight for long.
MAX_READS = 256
# How often waiting requests are checked for a passed deadline or a client that left.
SWEEP_S = 0.25

Outcome = Literal["cancelled", "gone", "deadline"]


@dataclass(frozen=True)
class ServeLimits:
    max_queue: int = 64
    max_queue_per_client: int = 16
    request_timeout_s: float | None = None  # every request's deadline is at most this


class ShuttingDown(Exception):
    """A stop was asked for while a request ran or a worker started: end it now."""


@dataclass(eq=False)
class Running:
    item: Pending[bytes]
    started: float  # time.monotonic() when it began to run
    outcome: Outcome | None = None  # why it must stop early; None: run on
    token_times: list[tuple[float, int]] = field(default_factory=list)  # when tokens became final, how many
    begun: Started | None = None
    stream: Stream | None = None


class Serving:
    def __init__(self, coordinator: Coordinator, server: RouterServer, limits: ServeLimits = ServeLimits(),
                 should_stop: Callable[[], bool] = lambda: False):
        self.coordinator = coordinator
        self.server = server
        self.limits = limits
        self.should_stop = should_stop
        self.queue: FairQueue[bytes] = FairQueue(limits.max_queue, limits.max_queue_per_client)
        self.active: list[Running] = []  # at most --max-batch, run side by side
        self.max_batch = max(1, coordinator.settings.max_batch)
        self.batcher: Batcher | None = None  # once the workers run
        self.budget: KvBudget | None = None  # KV memory admission, once the workers run
        self._held: Running | None = None  # begun, waiting for KV memory: the head of the line
        self.prompt_chars: int | None = None  # known once the tokenizer is loaded
        self._next_sweep = 0.0
        self._last_drop: bytes | None = None  # the client _drop last dropped (warned about once)
        coordinator.while_waiting = self._while_busy

    # --- the loop ----------------------------------------------------------------------

    def run(self, ready: Callable[[list[str]], None] | None = None) -> None:
        """Start the coordinator (clients are read meanwhile), serve until ``should_stop()``,
        then answer whatever is still waiting. Raises what ended serving abnormally."""
        started = False
        try:
            self.coordinator.start()
            self.batcher = self.coordinator.batcher()
            self.budget = self.coordinator.kv_budget()
            started = True
            self.prompt_chars = self.coordinator.max_prompt_chars()
            log.info("serving on %s", ", ".join(self.server.endpoints))
            if ready is not None:
                ready(self.server.endpoints)
            while not self.should_stop():
                # A worker that died while idle is restarted now (Pings say not ready meanwhile),
                # not when the next request finds it dead.
                self._recover()
                self._read_clients(timeout_ms=0 if len(self.queue) or self.active else IDLE_POLL_MS)
                self._sweep()
                self._admit_waiting()
                if self.active:
                    self._round()
        except ShuttingDown:
            pass
        except TooManyRestarts as error:
            self.answer_everyone("worker_failed", f"the server is giving up: {error}")
            raise
        except WorkerFailed as error:  # a worker could not be started (at startup, or to replace a dead one)
            self.answer_everyone("worker_failed", f"the server stops: a worker could not be started: {error}")
            raise
        except KeyboardInterrupt:
            self.answer_everyone("shutting_down", "the server is shutting down")
            raise
        except BaseException as error:
            if started:
                self.answer_everyone("internal", f"the server stopped on an internal error: "
                                                 f"{type(error).__name__}: {error}")
            else:  # a model that cannot load, a bad setting
                self.answer_everyone("shutting_down", f"the server could not start: {error}")
            raise
        self.answer_everyone("shutting_down", "the server is shutting down")

    def answer_everyone(self, code: str, message: str) -> None:
        """Give the request in flight and every waiting one (messages that already arrived
        included) an ErrorReply: nobody is left waiting for an answer that never comes."""
        try:
            self._read_clients(timeout_ms=0)
        except Exception:
            log.exception("could not read the last client messages")
        items = [running.item for running in self.active if running.outcome != "gone"]
        self.active = []
        self._held = None
        if self.batcher is not None:
            self.batcher.abort(ShuttingDown())
        items += self.queue.drain()
        for item in items:
            self._send(item.client, error_reply(item.request.request_id, code, message))
        if items:
            log.info("answered %d request(s) with %s", len(items), code)

    # --- running requests ---------------------------------------------------------------

    def _admit_waiting(self) -> None:
        """Start waiting requests while fewer than --max-batch run and the KV memory each can grow to
        fits the budget (each joins the next round). One whose memory does not fit yet is held at the
        head of the line (in ``active``, not started) until enough running requests end."""
        while True:
            running = self._held or self._begin_next()
            if running is None:
                return
            self._held = None
            begun = running.begun
            assert begun is not None
            if running.outcome is not None:  # cancelled, gone or past its deadline while held
                self._end_unstarted(running)
                continue
            budget = self.budget
            # A prompt that leaves no room in the context (or none at all) ends at its first step, reserving
            # nothing: neither refused for KV memory nor held at the head of the line for it.
            if budget is not None and 0 < len(begun.prompt_ids) < self.coordinator.max_len:
                need = budget.need(len(begun.prompt_ids), begun.request.max_new_tokens)
                if not budget.ever_fits(need):
                    self.active.remove(running)
                    self._answer(running.item.client, error_reply(begun.request.request_id, "kv_budget_exceeded",
                                                                  budget.refusal(need)))
                    continue
                if not budget.fits(need):
                    self._held = running
                    return
                budget.reserve(running, need)
            assert self.batcher is not None
            running.started = time.monotonic()
            running.stream = self.batcher.add(begun.seq_id, begun.loop, begun.uses_gpu)
            if running.stream.done:  # ended before its first step (a prompt that cannot fit)
                self._finish(running)

    def _begin_next(self) -> Running | None:
        """The next waiting request, tokenized and its loop made (``Coordinator.begin``), once
        fewer than --max-batch are in ``active``; None when none can begin now."""
        while len(self.active) < self.max_batch:
            item = self.queue.pop()
            if item is None:
                return None
            if self.server.peer_gone(item.client):
                self.coordinator.metrics.record_cancelled()
                self._client_left(item.client, taken=1)
                continue
            refusal = self._refuse_size(item.request)
            if refusal is not None:
                self._answer(item.client, refusal)
                continue
            running = Running(item, time.monotonic())
            self.active.append(running)  # from here on, run() answers it if serving ends
            try:
                begun = self.coordinator.begin(item.request, self._on_text(running))
            except (ShuttingDown, TooManyRestarts):
                raise
            except Exception as error:  # one request's bug must not take the server down
                log.exception("request %s failed unexpectedly", item.request.request_id)
                begun = error_reply(item.request.request_id, "internal", f"{type(error).__name__}: {error}")
            if isinstance(begun, m.ErrorReply):
                self.active.remove(running)
                self._answer(item.client, begun)
                continue
            running.begun = begun
            return running
        return None

    def _end_unstarted(self, running: Running) -> None:
        """Answer a held request that was cancelled, left or expired before it started."""
        self.active.remove(running)
        request = running.item.request
        if running.outcome == "gone":
            self.coordinator.metrics.record_cancelled()
        elif running.outcome == "deadline":
            self._answer(running.item.client, error_reply(
                request.request_id, "deadline_exceeded", "the request's deadline passed while it waited for "
                "KV memory"))
        else:
            self._answer(running.item.client, m.GenerateDone(request_id=request.request_id, token_ids=[], text="",
                                                             finish_reason="cancelled"))

    def _on_text(self, running: Running) -> OnText:
        request, client = running.item.request, running.item.client

        def on_text(token_ids: list[int], text: str, logprobs: list[m.TokenLogprob]) -> bool:
            if token_ids:
                running.token_times.append((time.monotonic(), len(token_ids)))
            if request.stream and running.outcome is None and (token_ids or text):  # not a bare "go on?"
                chunk = m.TokenChunk(request_id=request.request_id, token_ids=token_ids, text=text, logprobs=logprobs)
                if not self._send(client, chunk) and running.outcome is None:
                    running.outcome = "gone"
            return running.outcome is not None

        return on_text

    def _round(self) -> None:
        """One round of every running request's steps (``Batcher.round``); answer those that ended."""
        assert self.batcher is not None
        try:
            ended = self.batcher.round()
        except (ShuttingDown, TooManyRestarts):
            raise  # run() answers the running requests with everyone else's
        except Exception as error:  # a worker that died (WorkerFailed), or a bug: every running request ends
            if not isinstance(error, WorkerFailed):
                log.exception("a batch of %d request(s) failed unexpectedly", len(self.active))
            ended = self.batcher.abort(error)
        for stream in ended:
            running = next(running for running in self.active if running.stream is stream)
            self._finish(running)
        self._recover()  # restart a worker that died or was killed, before the next request

    def _recover(self) -> None:
        """Restart dead workers once nothing runs; a dead gpu_worker also while only ar requests run
        (they never use it and run on; a dovetail request admitted meanwhile would fail)."""
        started = self._started()
        if not started or (self.coordinator.draft_worker_dead()
                           and not any(running.stream is not None and running.stream.uses_gpu
                                       for running in started)):
            self.coordinator.recover()

    def _started(self) -> list[Running]:
        """The running requests: those in ``active`` but the one held for KV memory."""
        return [running for running in self.active if running.stream is not None]

    def _finish(self, running: Running) -> None:
        """Answer a request whose loop ended (its reply, or why it stopped early)."""
        self.active.remove(running)
        if self.budget is not None:
            self.budget.release(running)
        metrics = self.coordinator.metrics
        item, begun, stream = running.item, running.begun, running.stream
        request = item.request
        assert begun is not None and stream is not None and stream.outcome is not None
        outcome: LoopOutcome = stream.outcome
        try:
            reply: m.GenerateDone | m.ErrorReply = self.coordinator.conclude(begun, outcome)
        except Exception as error:  # one request's bug must not take the server down
            log.error("request %s failed unexpectedly: %s: %s", request.request_id, type(error).__name__, error)
            reply = error_reply(request.request_id, "internal", f"{type(error).__name__}: {error}")
        if isinstance(reply, m.GenerateDone):
            metrics.record_latency(item.arrived, running.started, running.token_times, time.monotonic())
        if running.outcome == "gone":
            log.info("request %s cancelled: its client is gone", request.request_id)
            metrics.record(reply)  # counted, though nobody is there to answer
            return
        if (running.outcome == "deadline" and isinstance(reply, m.GenerateDone)
                and reply.finish_reason == "cancelled"):  # not when it ended by itself meanwhile
            reply = error_reply(request.request_id, "deadline_exceeded",
                                f"no answer within the request's deadline; stopped after "
                                f"{len(reply.token_ids)} new tokens")
        self._answer(item.client, reply)

    def _while_busy(self) -> None:
        """Called between cycles and while a worker computes or starts."""
        self._read_clients(timeout_ms=0)
        self._sweep()
        if self.should_stop():
            raise ShuttingDown

    # --- client messages ---------------------------------------------------------------

    def _read_clients(self, timeout_ms: int) -> None:
        """Take the waiting client messages (at most MAX_READS): queue requests, note cancels,
        answer Pings and unreadable messages."""
        for _ in range(MAX_READS):
            try:
                received = self.server.recv(timeout_ms=timeout_ms)
            except ProtocolError as error:
                if error.peer is not None:
                    self._send(error.peer, error_reply(None, "bad_message", str(error)))
                timeout_ms = 0
                continue
            if received is None:
                return
            timeout_ms = 0
            peer, message = received
            try:
                self._handle(peer, message)
            except Exception as error:  # a bug in handling one message must not end serving
                log.exception("could not handle a %s", type(message).__name__)
                self._send(peer, error_reply(getattr(message, "request_id", None), "internal",
                                             f"{type(error).__name__}: {error}"))

    def _handle(self, peer: bytes, message: m.Message) -> None:
        if isinstance(message, m.GenerateRequest):
            self._admit(peer, message)
        elif isinstance(message, m.Cancel):
            self._cancel(peer, message.request_id)
        elif isinstance(message, m.Ping):
            self._send(peer, m.Pong(nonce=message.nonce, ready=self.coordinator.workers_ready()))
        elif isinstance(message, m.MetricsRequest):
            started = len(self._started())
            busy = None if self.batcher is None else self.batcher.busy_ms
            self._send(peer, self.coordinator.metrics.reply(queue_depth=len(self.queue) + len(self.active) - started,
                                                            running=started, busy_ms=busy))

    def _admit(self, peer: bytes, request: m.GenerateRequest) -> None:
        if self._id_in_use(peer, request.request_id):
            # Its replies would be told apart from the first one's by nothing, and a Cancel would pick one
            # at random: refuse it without an id, as a message that cannot be run (the first one's id
            # on an ErrorReply would end the first one for its client).
            self._send(peer, error_reply(None, "bad_message", f"request_id {request.request_id!r} is already "
                                         "running or waiting on this connection: use a fresh id per request; "
                                         "this request is not run"))
            return
        refusal = self._refuse_size(request)
        if refusal is not None:
            self._answer(peer, refusal)
            return
        try:
            self.queue.push(Pending(peer, request, self._deadline(request)))
        except QueueFull as error:
            self._answer(peer, error_reply(request.request_id, "busy",
                                           f"the server is busy: {error}; try again later"))

    def _id_in_use(self, peer: bytes, request_id: str) -> bool:
        """Whether ``peer`` has a request ``request_id`` running, held or waiting (not yet answered)."""
        return self.queue.waiting(peer, request_id) or any(
            running.item.client == peer and running.item.request.request_id == request_id for running in self.active)

    def _deadline(self, request: m.GenerateRequest) -> float | None:
        limits = [s for s in (None if request.deadline_ms is None else request.deadline_ms / 1000,
                              self.limits.request_timeout_s) if s is not None]
        return time.monotonic() + min(limits) if limits else None

    def _refuse_size(self, request: m.GenerateRequest) -> m.ErrorReply | None:
        """prompt_too_long, untokenized (16 MiB of text would block the server for a minute)."""
        return refuse_untokenized(request, self.prompt_chars, self.coordinator.max_len)

    def _cancel(self, peer: bytes, request_id: str) -> None:
        for running in self.active:
            if running.item.client == peer and running.item.request.request_id == request_id:
                if running.outcome is None:
                    running.outcome = "cancelled"
                return
        item = self.queue.remove(peer, request_id)
        if item is not None:
            self._answer(peer, m.GenerateDone(request_id=request_id, token_ids=[], text="", finish_reason="cancelled"))

    # --- clients that leave or do not read -------------------------------------------------

    def _sweep(self) -> None:
        """End the request in flight when its deadline passed or its client left; every
        SWEEP_S, do the same for the waiting ones."""
        now = time.monotonic()
        for running in self.active:
            if running.outcome is None:
                if running.item.deadline is not None and now >= running.item.deadline:
                    running.outcome = "deadline"
                elif self.server.peer_gone(running.item.client):
                    self._client_left(running.item.client)
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        for item in self.queue.expired(now):  # answered and counted (GET /metrics), as a running one is
            self._answer(item.client, error_reply(item.request.request_id, "deadline_exceeded",
                                                "the request's deadline passed while it waited its turn"))
        for client in self.queue.clients():
            if self.server.peer_gone(client):
                self._client_left(client)

    def _client_left(self, client: bytes, taken: int = 0) -> None:
        """Its connection closed: cancel its requests (``taken``: already out of the queue),
        nobody is there to answer."""
        dropped = len(self._cancel_waiting(client)) + taken
        hit = self._gone(client)
        log.info("client %s left: %d waiting request(s)%s cancelled", _name(client), dropped, _in_flight(hit))

    def _gone(self, client: bytes) -> int:
        """Mark the client's running requests gone (they stop at their next step); how many."""
        hit = [running for running in self.active if running.item.client == client and running.outcome is None]
        for running in hit:
            running.outcome = "gone"
        return len(hit)

    def _answer(self, peer: bytes, reply: m.GenerateDone | m.ErrorReply) -> bool:
        """A request's last message: counted in the metrics, then sent."""
        self.coordinator.metrics.record(reply)
        return self._send(peer, reply)

    def _send(self, peer: bytes, message: m.Message) -> bool:
        """Send without waiting: False when the client is gone or is not reading (then it is
        dropped: its requests are cancelled)."""
        try:
            return self.server.send(peer, message, timeout_ms=0)
        except ChannelTimeout:
            self._drop(peer, "is not reading its replies")
        except zmq.ZMQError as error:
            log.warning("could not send to client %s: %s", _name(peer), error)
        return False

    def _cancel_waiting(self, client: bytes) -> list[Pending[bytes]]:
        """Take a departed client's waiting requests out, each counted as cancelled (nobody is
        there to answer)."""
        dropped = self.queue.drop_client(client)
        self.coordinator.metrics.record_cancelled(len(dropped))
        return dropped

    def _drop(self, peer: bytes, why: str) -> None:
        dropped = self._cancel_waiting(peer)
        hit = self._gone(peer)
        # A client that sends on and never reads fails every reply (a Pong, a busy, ...): one warning for
        # it, not one per message (a flood of Pings wrote a line each).
        again = not dropped and not hit and peer == self._last_drop
        self._last_drop = peer
        log.log(logging.DEBUG if again else logging.WARNING, "client %s %s: dropped, %d waiting request(s)%s "
                "cancelled", _name(peer), why, len(dropped), _in_flight(hit))


def _in_flight(count: int) -> str:
    return "" if count == 0 else " and the one in flight" if count == 1 else f" and {count} in flight"


def _name(client: bytes) -> str:
    return client.hex()
