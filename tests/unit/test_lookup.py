"""Prompt lookup (dovetail_runtime/lookup.py): the branch it guesses, how the branch joins a draft
tree, and that a cycle with it still emits the target's own tokens."""

from __future__ import annotations

import random

import msgspec
import pytest

from dovetail_runtime.lookup import PromptLookup, copied, graft, shared_prefix
from dovetail_runtime.metrics import spec_tokens
from dovetail_runtime.tree_planner import AutoTree, BranchTerms, FixedTree, TreePlanner
from ipc.messages import Sampling
from ipc.tree import TreeShape, validate_parents


def brute_force_continuation(tokens: list[int], count: int, min_ngram: int = 2, max_ngram: int = 4) -> list[int]:
    """The rule read literally: the longest suffix (max_ngram down to min_ngram tokens) with an earlier
    occurrence, the latest such occurrence, the ``count`` tokens after it, copied one by one as the
    sequence would go on if it repeated them (so a copy may read its own output)."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                grown = list(tokens)
                for index in range(count):
                    grown.append(grown[start + n + index])
                return grown[len(tokens):]
    return []


def test_the_longest_suffix_match_wins_over_a_later_shorter_one():
    a, b, c, d, x, y = 10, 11, 12, 13, 20, 21
    lookup = PromptLookup([a, b, c, d, x, 5, c, d, y, 6, a, b, c, d], max_tokens=3)
    assert lookup.continuation() == [x, 5, c]  # "a b c d" at the start, not "c d" before y


def test_a_sequence_never_matches_its_own_suffix():
    assert PromptLookup([1, 2, 3], max_tokens=4).continuation() == []
    # The earlier "1 2", two back: the copy runs into the present and goes on from itself.
    assert PromptLookup([1, 2, 1, 2], max_tokens=5).continuation() == [1, 2, 1, 2, 1]
    assert PromptLookup([7, 7, 7], max_tokens=4).continuation() == [7, 7, 7, 7]  # "7 7" one back


def test_the_branch_is_cut_to_the_limit_and_off_at_zero():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert PromptLookup(tokens, max_tokens=4).continuation() == [3, 4, 5, 6]
    assert PromptLookup(tokens, max_tokens=4).continuation(limit=2) == [3, 4]
    assert PromptLookup(tokens, max_tokens=0).continuation() == []
    assert PromptLookup(tokens, max_tokens=4).continuation(limit=0) == []


@pytest.mark.parametrize("seed", range(5))
def test_extending_token_by_token_matches_the_rule_read_literally(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(5) for _ in range(200)]
    lookup = PromptLookup(tokens[:3], max_tokens=5)
    for end in range(3, len(tokens)):
        assert lookup.continuation() == brute_force_continuation(tokens[:end], 5), end
        lookup.extend(tokens[end:end + 1])


def test_the_branch_follows_the_answer_and_never_outgrows_what_the_budget_has_left():
    from dovetail_runtime.generation import Budget, Stats, prompt_lookup

    budget = Budget(3, frozenset(), lambda _tokens, _logprobs: False, Stats())
    branch = prompt_lookup([1, 2, 3, 4, 5, 6, 1, 2], budget, 4)
    assert branch(16) == [3, 4]  # 3 tokens left: two drafted, then the target's own
    budget.push([3])
    assert branch(16) == [4]  # the answer's token joined the index: "1 2 3" matched
    assert branch(0) == []
    budget.push([4, 5])
    assert branch(16) == []  # nothing left


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError):
        PromptLookup([1], max_tokens=-1)
    with pytest.raises(ValueError):
        PromptLookup([1], max_tokens=2, min_ngram=3, max_ngram=2)


# A draft tree: root 10, children 11 and 12, 11's child 13.
TOKENS, PARENTS = [10, 11, 12, 13], [-1, 0, 0, 1]


def test_a_branch_follows_the_trees_nodes_then_goes_on_as_new_ones():
    tokens, parents = graft(TOKENS, PARENTS, [11, 13, 14, 15])
    assert tokens == TOKENS + [14, 15]
    assert parents == PARENTS + [3, 4]


def test_a_branch_the_tree_lacks_hangs_from_the_root():
    tokens, parents = graft(TOKENS, PARENTS, [13, 11])
    assert tokens == TOKENS + [13, 11]
    assert parents == PARENTS + [0, 4]


def test_a_branch_inside_the_tree_adds_nothing():
    assert graft(TOKENS, PARENTS, [11, 13]) == (TOKENS, PARENTS)


def test_the_shared_prefix_is_what_the_branch_finds_on_the_trees_own_nodes():
    assert shared_prefix(TOKENS, PARENTS, [11, 13, 14, 15]) == 2  # graft adds rows for 14 and 15 only
    assert shared_prefix(TOKENS, PARENTS, [13, 11]) == 0
    assert shared_prefix(TOKENS, PARENTS, [11, 13]) == 2 and shared_prefix(TOKENS, PARENTS, []) == 0
    for branch in ([11, 13, 14, 15], [13, 11], [12, 5], [11]):
        tokens, _ = graft(TOKENS, PARENTS, branch)
        assert len(tokens) - len(TOKENS) == len(branch) - shared_prefix(TOKENS, PARENTS, branch)


def test_copied_counts_the_branch_tokens_the_target_accepted():
    assert copied([11, 13, 14], [11, 13, 9]) == 2  # 9: the bonus token, where the branch said 14
    assert copied([11, 13], [11, 13, 14]) == 2  # a branch accepted whole, then the bonus
    assert copied([11, 13], [12, 5]) == 0 and copied([], [12]) == 0


@pytest.mark.parametrize("seed", range(20))
def test_grafted_trees_stay_valid_with_distinct_siblings(seed):
    rng = random.Random(seed)
    tokens, parents = [0], [-1]
    for _ in range(rng.randrange(1, 12)):
        parent = rng.randrange(len(tokens))
        taken = {tokens[node] for node in range(1, len(tokens)) if parents[node] == parent}
        free = [token for token in range(6) if token not in taken]
        if free:
            tokens.append(rng.choice(free))
            parents.append(parent)
    branch = [rng.randrange(6) for _ in range(5)]
    grafted_tokens, grafted_parents = graft(tokens, parents, branch)
    validate_parents(grafted_parents)
    assert grafted_tokens[:len(tokens)] == tokens and grafted_parents[:len(parents)] == parents
    # Walking the branch from the root through the grafted tree finds every one of its tokens.
    node = 0
    for token in branch:
        node = next(child for child in range(1, len(grafted_tokens))
                    if grafted_parents[child] == node and grafted_tokens[child] == token)
    siblings = [(grafted_parents[node], grafted_tokens[node]) for node in range(1, len(grafted_tokens))]
    assert len(siblings) == len(set(siblings))


def planner() -> TreePlanner:
    bounds = AutoTree(max_tree_tokens=8, max_depth=3, top_k=4)
    return TreePlanner(bounds, verify_ms={1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0}, draft_ms={1: 1.0, 2: 2.0, 3: 3.0})


def test_the_planner_rates_the_draft_on_its_own_nodes_and_prices_the_whole_tree():
    """A path that leaves the draft's nodes for grafted ones rates the draft's trees as the path
    up to there, and the cycle's verify time counts for the size verified."""
    shape = TreeShape.clamped(4, 2, 4)
    tokens, parents = graft(TOKENS, PARENTS, [11, 13, 14, 15])
    with_graft, alone = planner(), planner()
    # accepted 11, 13 (draft nodes), 14 (grafted), then the bonus 15 (grafted too)
    with_graft.observe(shape, tokens, parents, [11, 13, 14, 15], 2.0, 15.0, 18.0, drafted=len(TOKENS))
    alone.observe(shape, TOKENS, PARENTS, [11, 13, 14], 2.0, 15.0, 18.0)
    assert with_graft.accepted_sum == alone.accepted_sum and with_graft.weight == alone.weight
    assert set(with_graft.seen_verify) == {len(tokens)} and set(alone.seen_verify) == {len(TOKENS)}


