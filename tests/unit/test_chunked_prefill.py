"""A long prompt prefilled in chunks (``Job.prefill_chunk``, ``PrefillRequest.offset/more``): the
chunks compute the prompt the whole-prompt prefill computes, the worker answers each chunk with its
feature rows from where the draft last read (in a busy batch it reads each chunk before the next),
a stream in chunks gets the tokens it gets alone and lets the running streams step between its
chunks, and chunks out of order are refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from cpu_worker.server import build_engine
from dovetail_runtime.batching import Batcher
from dovetail_runtime.generation import Job, ar_steps, dovetail_steps, run_alone
from dovetail_runtime.local_workers import local_workers
from dovetail_runtime.workers import WorkerRequestError
from gpu_worker.drafter import Drafter
from ipc import messages as m
from ipc.shm_ring import ShmRing, get_block
from ipc.tree import TreeShape

DEMO = Path(__file__).resolve().parents[2] / "demo"
SHAPE = TreeShape.clamped(8, 4, 4)
LONG = [1] + [(37 * index) % 900 + 20 for index in range(1, 70)]  # 70 tokens
SHORT = [1, 500, 600, 700, 42]


@pytest.fixture(scope="module")
def demo_pair():
    engine, _ = build_engine(str(DEMO / "target-code-9m"), "int8", 256)
    drafter = Drafter.from_pretrained(DEMO / "draft-dgf", DEMO / "target-code-9m", max_len=256, device="cpu")
    return engine, drafter


def make_job(seq_id: int, prompt: list[int], chunk: int | None, max_new_tokens: int = 16) -> Job:
    return Job(seq_id=seq_id, prompt_ids=prompt, max_new_tokens=max_new_tokens, sampling=m.Sampling(),
               eos_token_ids=frozenset(), max_len=256, prefill_chunk=chunk)


def collect(tokens: list[int]):
    def emit(new: list[int], _logprobs) -> bool:
        tokens.extend(new)
        return False
    return emit


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_prompt_in_chunks_computes_what_the_whole_prompt_does(precision):
    engine, _ = build_engine(str(DEMO / "target-code-9m"), precision, 256)
    whole = engine.prefill(LONG)
    whole_keys = engine.cache.keys[..., : len(LONG), :].clone()
    rows = []
    for offset in range(0, len(LONG), 16):
        last = engine.prefill(LONG[offset:offset + 16], offset)
        rows.append(last.features)
    assert engine.committed == len(LONG)
    chunked = torch.cat(rows)
    assert chunked.shape == whole.features.shape
    torch.testing.assert_close(chunked, whole.features, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last.logits, whole.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(engine.cache.keys[..., : len(LONG), :], whole_keys, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="offset 3, but the sequence holds 70"):
        engine.prefill([5], 3)


@pytest.mark.parametrize(("precision", "kv_dtype", "invariant"), [
    ("int8", "fp32", True), ("q4_0", "bf16", True), ("q4_1-a16", "fp32", True), ("int8-row", "fp32", True),
    ("fp32", "fp32", False), ("bf16", "bf16", False)])
def test_a_prompt_s_bits_do_not_depend_on_its_chunks_where_the_engine_says_so(precision, kv_dtype, invariant):
    """Where the engine declares it (the exact attention kernels, row-invariant linears, no fp32 prompt
    GEMM), a prompt cut any way gives the same bits: its cache, every feature row, the last logits and
    the next token's. So the coordinator may size a joining prompt's chunks by load (--join-chunk)."""
    engine, _ = build_engine(str(DEMO / "target-code-9m"), precision, 256, kv_dtype=kv_dtype)
    assert engine.chunk_invariant is invariant
    if not invariant:
        return  # fp32 (its prompt GEMM from 64 rows) and bf16 (torch's attention) keep fixed chunks
    reference = None
    for cuts in ([70], [16, 16, 16, 16, 6], [1] * 70, [33, 37], [64, 6]):
        offset, features = 0, []
        for size in cuts:
            step = engine.prefill(LONG[offset:offset + size], offset)
            features.append(step.features)
            offset += size
        cache = (engine.cache.keys[..., :70, :].clone(), engine.cache.values[..., :70, :].clone())
        following = engine.decode(int(step.logits.argmax()))
        signature = (torch.cat(features), step.logits, *cache, following.logits)
        if reference is None:
            reference = signature
        for got, expected in zip(signature, reference, strict=True):
            assert torch.equal(got, expected), cuts


def test_the_worker_answers_each_chunk_with_the_rows_not_read_yet(demo_pair):
    engine, _ = demo_pair
    with local_workers(engine, max_sequences=2) as (cpu, _):
        whole = cpu.request(m.PrefillRequest(seq_id=1, token_ids=LONG), m.PrefillResult)
        assert whole.features is not None and whole.features.rows == len(LONG)
        ring = ShmRing.attach(whole.features.ring)
        try:
            whole_rows = get_block(whole.features, {ring.name: ring}).clone()
            for offset in (0, 32):
                partial = cpu.request(m.PrefillRequest(seq_id=2, token_ids=LONG[offset:offset + 32], offset=offset,
                                                       more=True, features_now=True), m.PrefillPartial)
                assert partial.seq_id == 2 and partial.features is not None
                assert partial.features.rows == offset + 32  # features_from 0: nothing read yet
            # A chunk at another offset, or rows asked from where none are kept, is refused before
            # anything changes (the sequence goes on).
            with pytest.raises(WorkerRequestError, match="offset 70, but sequence 2 holds 64"):
                cpu.request(m.PrefillRequest(seq_id=2, token_ids=[5], offset=70, more=True), m.PrefillPartial)
            with pytest.raises(WorkerRequestError, match="on a prompt's first chunk"):
                cpu.request(m.PrefillRequest(seq_id=2, token_ids=[5], features_from=3), m.PrefillResult)
            # A step before the prompt is complete, or a chunk at the wrong offset, is refused.
            with pytest.raises(WorkerRequestError, match="not complete"):
                cpu.request(m.DecodeRequest(seq_id=2, token=5), m.DecodeResult)
            cpu.send(m.ReleaseSequence(seq_id=2))
            with pytest.raises(WorkerRequestError, match="not active"):
                cpu.request(m.PrefillRequest(seq_id=2, token_ids=LONG[64:], offset=64), m.PrefillResult)
            # A complete prompt takes no more chunks.
            with pytest.raises(WorkerRequestError, match="is complete"):
                cpu.request(m.PrefillRequest(seq_id=1, token_ids=[5], offset=len(LONG)), m.PrefillResult)
            # Each answer carries the rows from features_from on: read from the first chunk's answer,
            # not from the second's (the worker keeps them), then from 32 on with the last.
            rows = []
            for offset in (0, 32):
                partial = cpu.request(m.PrefillRequest(seq_id=3, token_ids=LONG[offset:offset + 32], offset=offset,
                                                       more=True, features_now=offset == 0), m.PrefillPartial)
                if offset == 0:
                    assert partial.features is not None and partial.features.rows == 32
                    rows.append(get_block(partial.features, {ring.name: ring}).clone())
                else:
                    assert partial.features is None  # not read now: kept for the next answer
            with pytest.raises(WorkerRequestError, match=r"features_from 16 is not where .* \(0, 32, 64\)"):
                cpu.request(m.PrefillRequest(seq_id=3, token_ids=LONG[64:], offset=64, features_from=16),
                            m.PrefillResult)
            last = cpu.request(m.PrefillRequest(seq_id=3, token_ids=LONG[64:], offset=64, features_from=32),
                               m.PrefillResult)
            assert last.features is not None and last.features.rows == len(LONG) - 32
            rows.append(get_block(last.features, {ring.name: ring}).clone())
            assert last.compute_ms > 0
            # int8 (its KV cache too): a chunk boundary moves a few roundings, no more.
            torch.testing.assert_close(torch.cat(rows), whole_rows, rtol=0.05, atol=0.05)
        finally:
            ring.close()
        # ar's prompts (no features asked) put nothing in the ring.
        plain = cpu.request(m.PrefillRequest(seq_id=4, token_ids=LONG[:32], return_features=False, more=True),
                            m.PrefillPartial)
        assert plain.features is None


@pytest.mark.parametrize("dovetail", [True, False])
def test_a_chunked_stream_gets_its_solo_tokens_and_the_running_one_steps_between_its_chunks(demo_pair, dovetail):
    engine, drafter = demo_pair

    batcher: Batcher | None = None

    def together() -> int:
        """How many streams the batch runs (as the coordinator's ``_batch_size``); 1 alone."""
        return len(batcher.streams) if batcher else 1

    def steps(job: Job, tokens: list[int]):
        return (dovetail_steps(job, SHAPE, collect(tokens), together) if dovetail
                else ar_steps(job, collect(tokens), together))

    alone: list[int] = []
    with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
        cpu, gpu = Recorder(cpu), Recorder(gpu) if dovetail else gpu
        run_alone(steps(make_job(1, LONG, 16), alone), cpu, gpu)
    if dovetail:
        # Alone, the draft reads the whole prompt with its first tree (the first token comes sooner),
        # and no chunk's answer carries rows before that.
        first, *_ = gpu.items((m.DraftExtend, m.DraftRequest))
        assert isinstance(first, m.DraftRequest) and list(first.tokens) == LONG[1:] + [alone[0]] and first.reset
        chunks = cpu.items(m.PrefillRequest)
        assert len(chunks) == 5 and not any(chunk.features_now for chunk in chunks[:4])
        solo_trees = gpu.replies(m.DraftResult)
    running_alone: list[int] = []
    with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
        run_alone(steps(make_job(2, SHORT, 16, max_new_tokens=40), running_alone), cpu, gpu)
    assert len(alone) == 16 and len(running_alone) == 40

    long_tokens: list[int] = []
    short_tokens: list[int] = []
    with local_workers(engine, drafter, SHAPE, max_sequences=2) as (cpu, gpu):
        cpu, gpu = Recorder(cpu), Recorder(gpu)
        batcher = Batcher(cpu, gpu)
        short = batcher.add(2, steps(make_job(2, SHORT, 16, max_new_tokens=40), short_tokens), uses_gpu=dovetail)
        batcher.round()  # its prefill
        batcher.round()
        long = batcher.add(1, steps(make_job(1, LONG, 16), long_tokens), uses_gpu=dovetail)
        rounds = 0
        while long.call is not None and isinstance(long.call.message, (m.PrefillRequest, m.DraftExtend)):
            before = len(short_tokens)
            batcher.round()
            rounds += 1
            assert len(short_tokens) > before  # the running stream stepped in the same round
        assert rounds == 5  # a chunk per round (and the draft reads the one before it in that round)
        assert [message.offset for message in cpu.items(m.PrefillRequest)] == [0, 16, 32, 48, 64]
        while batcher.streams:
            batcher.round()
        draft_reads = gpu.items((m.DraftExtend, m.DraftRequest))
        if dovetail:
            # Others running: the draft reads a chunk a round (pairs: row i with token i + 1), the last
            # chunk with the first new token.
            assert [list(message.tokens) for message in draft_reads[:5]] == [
                *(LONG[offset + 1:offset + 17] for offset in (0, 16, 32, 48)), LONG[65:] + [long_tokens[0]]]
            assert [message.reset for message in draft_reads[:5]] == [True, False, False, False, False]
            assert isinstance(draft_reads[4], m.DraftRequest) and len(gpu.items(m.DraftExtend)) == 4
            # Read in chunks, the draft proposes the tree it proposes after reading the prompt whole.
            assert gpu.replies(m.DraftResult)[0].tokens == solo_trees[0].tokens
        else:
            assert draft_reads == []
    assert long.outcome is not None and short.outcome is not None
    assert long_tokens == alone and short_tokens == running_alone


@pytest.mark.parametrize("dovetail", [True, False])
def test_a_prompt_joining_in_chunks_sized_by_load_gets_the_tokens_it_gets_whole(demo_pair, dovetail):
    """An int8 target's prompt bits do not depend on its chunks, so a prompt joining running streams
    may take whatever ``Job.join_chunk`` says each round (the load's sizes), and alone its whole
    prompt in one call: the same tokens either way, and the running stream's are its solo ones."""
    engine, drafter = demo_pair
    assert engine.chunk_invariant
    loops = Loops(dovetail)
    steps = loops.steps

    whole: list[int] = []
    running_alone: list[int] = []
    with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
        run_alone(steps(make_job(1, LONG, None), whole), cpu, gpu)
        run_alone(steps(make_job(2, SHORT, None, max_new_tokens=80), running_alone), cpu, gpu)
    sizes = [5, 9, 3, 16, 1, 11, 7, 13, 2, 8]
    asked = iter(sizes)
    joined: list[int] = []
    running: list[int] = []
    with local_workers(engine, drafter, SHAPE, max_sequences=2) as (cpu, gpu):
        cpu = Recorder(cpu)
        batcher = loops.batcher = Batcher(cpu, gpu)
        batcher.add(2, steps(make_job(2, SHORT, None, max_new_tokens=80), running), uses_gpu=dovetail)
        batcher.round()
        job = dataclasses.replace(make_job(1, LONG, None), join_chunk=lambda: next(asked))
        batcher.add(1, steps(job, joined), uses_gpu=dovetail)
        while batcher.streams:
            batcher.round()
        chunks = [len(message.token_ids) for message in cpu.items(m.PrefillRequest)]
    assert chunks == [5, 9, 3, 16, 1, 11, 7, 13, 2, 3]  # as asked while the other ran; the last what was left
    assert joined == whole and running == running_alone


@pytest.mark.parametrize("dovetail", [True, False])
def test_a_short_prompt_goes_before_the_rest_of_a_long_one(demo_pair, dovetail):
    """One prompt chunk a round, and of the prompts waiting the one with the fewest tokens left: a
    short prompt arriving while a long one joins in small chunks gets its first token at once, and
    every stream keeps its solo tokens (dovetail: the prefill ring's one slot passes between the two
    prompts' rows, each read by its draft before the next chunk is run)."""
    engine, drafter = demo_pair
    loops = Loops(dovetail)
    steps = loops.steps

    prompts = {1: LONG, 2: SHORT, 3: [1, 77, 78, 79]}
    solo: dict[int, list[int]] = {1: [], 2: [], 3: []}
    with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
        for seq_id, prompt in prompts.items():
            run_alone(steps(make_job(seq_id, prompt, None, max_new_tokens=30), solo[seq_id]), cpu, gpu)
    tokens: dict[int, list[int]] = {1: [], 2: [], 3: []}
    order: list[tuple[int, int]] = []  # (sequence, offset) of each prompt chunk, as run
    with local_workers(engine, drafter, SHAPE, max_sequences=3) as (cpu, gpu):
        original = cpu.request

        def noting(message, expect):
            for item in (message.items if isinstance(message, m.StepBatch) else [message]):
                if isinstance(item, m.PrefillRequest):
                    order.append((item.seq_id, item.offset))
            return original(message, expect)

        cpu.request = noting  # type: ignore[method-assign]
        batcher = loops.batcher = Batcher(cpu, gpu)
        batcher.add(2, steps(make_job(2, SHORT, None, max_new_tokens=30), tokens[2]), dovetail)
        batcher.round()
        long_job = dataclasses.replace(make_job(1, LONG, None, max_new_tokens=30), join_chunk=lambda: 4)
        batcher.add(1, steps(long_job, tokens[1]), dovetail)
        for _ in range(3):
            batcher.round()
        batcher.add(3, steps(make_job(3, prompts[3], None, max_new_tokens=30), tokens[3]), dovetail)
        while batcher.streams:
            batcher.round()
    assert order[:5] == [(2, 0), (1, 0), (1, 4), (1, 8), (3, 0)]  # the short prompt at once
    # 4 tokens a round while another stream decodes, the rest in one call once it runs alone
    offsets = [offset for seq_id, offset in order if seq_id == 1]
    assert offsets == list(range(0, offsets[-1] + 1, 4)) and offsets[-1] >= 16
    assert tokens == solo


class Loops:
    """Streams' decoding loops (dovetail or ar), each told the size of ``batcher`` as the
    coordinator's ``_batch_size`` tells it (1 before there is one)."""

    def __init__(self, dovetail: bool):
        self.dovetail = dovetail
        self.batcher: Batcher | None = None

    def together(self) -> int:
        return len(self.batcher.streams) if self.batcher else 1

    def steps(self, job: Job, tokens: list[int]):
        return (dovetail_steps(job, SHAPE, collect(tokens), self.together) if self.dovetail
                else ar_steps(job, collect(tokens), self.together))


class Recorder:
    """A worker whose every message and reply for sequence 1 (batches unpacked) is kept, in order."""

    def __init__(self, worker):
        self.worker = worker
        self.seen: list[m.Message] = []
        self.answers: list[m.Message] = []

    def request(self, message, expect):
        self.seen.extend(mine(message))
        reply = self.worker.request(message, expect)
        self.answers.extend(mine(reply))
        return reply

    def replies(self, kinds):
        return [message for message in self.answers if isinstance(message, kinds)]

    def send(self, message):
        self.worker.send(message)

    def items(self, kinds):
        return [message for message in self.seen if isinstance(message, kinds)]


def mine(message: m.Message) -> list[m.Message]:
    items = message.items if isinstance(message, (m.StepBatch, m.DraftBatch, m.StepBatchResult,
                                                  m.DraftBatchResult)) else [message]
    return [item for item in items if getattr(item, "seq_id", None) == 1]


def test_the_flag_sets_the_chunk_for_every_request_and_0_means_whole_prompts():
    from dovetail_runtime import cli
    from dovetail_runtime.cli_options import run_options
    from dovetail_runtime.generation import DEFAULT_PREFILL_CHUNK

    def chunk(*flags: str) -> int | None:
        context = cli.run_main.make_context("dovetail-run", ["--target", "/t", *flags])
        return cli.runtime_settings(run_options(context.params), "/t", None).prefill_chunk

    assert chunk() == DEFAULT_PREFILL_CHUNK == 256
    assert chunk("--prefill-chunk", "32") == 32
    assert chunk("--prefill-chunk", "0") is None
    assert chunk("--prefill-chunk", "32", "--prompt", "hi") == 32  # one-shot runs chunk alike


@pytest.mark.parametrize("dovetail", [True, False])
def test_a_stop_asked_between_two_chunks_ends_the_prefill_there(demo_pair, dovetail):
    engine, drafter = demo_pair
    polls: list[int] = []

    def emit(new: list[int], _logprobs) -> bool:
        assert new == []  # asked between chunks, before any token
        polls.append(1)
        return len(polls) == 2  # go on after the first chunk, stop after the second

    job = make_job(1, LONG, 16)
    with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
        sent: list[int] = []
        original = cpu.request

        def counting(message, expect):
            if isinstance(message, m.PrefillRequest):
                sent.append(message.offset)
            return original(message, expect)

        cpu.request = counting  # type: ignore[method-assign]
        steps = dovetail_steps(job, SHAPE, emit) if dovetail else ar_steps(job, emit)
        finish, stats = run_alone(steps, cpu, gpu)
    assert sent == [0, 16] and finish == "stop" and stats.new_tokens == 0


def test_a_prompt_chunk_in_a_step_batch_fails_alone(demo_pair):
    engine, _ = demo_pair
    with local_workers(engine, max_sequences=3) as (cpu, _):
        first = cpu.request(m.PrefillRequest(seq_id=1, token_ids=SHORT, return_features=False), m.PrefillResult)
        cpu.request(m.PrefillRequest(seq_id=2, token_ids=LONG[:16], return_features=False, more=True),
                    m.PrefillPartial)
        reply = cpu.request(m.StepBatch(items=[
            m.DecodeRequest(seq_id=1, token=first.token),
            m.PrefillRequest(seq_id=2, token_ids=LONG[20:36], offset=20, return_features=False, more=True),
        ]), m.StepBatchResult)
        decoded, misplaced = reply.items
        assert isinstance(decoded, m.DecodeResult)
        assert isinstance(misplaced, m.WorkerError) and "offset 20, but sequence 2 holds 16" in misplaced.message
        # The right chunk runs beside the next step; a second chunk in one batch is refused (each
        # answer's rows take the prefill ring's one slot).
        reply = cpu.request(m.StepBatch(items=[
            m.DecodeRequest(seq_id=1, token=decoded.token),
            m.PrefillRequest(seq_id=2, token_ids=LONG[16:32], offset=16, return_features=False, more=True),
            m.PrefillRequest(seq_id=3, token_ids=SHORT, return_features=False),
        ]), m.StepBatchResult)
        stepped, chunk, second = reply.items
        assert isinstance(stepped, m.DecodeResult) and isinstance(chunk, m.PrefillPartial)
        assert isinstance(second, m.WorkerError) and "one prompt chunk per batch" in second.message
        # A prompt past the context ends its sequence alone.
        reply = cpu.request(m.StepBatch(items=[
            m.DecodeRequest(seq_id=1, token=stepped.token),
            m.PrefillRequest(seq_id=3, token_ids=[5] * 300, return_features=False),
        ]), m.StepBatchResult)
        stepped, too_long = reply.items
        assert isinstance(stepped, m.DecodeResult)
        assert isinstance(too_long, m.WorkerError) and "exceeds the context" in too_long.message
        with pytest.raises(WorkerRequestError, match="sequence 3 is not active"):
            cpu.request(m.DecodeRequest(seq_id=3, token=5), m.DecodeResult)
