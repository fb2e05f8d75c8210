"""A prompt chunk run through the layers in parts (``cpu_worker.prompt_parts``,
``PrefillRequest.budget_ms``/``resume``): the parts compute the chunk's whole prefill bit for bit,
the worker answers PrefillPending until the last part and refuses anything else for the sequence
meanwhile, and a long prompt joining a busy batch at a precision whose prompt bits depend on the
chunks (fp32, bf16) goes in parts, one a round, with the running stream stepping between them and
every stream getting its solo tokens."""

from __future__ import annotations

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
TARGET = str(DEMO / "target-code-9m")
LAYERS = 6  # the demo target's
SHAPE = TreeShape.clamped(8, 4, 4)
LONG = [1] + [(37 * index) % 900 + 20 for index in range(1, 70)]  # 70 tokens: a 64-token chunk, then 6
SHORT = [1, 500, 600, 700, 42]
TINY_BUDGET = 1e-6  # ms: one layer a part


def in_parts(engine, tokens: list[int], offset: int) -> tuple[object, int]:
    """The chunk through ``prefill_part`` one layer a call: its output and the calls made."""
    step = engine.prefill_part(tokens, offset, TINY_BUDGET)
    calls = 1
    while step is None:
        assert engine.pending is not None and engine.pending.layers_done == calls
        step = engine.prefill_part(tokens, offset, TINY_BUDGET, resume=True)
        calls += 1
    return step, calls


@pytest.mark.parametrize(("precision", "aux_layers"), [("fp32", None), ("fp32", [0, 2, 5]), ("int8", None),
                                                       ("int8", [0, 2, 5]), ("bf16", None)])
def test_a_chunk_in_parts_computes_its_whole_prefill_bit_for_bit(precision, aux_layers):
    """fp32's 64-row chunk takes its GEMM (bits that depend on the rows), int8's the native layer
    loop (its parts too, attending causally there), an EAGLE-3 engine's rows are streams entering
    layers that different parts run."""
    engine, _ = build_engine(TARGET, precision, 256, aux_layers=aux_layers)
    first = engine.prefill(LONG[:64])
    second = engine.prefill(LONG[64:], 64)
    after = engine.decode(LONG[5])
    keys = engine.cache.keys[..., :71, :].clone()
    engine.reset()
    parted, calls = in_parts(engine, LONG[:64], 0)
    assert calls == LAYERS and engine.committed == 64 and engine.pending is None
    rest, calls = in_parts(engine, LONG[64:], 64)
    assert calls == LAYERS
    assert torch.equal(parted.features, first.features) and torch.equal(parted.logits, first.logits)
    assert torch.equal(rest.features, second.features) and torch.equal(rest.logits, second.logits)
    assert torch.equal(engine.decode(LONG[5]).logits, after.logits)
    assert torch.equal(engine.cache.keys[..., :71, :], keys)
    # A budget of 0 runs the whole chunk at once.
    engine.reset()
    assert torch.equal(engine.prefill_part(LONG[:64], 0, 0.0).features, first.features)


def test_only_the_chunk_part_way_through_can_be_resumed():
    engine, _ = build_engine(TARGET, "fp32", 256)
    with pytest.raises(ValueError, match="nothing to resume"):
        engine.prefill_part(LONG[:64], 0, TINY_BUDGET, resume=True)
    assert engine.prefill_part(LONG[:64], 0, TINY_BUDGET) is None
    for tokens, offset in ((LONG[1:65], 0), (LONG[:64], 64), (LONG[:63], 0)):
        with pytest.raises(ValueError, match="nothing to resume"):
            engine.prefill_part(tokens, offset, TINY_BUDGET, resume=True)
    assert engine.pending is not None and engine.pending.layers_done == 1 and engine.committed == 0
    engine.reset()  # a released sequence drops it
    assert engine.pending is None
    assert engine.prefill_part(LONG[:64], 0, TINY_BUDGET) is None
    engine.prefill(LONG[:64])  # so does a whole prefill (its rows overwrite the part's)
    assert engine.pending is None and engine.committed == 64


