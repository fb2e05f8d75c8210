"""Several plain steps in one call (``m.DecodeRun``, ``dovetail_runtime.plain_runs``): a run gives
exactly the tokens and logprobs of one DecodeRequest per step (greedy and seeded sampling), ends at an
end-of-sequence id, at a stop string, at the budget and at the context's end as single steps do, and
with prompt lookup where a branch may start (``cpu_worker.repeat_watch``); a lone sequence's loop
asks for runs, one in a busy batch does not, and the batcher never puts a run in a StepBatch."""

from __future__ import annotations

from pathlib import Path

import pytest
from msgspec.structs import replace

from cpu_worker.repeat_watch import RepeatWatch
from cpu_worker.server import build_engine
from dovetail_runtime import plain_runs
from dovetail_runtime.batching import Batcher
from dovetail_runtime.generation import Job, Stop, ar_steps, run_alone
from dovetail_runtime.local_workers import LocalWorker, local_workers
from dovetail_runtime.plain_runs import RunSizer
from dovetail_runtime.workers import WorkerRequestError
from ipc import messages as m

DEMO = Path(__file__).resolve().parents[2] / "demo"
PROMPT = [1, 500, 600, 700, 42, 9, 10]
GREEDY = m.Sampling()
SAMPLED = m.Sampling(temperature=0.9, top_k=40, seed=5)


@pytest.fixture(scope="module")
def engine():
    return build_engine(str(DEMO / "target-code-9m"), "int8", 128)[0]


class Counting(LocalWorker):
    """Records what it is sent by type (a StepBatch's items after it, as ``StepBatch/<type>``)."""

    def __init__(self, inner: LocalWorker):
        super().__init__(inner.name, inner.handlers)
        self.sent: list[str] = []
        self.steps: list[int] = []  # per call: the tokens a run picked, else 1

    def request(self, message, expect):
        self.sent.append(type(message).__name__)
        if isinstance(message, m.StepBatch):
            self.sent.extend(f"StepBatch/{type(item).__name__}" for item in message.items)
        reply = super().request(message, expect)
        self.steps.append(len(reply.tokens) if isinstance(reply, m.DecodeRunResult) else 1)
        return reply


def start(cpu, seq_id: int, sampling: m.Sampling = GREEDY, logprobs: int | None = None) -> int:
    first = cpu.request(m.PrefillRequest(seq_id=seq_id, token_ids=PROMPT, sampling=sampling, logprobs=logprobs,
                                         return_features=False), m.PrefillResult)
    return first.token


@pytest.mark.parametrize("sampling", [m.Sampling(), SAMPLED], ids=["greedy", "sampled"])
def test_a_run_gives_the_single_steps_tokens_and_logprobs(engine, sampling):
    with local_workers(engine, max_sequences=2) as (cpu, _):
        token = start(cpu, 1, sampling, logprobs=2)
        single, logprobs = [], []
        for _ in range(20):
            decoded = cpu.request(m.DecodeRequest(seq_id=1, token=token), m.DecodeResult)
            token = decoded.token
            single.append(token)
            logprobs.append(decoded.logprob)
        token = start(cpu, 2, sampling, logprobs=2)
        ran = [cpu.request(m.DecodeRun(seq_id=2, token=token, steps=7), m.DecodeRunResult)]
        ran.append(cpu.request(m.DecodeRun(seq_id=2, token=ran[-1].tokens[-1], steps=13), m.DecodeRunResult))
    assert [token for run in ran for token in run.tokens] == single
    assert [logprob for run in ran for logprob in run.logprobs] == logprobs
    assert all(run.compute_ms > 0 for run in ran)