def test_without_drafted_the_grafted_nodes_would_be_rated_as_the_drafts():
    """The check above can fail: rated as if the draft had offered them, the grafted nodes raise
    its acceptance."""
    shape = TreeShape.clamped(4, 2, 4)
    tokens, parents = graft(TOKENS, PARENTS, [14])  # a third child of the root, accepted
    rated_as_draft, rated_right = planner(), planner()
    rated_as_draft.observe(shape, tokens, parents, [14, 1], 2.0, 15.0, 18.0)
    rated_right.observe(shape, tokens, parents, [14, 1], 2.0, 15.0, 18.0, drafted=len(TOKENS))
    assert rated_as_draft.accepted_sum[(4, 1, 4)] == 1.0  # as if the draft's third pick had been right
    assert sum(rated_right.accepted_sum.values()) == 0.0  # the draft's own nodes: none accepted


# --- a cycle with the lookup on a tiny model: the target's own tokens, and the branch used ---------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A target with an 8-token vocabulary (so its text repeats) and an untrained 1-layer head."""
    from conftest import sharp_tiny_pair

    return sharp_tiny_pair(tmp_path_factory.mktemp("tiny-lookup"), 96)


def greedy_job(engine, prompt: list[int], count: int):
    """A greedy request for ``count`` tokens, the list its emitted tokens go to, and its emit callback."""
    from dovetail_runtime.generation import Job

    job = Job(seq_id=1, prompt_ids=prompt, max_new_tokens=count, sampling=Sampling(), eos_token_ids=frozenset(),
              max_len=engine.max_len)
    emitted: list[int] = []

    def emit(tokens: list[int], _logprobs) -> bool:
        emitted.extend(tokens)
        return False

    return job, emitted, emit


