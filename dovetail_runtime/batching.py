"""Many requests' decoding loops side by side (``--max-batch``).

Each loop (``generation.ar_steps``, ``dovetail_steps``) yields its next worker call. A round
takes every loop's pending call: the draft steps go to the gpu_worker as one DraftBatch, then
the decode steps and trees to the cpu_worker as one StepBatch, which the target verifies in one
forward (``cpu_worker.batched``), each sequence getting exactly the result it would get alone.
On a memory-bound CPU that pass costs little more than one sequence's, so N streams run at
nearly N times the tokens per second of one.

A new sequence's prefill takes at most one call per round, in the round's StepBatch (of the
prompts waiting, the one with the fewest tokens left: a short prompt never waits out a long one's
prefill): a long prompt comes in chunks, one per round, so it delays the running streams by one chunk per round,
never by its whole prefill; the chunk's rows share the steps' pass over the weights wherever that
keeps their bits (``cpu_worker.batched``). A chunk is ``Job.prefill_chunk`` tokens (256 by
default), or, where the target's prompt bits do not depend on the chunks, ``Job.join_chunk()``
while others run: with ``--join-chunk auto`` the batch tells a ``JoinSizer`` each round's time, and
it sizes the next chunk to about one round of the running streams. While others
run, each chunk's answer carries its feature rows; they wait in the prefill ring's single slot until
the sequence's draft reads them at the start of the next round (a DraftExtend in that round's
DraftBatch, or after the last chunk its first draft step), before any prefill call can write the
slot again: so the draft, too, takes in a long prompt a chunk per round
(``generation.prefill_steps``). Where no tree can pay at the batch's load, the rows wait with the
cpu_worker for the last chunk's answer, and the draft keeps them unread (``generation.defer_prompt``).
Where a prompt's bits depend on its chunks (fp32, bf16), its ``--prefill-chunk`` pieces keep their
size, and one that runs apart from the others' steps goes a few layers a round instead, each part
about one of their cycles (``Job.join_budget``, ``cpu_worker.prompt_parts``).

A call that fails for one sequence (a WorkerError item) ends that stream alone. A gpu_worker that
dies (WorkerFailed) ends the streams that draft (their draft state died with it) and the ar streams
go on, as they never used it; a cpu_worker that dies propagates out of ``round`` and the caller ends
every stream (``abort``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ipc import messages as m

from .generation import Call, FinishReason, Stats, Steps, Worker
from .join_sizing import JoinSizer
from .workers import WorkerFailed, WorkerRequestError

log = logging.getLogger(__name__)

Outcome = tuple[FinishReason, Stats] | BaseException


@dataclass(eq=False)
class Stream:
    """One request's loop in the batch: its pending call, or once it has ended its outcome
    (how it finished, or the exception that ended it)."""

    seq_id: int
    steps: Steps
    uses_gpu: bool
    call: Call | None = None
    outcome: Outcome | None = None

    @property
    def done(self) -> bool:
        return self.outcome is not None


PROMPT_CALLS = (m.PrefillRequest, m.DraftExtend)  # calls of a sequence still taking in its prompt


def decoding(call: Call | None) -> bool:
    """Whether a pending call is a step of a stream past its prompt (one a joining prompt delays)."""
    return call is not None and not isinstance(call.message, PROMPT_CALLS)


def prompt_rows_read(call: Call) -> int:
    """Prompt rows this draft call reads (a DraftExtend, or a first draft step reading the rest;
    one reading rows a DraftExtend left unread counts its own only)."""
    message = call.message
    if isinstance(message, m.DraftExtend):
        return 0 if message.defer else len(message.tokens)
    if call.reads_prompt and isinstance(message, m.DraftRequest):
        return len(message.tokens)
    return 0


class Batcher:
    def __init__(self, cpu: Worker, gpu: Worker | None, join: JoinSizer | None = None):
        self.cpu = cpu
        self.gpu = gpu
        self.streams: list[Stream] = []
        # Each worker's compute time in ms ("cpu", "gpu"), a batched pass counted once (its replies each
        # carry the whole pass's time, or a share): what /metrics shows as the workers' busy seconds.
        self.busy_ms: dict[str, float] = {"cpu": 0.0, "gpu": 0.0}
        self.join = join  # told each round's costs, it sizes joining prompts' chunks (--join-chunk auto)

    def running(self) -> int:
        """Streams past their prompt, whose next tokens a joining prompt's chunk would delay."""
        return sum(decoding(stream.call) for stream in self.streams)

    def add(self, seq_id: int, steps: Steps, uses_gpu: bool) -> Stream:
        """Start a loop; it takes part from the next round (or has already ended: a prompt
        that cannot fit raises before its first call)."""
        stream = Stream(seq_id, steps, uses_gpu)
        self.streams.append(stream)  # counted already while its first call is made (the batch's size)
        self._advance(stream, None)
        if stream.done:
            self.streams.remove(stream)
        return stream

    def round(self) -> list[Stream]:
        """One round (see the module doc); returns the streams that ended in it. A cpu_worker's
        death (``WorkerFailed``) propagates: call ``abort``; a gpu_worker's ends the drafting streams."""
        started = time.perf_counter()
        calls = [stream.call for stream in self.streams if stream.call is not None]
        running = sum(decoding(call) for call in calls)
        draft_rows = sum(prompt_rows_read(call) for call in calls)
        drafts = [stream for stream in self.streams if stream.call is not None and stream.call.worker == "gpu"]
        if drafts:
            if self.gpu is None:
                raise RuntimeError("a draft step without a gpu_worker")
            try:
                self._dispatch(self.gpu, drafts, m.DraftBatch, m.DraftBatchResult)
            except WorkerFailed as error:
                self._end_drafting(error)
        waiting = [(stream, stream.call) for stream in self.streams if stream.call is not None]
        # The prompt closest to its first token first (arrival order among equals): a short prompt
        # never waits out a long one's prefill, which takes many rounds in small chunks.
        prefills = sorted((stream for stream, call in waiting if isinstance(call.message, m.PrefillRequest)),
                          key=lambda stream: stream.call.prompt_left if stream.call is not None else 0)
        steps = [stream for stream, call in waiting
                 if call.worker == "cpu" and not isinstance(call.message, m.PrefillRequest | m.DecodeRun)]
        # A lone sequence's run of plain steps (``plain_runs``) goes as itself, first: a StepBatch holds
        # single steps. (Its loop asked for it alone; whoever joined since waits out one run.)
        runs = [stream for stream, call in waiting if isinstance(call.message, m.DecodeRun)]
        for stream in runs:
            self._call(self.cpu, stream)
        # One prompt chunk a round, in the running steps' forward (the cpu_worker runs it apart where
        # that would change its bits: cpu_worker.batched); none in a round the chunks' sizer wants
        # free of prompt work, to measure the running streams' cycle (join_sizing; a run's round measures none).
        if self.join is not None and running and not runs and self.join.wants_clean_round(running):
            prefills = []
        chunk = prefills[0].call.message if prefills and prefills[0].call is not None else None
        if steps or prefills:
            self._dispatch(self.cpu, steps + prefills[:1], m.StepBatch, m.StepBatchResult)
        if self.join is not None and not runs:  # a run's round is no cycle of the running streams
            # A chunk that may go in parts of its layers (a target whose prompt bits depend on the cuts)
            # tells a cycle apart from prompt work, not a row's cost.
            parted = isinstance(chunk, m.PrefillRequest) and (chunk.budget_ms > 0 or chunk.resume)
            rows = len(chunk.token_ids) if isinstance(chunk, m.PrefillRequest) and not parted else 0
            # (A round whose streams all ended before their target step is no cycle: counted as none.)
            self.join.observe((time.perf_counter() - started) * 1e3, running if steps else 0, rows, draft_rows,
                              rows > 0 or draft_rows > 0 or parted, parted)
            if rows:
                log.debug("a prompt chunk of %d rows beside %d streams; next: %s", rows, running,
                          self.join.describe(running))
        ended = [stream for stream in self.streams if stream.done]
        self.streams = [stream for stream in self.streams if not stream.done]
        return ended

    def _end_drafting(self, error: WorkerFailed) -> None:
        """The gpu_worker died: end every stream that uses it (its draft state is gone) with ``error``;
        the ar streams take their steps in this round as if nothing happened (they never used it)."""
        for stream in self.streams:
            if stream.uses_gpu and not stream.done:
                stream.steps.close()
                stream.call = None
                stream.outcome = error
                self._release(stream)

    def abort(self, error: BaseException) -> list[Stream]:
        """End every running stream with ``error`` (a worker died: its sequences are gone). The worker
        that lives on still holds them: each is released there (``WorkerHandle.send`` skips a dead
        worker), or its slots stay taken and later batches find no room."""
        ended = self.streams
        self.streams = []
        for stream in ended:
            stream.steps.close()
            stream.call = None
            stream.outcome = error
            self._release(stream)
        return ended

    def _dispatch(self, worker: Worker, streams: Sequence[Stream], batch: type[m.StepBatch] | type[m.DraftBatch],
                  result: type[m.StepBatchResult] | type[m.DraftBatchResult]) -> None:
        """The streams' calls to one worker: a lone call as itself, several as one batch."""
        if len(streams) == 1:
            self._call(worker, streams[0])
            return
        calls = [stream.call for stream in streams]
        items = [call.message for call in calls if call is not None]
        replies = worker.request(batch(items=items), result)  # type: ignore[arg-type]
        self._busy(worker, replies.compute_ms)
        if len(replies.items) != len(streams):
            raise WorkerRequestError(f"{len(replies.items)} results for a batch of {len(streams)}")
        for stream, call, item in zip(streams, calls, replies.items, strict=True):
            assert call is not None
            if isinstance(item, m.WorkerError):
                self._advance(stream, None, WorkerRequestError(f"{item.worker}: {item.message}"))
            elif not isinstance(item, call.expect) or getattr(item, "seq_id", None) != stream.seq_id:
                self._advance(stream, None, WorkerRequestError(
                    f"a batch answered {type(item).__name__} for sequence {stream.seq_id}'s {call.expect.__name__}"))
            else:
                self._advance(stream, item)

    def _call(self, worker: Worker, stream: Stream) -> None:
        call = stream.call
        assert call is not None
        try:
            reply = worker.request(call.message, call.expect)
        except WorkerRequestError as error:
            self._advance(stream, None, error)
            return
        self._busy(worker, getattr(reply, "compute_ms", 0.0))
        self._advance(stream, reply)

    def _busy(self, worker: Worker, compute_ms: float) -> None:
        self.busy_ms["gpu" if worker is self.gpu else "cpu"] += compute_ms

    def _advance(self, stream: Stream, reply: m.Message | None, error: BaseException | None = None) -> None:
        """Send the loop its reply (or throw the error into it) and take its next call; a loop that
        returns or raises has ended, and its sequence is released on both workers."""
        try:
            if error is not None:
                stream.call = stream.steps.throw(error)
            elif stream.call is None:
                stream.call = next(stream.steps)
            else:
                assert reply is not None
                stream.call = stream.steps.send(reply)
            return
        except StopIteration as stop:
            stream.outcome = stop.value
        except Exception as raised:  # the loop's own end: a worker's error, a prompt that cannot fit
            stream.outcome = raised
        stream.call = None
        self._release(stream)

    def _release(self, stream: Stream) -> None:
        """Free an ended stream's sequence on its workers."""
        self.cpu.send(m.ReleaseSequence(seq_id=stream.seq_id))
        if stream.uses_gpu and self.gpu is not None:
            self.gpu.send(m.ReleaseSequence(seq_id=stream.seq_id))