def test_a_run_ends_after_a_stop_id_or_a_repeated_pair_and_refuses_to_overrun_the_context(engine):
    with local_workers(engine, max_sequences=1) as (cpu, _):
        token = start(cpu, 1)
        free = cpu.request(m.DecodeRun(seq_id=1, token=token, steps=30), m.DecodeRunResult).tokens
        token = start(cpu, 1)
        stop = free[11]
        stopped = cpu.request(m.DecodeRun(seq_id=1, token=token, steps=30, stop_ids=[stop]), m.DecodeRunResult)
        assert stopped.tokens == free[:free.index(stop) + 1]
        # Where the sequence's newest pair occurred before (the prompt's pairs count): lookup's turn.
        watch = RepeatWatch()
        watch.add(PROMPT + [free[0]])
        first_repeat = next(index for index, token in enumerate(free[1:], 1) if watch.add([token]))
        token = start(cpu, 1)
        watched = cpu.request(m.DecodeRun(seq_id=1, token=token, steps=30, stop_at_repeat=True), m.DecodeRunResult)
        assert watched.tokens == free[:first_repeat + 1] and len(watched.tokens) < 30
    # A run that cannot fit the context is refused before any step: the sequence goes on as if it had
    # not been asked for.
    with local_workers(engine, max_sequences=1) as (cpu, _):
        longest = m.DecodeRun(seq_id=1, token=0, steps=m.MAX_RUN_STEPS)
        token = cpu.request(replace(longest, token=start(cpu, 1)), m.DecodeRunResult).tokens[-1]
        after = cpu.request(m.DecodeRun(seq_id=1, token=token, steps=3), m.DecodeRunResult).tokens
        token = cpu.request(replace(longest, token=start(cpu, 1)), m.DecodeRunResult).tokens[-1]
        assert len(PROMPT) + 2 * m.MAX_RUN_STEPS > engine.max_len
        with pytest.raises(WorkerRequestError, match="exceeds the context"):
            cpu.request(m.DecodeRun(seq_id=1, token=token, steps=m.MAX_RUN_STEPS), m.DecodeRunResult)
        assert cpu.request(m.DecodeRun(seq_id=1, token=token, steps=3), m.DecodeRunResult).tokens == after


def test_the_repeat_watch_holds_the_prompt_however_it_came(engine):
    """A prompt whole, in chunks, or as a batch item: the same pairs, so the same stop."""
    repeat = m.DecodeRun(seq_id=0, token=0, steps=40, stop_at_repeat=True)
    stops = []
    with local_workers(engine, max_sequences=3) as (cpu, _):
        first = start(cpu, 1)
        stops.append(cpu.request(replace(repeat, seq_id=1, token=first), m.DecodeRunResult).tokens)
        cpu.request(m.PrefillRequest(seq_id=2, token_ids=PROMPT[:3], more=True, return_features=False),
                    m.PrefillPartial)
        chunked = cpu.request(m.PrefillRequest(seq_id=2, token_ids=PROMPT[3:], offset=3, return_features=False),
                              m.PrefillResult)
        stops.append(cpu.request(replace(repeat, seq_id=2, token=chunked.token), m.DecodeRunResult).tokens)
        batched = cpu.request(m.StepBatch(items=[m.PrefillRequest(seq_id=3, token_ids=PROMPT, return_features=False)]),
                              m.StepBatchResult).items[0]
        assert isinstance(batched, m.PrefillResult)
        stops.append(cpu.request(replace(repeat, seq_id=3, token=batched.token), m.DecodeRunResult).tokens)
    assert stops[0] == stops[1] == stops[2] and len(stops[0]) < 40


def test_the_repeat_watch_says_where_the_newest_pair_occurred_before():
    watch = RepeatWatch()
    assert not watch.add([5, 6, 7])
    assert not watch.add([5])  # (7, 5) is new
    assert watch.add([6])  # (5, 6) occurred at the start
    assert not watch.add([8]) and watch.add([]) is False


