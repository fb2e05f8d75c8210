"""How much of prompt lookup's branch a lookup-mode step verifies (dovetail_runtime.lookup_policy):
as much as pays at the measured row costs and the acceptance seen so far, with probes."""

from __future__ import annotations

import pytest

from dovetail_runtime.lookup_policy import PROBE_EVERY, BranchPolicy

BRANCH = [11, 12, 13, 14, 15, 16, 17, 18]
# Rows nearly free (a large model's pass reads weights) and rows that cost a step each (AVX2, 135M).
CHEAP = {size: 100.0 + 2.0 * size for size in range(1, 10)}
DEAR = {size: 5.0 * size for size in range(1, 10)}


def test_with_cheap_rows_long_branches_are_verified_from_the_start():
    policy = BranchPolicy(CHEAP)
    assert len(policy.choose(BRANCH)) >= 4  # at the prior a fifth token adds 3% more tokens for 2% more time


def test_with_dear_rows_and_misses_no_branch_is_verified_but_probes():
    policy = BranchPolicy(DEAR)
    assert len(policy.choose(BRANCH)) == 0  # at the prior (half accepted) a row costing a step never pays
    policy = BranchPolicy({**DEAR, 2: 6.0})  # a second row at 1.2x: pays at the prior
    for _ in range(20):
        if policy.choose(BRANCH):
            policy.observe(0)  # always wrong
    tried = [len(policy.choose(BRANCH)) for _ in range(4 * PROBE_EVERY)]
    assert tried.count(1) == 4 and set(tried) == {0, 1}  # one probe of one token every PROBE_EVERY branches


def test_branches_grow_while_copies_are_accepted_and_shrink_when_they_stop():
    costs = {size: 10.0 + 4.0 * size for size in range(1, 10)}  # a row at 0.4 of a step
    policy = BranchPolicy(costs)
    lengths = []
    for _ in range(12):
        chosen = policy.choose(BRANCH)
        lengths.append(len(chosen))
        policy.observe(len(chosen))  # every copied token right
    assert lengths[-1] == len(BRANCH) and lengths[-1] > lengths[0]
    for _ in range(12):
        policy.observe(0) if policy.choose(BRANCH) else None
    assert len(policy.choose(BRANCH)) < len(BRANCH) // 2


def test_the_branch_is_never_longer_than_the_measured_sizes_or_the_branch():
    policy = BranchPolicy({1: 10.0, 2: 10.0, 3: 10.0})
    assert policy.choose(BRANCH) == BRANCH[:2]
    assert policy.choose([7]) == [7]
    assert policy.choose([]) == []
    for costs in ({2: 1.0}, {1: 10.0}):  # no plain step's cost, or nothing to weigh a branch row with
        with pytest.raises(ValueError, match="t_verify"):
            BranchPolicy(costs)


def test_a_planners_curve_is_interpolated_and_made_non_decreasing():
    # A tree planner's sizes (no 5, no 7) with one timing taken in a busy spell (T = 2).
    policy = BranchPolicy({1: 10.0, 2: 30.0, 3: 11.0, 4: 12.0, 6: 14.0, 8: 16.0})
    assert policy.cost == {1: 10.0, 2: 11.0, 3: 11.0, 4: 12.0, 5: 13.0, 6: 14.0, 7: 15.0, 8: 16.0}
    assert policy.longest == 7
    for _ in range(10):
        policy.observe(len(policy.choose(BRANCH)))  # all accepted: the branch grows past the gaps
    assert policy.choose(BRANCH) == BRANCH[:7]


# --- a branch grafted onto a draft tree: its free tokens kept, new rows only where they pay ------------

TREE_TOKENS, TREE_MS = 2.0, 100.0  # a tree emitting 2 tokens a 100 ms cycle: 0.02 tokens a ms to beat


def test_a_grafted_branch_keeps_the_tokens_the_tree_has_and_adds_dear_rows_only_as_probes():
    policy = BranchPolicy(DEAR)
    dear = lambda rows: 60.0 * rows  # noqa: E731 - a row at 0.6 of the cycle: at the prior it never pays
    offers = [policy.choose_grafted(BRANCH, 2, TREE_TOKENS, TREE_MS, dear) for _ in range(2 * PROBE_EVERY)]
    assert offers.count(BRANCH[:2]) == 2 * PROBE_EVERY - 2  # the two tokens on the tree's nodes cost nothing
    assert offers.count(BRANCH[:3]) == 2  # one new row every PROBE_EVERY branches that would add none
    assert policy.choose_grafted(BRANCH[:2], 2, TREE_TOKENS, TREE_MS, dear) == BRANCH[:2]  # nothing to add: no probe


def test_a_grafted_branch_takes_cheap_rows_and_grows_while_its_copies_are_accepted():
    policy = BranchPolicy(DEAR)  # the plain steps' curve plays no part on a tree
    assert len(policy.choose_grafted(BRANCH, 0, TREE_TOKENS, TREE_MS, lambda rows: 0.5 * rows)) >= 4  # nearly free
    policy = BranchPolicy(DEAR)
    fair = lambda rows: 30.0 * rows  # noqa: E731 - pays once copies are right more often than not
    lengths = []
    for _ in range(40):
        offered = policy.choose_grafted(BRANCH, 0, TREE_TOKENS, TREE_MS, fair)
        lengths.append(len(offered))
        policy.observe(len(offered))  # every copied token accepted
    assert lengths[0] == 0 and lengths[-1] >= 4
    for _ in range(12):
        policy.observe(0) if policy.choose_grafted(BRANCH, 0, TREE_TOKENS, TREE_MS, fair) else None
    assert policy.choose_grafted(BRANCH, 0, TREE_TOKENS, TREE_MS, fair) in ([], BRANCH[:1])  # none, or a probe