def run(engine, drafter, prompt: list[int], count: int, params: Sampling, lookup_tokens: int,
        shape: TreeShape = TreeShape.clamped(3, 2, 1)):
    """(tokens, stats) with prompt lookup's ``lookup_tokens``: dovetail with a drafter, ar (lookup decoding) without."""
    from dovetail_runtime.generation import Job

    from test_sampling import run_job

    job = Job(seq_id=1, prompt_ids=prompt, max_new_tokens=count, sampling=params, eos_token_ids=frozenset(),
              max_len=engine.max_len)
    tokens, _, stats = run_job(engine, drafter, job, shape, lookup_tokens)
    return tokens, stats


def test_greedy_with_lookup_emits_ars_tokens_and_lookup_adds_some(tiny_pair):
    engine, drafter = tiny_pair
    prompt = [1, 5, 2, 7, 1, 5, 2]
    ar, _ = run(engine, None, prompt, 48, Sampling(), 0)
    without, plain_stats = run(engine, drafter, prompt, 48, Sampling(), 0)
    with_lookup, stats = run(engine, drafter, prompt, 48, Sampling(), 4)
    assert without == ar and with_lookup == ar
    assert plain_stats.lookup_tokens == 0
    assert stats.lookup_tokens > 0  # tokens accepted on grafted nodes...
    assert stats.cycles < plain_stats.cycles  # ...so fewer cycles for the same answer
    drafted, accepted = spec_tokens(stats.message())  # the metrics count grafted nodes as drafted
    assert stats.lookup_tokens <= accepted <= drafted
    assert drafted == stats.lookup_nodes + 2 * stats.cycles


def test_plain_steps_with_lookup_emit_ars_tokens_in_fewer_steps(tiny_pair):
    """A one-node tree: no draft step pays, the request decodes plainly, and lookup's branch rides
    on the plain steps."""
    engine, drafter = tiny_pair
    prompt, plain = [1, 5, 2, 7, 1, 5, 2], TreeShape.clamped(1, 1, 1)
    ar, ar_stats = run(engine, None, prompt, 48, Sampling(), 0)
    emitted, stats = run(engine, drafter, prompt, 48, Sampling(), 4, plain)
    assert emitted == ar
    assert stats.trees["1/0/0"] == stats.cycles  # all plain: a one-node tree never pays for reading the prompt
    assert sum(stats.accept_per_depth) == stats.cycles
    # The one-node trees draft nothing: every token past one a step was the branch's.
    assert stats.lookup_tokens == sum(k * cycles for k, cycles in enumerate(stats.accept_per_depth)) > 0
    assert stats.cycles < ar_stats.cycles


@pytest.mark.parametrize("seed", range(4))
def test_seeded_sampling_with_lookup_equals_seeded_ar(tiny_pair, seed):
    engine, drafter = tiny_pair
    params = msgspec.structs.replace(Sampling(temperature=1.0), seed=seed)
    ar, _ = run(engine, None, [1, 5, 2, 7], 24, params, 0)
    assert run(engine, drafter, [1, 5, 2, 7], 24, params, 4)[0] == ar


class PricedTree(FixedTree):
    """A fixed tree whose grafted branches are weighed at given costs: a 2-token, 10 ms cycle and
    ``row_ms`` a branch row."""

    def __init__(self, shape: TreeShape, row_ms: float):
        super().__init__(shape)
        self.row_ms = row_ms

    def branch_terms(self, shape: TreeShape, batch: int = 1) -> BranchTerms:
        return BranchTerms(2.0, 10.0, lambda rows: self.row_ms * rows)


