"""Many requests side by side (dovetail_runtime/batching.py) over in-process workers: every stream
(dovetail or ar, greedy or seeded sampling, with logprobs) gets exactly the tokens and logprobs it
gets alone; a stream that fails or stops early changes nobody else's; the calls really are merged
into batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpu_worker.server import build_engine
from dovetail_runtime.batching import Batcher, Stream
from dovetail_runtime.generation import Job, ar_steps, dovetail_steps, run_alone
from dovetail_runtime.local_workers import LocalWorker, local_workers
from dovetail_runtime.tree_planner import FixedTree
from dovetail_runtime.workers import WorkerFailed, WorkerRequestError
from gpu_worker.drafter import Drafter
from ipc import messages as m
from ipc.tree import TreeShape

DEMO = Path(__file__).resolve().parents[2] / "demo"
SHAPE = TreeShape.clamped(8, 4, 4)
PROMPTS = [[1, 500, 600, 700, 42], [1, 9, 10], [1, 300, 301, 302, 303, 304, 305], [1, 77],
           [1, 42, 42, 42], [1, 800, 12], [1, 5, 6, 7, 8, 9], [1, 1000]]


@pytest.fixture(scope="module")
def demo_pair():
    engine, _ = build_engine(str(DEMO / "target-code-9m"), "int8", 256)
    drafter = Drafter.from_pretrained(DEMO / "draft-dgf", DEMO / "target-code-9m", max_len=256, device="cpu")
    return engine, drafter


def job(index: int, max_new_tokens: int = 20) -> tuple[Job, bool]:
    """Request ``index``: even ones dovetail, odd ones ar; every third sampled with a seed; logprobs on some."""
    sampling = m.Sampling(temperature=0.8, top_k=20, seed=index) if index % 3 == 2 else m.Sampling()
    return (Job(seq_id=100 + index, prompt_ids=PROMPTS[index], max_new_tokens=max_new_tokens, sampling=sampling,
                eos_token_ids=frozenset(), max_len=256, logprobs=2 if index % 4 == 1 else None), index % 2 == 0)


class Recorder:
    def __init__(self, stop_after: int | None = None):
        self.tokens: list[int] = []
        self.logprobs: list[m.TokenLogprob] = []
        self.stop_after = stop_after

    def __call__(self, new: list[int], new_logprobs: list[m.TokenLogprob]) -> bool:
        self.tokens.extend(new)
        self.logprobs.extend(new_logprobs)
        return self.stop_after is not None and len(self.tokens) >= self.stop_after


def steps_for(index: int, recorder: Recorder, batcher: Batcher | None = None):
    """Request ``index``'s loop; with ``batcher``, told how many streams it runs beside (as the coordinator
    does: alone, a plain stretch asks for several steps a call)."""
    request, dovetail = job(index)
    batch = (lambda: max(1, len(batcher.streams))) if batcher is not None else (lambda: 1)
    return dovetail_steps(request, SHAPE, recorder, batch) if dovetail else ar_steps(request, recorder, batch)


class Counting(LocalWorker):
    """A local worker that counts the messages it is sent, by type."""

    def __init__(self, inner: LocalWorker):
        super().__init__(inner.name, inner.handlers)
        self.counts: dict[str, int] = {}

    def request(self, message, expect):
        self.counts[type(message).__name__] = self.counts.get(type(message).__name__, 0) + 1
        for item in getattr(message, "items", []):  # a batch's items as "StepBatch/PrefillRequest"
            key = f"{type(message).__name__}/{type(item).__name__}"
            self.counts[key] = self.counts.get(key, 0) + 1
        return super().request(message, expect)


def run_batched(engine, drafter, indices: list[int], recorders: dict[int, Recorder]):
    with local_workers(engine, drafter, SHAPE, max_sequences=8) as (cpu, gpu):
        cpu, gpu = Counting(cpu), Counting(gpu)
        batcher = Batcher(cpu, gpu)
        streams: dict[int, Stream] = {}
        pending = list(indices)
        while pending or batcher.streams:
            if pending:  # one joins per round: new requests arrive while others run
                index = pending.pop(0)
                streams[index] = batcher.add(job(index)[0].seq_id, steps_for(index, recorders[index], batcher),
                                             uses_gpu=job(index)[1])
            batcher.round()
    return streams, cpu.counts, gpu.counts


def test_every_stream_gets_its_solo_tokens_and_logprobs(demo_pair):
    engine, drafter = demo_pair
    solo: dict[int, Recorder] = {}
    for index in range(8):
        solo[index] = Recorder()
        with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
            run_alone(steps_for(index, solo[index]), cpu, gpu)
    together = {index: Recorder() for index in range(8)}
    streams, cpu_counts, gpu_counts = run_batched(engine, drafter, list(range(8)), together)
    for index in range(8):
        assert together[index].tokens == solo[index].tokens and len(solo[index].tokens) == 20, index
        assert together[index].logprobs == solo[index].logprobs, index
        finish, stats = streams[index].outcome
        assert finish == "length" and stats.new_tokens == 20
    # Merged: far fewer worker round trips than the streams' steps, and batches on both workers.
    assert cpu_counts["StepBatch"] >= 10 and gpu_counts["DraftBatch"] >= 5
    # The first prompt alone; each later one in the running streams' forward (one chunk each here).
    assert cpu_counts["PrefillRequest"] == 1 and cpu_counts["StepBatch/PrefillRequest"] == 7
    requests = sum(count for name, count in cpu_counts.items() if "/" not in name)
    assert requests < sum(streams[index].outcome[1].cycles for index in range(8))


def test_a_failing_or_stopping_stream_changes_nobody_else(demo_pair):
    engine, drafter = demo_pair
    expected = {}
    for index in (0, 1, 2):
        expected[index] = Recorder()
        with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
            run_alone(steps_for(index, expected[index]), cpu, gpu)
    with local_workers(engine, drafter, SHAPE, max_sequences=8) as (cpu, gpu):
        batcher = Batcher(cpu, gpu)
        recorders = {index: Recorder() for index in (0, 1, 2)}
        stopper = Recorder(stop_after=3)
        too_long = Job(seq_id=7, prompt_ids=[1] * 300, max_new_tokens=5, sampling=m.Sampling(),
                       eos_token_ids=frozenset(), max_len=256)
        refused = batcher.add(7, ar_steps(too_long, Recorder()), uses_gpu=False)
        assert refused.done and isinstance(refused.outcome, ValueError)  # PromptTooLong, before any call
        streams = {index: batcher.add(job(index)[0].seq_id, steps_for(index, recorders[index], batcher), job(index)[1])
                   for index in (0, 1, 2)}
        stopping = batcher.add(job(3)[0].seq_id, dovetail_steps(job(3)[0], SHAPE, stopper), uses_gpu=True)
        batcher.round()
        batcher.round()
        # A sequence the cpu_worker no longer holds: its next step fails alone.
        doomed_job = Job(seq_id=9, prompt_ids=[1, 2, 3], max_new_tokens=30, sampling=m.Sampling(),
                         eos_token_ids=frozenset(), max_len=256)
        doomed = batcher.add(9, ar_steps(doomed_job, Recorder()), uses_gpu=False)
        while isinstance(doomed.call.message, m.PrefillRequest):  # one prefill per round, in turn
            batcher.round()
        cpu.send(m.ReleaseSequence(seq_id=9))
        while batcher.streams:
            batcher.round()
    assert isinstance(doomed.outcome, WorkerRequestError) and "not active" in str(doomed.outcome)
    assert stopping.outcome[0] == "stop" and 3 <= len(stopper.tokens) < 20
    for index in (0, 1, 2):
        assert recorders[index].tokens == expected[index].tokens and streams[index].outcome[0] == "length"


def test_abort_ends_every_stream_and_frees_its_sequence_where_the_worker_lives_on(demo_pair):
    """One worker died; the other still holds the batch's sequences unless they are released: with
    every slot held, the next requests found no room ("4 sequences are active") until a restart."""
    engine, drafter = demo_pair
    with local_workers(engine, drafter, SHAPE, max_sequences=2) as (cpu, gpu):
        batcher = Batcher(cpu, gpu)
        first = batcher.add(job(0)[0].seq_id, steps_for(0, Recorder(), batcher), True)
        second = batcher.add(job(1)[0].seq_id, steps_for(1, Recorder(), batcher), False)
        batcher.round()
        error = RuntimeError("the gpu_worker died")
        assert batcher.abort(error) == [first, second] and batcher.streams == []
        assert first.outcome is error and second.outcome is error
        recorders = {index: Recorder() for index in (2, 4)}
        later = [batcher.add(job(index)[0].seq_id, steps_for(index, recorders[index], batcher), job(index)[1])
                 for index in (2, 4)]
        while batcher.streams:
            batcher.round()
        assert all(isinstance(stream.outcome, tuple) and stream.outcome[0] == "length" for stream in later), \
            [str(stream.outcome) for stream in later]


class Dying(LocalWorker):
    """A local worker that dies (WorkerFailed on every request) once ``dead`` is set."""

    def __init__(self, inner: LocalWorker):
        super().__init__(inner.name, inner.handlers)
        self.dead = False

    def request(self, message, expect):
        if self.dead:
            raise WorkerFailed(f"{self.name} (pid 1) died with exit code -9")
        return super().request(message, expect)


def test_a_dead_gpu_worker_ends_the_drafting_streams_and_the_ar_ones_run_on(demo_pair):
    """A killed gpu_worker failed every stream of the batch, the ar ones too (worker_failed), though
    they never use it: they now end with their solo tokens."""
    engine, drafter = demo_pair
    expected = Recorder()
    with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
        run_alone(steps_for(1, expected), cpu, gpu)
    with local_workers(engine, drafter, SHAPE, max_sequences=4) as (cpu, gpu):
        gpu = Dying(gpu)
        batcher = Batcher(cpu, gpu)
        recorders = {index: Recorder() for index in (0, 1, 2)}
        streams = {index: batcher.add(job(index)[0].seq_id, steps_for(index, recorders[index], batcher), job(index)[1])
                   for index in (0, 1, 2)}
        for _ in range(3):
            batcher.round()
        assert not any(stream.done for stream in streams.values())
        gpu.dead = True
        ended = batcher.round()
        assert ended == [streams[0], streams[2]]  # the dovetail ones, at once
        assert all(isinstance(streams[index].outcome, WorkerFailed) for index in (0, 2))
        while batcher.streams:
            batcher.round()
    assert streams[1].outcome[0] == "length" and recorders[1].tokens == expected.tokens


class Timing(LocalWorker):
    """A local worker that adds up the compute time its replies report (a batch's once)."""

    def __init__(self, inner: LocalWorker):
        super().__init__(inner.name, inner.handlers)
        self.compute_ms = 0.0

    def request(self, message, expect):
        reply = super().request(message, expect)
        self.compute_ms += getattr(reply, "compute_ms", 0.0)
        return reply


def test_the_batcher_counts_each_workers_time_once_a_pass(demo_pair):
    """Each request's verify_ms is its batch's whole pass (the planner needs that), so their sum over
    four streams is ~4x the target's time; ``busy_ms`` is the workers' own."""
    engine, drafter = demo_pair
    with local_workers(engine, drafter, SHAPE, max_sequences=4) as (cpu, gpu):
        cpu, gpu = Timing(cpu), Timing(gpu)
        batcher = Batcher(cpu, gpu)
        streams = [batcher.add(job(index)[0].seq_id, steps_for(index, Recorder(), batcher), job(index)[1])
                   for index in range(4)]
        while batcher.streams:
            batcher.round()
    assert batcher.busy_ms == {"cpu": cpu.compute_ms, "gpu": gpu.compute_ms} and cpu.compute_ms > 0 < gpu.compute_ms
    requests_ms = sum(stream.outcome[1].verify_ms + stream.outcome[1].prefill_ms for stream in streams)
    assert requests_ms > 2 * batcher.busy_ms["cpu"]


def test_a_batch_item_for_an_unknown_or_repeated_sequence_fails_alone(demo_pair):
    engine, drafter = demo_pair
    with local_workers(engine, drafter, SHAPE, max_sequences=2) as (cpu, gpu):
        for seq_id in (1, 2):
            cpu.request(m.PrefillRequest(seq_id=seq_id, token_ids=[1, 5, 6], return_features=False), m.PrefillResult)
        items = [m.DecodeRequest(seq_id=1, token=7), m.DecodeRequest(seq_id=1, token=8),
                 m.DecodeRequest(seq_id=3, token=7), m.DecodeRequest(seq_id=2, token=7)]
        reply = cpu.request(m.StepBatch(items=items), m.StepBatchResult)
        first, repeated, unknown, second = reply.items
        assert isinstance(first, m.DecodeResult) and isinstance(second, m.DecodeResult)
        assert first.token == second.token  # the same prompt and token: the same next token
        assert isinstance(repeated, m.WorkerError) and "twice" in repeated.message
        assert isinstance(unknown, m.WorkerError) and "not active" in unknown.message
        # A third sequence beyond max_sequences ends the longest-held one.
        cpu.request(m.PrefillRequest(seq_id=3, token_ids=[1, 2], return_features=False), m.PrefillResult)
        with pytest.raises(WorkerRequestError, match="not active"):
            cpu.request(m.DecodeRequest(seq_id=1, token=7), m.DecodeResult)
        assert isinstance(cpu.request(m.DecodeRequest(seq_id=2, token=7), m.DecodeResult), m.DecodeResult)


def test_a_draft_batch_item_for_an_unknown_sequence_fails_alone(demo_pair):
    engine, drafter = demo_pair
    with local_workers(engine, drafter, SHAPE, max_sequences=2) as (cpu, gpu):
        prefill = cpu.request(m.PrefillRequest(seq_id=1, token_ids=[1, 5, 6]), m.PrefillResult)
        assert prefill.features is not None
        fresh = m.DraftRequest(seq_id=1, tokens=[5, 6, prefill.token], features=prefill.features, shape=SHAPE,
                               reset=True)
        stale = m.DraftRequest(seq_id=9, tokens=[5], features=prefill.features, shape=SHAPE)
        reply = gpu.request(m.DraftBatch(items=[fresh, stale]), m.DraftBatchResult)
        drafted, refused = reply.items
        assert isinstance(drafted, m.DraftResult) and drafted.tokens[0] == prefill.token
        assert isinstance(refused, m.WorkerError) and "not active" in refused.message and refused.seq_id == 9


class BusyPlanner(FixedTree):
    """Full trees alone; one-node trees whenever the batch holds others (as a costly verify plans).
    Counts the trees it is shown (``observed``)."""

    observed = 0

    def shape(self, batch: int = 1) -> TreeShape:
        return self.envelope if batch == 1 else TreeShape.clamped(1, 1, 1)

    def trees_may_pay(self, batch: int) -> bool:
        return batch == 1

    def observe(self, shape: TreeShape, *args, **kwargs) -> None:
        self.observed += shape.tree_tokens > 1


def test_under_sustained_load_dovetail_streams_decode_plainly_with_their_solo_tokens(demo_pair):
    engine, drafter = demo_pair
    indices = (0, 2, 4, 6)  # dovetail; 2 samples with a seed
    solo: dict[int, Recorder] = {}
    for index in indices:
        solo[index] = Recorder()
        with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
            run_alone(dovetail_steps(job(index, 40)[0], BusyPlanner(SHAPE), solo[index]), cpu, gpu)
    together = {index: Recorder() for index in indices}
    steps_sent: dict[str, int] = {}
    with local_workers(engine, drafter, SHAPE, max_sequences=4) as (cpu, gpu):
        cpu, gpu = Counting(cpu), Counting(gpu)
        batcher = Batcher(cpu, gpu)

        def busy() -> int:
            return len(batcher.streams)

        streams = {index: batcher.add(job(index)[0].seq_id, dovetail_steps(job(index, 40)[0], BusyPlanner(SHAPE),
                                                                           together[index], busy), uses_gpu=True)
                   for index in indices}
        while batcher.streams:
            for stream in batcher.streams:
                if stream.call is not None and stream.call.worker == "cpu":
                    kind = type(stream.call.message).__name__
                    steps_sent[kind] = steps_sent.get(kind, 0) + 1
            batcher.round()
    for index in indices:
        assert together[index].tokens == solo[index].tokens and len(solo[index].tokens) == 40, index
        finish, stats = streams[index].outcome
        assert stats.trees["1/0/0"] >= 25 and stats.new_tokens == 40  # mostly plain decode steps
        # No draft step at all while the batch stays busy: not for the prompt (its rows go to the
        # draft unread), nor a head step and round trip for a one-node tree.
        assert "1/0/1" not in stats.trees, index
    # Each prompt's rows handed over unread (alone or batched), and trees once a stream is alone at the end.
    assert gpu.counts.get("DraftBatch/DraftExtend", 0) + gpu.counts.get("DraftExtend", 0) == len(indices)
    assert gpu.counts.get("DraftBatch", 0) + gpu.counts.get("DraftRequest", 0) + gpu.counts.get("DraftExtend", 0) \
        <= len(indices) + 3
    assert steps_sent["DecodeRequest"] >= 4 * 25


def test_a_request_decoding_plainly_drafts_again_once_the_load_drops(demo_pair):
    """A dovetail request kept at one-node trees by a busy batch decodes plainly while the batch is
    busy (its prompt's rows handed to the draft unread), then, alone again, gets full trees (the
    draft reading the prompt's rows with a root-only feature row, and going on from there), its
    tokens its solo tokens all along."""
    engine, drafter = demo_pair
    short_job = job(1, 16)[0]  # ar with logprobs
    # Dovetail, greedy, a 40-token prompt in 8-token chunks (run while the ar request decodes).
    long_job = Job(seq_id=100, prompt_ids=[1] + [(37 * index) % 900 + 20 for index in range(1, 40)],
                   max_new_tokens=60, sampling=m.Sampling(), eos_token_ids=frozenset(), max_len=256, prefill_chunk=8)
    solo = Recorder()
    with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
        run_alone(dovetail_steps(long_job, BusyPlanner(SHAPE), solo), cpu, gpu)
    resets: list[int] = []
    draft_calls: list[tuple[str, int]] = []  # (kind, pairs sent)

    class Watching(LocalWorker):
        def request(self, message, expect):
            items = message.items if isinstance(message, m.DraftBatch) else [message]
            resets.extend(item.seq_id for item in items
                          if isinstance(item, m.DraftRequest | m.DraftExtend) and item.reset)
            draft_calls.extend(("kept" if isinstance(item, m.DraftExtend) and item.defer else type(item).__name__,
                                len(item.tokens)) for item in items if item.seq_id == long_job.seq_id)
            return super().request(message, expect)

    together, short = Recorder(), Recorder()
    with local_workers(engine, drafter, SHAPE, max_sequences=2) as (cpu, gpu):
        batcher = Batcher(cpu, Watching(gpu.name, gpu.handlers))

        def busy() -> int:
            return len(batcher.streams)

        planner = BusyPlanner(SHAPE)
        stream = batcher.add(long_job.seq_id, dovetail_steps(long_job, planner, together, busy), True)
        batcher.add(short_job.seq_id, ar_steps(short_job, short, busy), uses_gpu=False)
        while batcher.streams:
            batcher.round()
    assert together.tokens == solo.tokens and len(solo.tokens) == 60
    finish, stats = stream.outcome
    assert "1/0/1" not in stats.trees  # no draft step while the ar request ran: the prompt's rows kept ...
    assert stats.trees["1/0/0"] >= 3  # ... plain steps (and the root-only verify) ...
    full = stats.trees[f"{SHAPE.tree_tokens}/{SHAPE.depth}/{SHAPE.top_k}"]
    assert full >= 3 and planner.observed == full  # ... then full trees again
    assert resets == [long_job.seq_id]  # the kept prompt's only: the draft goes on from its own context
    # The whole prompt's pairs handed over unread after its last chunk (the cpu_worker kept the chunks'
    # rows: no tree could pay meanwhile), then the first tree's step with one root-only pair.
    assert draft_calls[:2] == [("kept", len(long_job.prompt_ids)), ("DraftRequest", 1)]
    assert all(kind == "DraftRequest" for kind, _ in draft_calls[1:])


class PlainForAWhile(FixedTree):
    """Alone: full trees for 3 cycles, then one node (plain steps) for the next 20 asks, then full
    trees again, as the planner's fallback plans where trees stop paying for a while."""

    asked = 0

    def shape(self, batch: int = 1) -> TreeShape:
        self.asked += 1
        return TreeShape.clamped(1, 1, 1) if 3 < self.asked <= 23 else self.envelope

    def plain_run_cap(self) -> int:
        return 1  # one step an ask, as it counts asks


def test_a_request_alone_decodes_plainly_where_its_planner_says_so_then_drafts_again(demo_pair):
    """Its tokens stay ar's, the draft goes on from its own context (one reset: the prompt's), and
    the tree the planner planned to end the plain steps is the next one drafted."""
    engine, drafter = demo_pair
    request = job(0, 60)[0]
    ar = Recorder()
    with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
        run_alone(ar_steps(request, ar), cpu, gpu)
    drafts: list[tuple[bool, int]] = []

    class Watching(LocalWorker):
        def request(self, message, expect):
            if isinstance(message, m.DraftRequest):
                drafts.append((message.reset, message.shape.tree_tokens))
            return super().request(message, expect)

    recorder, planner = Recorder(), PlainForAWhile(SHAPE)
    with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
        _, stats = run_alone(dovetail_steps(request, planner, recorder), cpu, Watching(gpu.name, gpu.handlers))
    assert recorder.tokens == ar.tokens and len(ar.tokens) == 60
    assert stats.trees["1/0/0"] == 21  # 20 plain steps and the root-only verify that ends them
    full = stats.trees[f"{SHAPE.tree_tokens}/{SHAPE.depth}/{SHAPE.top_k}"]
    assert full > 3 and len(drafts) == full and planner.asked == full + 20
    assert [reset for reset, _ in drafts] == [True] + [False] * (full - 1)
    assert {size for _, size in drafts} == {SHAPE.tree_tokens}


def test_a_sequences_first_cycle_teaches_the_planner_acceptance_but_not_times(demo_pair):
    """Its draft step also read the whole prompt."""
    engine, drafter = demo_pair
    timed: list[bool] = []

    class Recording(FixedTree):
        def observe(self, *args, **kwargs) -> None:
            timed.append(kwargs["timed"])

    with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
        run_alone(dovetail_steps(job(0, 24)[0], Recording(SHAPE), Recorder()), cpu, gpu)
    assert len(timed) >= 3 and timed[0] is False and all(timed[1:])


def test_the_first_draft_step_is_reported_as_the_drafts_absorption_of_the_prompt(demo_pair):
    """RequestStats.draft_prompt_ms: the part of draft_ms the draft spent reading the prompt (its
    first step, which starts the sequence), so benchmarks can tell it from the per-cycle cost."""
    engine, drafter = demo_pair
    steps: list[tuple[bool, int, float]] = []

    class Watching(LocalWorker):
        def request(self, message, expect):
            reply = super().request(message, expect)
            if isinstance(message, m.DraftRequest):
                steps.append((message.reset, len(message.tokens), reply.compute_ms))
            return reply

    request, _ = job(0, max_new_tokens=24)
    with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
        _, stats = run_alone(dovetail_steps(request, SHAPE, Recorder()), cpu, Watching(gpu.name, gpu.handlers))
    assert steps[0][:2] == (True, len(PROMPTS[0])) and not any(reset for reset, _, _ in steps[1:])
    message = stats.message()
    assert message.draft_prompt_ms == round(steps[0][2], 3) > 0
    assert message.draft_ms == pytest.approx(sum(ms for _, _, ms in steps), abs=1e-3)
