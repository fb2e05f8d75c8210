"""The solo plain fallback (dovetail_runtime/plain_fallback.py) and the planner's use of it: plain
steps once the recent trees emit fewer tokens per second than plain steps would, a probe tree now
and then, trees again as soon as a probe pays, probes rarer where trees keep failing."""

from __future__ import annotations

import pytest

from dovetail_runtime.plain_fallback import PLAIN_EVIDENCE, PROBE_EVERY, PROBE_EVERY_MAX, PlainFallback
from dovetail_runtime.plain_runs import LONGEST_RUN
from dovetail_runtime.tree_planner import AutoTree, TreePlanner

STEP_MS = 10.0  # a plain decode step


def poor_cycles(fallback: PlainFallback, count: int) -> None:
    """Cycles that emit 2 tokens in 30 ms: 15 ms a token against a plain step's 10."""
    for _ in range(count):
        fallback.observe(2, 30.0, STEP_MS)


def steps_until_probe(fallback: PlainFallback) -> int:
    """Asks, each plain one followed by its step, until the probe's (counted); then, as the runtime
    does (``generation.plain_until_tree``), the stretch's last step: a root-only verify."""
    steps = 1
    while fallback.step_plain():
        fallback.stepped()
        steps += 1
    fallback.stepped()
    return steps


def plain_shapes(planner: TreePlanner, count: int) -> list:
    """``count`` of the planner's shapes, each one-node shape taken as a plain step, and each probe tree
    preceded by the stretch's root-only verify (``generation.plain_until_tree``), a step too."""
    shapes = []
    for _ in range(count):
        shapes.append(planner.shape())
        planner.plain_stepped()
    return shapes


class FakeClock:
    """Seconds that move only when told: plain steps of STEP_MS unless a test says otherwise."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += STEP_MS / 1e3
        return self.now


def test_poor_trees_turn_plain_only_after_the_evidence():
    fallback = PlainFallback(FakeClock())
    poor_cycles(fallback, PLAIN_EVIDENCE - 1)
    assert not fallback.plain
    poor_cycles(fallback, 1)
    assert fallback.plain and fallback.probe_every == PROBE_EVERY


def test_trees_that_pay_never_turn_plain():
    fallback = PlainFallback(FakeClock())
    for _ in range(10 * PLAIN_EVIDENCE):
        fallback.observe(3, 25.0, STEP_MS)  # 8.3 ms a token
    assert not fallback.plain


def test_a_hard_patch_among_good_cycles_is_judged_on_the_recent_ones():
    fallback = PlainFallback(FakeClock())
    for _ in range(50):
        fallback.observe(4, 25.0, STEP_MS)
    poor_cycles(fallback, 3)  # three bad cycles do not outweigh the good ones before them
    assert not fallback.plain
    poor_cycles(fallback, 30)  # a long hard stretch does
    assert fallback.plain


def test_a_probe_that_pays_brings_the_trees_back_one_that_does_not_keeps_plain():
    fallback = PlainFallback(FakeClock())
    poor_cycles(fallback, PLAIN_EVIDENCE)
    assert steps_until_probe(fallback) == PROBE_EVERY
    fallback.observe(2, 30.0, STEP_MS)  # the probe: 15 ms a token
    assert fallback.plain
    assert steps_until_probe(fallback) == PROBE_EVERY
    fallback.observe(4, 30.0, STEP_MS)  # 7.5 ms a token
    assert not fallback.plain


def test_trees_that_fail_again_soon_make_probes_rarer_and_trees_that_hold_reset_them():
    fallback = PlainFallback(FakeClock())
    poor_cycles(fallback, PLAIN_EVIDENCE)
    every = [fallback.probe_every]
    for _ in range(6):
        fallback.observe(4, 30.0, STEP_MS)  # a probe pays ...
        poor_cycles(fallback, PLAIN_EVIDENCE)  # ... and the trees fail again at once
        assert fallback.plain
        every.append(fallback.probe_every)
    assert every == [min(PROBE_EVERY * 2 ** n, PROBE_EVERY_MAX) for n in range(7)]
    fallback.observe(4, 30.0, STEP_MS)
    for _ in range(2 * PLAIN_EVIDENCE):
        fallback.observe(3, 25.0, STEP_MS)  # trees that hold for a while
    poor_cycles(fallback, 40)
    assert fallback.plain and fallback.probe_every == PROBE_EVERY


def planner_on(verify, draft) -> TreePlanner:
    bounds = AutoTree(max_tree_tokens=8, max_depth=4, top_k=4)
    planner = TreePlanner(bounds, {size: verify(size) for size in bounds.tree_sizes},
                          {depth: draft(depth) for depth in range(1, 5)}, min_samples=1.0)
    planner.fallback.clock = FakeClock()
    return planner


def run_poor_trees(planner: TreePlanner, verify, draft, cycles: int = 100) -> int:
    """Up to ``cycles`` tree cycles that accept nothing (1 token each) at these costs, until the
    planner says one node; returns how many trees it verified."""
    for trees in range(cycles):
        shape = planner.shape()
        if shape.tree_tokens == 1:
            planner.plain_stepped()  # taken
            return trees
        tokens, parents = list(range(shape.tree_tokens)), [-1] + [0] * (shape.tree_tokens - 1)
        took_draft, took_verify = draft(shape.depth), verify(shape.tree_tokens)
        planner.observe(shape, tokens, parents, [99], took_draft, took_verify, took_draft + took_verify + 1.0)
    return cycles


def test_the_planner_alone_says_plain_steps_with_its_smallest_tree_as_the_probe():
    """Costs like the demo's (a plain step 10 ms, a draft level 5, a row 2.5): a two-node cycle costs
    about two plain steps, so every tree needs near-perfect acceptance to pay (``trees_hopeless``)."""
    verify, draft = (lambda size: STEP_MS + 2.5 * (size - 1)), (lambda depth: 5.0 * depth)
    planner = planner_on(verify, draft)
    assert planner.trees_hopeless(STEP_MS)
    trees = run_poor_trees(planner, verify, draft)
    # The verdict counts the cycles of the best tree, not the probes of larger ones.
    assert planner.fallback.plain and PLAIN_EVIDENCE <= trees < 2 * PLAIN_EVIDENCE
    shapes = plain_shapes(planner, 3 * PROBE_EVERY - 1)
    probes = [index for index, planned in enumerate(shapes) if planned.tree_tokens > 1]
    assert len(probes) == 3 and probes[1] - probes[0] == PROBE_EVERY
    # The probe: the smallest tree of the widest beam, the cheapest way to ask whether drafting pays.
    assert all((shapes[i].tree_tokens, shapes[i].depth, shapes[i].top_k) == (2, 1, 4) for i in probes)
    assert "plain" in planner.describe()


def test_where_trees_have_room_a_hard_patch_keeps_its_trees():
    """Costs like the 7B stand-in's (a plain step 110 ms, a row ~20, a draft level ~15): poor cycles
    there are the text's, and the rest of the answer pays, so the planner keeps drafting."""
    verify, draft = (lambda size: 110.0 + 20.0 * (size - 1)), (lambda depth: 10.0 + 15.0 * depth)
    planner = planner_on(verify, draft)
    assert not planner.trees_hopeless(110.0)
    assert run_poor_trees(planner, verify, draft) == 100 and not planner.fallback.plain