def test_the_sizer_fits_a_run_in_its_time_within_its_cap(monkeypatch):
    cap = [100]
    sizer = RunSizer(lambda: cap[0], run_ms=20.0)
    assert sizer.steps(100) == 1  # nothing timed yet
    sizer.observe(1, 0.0)  # a fake worker's zero teaches nothing
    assert sizer.steps(100) == 1
    sizer.observe(2, 8.0)  # 4 ms a step
    assert sizer.steps(100) == 5 and sizer.steps(3) == 3 and sizer.steps(1) == 1
    sizer.observe(1, 0.1)  # a decaying mean: 4 + 0.2 (0.1 - 4) = 3.22 ms
    assert sizer.steps(100) == 6
    cap[0] = 4  # a probe tree due after 4 more steps
    assert sizer.steps(100) == 4
    cap[0] = 1  # in a batch, or while trees run
    assert sizer.steps(100) == 1
    fast = RunSizer(lambda: 100, run_ms=20.0)
    fast.observe(1, 0.1)
    assert fast.steps(100) == plain_runs.LONGEST_RUN
    never = RunSizer(lambda: 100, run_ms=0.0)
    never.observe(1, 4.0)
    assert never.steps(100) == 1
    monkeypatch.setenv(plain_runs.RUN_MS_VARIABLE, "0")
    off = RunSizer(lambda: 100)
    off.observe(1, 4.0)
    assert off.steps(100) == 1
    for bad in ("fast", "-3", "nan", "inf"):
        monkeypatch.setenv(plain_runs.RUN_MS_VARIABLE, bad)
        assert RunSizer(lambda: 100).run_ms == plain_runs.RUN_MS
    monkeypatch.setenv(plain_runs.RUN_MS_VARIABLE, "40")
    assert RunSizer(lambda: 100).run_ms == 40.0


def decode(engine, job: Job, run_ms: str, monkeypatch, stop_at: int | None = None, lookup_tokens: int = 0):
    """``job`` alone through ar_steps with runs of ``run_ms``: its tokens, logprobs, stats and what the
    cpu_worker was sent; ``stop_at``: a stop string's place (the emit callback keeps that many tokens)."""
    monkeypatch.setenv(plain_runs.RUN_MS_VARIABLE, run_ms)
    tokens: list[int] = []
    logprobs: list[m.TokenLogprob] = []

    def emit(new, new_logprobs):
        if stop_at is not None and len(tokens) + len(new) >= stop_at:
            keep = stop_at - len(tokens)
            tokens.extend(new[:keep])
            logprobs.extend(new_logprobs[:keep])
            return Stop(kept=keep)
        tokens.extend(new)
        logprobs.extend(new_logprobs)
        return False

    with local_workers(engine, lookup_tokens=lookup_tokens) as (cpu, _):
        counted = Counting(cpu)
        finish, stats = run_alone(ar_steps(job, emit, lookup_tokens=lookup_tokens), counted, None)
    return tokens, logprobs, finish, stats, counted.sent


@pytest.mark.parametrize("case", ["budget", "eos", "stop string", "context", "sampled"])
def test_a_lone_request_runs_its_steps_and_ends_as_single_steps_do(engine, monkeypatch, case):
    reference = decode(engine, Job(1, PROMPT, 40, m.Sampling(), frozenset(), 128), "0", monkeypatch)[0]
    sampling, eos, max_len, max_new, stop_at = m.Sampling(), frozenset(), 128, 37, None
    if case == "eos":
        eos = frozenset([reference[23]])
    elif case == "stop string":
        stop_at = 19
    elif case == "context":
        max_len, max_new = len(PROMPT) + 30, 100
    elif case == "sampled":
        sampling = SAMPLED
    job = Job(1, PROMPT, max_new, sampling, eos, max_len, logprobs=1)
    single = decode(engine, job, "0", monkeypatch, stop_at)
    runs = decode(engine, job, "1000", monkeypatch, stop_at)
    assert runs[:3] == single[:3]  # tokens, logprobs, finish reason
    assert runs[3].new_tokens == single[3].new_tokens == len(single[0]) > 0
    assert runs[3].cycles == single[3].cycles and runs[3].trees == single[3].trees  # steps, not tokens computed
    assert "DecodeRun" not in single[4]
    assert runs[4].count("DecodeRun") >= 1 and runs[4].count("DecodeRequest") == 1  # timed once, then runs
    assert len(runs[4]) < len(single[4])