def test_the_worker_answers_pending_parts_then_the_chunk_s_answer():
    engine, _ = build_engine(TARGET, "fp32", 256)
    whole_first = engine.prefill(LONG[:64])
    whole = engine.prefill(LONG[64:], 64)
    with local_workers(engine.sibling(), max_sequences=2) as (cpu, _):
        chunk = m.PrefillRequest(seq_id=1, token_ids=LONG[:64], offset=0, more=True, budget_ms=TINY_BUDGET,
                                 features_now=True)
        answers = [cpu.request(chunk, m.PrefillAnswer)]
        while isinstance(answers[-1], m.PrefillPending):
            # Meanwhile the sequence takes nothing but its chunk's next part (a wrong one changes nothing).
            with pytest.raises(WorkerRequestError, match="not complete"):
                cpu.request(m.DecodeRequest(seq_id=1, token=5), m.DecodeResult)
            with pytest.raises(WorkerRequestError, match="nothing to resume"):
                cpu.request(m.PrefillRequest(seq_id=1, token_ids=LONG[:64], offset=64, resume=True), m.PrefillAnswer)
            answers.append(cpu.request(m.PrefillRequest(seq_id=1, token_ids=LONG[:64], offset=0, more=True,
                                                        budget_ms=TINY_BUDGET, resume=True, features_now=True),
                                       m.PrefillAnswer))
        pending, partial = answers[:-1], answers[-1]
        assert [(answer.layers_done, answer.layers) for answer in pending] == [(done, LAYERS) for done in range(1, 6)]
        assert isinstance(partial, m.PrefillPartial) and partial.features is not None
        ring = ShmRing.attach(partial.features.ring)
        try:
            assert torch.equal(get_block(partial.features, ring).clone(), whole_first.features)
        finally:
            ring.close()
        last = cpu.request(m.PrefillRequest(seq_id=1, token_ids=LONG[64:], offset=64), m.PrefillResult)
        assert last.token == int(whole.logits.argmax())
        # A resume of a sequence with no chunk part way through (nor any sequence) is refused.
        with pytest.raises(WorkerRequestError, match="complete"):
            cpu.request(m.PrefillRequest(seq_id=1, token_ids=LONG[64:], offset=64, resume=True), m.PrefillAnswer)
        with pytest.raises(WorkerRequestError, match="not active"):
            cpu.request(m.PrefillRequest(seq_id=3, token_ids=LONG[:64], resume=True), m.PrefillAnswer)


@pytest.mark.parametrize(("precision", "dovetail"), [("fp32", False), ("fp32", True), ("bf16", False)])
def test_a_prompt_joining_a_busy_batch_goes_in_parts_and_everyone_gets_their_solo_tokens(precision, dovetail):
    engine, _ = build_engine(TARGET, precision, 256)
    drafter = (Drafter.from_pretrained(DEMO / "draft-dgf", DEMO / "target-code-9m", max_len=256, device="cpu")
               if dovetail else None)
    batcher: Batcher | None = None

    def together() -> int:
        return len(batcher.streams) if batcher else 1

    def steps(job: Job, tokens: list[int]):
        def emit(new, _logprobs) -> bool:
            tokens.extend(new)
            return False
        return dovetail_steps(job, SHAPE, emit, together) if dovetail else ar_steps(job, emit, together)

    def job(seq_id: int, prompt: list[int], max_new_tokens: int) -> Job:
        return Job(seq_id=seq_id, prompt_ids=prompt, max_new_tokens=max_new_tokens, sampling=m.Sampling(),
                   eos_token_ids=frozenset(), max_len=256, prefill_chunk=64, join_budget=lambda: TINY_BUDGET)

    solo: dict[int, list[int]] = {1: [], 2: []}
    for seq_id, prompt, count in ((1, LONG, 16), (2, SHORT, 40)):
        with local_workers(engine, drafter, SHAPE) as (cpu, gpu):
            run_alone(steps(job(seq_id, prompt, count), solo[seq_id]), cpu, gpu)
    tokens: dict[int, list[int]] = {1: [], 2: []}
    with local_workers(engine, drafter, SHAPE, max_sequences=2) as (cpu, gpu):
        cpu = Chunks(cpu)
        batcher = Batcher(cpu, gpu)
        short = batcher.add(2, steps(job(2, SHORT, 40), tokens[2]), uses_gpu=dovetail)
        batcher.round()  # its prefill (nobody else decodes: whole)
        batcher.round()
        long = batcher.add(1, steps(job(1, LONG, 16), tokens[1]), uses_gpu=dovetail)
        while long.call is not None and isinstance(long.call.message, (m.PrefillRequest, m.DraftExtend)):
            before = len(tokens[2])
            batcher.round()
            assert len(tokens[2]) > before  # the running stream stepped in every round of the prompt
        while batcher.streams:
            batcher.round()
    # The 64-token chunk ran apart, one layer a round; the 6-token one rode in the others' forward,
    # whole (bf16's linears are row-invariant too: its weights widened on fp32's row kernel).
    assert cpu.chunks == [(0, False)] + [(0, True)] * (LAYERS - 1) + [(64, False)]
    assert long.outcome is not None and short.outcome is not None
    assert tokens == solo