def test_timed_plain_steps_replace_the_planners_estimate():
    """The estimate said 10 ms a step; the plain steps take 4: a probe emitting 2 tokens in 9 ms
    pays against the estimate but not against the steps as timed, so it stays plain."""
    now = [0.0]
    fallback = PlainFallback(lambda: now[0])
    poor_cycles(fallback, PLAIN_EVIDENCE)
    for _ in range(PROBE_EVERY - 1):
        assert fallback.step_plain()
        fallback.stepped()
        now[0] += 0.004
    assert not fallback.step_plain()  # the probe
    now[0] += 0.5  # a probe tree, then a long pause (a batch): neither is a plain step
    fallback.interrupt()
    assert fallback.plain_step_ms(STEP_MS) == pytest.approx(4.0)
    fallback.observe(2, 9.0, fallback.plain_step_ms(STEP_MS))
    assert fallback.plain and "plain steps 250.0 tokens/s" in fallback.describe()
    fallback.observe(3, 9.0, fallback.plain_step_ms(STEP_MS))  # 3 ms a token
    assert not fallback.plain
    # The next request's first ask comes after its prompt ran: a gap, not a plain step.
    fallback.step_plain()
    now[0] += 0.2
    fallback.step_plain()
    assert fallback.plain_step_ms(STEP_MS) == pytest.approx(4.0)


@pytest.mark.parametrize("run", [1, 3, 7, 100])
def test_plain_calls_of_several_steps_probe_after_as_many_steps_as_single_ones(run):
    """A lone sequence takes its plain steps several a call (``plain_runs``): each call at most the
    fallback's ``run_cap``, so the probe comes after the same PROBE_EVERY - 1 plain steps, in as few
    calls as the cap allows, and each call's time counts as its steps' (4 ms each here)."""
    now = [0.0]
    fallback = PlainFallback(lambda: now[0])
    poor_cycles(fallback, PLAIN_EVIDENCE)
    assert fallback.plain
    stretches, calls = [], []
    for _ in range(3):
        steps = made = 0
        while fallback.step_plain():
            taken = min(run, fallback.run_cap())
            fallback.stepped(taken)
            steps, made = steps + taken, made + 1
            now[0] += 0.004 * taken
        stretches.append(steps)
        calls.append(made)
        fallback.stepped()  # the stretch's last step, a root-only verify, before the probe tree
        now[0] += 0.5  # the probe tree (it does not pay): plain again
        fallback.interrupt()
    assert stretches == [PROBE_EVERY - 1] * 3
    assert calls == [-(-(PROBE_EVERY - 1) // run)] * 3
    assert fallback.plain_step_ms(STEP_MS) == pytest.approx(4.0)
    fallback.settle_plain()
    assert fallback.run_cap() == LONGEST_RUN and fallback.step_plain()  # no probe to wait for


def test_tokens_only_prompt_lookup_offered_do_not_keep_the_trees():
    """Prompt lookup's branch rides on plain steps too (generation.plain_steps), so a cycle whose
    accepted tokens all came from grafted nodes says nothing for the draft: at the demo's costs the
    planner goes plain as when those cycles accept nothing (counted, the 4 tokens a cycle would keep
    it drafting)."""
    verify, draft = (lambda size: STEP_MS + 2.5 * (size - 1)), (lambda depth: 5.0 * depth)
    planner = planner_on(verify, draft)
    trees = 0
    while (shape := planner.shape()).tree_tokens > 1 and trees < 100:
        trees += 1
        drafted = shape.tree_tokens
        tokens = list(range(drafted)) + [101, 102, 103]  # the draft's nodes, then a grafted branch
        parents = [-1] + [0] * (drafted - 1) + [0, drafted, drafted + 1]
        took_draft, took_verify = draft(shape.depth), verify(len(tokens))
        planner.observe(shape, tokens, parents, [101, 102, 103, 99], took_draft, took_verify,
                        took_draft + took_verify + 1.0, drafted=drafted)
    assert planner.fallback.plain and PLAIN_EVIDENCE <= trees < 2 * PLAIN_EVIDENCE
