"""--join-chunk: how a prompt joining running requests is cut. The sizer learns a round's cost and what a
chunk adds to it (a fixed part and a part per row) from the rounds it is told of and sizes a chunk to
about one cycle, growing at most twofold a round; the coordinator uses it only for a target whose
prompt bits do not depend on their chunks, and the flag parses as auto or a positive count."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from cpu_worker.server import build_engine
from dovetail_runtime import cli, join_sizing
from dovetail_runtime.batching import Batcher
from dovetail_runtime.cli_options import run_options
from dovetail_runtime.coordinator import Coordinator, RuntimeSettings
from dovetail_runtime.generation import Job, ar_steps
from dovetail_runtime.join_sizing import FIRST_PART_MS, FIRST_ROWS, PROBE_EVERY, SMOOTHING, ChunkCost, JoinSizer
from dovetail_runtime.local_workers import local_workers
from ipc import messages as m

DEMO = Path(__file__).resolve().parents[2] / "demo"


def test_a_chunk_settles_at_about_one_cycle_of_the_running_streams():
    sizer = JoinSizer(limit=256)
    assert sizer.rows(2) == FIRST_ROWS  # nothing measured yet
    sizer.observe(40.0, streams=2, chunk_rows=0, draft_rows=0, prompt_work=False)  # a cycle of 40 ms
    assert sizer.rows(2) == FIRST_ROWS  # no chunk measured yet
    rows = sizer.rows(2)
    for _ in range(12):  # each prompt row adds 1.25 ms: 32 rows make one more cycle
        sizer.observe(40.0 + 1.25 * rows, streams=2, chunk_rows=rows, draft_rows=rows, prompt_work=True)
        following = sizer.rows(2)
        assert following <= 2 * rows  # never more than twice the last chunk
        rows = following
    assert rows == 32
    assert sizer.describe(2) == ("32 rows (cycle 40.0 ms, 1.25 ms a prompt row; "
                                 "fitted: 0.00 ms a chunk and 1.25 ms a row)")
    # Four streams make a longer cycle, so room for more rows; a size never measured takes the nearest's.
    sizer.observe(60.0, streams=4, chunk_rows=0, draft_rows=0, prompt_work=False)
    assert sizer.rows(4) == 48 and sizer.rows(5) == 48 and sizer.rows(1) == 32


@pytest.mark.parametrize(("fixed_ms", "expected", "extra_ms", "per_row_alone"), [
    (10.0, 12, 20.8, 1),  # over half a cycle: rows that cost at least as much, a round 20.8 ms longer
    (2.5, 3, 5.2, 3),  # under: the fixed part and the rows make at most about one cycle
])
def test_a_chunk_s_fixed_cost_never_shrinks_it_to_a_row(fixed_ms, expected, extra_ms, per_row_alone, monkeypatch):
    """A chunk's round pays a fixed part (the draft's call to read the rows, the messages) beside
    0.9 ms a row, a cycle being 6 ms. Sized per row alone (the fitted line never believed), a fixed
    part of a cycle or more shrinks every next chunk down to one row, each still paying it."""
    def settle() -> JoinSizer:
        sizer = JoinSizer(limit=256)
        sizer.observe(6.0, streams=1, chunk_rows=0, draft_rows=0, prompt_work=False)
        rows = sizer.rows(1)
        for _ in range(30):
            sizer.observe(6.0 + fixed_ms + 0.9 * rows, streams=1, chunk_rows=rows, draft_rows=rows,
                          prompt_work=True)
            rows = sizer.rows(1)
        return sizer

    sizer = settle()
    assert sizer.rows(1) == expected and fixed_ms + 0.9 * expected == pytest.approx(extra_ms)
    fitted = sizer.cost.fitted
    assert fitted is not None and fitted == (pytest.approx(fixed_ms), pytest.approx(0.9))
    monkeypatch.setattr(join_sizing, "MIN_FIT_ROUNDS", 10**6)
    assert settle().rows(1) == per_row_alone


def test_rounds_without_running_streams_or_with_a_whole_prompt_read_teach_nothing_and_the_limit_holds():
    sizer = JoinSizer(limit=20)
    sizer.observe(500.0, streams=0, chunk_rows=256, draft_rows=0, prompt_work=True)  # a prompt alone
    sizer.observe(500.0, streams=0, chunk_rows=0, draft_rows=0, prompt_work=False)
    assert sizer.cycles_ms == {} and sizer.cost.per_row_ms() is None
    sizer.observe(10.0, streams=1, chunk_rows=0, draft_rows=0, prompt_work=False)
    # A first draft step reading a whole prompt is prompt work: not a cycle, and no row cost either.
    sizer.observe(300.0, streams=1, chunk_rows=0, draft_rows=600, prompt_work=True)
    sizer.observe(300.0, streams=1, chunk_rows=8, draft_rows=600, prompt_work=True)
    assert sizer.cycles_ms == {1: 10.0} and sizer.cost.per_row_ms() is None
    sizer.observe(9.0, streams=1, chunk_rows=8, draft_rows=8, prompt_work=True)  # noise: the chunk seemed free
    assert sizer.cost.per_row_ms() == 0.0 and sizer.rows(1) == 16  # twice the last chunk, no more
    sizer.observe(10.0, streams=1, chunk_rows=16, draft_rows=8, prompt_work=True)
    assert sizer.rows(1) == 20  # --prefill-chunk caps it
    sizer.cost = ChunkCost(count=1, mean_rows=16.0, mean_ms=1e-308)  # decayed towards nothing: no overflow
    assert sizer.rows(1) == 20
    assert JoinSizer(limit=4).rows(3) == 4


def test_a_round_is_held_clean_of_prompt_work_where_a_cycle_is_unknown_or_stale():
    sizer = JoinSizer(limit=256)
    assert sizer.wants_clean_round(2)  # never measured
    sizer.observe(100.0, streams=2, chunk_rows=0, draft_rows=0, prompt_work=False)
    assert not sizer.wants_clean_round(2) and sizer.wants_clean_round(3)
    for _ in range(PROBE_EVERY):
        assert not sizer.wants_clean_round(2)
        sizer.observe(150.0, streams=2, chunk_rows=8, draft_rows=8, prompt_work=True)
    assert sizer.wants_clean_round(2)  # again, to follow the cycle
    sizer.observe(300.0, streams=2, chunk_rows=0, draft_rows=8, prompt_work=True)  # the draft read rows: not clean
    assert sizer.wants_clean_round(2)
    sizer.observe(120.0, streams=2, chunk_rows=0, draft_rows=0, prompt_work=False)
    assert not sizer.wants_clean_round(2) and sizer.cycles_ms[2] == 100.0 + SMOOTHING * 20.0


def info(chunk_invariant: bool, dtype: str = "int8") -> m.TargetInfo:
    return m.TargetInfo(threads=2, cores=[0, 1], max_len=512, hidden_size=64, vocab_size=100, dtype=dtype,
                        weight_bytes=1, kv_cache_bytes=1, kv_dtype="float32", exact_tree=True, kernel=None,
                        feature_size=64, aux_layers=[], chunk_invariant=chunk_invariant)


class Running:
    """A batch with this many streams past their prompt."""

    def __init__(self, count: int):
        self.count = count

    def running(self) -> int:
        return self.count


@pytest.mark.parametrize(("join_chunk", "max_batch", "invariant", "expected"), [
    ("auto", 4, True, "auto"), (16, 4, True, 16), (999, 4, True, 64),  # never more than --prefill-chunk
    ("auto", 4, False, "parts"), (16, 4, False, None),  # fp32/bf16: --prefill-chunk pieces (auto: in parts)
    ("auto", 1, True, None), (None, 4, True, None)])
def test_the_coordinator_sizes_joining_chunks_only_where_the_target_allows_it(join_chunk, max_batch, invariant,
                                                                              expected):
    coordinator = Coordinator(RuntimeSettings(target="/t", draft=None, max_batch=max_batch, prefill_chunk=64,
                                              join_chunk=join_chunk))
    batch = Running(2)
    sizer, join, budget = coordinator._joining(info(invariant), batch)  # type: ignore[arg-type]
    if expected is None:
        assert sizer is None and join is None and budget is None
        return
    if expected == "parts":  # the pieces' layers in parts of one measured cycle of the running streams
        assert sizer is not None and join is None and budget is not None
        assert budget() == FIRST_PART_MS  # no cycle measured yet: one layer
        sizer.observe(12.0, 2, 0, 0, False)
        assert budget() == 12.0
        batch.count = 0
        assert budget() is None
        return
    assert join is not None and budget is None
    if expected == "auto":
        assert sizer is not None and sizer.limit == 64 and join() == FIRST_ROWS
    else:
        assert sizer is None and join() == expected
    batch.count = 0  # nobody decoding: nobody to protect, the prompt takes --prefill-chunk pieces
    assert join() is None


def test_a_prompt_with_nobody_decoding_takes_whole_chunks_and_one_joining_a_stream_takes_measured_ones():
    """Two long prompts arrive at an idle server: the first goes in --prefill-chunk pieces though the
    second waits beside it (only prompts run: no stream to protect); the second, once the first
    decodes, in the sizer's (8 rows at first, then at most twice the last), with the same tokens."""
    engine, _ = build_engine(str(DEMO / "target-code-9m"), "int8", 256)
    coordinator = Coordinator(RuntimeSettings(target="/t", draft=None, max_batch=4, prefill_chunk=32))
    prompt = [1] + [(37 * index) % 900 + 20 for index in range(1, 70)]
    tokens: list[list[int]] = [[], []]
    with local_workers(engine, max_sequences=4) as (cpu, _):
        recorder = Sizes(cpu)
        batcher = Batcher(recorder, None)
        batcher.join, join, _ = coordinator._joining(info(True), batcher)
        for seq_id in (1, 2):
            job = Job(seq_id=seq_id, prompt_ids=prompt, max_new_tokens=40, sampling=m.Sampling(),
                      eos_token_ids=frozenset(), max_len=256, prefill_chunk=32, join_chunk=join)
            into = tokens[seq_id - 1]
            batcher.add(seq_id, ar_steps(job, lambda new, _logprobs, into=into: into.extend(new) or False,
                                         lambda: len(batcher.streams)), uses_gpu=False)
        while batcher.streams:
            batcher.round()
    first, second = recorder.sizes[1], recorder.sizes[2]
    assert first == [32, 32, 6]
    assert second[:2] == [32, FIRST_ROWS] and sum(second) == len(prompt) and len(second) > 3
    assert all(1 <= after <= min(32, 2 * before) for before, after in zip(second[1:], second[2:-1], strict=False))
    assert tokens[0] == tokens[1] and len(tokens[0]) == 40  # the same prompt, the same tokens


class Sizes:
    """A worker that notes each sequence's prompt chunk sizes (batches unpacked)."""

    def __init__(self, worker):
        self.worker = worker
        self.sizes: dict[int, list[int]] = {1: [], 2: []}

    def request(self, message, expect):
        items = message.items if isinstance(message, m.StepBatch) else [message]
        for item in items:
            if isinstance(item, m.PrefillRequest):
                self.sizes[item.seq_id].append(len(item.token_ids))
        return self.worker.request(message, expect)

    def send(self, message):
        self.worker.send(message)


def test_the_flag_takes_auto_or_a_positive_count():
    def parsed(*flags: str):
        context = cli.run_main.make_context("dovetail-run", ["--target", "/t", *flags])
        return cli.runtime_settings(run_options(context.params), "/t", None).join_chunk

    assert parsed() == "auto" and parsed("--join-chunk", "AUTO") == "auto"
    assert parsed("--join-chunk", "12") == 12
    for bad in ("0", "-3", "many"):
        with pytest.raises(click.BadParameter):
            parsed("--join-chunk", bad)