class Chunks:
    """A worker that notes sequence 1's prompt chunks (offset, resumed), batches unpacked."""

    def __init__(self, worker):
        self.worker = worker
        self.chunks: list[tuple[int, bool]] = []

    def request(self, message, expect):
        items = message.items if isinstance(message, m.StepBatch) else [message]
        self.chunks += [(item.offset, item.resume) for item in items
                        if isinstance(item, m.PrefillRequest) and item.seq_id == 1]
        return self.worker.request(message, expect)

    def send(self, message):
        self.worker.send(message)


def test_a_stop_asked_between_two_parts_ends_the_prefill_there():
    """A cancel or a client gone is noticed between two parts, as between two chunks: the chunk's
    other layers never run."""
    engine, _ = build_engine(TARGET, "fp32", 256)
    polls: list[int] = []

    def emit(new: list[int], _logprobs) -> bool:
        assert new == []  # asked between parts, before any token
        polls.append(1)
        return len(polls) == 2  # go on after the first part, stop after the second

    job = Job(seq_id=1, prompt_ids=LONG, max_new_tokens=16, sampling=m.Sampling(), eos_token_ids=frozenset(),
              max_len=256, prefill_chunk=64, join_budget=lambda: TINY_BUDGET)
    with local_workers(engine) as (cpu, _):
        sent: list[tuple[int, bool]] = []
        original = cpu.request

        def counting(message, expect):
            if isinstance(message, m.PrefillRequest):
                sent.append((message.offset, message.resume))
            return original(message, expect)

        cpu.request = counting  # type: ignore[method-assign]
        finish, stats = run_alone(ar_steps(job, emit, lambda: 2), cpu, None)  # as if another stream ran
    assert sent == [(0, False), (0, True)] and finish == "stop" and stats.new_tokens == 0


def test_a_new_chunk_is_refused_while_one_is_part_way_and_the_batch_runs_on():
    """A chunk that is not the part way one's resume (here: a short one at the same offset, which
    would ride the others' forward) gets a WorkerError in its batch, the other items run, and the
    part way chunk then finishes with the bits of its whole prefill."""
    engine, _ = build_engine(TARGET, "fp32", 256)
    solo = engine.sibling()
    solo.prefill(LONG[:6])
    whole = solo.prefill(LONG[6:70], 6)
    with local_workers(engine.sibling(), max_sequences=2) as (cpu, _):
        cpu.request(m.PrefillRequest(seq_id=1, token_ids=LONG[:6], more=True), m.PrefillPartial)
        cpu.request(m.PrefillRequest(seq_id=2, token_ids=SHORT), m.PrefillResult)
        parted = m.PrefillRequest(seq_id=1, token_ids=LONG[6:70], offset=6, budget_ms=TINY_BUDGET)
        assert isinstance(cpu.request(parted, m.PrefillAnswer), m.PrefillPending)
        batch = cpu.request(m.StepBatch(items=[m.PrefillRequest(seq_id=1, token_ids=LONG[6:11], offset=6),
                                               m.DecodeRequest(seq_id=2, token=7)]), m.StepBatchResult)
        refused, decoded = batch.items
        assert isinstance(refused, m.WorkerError) and "part way through the layers: resume it" in refused.message
        assert isinstance(decoded, m.DecodeResult)
        answer: m.Message = m.PrefillPending(seq_id=1, layers_done=0, layers=LAYERS)
        while isinstance(answer, m.PrefillPending):
            answer = cpu.request(m.PrefillRequest(seq_id=1, token_ids=LONG[6:70], offset=6, budget_ms=TINY_BUDGET,
                                                  resume=True), m.PrefillAnswer)
        assert isinstance(answer, m.PrefillResult) and answer.token == int(whole.logits.argmax())