def test_with_prompt_lookup_a_run_hands_back_where_a_branch_may_start(engine, monkeypatch):
    """The demo's code model repeats names in stretches of 4-5 tokens: runs that ended only at their
    length skipped every one of them."""
    prompt = [1] + [(7 * index) % 50 + 300 for index in range(30)] * 2
    job = Job(1, prompt, 60, m.Sampling(), frozenset(), 256)
    single = decode(engine, job, "0", monkeypatch, lookup_tokens=8)
    runs = decode(engine, job, "1000", monkeypatch, lookup_tokens=8)
    assert runs[0] == single[0]
    assert runs[3].lookup_tokens == single[3].lookup_tokens > 0
    assert runs[3].lookup_nodes == single[3].lookup_nodes and runs[3].cycles == single[3].cycles
    assert "DecodeRun" in runs[4]


def test_a_run_never_goes_into_a_step_batch_and_a_joining_request_gets_its_solo_tokens(engine, monkeypatch):
    monkeypatch.setenv(plain_runs.RUN_MS_VARIABLE, "1000")
    jobs = [Job(1, PROMPT, 100, m.Sampling(), frozenset(), 128), Job(2, PROMPT[:4], 30, SAMPLED, frozenset(), 128)]
    solo = [decode(engine, job, "1000", monkeypatch)[0] for job in jobs]
    outputs: list[list[int]] = [[], []]
    with local_workers(engine, max_sequences=2) as (cpu, _):
        counted = Counting(cpu)
        batcher = Batcher(counted, None)

        def together() -> int:
            return max(1, len(batcher.streams))

        batcher.add(1, ar_steps(jobs[0], lambda new, _lp: outputs[0].extend(new) or False, together), False)
        for _ in range(4):  # alone: its prefill, a timed step, then runs
            batcher.round()
        assert "DecodeRun" in counted.sent
        batcher.add(2, ar_steps(jobs[1], lambda new, _lp: outputs[1].extend(new) or False, together), False)
        while batcher.streams:
            batcher.round()
    assert outputs == solo
    assert "StepBatch/DecodeRun" not in counted.sent and "StepBatch/DecodeRequest" in counted.sent


def test_a_dovetail_request_between_probe_trees_runs_its_plain_steps_and_still_probes(engine, monkeypatch):
    """The planner's fallback plain (trees did not pay lately, yet could): the plain steps go several a
    call, up to the next probe tree, which comes after as many plain steps as one a call takes; the
    tokens stay ar's."""
    from dovetail_runtime.generation import dovetail_steps
    from dovetail_runtime.plain_fallback import PROBE_EVERY
    from dovetail_runtime.tree_planner import AutoTree, TreePlanner
    from gpu_worker.drafter import Drafter

    job = Job(1, PROMPT, 40, m.Sampling(), frozenset(), 128)
    expected = decode(engine, job, "0", monkeypatch)[0]
    drafter = Drafter.from_pretrained(DEMO / "draft-dgf", DEMO / "target-code-9m", max_len=128, device="cpu")
    first_stretch = {}
    for run_ms in ("0", "1000"):
        monkeypatch.setenv(plain_runs.RUN_MS_VARIABLE, run_ms)
        planner = TreePlanner(AutoTree(max_tree_tokens=4, max_depth=2, top_k=4), {1: 5.0, 2: 5.5, 4: 6.0},
                              {1: 1.0, 2: 2.0})
        planner.fallback.plain = True  # as after a dozen poor cycles
        tokens: list[int] = []
        with local_workers(engine, drafter, planner.envelope) as (cpu, gpu):
            counted = Counting(cpu)
            steps = dovetail_steps(job, planner, lambda new, _lp, into=tokens: into.extend(new) or False)
            run_alone(steps, counted, gpu)
        assert tokens == expected
        # The prompt's one-node cycle, plain steps, then the stretch's root-only verify before the probe.
        sent = counted.sent
        assert sent[:3] == ["PrefillRequest", "VerifyRequest", "DecodeRequest"]
        stretch = sent[2:sent.index("VerifyRequest", 2)]
        first_stretch[run_ms] = sum(counted.steps[index] for index in range(2, 2 + len(stretch)))
        assert ("DecodeRun" in stretch) == (run_ms != "0")
        if run_ms != "0":  # a timed step, then one run up to the probe
            assert stretch == ["DecodeRequest", "DecodeRun"]
    assert first_stretch["0"] == first_stretch["1000"] == PROBE_EVERY - 1
