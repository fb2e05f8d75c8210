"""``--mode lookup``: plain decoding that also verifies prompt lookup's branch each step, with no draft
head. It must give ar's tokens (greedy, and seeded sampling token for token) while emitting several
tokens a step where the text repeats."""

from __future__ import annotations

import msgspec
import pytest

from dovetail_runtime.generation import Job, generate_ar
from dovetail_runtime.local_workers import local_workers
from dovetail_runtime.tokenizer import Tokenizer
from ipc import messages as m

from conftest import DEMO_DRAFT, DEMO_TARGET

# Code that repeats itself: the answer goes on copying names and lines from the prompt.
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef add("


@pytest.fixture(scope="module")
def engine():
    from cpu_worker.server import build_engine

    engine, _ = build_engine(str(DEMO_TARGET), "int8", 256)  # an exact kernel: trees verify as decoding does
    return engine


GREEDY = m.Sampling()


def decode(engine, prompt_ids: list[int], count: int, lookup_tokens: int,
           sampling: m.Sampling = GREEDY) -> tuple[list[int], m.RequestStats]:
    job = Job(seq_id=1, prompt_ids=prompt_ids, max_new_tokens=count, sampling=sampling,
              eos_token_ids=frozenset(), max_len=engine.max_len)
    emitted: list[int] = []

    def emit(tokens: list[int], _logprobs) -> bool:
        emitted.extend(tokens)
        return False

    with local_workers(engine, lookup_tokens=max(lookup_tokens, 1)) as (cpu, _):
        _, stats = generate_ar(cpu, job, emit, lookup_tokens=lookup_tokens)
    return emitted, stats.message()


def test_greedy_lookup_decoding_is_ar_in_fewer_steps(engine):
    prompt_ids = Tokenizer.from_dir(DEMO_TARGET).encode(PROMPT)
    ar_tokens, ar_stats = decode(engine, prompt_ids, 64, lookup_tokens=0)
    for branch in (1, 4, 16):
        tokens, stats = decode(engine, prompt_ids, 64, lookup_tokens=branch)
        assert tokens == ar_tokens, branch
        assert stats.lookup_tokens > 0 and stats.cycles < ar_stats.cycles, (branch, stats)
        # The metrics' accounting: every verified branch node counted, accepted ones by depth.
        assert stats.lookup_nodes >= stats.lookup_tokens
        assert sum(depth * count for depth, count in enumerate(stats.accept_per_depth)) == stats.lookup_tokens
    assert ar_stats.lookup_tokens == 0 and ar_stats.tau == 1.0


def test_seeded_sampled_lookup_decoding_is_ar_token_for_token(engine):
    prompt_ids = Tokenizer.from_dir(DEMO_TARGET).encode(PROMPT)
    copied = 0
    for seed in range(12):
        sampling = m.Sampling(temperature=0.8, top_p=0.95, seed=seed)
        ar_tokens, _ = decode(engine, prompt_ids, 32, lookup_tokens=0, sampling=sampling)
        tokens, stats = decode(engine, prompt_ids, 32, lookup_tokens=8, sampling=sampling)
        assert tokens == ar_tokens, seed
        copied += stats.lookup_tokens
    assert copied > 0  # the branches were taken, not just tried


def test_a_server_without_a_head_serves_lookup_and_names_it_for_dovetail_requests(tmp_path, monkeypatch):
    from dovetail_runtime.coordinator import Coordinator, RuntimeSettings

    monkeypatch.setenv("DOVETAIL_CACHE_DIR", str(tmp_path))
    coordinator = Coordinator(RuntimeSettings(target=str(DEMO_TARGET), draft=None, mode="lookup", target_dtype="int8",
                                              max_len=256, max_batch=1, startup_timeout_s=120))
    try:
        coordinator.start()
        assert coordinator.default_mode == "lookup"
        # What a branch row costs here was measured (and cached) for the branch policy.
        assert coordinator.lookup_costs is not None and sorted(coordinator.lookup_costs) == [1, 2, 3, 4, 5]
        assert (tmp_path / "verify_cost.json").is_file()
        request = m.GenerateRequest(request_id="a", prompt=PROMPT, max_new_tokens=32)
        served = coordinator.generate(request)
        assert isinstance(served, m.GenerateDone) and served.stats.lookup_tokens > 0
        plain = coordinator.generate(msgspec.structs.replace(request, request_id="b", mode="ar"))
        assert isinstance(plain, m.GenerateDone) and plain.token_ids == served.token_ids
        refused = coordinator.generate(msgspec.structs.replace(request, request_id="c", mode="dovetail"))
        assert isinstance(refused, m.ErrorReply) and refused.code == "unsupported"
        assert "'lookup'" in refused.message
    finally:
        coordinator.close()


def test_the_branch_policy_keeps_the_results_of_ar_with_measured_costs(engine):
    prompt_ids = Tokenizer.from_dir(DEMO_TARGET).encode(PROMPT)
    ar_tokens, _ = decode(engine, prompt_ids, 64, lookup_tokens=0)
    job = Job(seq_id=1, prompt_ids=prompt_ids, max_new_tokens=64, sampling=GREEDY, eos_token_ids=frozenset(),
              max_len=engine.max_len)
    emitted: list[int] = []
    with local_workers(engine, lookup_tokens=8) as (cpu, _):
        _, stats = generate_ar(cpu, job, lambda tokens, _lp: emitted.extend(tokens) or False, lookup_tokens=8,
                               verify_ms={size: 1.0 + 0.05 * size for size in range(1, 10)})
    assert emitted == ar_tokens and stats.lookup_tokens > 0


def test_lookup_streams_beside_others_and_at_the_context_end_get_ar_tokens_and_logprobs(engine):
    from dovetail_runtime.batching import Batcher
    from dovetail_runtime.generation import ar_steps, run_alone

    prompt_ids = Tokenizer.from_dir(DEMO_TARGET).encode(PROMPT)
    settings = [(m.Sampling(), 2), (m.Sampling(temperature=0.8, seed=5), None), (m.Sampling(), None)]

    def jobs(max_len: int) -> list[Job]:
        return [Job(seq_id=10 + index, prompt_ids=prompt_ids, max_new_tokens=40, sampling=sampling,
                    eos_token_ids=frozenset(), max_len=max_len, logprobs=logprobs)
                for index, (sampling, logprobs) in enumerate(settings)]

    def recorder(into: list):
        return lambda tokens, logprobs: into.append((list(tokens), list(logprobs))) and False

    def batch_size(batcher: Batcher):
        return lambda: len(batcher.streams)

    def flat(chunks: list) -> tuple[list[int], list]:
        return [t for tokens, _ in chunks for t in tokens], [lp for _, lps in chunks for lp in lps]

    for max_len in (256, len(prompt_ids) + 13):  # the second ends at the context, mid-branch
        solo = []
        for job in jobs(max_len):
            chunks: list = []
            with local_workers(engine, lookup_tokens=8) as (cpu, _):
                run_alone(ar_steps(job, recorder(chunks)), cpu, None)
            solo.append(flat(chunks))
        together: list[list] = [[] for _ in settings]
        streams = []
        with local_workers(engine, lookup_tokens=8, max_sequences=4) as (cpu, _):
            batcher = Batcher(cpu, None)
            pending, rounds = list(enumerate(jobs(max_len))), 0
            while pending or batcher.streams:
                if pending and rounds % 4 == 0:  # a new stream every 4 rounds: each runs alone, then beside others
                    index, job = pending.pop(0)
                    steps = ar_steps(job, recorder(together[index]), batch_size(batcher), lookup_tokens=8,
                                     verify_ms=dict.fromkeys(range(1, 10), 1.0))
                    streams.append(batcher.add(job.seq_id, steps, uses_gpu=False))
                batcher.round()
                rounds += 1
        for index in range(len(settings)):
            assert flat(together[index]) == solo[index], (max_len, index)
        assert sum(stream.outcome[1].lookup_tokens for stream in streams) > 0  # branches were taken


@pytest.mark.parametrize("mode, draft, lookup_tokens", [("ar", None, 0), ("dovetail", "draft-dgf", 4)])
def test_other_servers_serve_lookup_requests_or_say_why_not(tmp_path, monkeypatch, mode, draft, lookup_tokens):
    from dovetail_runtime.coordinator import Coordinator, RuntimeSettings

    monkeypatch.setenv("DOVETAIL_CACHE_DIR", str(tmp_path))
    coordinator = Coordinator(RuntimeSettings(target=str(DEMO_TARGET), draft=str(DEMO_DRAFT) if draft else None,
                                              mode=mode, target_dtype="int8", lookup_tokens=lookup_tokens,
                                              max_len=256, max_batch=1, startup_timeout_s=120))
    try:
        coordinator.start()
        request = m.GenerateRequest(request_id="a", prompt=PROMPT, max_new_tokens=32, mode="lookup")
        served = coordinator.generate(request)
        if not lookup_tokens:
            assert isinstance(served, m.ErrorReply) and served.code == "unsupported"
            assert "--lookup-tokens 0" in served.message
            return
        # A head's auto trees measured the costs the branch policy weighs (T = 1, 2, 3, 4, 6, ...).
        assert coordinator.lookup_costs is not None and {1, 2, 3, 4, 6} <= set(coordinator.lookup_costs)
        plain = coordinator.generate(msgspec.structs.replace(request, request_id="b", mode="ar"))
        assert isinstance(served, m.GenerateDone) and isinstance(plain, m.GenerateDone)
        assert served.token_ids == plain.token_ids and served.stats.draft_ms == 0
    finally:
        coordinator.close()


def test_a_dovetail_requests_plain_steps_verify_as_much_of_the_branch_as_pays(engine):
    from dovetail_runtime.generation import dovetail_steps, run_alone
    from dovetail_runtime.tree_planner import FixedTree
    from gpu_worker.drafter import Drafter
    from ipc.tree import TreeShape

    drafter = Drafter.from_pretrained(DEMO_DRAFT, DEMO_TARGET, max_len=engine.max_len, device="cpu")
    prompt_ids = Tokenizer.from_dir(DEMO_TARGET).encode(PROMPT)
    ar_tokens, _ = decode(engine, prompt_ids, 48, lookup_tokens=0)
    plain = TreeShape.clamped(1, 1, 1)  # no tree pays: the request decodes plainly

    def run(verify_ms: dict[int, float] | None) -> tuple[list[int], m.RequestStats]:
        job = Job(seq_id=1, prompt_ids=prompt_ids, max_new_tokens=48, sampling=GREEDY, eos_token_ids=frozenset(),
                  max_len=engine.max_len)
        emitted: list[int] = []
        with local_workers(engine, drafter, plain, lookup_tokens=8) as (cpu, gpu):
            steps = dovetail_steps(job, FixedTree(plain), lambda tokens, _lp: emitted.extend(tokens) or False,
                                   lookup_tokens=8, verify_ms=verify_ms)
            _, stats = run_alone(steps, cpu, gpu)
        return emitted, stats.message()

    whole, whole_stats = run(None)  # no costs known: every branch whole
    cheap, cheap_stats = run({size: 1.0 + 0.05 * size for size in range(1, 10)})  # rows nearly free
    dear, dear_stats = run({size: float(size) for size in range(1, 10)})  # a row costs a step: never pays
    assert whole == cheap == dear == ar_tokens
    assert cheap_stats.lookup_tokens > 0 and cheap_stats.cycles < dear_stats.cycles
    # Dear rows: only a one-token probe every eighth branch is verified.
    assert dear_stats.lookup_nodes <= dear_stats.cycles // 8 + 1 < whole_stats.lookup_nodes


def test_where_no_tree_could_pay_a_dovetail_request_never_drafts_and_gets_ar_tokens(engine):
    from dovetail_runtime.generation import dovetail_steps, run_alone
    from dovetail_runtime.tree_planner import AutoTree, TreePlanner
    from gpu_worker.drafter import Drafter

    drafter = Drafter.from_pretrained(DEMO_DRAFT, DEMO_TARGET, max_len=engine.max_len, device="cpu")
    prompt_ids = Tokenizer.from_dir(DEMO_TARGET).encode(PROMPT)
    ar_tokens, _ = decode(engine, prompt_ids, 48, lookup_tokens=0)
    # A row costs half a step, the head's level 40% of one (the real pair on a 2-core Zen 3).
    planner = TreePlanner(AutoTree(max_tree_tokens=8, max_depth=4, top_k=4),
                          {1: 5.9, 2: 9.0, 3: 12.4, 4: 16.0, 6: 22.3, 8: 24.3}, {1: 2.5, 2: 4.9, 3: 6.2, 4: 9.2})
    job = Job(seq_id=1, prompt_ids=prompt_ids, max_new_tokens=48, sampling=GREEDY, eos_token_ids=frozenset(),
              max_len=engine.max_len)
    emitted: list[int] = []
    sent: list[str] = []
    with local_workers(engine, drafter, planner.envelope, lookup_tokens=4) as (cpu, gpu):
        assert gpu is not None
        handle = gpu.request

        def counted(message, expect):
            sent.append(type(message).__name__)
            return handle(message, expect)

        gpu.request = counted  # type: ignore[method-assign]
        target_calls: list[str] = []
        target_handle = cpu.request

        def target_counted(message, expect):
            target_calls.append(type(message).__name__)
            return target_handle(message, expect)

        cpu.request = target_counted  # type: ignore[method-assign]
        steps = dovetail_steps(job, planner, lambda tokens, _lp: emitted.extend(tokens) or False, lookup_tokens=4,
                               verify_ms={1: 5.9, 2: 9.0, 3: 12.4, 4: 16.0, 5: 19.1})
        _, stats = run_alone(steps, cpu, gpu)
    assert emitted == ar_tokens
    assert sent == ["DraftExtend"]  # the prompt's rows handed over, kept unread: no draft step ever ran
    assert stats.message().lookup_tokens > 0  # its plain steps still copy from the prompt
    assert "DecodeRun" in target_calls  # plain for good: several steps a call (plain_runs)