@pytest.mark.parametrize("row_ms", [0.01, 100.0])
def test_trees_graft_as_much_of_the_branch_as_pays_and_emit_ars_tokens(tiny_pair, row_ms):
    """Dear rows: the branch keeps only its tokens on the tree's own nodes, and a new row now and
    then (the policy's probes); nearly free rows: it is grafted as it comes. ar's tokens either way."""
    from dovetail_runtime.generation import generate_dovetail
    from dovetail_runtime.local_workers import local_workers
    from dovetail_runtime.lookup_policy import PROBE_EVERY

    engine, drafter = tiny_pair
    prompt, shape = [1, 5, 2, 7, 1, 5, 2], TreeShape.clamped(3, 2, 1)
    ar, _ = run(engine, None, prompt, 48, Sampling(), 0)
    _, whole = run(engine, drafter, prompt, 48, Sampling(), 4, shape)
    job, emitted, emit = greedy_job(engine, prompt, 48)
    with local_workers(engine, drafter, shape, lookup_tokens=4) as (cpu, gpu):
        _, stats = generate_dovetail(cpu, gpu, job, PricedTree(shape, row_ms), emit, lookup_tokens=4,
                                     verify_ms={1: 10.0, 2: 20.0, 8: 80.0})
    assert emitted == ar
    assert whole.lookup_nodes > whole.cycles  # whole branches: more than a node a cycle on this repeating text
    if row_ms > 1:
        assert stats.lookup_nodes <= stats.cycles // PROBE_EVERY + 1  # probes only
    else:
        assert stats.lookup_nodes >= whole.lookup_nodes // 2 and stats.lookup_tokens > 0


def test_a_first_cycle_of_one_node_weighs_its_branch_as_a_plain_step(tiny_pair):
    """A request that starts while the server's planner decodes plainly drafts a one-node tree first
    (its draft reads the prompt); a repeating prompt gives it a branch, weighed as a plain step's (a
    one-node tree has no draft levels to price it by). ar's tokens."""
    from dovetail_runtime.generation import generate_dovetail
    from dovetail_runtime.local_workers import local_workers

    engine, drafter = tiny_pair
    prompt = [1, 5, 2, 7, 1, 5, 2, 7, 1, 5]  # ends in a 2-gram seen before: a branch from the first cycle
    ar, _ = run(engine, None, prompt, 24, Sampling(), 0)
    bounds = AutoTree(max_tree_tokens=8, max_depth=3, top_k=2)
    verify_ms = {1: 10.0, 2: 12.0, 3: 14.0, 4: 16.0, 6: 20.0, 8: 24.0}
    planner = TreePlanner(bounds, verify_ms, draft_ms={1: 1.0, 2: 2.0, 3: 3.0})
    planner.fallback.plain = True  # as a previous request left it
    job, emitted, emit = greedy_job(engine, prompt, 24)
    with local_workers(engine, drafter, bounds.envelope, lookup_tokens=4) as (cpu, gpu):
        _, stats = generate_dovetail(cpu, gpu, job, planner, emit, lookup_tokens=4, verify_ms=verify_ms)
    assert emitted == ar
    assert stats.trees["1/0/2"] >= 1 and stats.lookup_nodes > 0


def test_plain_steps_in_a_busy_batch_take_no_branch(tiny_pair):
    """Where the batch's load leaves no tree room the floor is plain batched decoding: no lookup rows."""
    from dovetail_runtime.generation import dovetail_steps, run_alone
    from dovetail_runtime.local_workers import local_workers

    engine, drafter = tiny_pair
    prompt, plain = [1, 5, 2, 7, 1, 5, 2], TreeShape.clamped(1, 1, 1)
    ar, _ = run(engine, None, prompt, 48, Sampling(), 0)
    job, emitted, emit = greedy_job(engine, prompt, 48)
    with local_workers(engine, drafter, plain, lookup_tokens=4) as (cpu, gpu):
        _, stats = run_alone(dovetail_steps(job, plain, emit, batch=lambda: 2, lookup_tokens=4), cpu, gpu)
    assert emitted == ar
    assert stats.lookup_nodes == 0 and stats.trees["1/0/0"] == stats.cycles == 47
