"""The tree planner (--tree-tokens auto): what one verified tree says about smaller trees,
the choice it makes from costs and acceptance, and the startup verdict on drafting."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from cpu_worker.acceptance import accept_path
from dovetail_runtime.plain_fallback import PROBE_EVERY_MAX
from dovetail_runtime.tree_planner import (
    AutoTree,
    TreePlanner,
    accepted_path,
    drafting_cannot_pay,
    interpolate,
)
from gpu_worker.tree import build_tree
from ipc.tree import TreeShape, tree_depths

VOCAB = 6


def random_tree(shape: TreeShape, seed: int) -> tuple[list[int], list[int]]:
    """A real EAGLE-2 tree (nodes in selection order) over a fake head with random log-probs."""
    generator = torch.Generator().manual_seed(seed)

    def expand(tokens, features, depth, ancestors):
        return features, torch.randn(tokens.shape[0], VOCAB, generator=generator).log_softmax(-1)

    root = torch.randn(VOCAB, generator=generator).log_softmax(-1)
    tree = build_tree(0, torch.zeros(2), root, expand, shape)
    return tree.tokens.tolist(), tree.parents.tolist()


def path_tokens(tokens, parents, node) -> tuple[int, ...]:
    path = []
    while node > 0:
        path.append(tokens[node])
        node = parents[node]
    return tuple(reversed(path))


def oracle_pick(seed: int):
    """A deterministic 'target': its greedy choice after any path of tokens (often a token the
    random tree holds, so paths get accepted several levels deep)."""
    def pick(path: tuple[int, ...]) -> int:
        return random.Random(repr((seed, path))).choice([0, 1, 2, 3, 4, 5, 0, 1])
    return pick


def verify(tokens, parents, target) -> list[int]:
    nodes, bonus = accept_path(tokens, parents, lambda node: target(path_tokens(tokens, parents, node)))
    return [tokens[n] for n in nodes[1:]] + [bonus]


def test_accepted_path_follows_the_accepted_tokens():
    tokens, parents = [9, 1, 2, 3, 1], [-1, 0, 0, 1, 3]
    assert accepted_path(tokens, parents, [1, 3, 1, 5]) == [1, 3, 4]
    assert accepted_path(tokens, parents, [7]) == []


@pytest.mark.parametrize("seed", range(6))
def test_one_verified_tree_gives_every_smaller_trees_acceptance(seed):
    """For every (T', d') inside the verified shape, the planner's count equals verifying the
    smaller tree the drafter would have built (the tree's nodes no deeper than d', first T'-1)."""
    bounds = AutoTree(max_tree_tokens=32, max_depth=6, top_k=3)
    shape = TreeShape.clamped(32, 6, 3)
    tokens, parents = random_tree(shape, seed)
    target = oracle_pick(seed)
    planner = TreePlanner(bounds, {1: 1.0, 32: 2.0}, {1: 1.0}, decay=1.0, min_samples=1.0)
    planner.observe(shape, tokens, parents, verify(tokens, parents, target), 1.0, 1.0, 2.0)
    depths = tree_depths(parents)
    checked = 0
    for (size, depth, top_k), weight in planner.weight.items():
        if top_k != shape.top_k or depth > shape.depth or size > len(tokens):
            # Other beam widths learn from their own trees only.
            assert weight == 0.0
            continue
        keep = [0] + [node for node in range(1, len(tokens)) if depths[node] <= depth][:size - 1]
        if len(keep) < size:
            assert weight == 0.0  # not observable from this tree
            continue
        index = {node: i for i, node in enumerate(keep)}
        sub_tokens = [tokens[node] for node in keep]
        sub_parents = [-1] + [index[parents[node]] for node in keep[1:]]
        # The drafter's own smaller tree is exactly this one (tests/unit/test_draft_tree.py).
        expected = len(verify(sub_tokens, sub_parents, target)) - 1
        assert weight == 1.0 and planner.accepted_sum[(size, depth, top_k)] == expected, (size, depth)
        checked += 1
    assert checked > 20


class World:
    """A stationary drafting world: peaked draft trees (a fake head), and a target that takes
    a node's best child with probability ``first`` and its second with ``second``."""

    def __init__(self, first: float, second: float = 0.1, seed: int = 0,
                 verify=lambda size: 100.0 + 20.0 * size, draft=lambda depth: 15.0 * depth):
        self.first, self.second, self.rng = first, second, random.Random(seed)
        self.verify, self.draft = verify, draft
        self.cycle = 0
        self.now = 0.0  # ms, the cycles' and plain steps' costs
        self.plain_steps = 0

    def tree(self, shape: TreeShape) -> tuple[list[int], list[int]]:
        self.cycle += 1
        generator = torch.Generator().manual_seed(self.cycle)

        def expand(tokens, features, depth, ancestors):
            logits = torch.randn(tokens.shape[0], VOCAB, generator=generator) * 2.5
            return features, logits.log_softmax(-1)

        root = (torch.randn(VOCAB, generator=generator) * 2.5).log_softmax(-1)
        tree = build_tree(0, torch.zeros(2), root, expand, shape)
        return tree.tokens.tolist(), tree.parents.tolist()

    def accepted(self, tokens: list[int], parents: list[int]) -> list[int]:
        children: dict[int, list[int]] = {}
        for node in range(1, len(tokens)):
            children.setdefault(parents[node], []).append(tokens[node])

        def pick(node: int) -> int:
            draw, kids = self.rng.random(), children.get(node, [])
            if draw < self.first and kids:
                return kids[0]
            if draw < self.first + self.second and len(kids) > 1:
                return kids[1]
            return VOCAB + 1  # a token the draft did not propose

        nodes, bonus = accept_path(tokens, parents, pick)
        return [tokens[n] for n in nodes[1:]] + [bonus]

    def run(self, planner: TreePlanner, cycles: int) -> None:
        """``cycles`` of the planner's choosing; a one-node shape is a plain step (the solo fallback),
        which the world's clock times as verify(1)."""
        planner.fallback.clock = lambda: self.now / 1e3
        for _ in range(cycles):
            shape = planner.shape()
            if shape.tree_tokens == 1:
                self.now += self.verify(1)
                self.plain_steps += 1
                planner.plain_stepped()
                continue
            tokens, parents = self.tree(shape)
            draft, verify = self.draft(shape.depth), self.verify(len(tokens))
            self.now += draft + verify
            planner.observe(shape, tokens, parents, self.accepted(tokens, parents), draft, verify, draft + verify)

    def true_rates(self, bounds: AutoTree, cycles: int = 1500) -> dict[tuple[int, int, int], float]:
        """Tokens per ms of every shape, from envelope trees of each beam width (exact per tree,
        see above)."""
        truth = TreePlanner(bounds, {1: 1.0}, {1: 1.0}, decay=1.0, min_samples=1.0)
        for top_k in bounds.top_ks:
            envelope = TreeShape.clamped(bounds.envelope.tree_tokens, bounds.envelope.depth, top_k)
            for _ in range(cycles):
                tokens, parents = self.tree(envelope)
                truth.observe(envelope, tokens, parents, self.accepted(tokens, parents), 1.0, 1.0, 2.0)
        # Shapes with more nodes than candidates at their depth are never observed (nor built).
        return {cell: tokens / (self.verify(cell[0]) + self.draft(cell[1]))
                for cell in truth.cells if (tokens := truth.expected_tokens(cell)) is not None}


@pytest.mark.parametrize("first", [0.3, 0.6, 0.8, 0.95])
def test_the_planner_runs_near_the_best_fixed_shape(first):
    """Over 400 cycles after a 200-cycle start, probes included, the shapes it chose emit at
    least 90% of the tokens per second of the best fixed shape, top_k 3 or 1 (measured over
    these worlds and a second seed each: 0.94-0.98)."""
    bounds = AutoTree(max_tree_tokens=32, max_depth=8, top_k=3)
    # Costs shaped like the 7B int8 stand-in on 2 cores with a CPU draft (README).
    world = World(first, seed=int(first * 100), verify=lambda size: 400.0 + 30.0 * size,
                  draft=lambda depth: 30.0 * depth + 20.0)
    rates = world.true_rates(bounds, 800)
    best = max(rates, key=rates.get)
    verify_ms = {size: world.verify(size) for size in bounds.tree_sizes}
    draft_ms = {depth: world.draft(depth) for depth in range(1, 9)}
    planner = TreePlanner(bounds, verify_ms, draft_ms)
    world.run(planner, 200)
    planner.chosen.clear()
    world.run(planner, 400)

    def cost(cell):
        return world.verify(cell[0]) + world.draft(cell[1])

    tokens = sum(count * rates[cell] * cost(cell) for cell, count in planner.chosen.items())
    elapsed = sum(count * cost(cell) for cell, count in planner.chosen.items())
    assert tokens / elapsed >= 0.9 * rates[best], (best, planner.chosen.most_common(3), tokens / elapsed / rates[best])
    assert len(planner.chosen) > 1  # it explored


def test_the_planner_narrows_the_beam_when_a_deep_narrow_tree_pays():
    """A target that nearly always takes the draft's best child: a chain (top_k 1) reaches deeper
    than a top_k 3 tree of the same size. The planner, allowed top_k 3, finds it through its
    probes of the narrower beam (measured: 0.97-0.98 of the best shape's rate, where the best
    top_k 3 shape gives 0.73-0.75)."""
    bounds = AutoTree(max_tree_tokens=32, max_depth=8, top_k=3)
    assert bounds.top_ks == [1, 3]
    verify, draft = (lambda size: 400.0 + 30.0 * size), (lambda depth: 30.0 * depth + 20.0)
    world = World(0.95, seed=95, verify=verify, draft=draft)
    rates = world.true_rates(bounds, 600)
    assert max(rates, key=rates.get)[2] == 1  # the world's best shape is a chain
    planner = TreePlanner(bounds, {size: verify(size) for size in bounds.tree_sizes},
                          {depth: draft(depth) for depth in range(1, 9)})
    world.run(planner, 400)
    assert planner.best[2] == 1, planner.describe()
    narrow = sum(count for (_, _, top_k), count in planner.chosen.items() if top_k == 1)
    assert narrow > 0.6 * sum(planner.chosen.values())


def test_a_probe_reaches_the_largest_tree_that_costs_little_more():
    """Sitting on a small tree, a probe one step up rates only the next shapes; where verifying
    a larger tree costs little more (MKL packed fp32: T=16 at 1.7x a decode step), the probe is
    the deepest tree within PROBE_BUDGET of the best cycle, which rates every tree inside it.
    Where costs climb steeply it stays one step up."""
    from dovetail_runtime.tree_planner import PROBE_BUDGET

    bounds = AutoTree(max_tree_tokens=32, max_depth=8, top_k=4)
    draft = {depth: 10.0 * depth for depth in range(1, 9)}
    for verify, wide in (({size: 600.0 + 10.0 * size for size in bounds.tree_sizes}, True),
                         ({size: 500.0 + 150.0 * size for size in bounds.tree_sizes}, False)):
        planner = TreePlanner(bounds, verify, draft)
        planner.best = (2, 1, 4)
        planner.cycles = planner.explore_every  # the first probe: two sizes and two levels up, same beam
        probe = planner.probe()
        if wide:
            assert probe[2] == 4 and probe[1] >= 5 and probe[0] >= 8, probe
            assert planner.cycle_ms(probe) <= PROBE_BUDGET * planner.cycle_ms(planner.best)
        else:
            assert probe == (4, 3, 4)


def test_the_first_shape_is_the_deepest_tree_that_costs_little_more_than_the_cheapest():
    """Before any acceptance is known: on costs like the 7B int8 stand-in's on 2 EPYC cores
    (t_verify rising ~60 ms a node), a small tree, not EAGLE-2's 16-node start at ~3x a decode
    step; where verification is nearly flat (MKL's packed fp32 on a Xeon: T = 16 at 1.7x a
    decode step), a large, deep one."""
    from dovetail_runtime.tree_planner import PROBE_BUDGET

    bounds = AutoTree(max_tree_tokens=64, max_depth=10, top_k=8)
    draft = {depth: 25.0 + 35.0 * depth for depth in range(1, 11)}
    steep = TreePlanner(bounds, {size: 380.0 + 60.0 * size for size in bounds.tree_sizes}, draft)
    size, depth, top_k = steep.best
    assert top_k == 8 and size <= 4 and depth >= 1, steep.best
    cheapest = min(steep.cycle_ms(cell) for cell in steep.cells)
    assert steep.cycle_ms(steep.best) <= PROBE_BUDGET * cheapest
    deeper = [cell for cell in steep.cells if cell[2] == 8 and cell[1] > depth]
    assert all(steep.cycle_ms(cell) > PROBE_BUDGET * cheapest for cell in deeper)
    flat = TreePlanner(bounds, {size: 600.0 + 10.0 * size for size in bounds.tree_sizes},
                       {depth: 10.0 * depth for depth in range(1, 11)})
    assert flat.best[0] >= 8 and flat.best[1] >= 6 and flat.best[2] == 8, flat.best
    assert flat.cycle_ms(flat.best) <= PROBE_BUDGET * min(flat.cycle_ms(cell) for cell in flat.cells)


def test_the_first_shape_falls_back_to_the_narrower_beam_when_no_wide_cell_is_affordable():
    """The timings of a CI run on the 9M demo (2 busy cores): top_k 8 measured 9.9 ms at depth 1,
    top_k 4 5.8 ms, verification 3.6-4.9 ms up to T = 4. No top_k 8 cell is within the probe
    budget of the cheapest cell, so the start is the cheapest cell, of the narrower beam."""
    from dovetail_runtime.tree_planner import PROBE_BUDGET

    bounds = AutoTree(max_tree_tokens=64, max_depth=10, top_k=8)
    verify = {1: 3.6, 2: 3.9, 3: 4.4, 4: 4.9, 6: 6.0, 8: 7.1, 12: 8.2, 16: 10.3, 24: 14.4, 32: 17.9, 48: 23.7,
              64: 30.1}
    by_top_k = {4: {depth: 5.8 + 5.0 * (depth - 1) for depth in range(1, 11)},
                8: {depth: 9.9 + 10.0 * (depth - 1) for depth in range(1, 11)}}
    planner = TreePlanner(bounds, verify, by_top_k[8], draft_ms_by_top_k=by_top_k)
    cheapest = min(planner.cells, key=planner.cycle_ms)
    assert all(planner.cycle_ms(cell) > PROBE_BUDGET * planner.cycle_ms(cheapest)
               for cell in planner.cells if cell[2] == 8)
    assert planner.best == cheapest and planner.best[2] == 4, planner.best
    # The same costs with the wide beam as cheap as the narrow one: the start is of the wide beam.
    even = TreePlanner(bounds, verify, by_top_k[4], draft_ms_by_top_k={4: by_top_k[4], 8: by_top_k[4]})
    assert even.best[2] == 8, even.best


def test_the_planner_moves_up_when_deeper_drafts_start_paying():
    bounds = AutoTree(max_tree_tokens=32, max_depth=10, top_k=2)
    cheap_verify, cheap_draft = (lambda size: 100.0 + 5.0 * size), (lambda depth: 5.0 * depth)
    verify_ms = {size: cheap_verify(size) for size in bounds.tree_sizes}
    draft_ms = {depth: cheap_draft(depth) for depth in range(1, 11)}
    planner = TreePlanner(bounds, verify_ms, draft_ms)
    World(0.15, 0.05, verify=cheap_verify, draft=cheap_draft).run(planner, 200)
    shallow = planner.best
    World(0.97, 0.02, seed=1, verify=cheap_verify, draft=cheap_draft).run(planner, 600)
    assert planner.best[1] >= shallow[1] + 3, (shallow, planner.best)


def test_costs_are_rescaled_by_what_cycles_take():
    bounds = AutoTree(max_tree_tokens=16, max_depth=4, top_k=2)
    planner = TreePlanner(bounds, dict.fromkeys(bounds.tree_sizes, 100.0), dict.fromkeys(range(1, 5), 10.0))
    World(0.5, verify=lambda size: 200.0, draft=lambda depth: 10.0).run(planner, 80)
    assert planner.verify_scale == pytest.approx(2.0, rel=0.02)
    assert planner.draft_scale == pytest.approx(1.0, rel=0.02)


def test_a_size_measured_wrong_at_startup_is_corrected_by_the_cycles_seen():
    bounds = AutoTree(max_tree_tokens=32, max_depth=8, top_k=3)
    verify, draft = (lambda size: 400.0 + 30.0 * size), (lambda depth: 30.0 * depth + 20.0)
    measured = {size: verify(size) for size in bounds.tree_sizes}
    measured[8] *= 3  # a busy machine during the startup measurement of T = 8
    planner = TreePlanner(bounds, measured, {depth: draft(depth) for depth in range(1, 9)})
    World(0.9, verify=verify, draft=draft).run(planner, 300)
    assert sum(count for (size, _, _), count in planner.chosen.items() if size == 8) > 0  # probed, then seen
    assert planner.cycle_ms((8, 5, 3)) == pytest.approx(verify(8) + draft(5), rel=0.05)


def test_verify_costs_are_made_non_decreasing_and_interpolated():
    """A size timed above a larger one was timed during a busy spell: it takes the larger one's cost."""
    planner = TreePlanner(AutoTree(max_tree_tokens=8), {1: 4.0, 2: 5.0, 4: 4.5, 8: 9.0}, {1: 1.0, 2: 3.0, 3: 2.5})
    assert planner.verify_ms == {1: 4.0, 2: 4.5, 4: 4.5, 8: 9.0}
    assert all(by_depth == {1: 1.0, 2: 2.5, 3: 2.5} for by_depth in planner.draft_ms.values())
    assert interpolate({2: 10.0, 6: 30.0}, 3) == 15.0 and interpolate({2: 10.0}, 64) == 10.0


def test_one_size_timed_during_a_busy_spell_does_not_price_the_sizes_above_it():
    """The 7B chat stand-in's curve as it stood in the cache (q4_0, 2 cores: T = 2 timed while the host
    was busy, 157.5 ms against 131.9 for T = 3) and its head's draft curve. Under the running maximum
    T = 2, 3 and 4 all cost 157.5 ms (a 3-node tree looked no cheaper than a 4-node one, and the first
    trees had 6 nodes); rated at the least of their own and larger sizes' costs, T = 3 is the cheaper
    one again, and the first trees are smaller."""
    cached = {1: 115.5, 2: 157.5, 3: 131.9, 4: 153.6, 6: 178.6, 8: 197.9, 12: 236.9, 16: 412.3, 24: 615.3,
              32: 828.5, 48: 1223.7, 64: 1425.9}
    draft = {1: 10.2, 2: 20.6, 3: 38.5, 4: 46.2, 5: 57.3, 6: 62.7, 7: 93.3, 8: 104.2, 9: 114.2, 10: 121.3}
    planner = TreePlanner(AutoTree(), cached, draft)
    assert planner.cycle_ms((3, 2, 8)) == pytest.approx(131.9 + 20.6)
    assert planner.cycle_ms((3, 2, 8)) < planner.cycle_ms((4, 2, 8)) - 20
    assert planner.first_shape()[0] <= 4
    costs = planner.costs()
    assert costs.verify[2] == costs.verify[3] == 131.9 and costs.verify[4] == 153.6


def test_drafting_cannot_pay_is_said_only_when_even_perfect_acceptance_loses():
    bounds = AutoTree()
    # The 9M demo on 2 cores: a decode step 4.2 ms, a draft level ~7.5 ms.
    demo = drafting_cannot_pay({1: 4.2, 2: 4.3, 4: 4.3, 64: 11.6}, {d: 7.5 * d for d in range(1, 11)}, bounds)
    assert demo is not None and "--mode ar" in demo and "4.2 ms" in demo
    # A 7B int8 target with a 1-layer head drafting on the same cores.
    assert drafting_cannot_pay({1: 395.0, 8: 674.0, 64: 2022.0}, {d: 30.0 * d + 20 for d in range(1, 11)},
                               bounds) is None


def test_a_grafted_branch_is_weighed_against_the_trees_rated_cycle_and_its_extra_rows():
    bounds = AutoTree(max_tree_tokens=16, max_depth=4, top_k=2)
    verify = {1: 100.0, 2: 110.0, 3: 120.0, 4: 130.0, 6: 150.0, 8: 170.0, 12: 210.0, 16: 250.0}
    planner = TreePlanner(bounds, verify, dict.fromkeys(range(1, 5), 10.0))
    shape = TreeShape.clamped(4, 2, 2)
    unrated = planner.branch_terms(shape)
    assert unrated.tree_ms == pytest.approx(10.0 + 130.0)
    # Before the tree is rated: as many tokens as break even with plain steps (t_verify(1) each).
    assert unrated.tree_tokens == pytest.approx(140.0 / 100.0)
    assert unrated.extra_ms(2) == pytest.approx(150.0 - 130.0)
    # Past the measured curve rows still cost, in proportion (a branch on the largest tree is not free).
    largest = planner.branch_terms(TreeShape.clamped(16, 4, 2))
    assert largest.extra_ms(4) == pytest.approx(250.0 * 20 / 16 - 250.0)
    world = World(0.9, verify=lambda size: verify.get(size, 90.0 + 10.0 * size), draft=lambda depth: 10.0)
    world.run(planner, 60)
    rated = planner.branch_terms(shape)
    assert rated.tree_tokens == pytest.approx(planner.expected_tokens((4, 2, 2)))
    assert rated.tree_tokens > unrated.tree_tokens  # a draft right 90% of the time beats break-even
    # In a batch of 3 the branch's rows lengthen the pass all three wait on: weighed against the batch's
    # tokens, so a row that would pay for one sequence's own rate alone does not pay for the batch's.
    batched = planner.branch_terms(shape, 3)
    assert batched.tree_tokens == pytest.approx(3 * rated.tree_tokens)
    assert batched.extra_ms(4) > 0


def batch_planner(verify) -> TreePlanner:
    """A planner that has seen 300 solo cycles of a good draft (World 0.8) on these verify costs."""
    bounds = AutoTree(max_tree_tokens=32, max_depth=6, top_k=3)
    draft = lambda depth: 2.0 * depth  # noqa: E731 - a draft on a GPU: cheap
    planner = TreePlanner(bounds, {size: verify(size) for size in bounds.tree_sizes},
                          {depth: draft(depth) for depth in range(1, 7)})
    World(0.8, verify=verify, draft=draft).run(planner, 300)
    return planner


def test_in_a_batch_speculation_shrinks_to_plain_decoding_where_rows_cost_nearly_full_price():
    """AVX2-like costs (each row about as dear as a decode step's weights): alone a tree pays, but
    in a batch of 4 the pass is already full and plain decoding (T = 1) wins; with a flat curve
    (AMX-like: rows nearly free) the batch keeps speculating."""
    steep = batch_planner(lambda size: 40.0 + 70.0 * size)
    assert steep.shape(1).tree_tokens > 1
    plain = steep.shape(4)
    assert plain.tree_tokens == 1
    flat = batch_planner(lambda size: 100.0 + 1.0 * size)
    assert flat.shape(4).tree_tokens > 1


def test_before_any_rating_a_batch_decodes_plainly_where_no_tree_could_pay_it():
    """Nothing rated yet (a fresh server's first busy cycles): where even trees whose every drafted
    token were accepted emit fewer tokens per second than plain steps at this batch size (the demo's
    135M target on two cores: a row of arithmetic costs a third of a step), the batch's first cycle
    is one node; where rows are nearly free beside the weights' pass, it starts with the solo choice
    (a tree) as before, and alone a request still gets its tree."""
    bounds = AutoTree(max_tree_tokens=32, max_depth=6, top_k=4)
    draft = {depth: 1.6 + 1.2 * (depth - 1) for depth in range(1, 7)}
    steep = TreePlanner(bounds, {size: 3.0 + 1.3 * size for size in bounds.tree_sizes}, draft)
    assert all(steep.expected_tokens(cell) is None for cell in steep.cells)
    # Asked beforehand (does the draft need the prompt read?), without counting as a cycle.
    assert not steep.trees_may_pay(4) and steep.trees_may_pay(1) and steep.cycles == 0
    assert steep.shape(4).tree_tokens == 1
    assert steep.shape(1).tree_tokens > 1
    flat = TreePlanner(bounds, {size: 100.0 + 1.0 * size for size in bounds.tree_sizes}, draft)
    assert flat.trees_may_pay(4)
    assert flat.shape(4) == TreeShape.clamped(*flat.best) and flat.best[0] > 1


@pytest.mark.parametrize("batch, timed", [(4, True), (1, False)])
def test_batched_and_untimed_cycles_teach_acceptance_but_not_costs(batch, timed):
    """A batched cycle's times are the batch's (its draft time only says what its share of a batched
    draft costs); an untimed one's (a sequence's first, whose draft step also read the prompt) are
    not a cycle's."""
    planner = batch_planner(lambda size: 100.0 + 1.0 * size)
    costs = (planner.verify_scale, planner.draft_scale, planner.ipc_ms, dict(planner.seen_verify),
             dict(planner.seen_draft))
    shape = planner.shape(batch)
    tokens, parents = random_tree(shape, seed=3)
    before = dict(planner.weight)
    share = planner.batch_draft_share
    solo_draft = planner.draft_scale * 2.0 * shape.depth
    planner.observe(shape, tokens, parents, [tokens[1], 5], 0.2 * solo_draft, 900.0, 1250.0, batch=batch,
                    timed=timed)
    assert (planner.verify_scale, planner.draft_scale, planner.ipc_ms, planner.seen_verify,
            planner.seen_draft) == costs
    assert any(planner.weight[cell] != before[cell] for cell in before)
    if batch > 1:  # a step toward 0.2 of the solo draft
        assert planner.batch_draft_share == pytest.approx(share + planner.smoothing * (0.2 - share))
    else:
        assert planner.batch_draft_share == share


def test_a_batch_speculates_once_its_drafts_prove_cheap_together():
    """A draft as dear as a CPU's (here 30 ms a level): drafted one after another, a batch of 4
    cannot pay for trees; once batched cycles show each sequence's share of the batch's draft step
    is a twentieth of its solo step (as on a GPU), the batch speculates."""
    verify = lambda size: 100.0 + 4.0 * size  # noqa: E731 - rows cheap next to the weights' pass
    bounds = AutoTree(max_tree_tokens=32, max_depth=6, top_k=3)
    draft = lambda depth: 30.0 * depth  # noqa: E731
    planner = TreePlanner(bounds, {size: verify(size) for size in bounds.tree_sizes},
                          {depth: draft(depth) for depth in range(1, 7)})
    World(0.8, verify=verify, draft=draft).run(planner, 300)
    planner.batch_draft_share = 1.0
    assert planner.shape(1).tree_tokens > 1 and planner.shape(4).tree_tokens == 1
    shape = planner.shape(1)
    tokens, parents = random_tree(shape, seed=4)
    for _ in range(30):
        planner.observe(shape, tokens, parents, [tokens[1]], 0.05 * planner.draft_scale * draft(shape.depth), 400.0,
                        600.0, batch=4)
    assert planner.batch_draft_share == pytest.approx(0.05 + 0.95 * (1 - planner.smoothing) ** 30)
    assert planner.shape(4).tree_tokens > 1


# The real pair (SmolLM2-135M Q4_1, its head on the same cores) measured on a 2-core Zen 3 (AVX2): a
# row of arithmetic costs half a step.
ZEN3_VERIFY = {1: 5.9, 2: 9.0, 3: 12.4, 4: 16.0, 6: 22.3, 8: 24.3, 12: 46.1, 16: 52.0, 24: 82.3, 32: 106.5,
               48: 154.4, 64: 181.9}
ZEN3_DRAFT = {1: 2.5, 2: 4.9, 3: 6.2, 4: 9.2, 5: 11.5, 6: 12.9, 7: 15.9, 8: 18.3, 9: 21.6, 10: 29.6}


def test_alone_a_request_decodes_plainly_from_its_first_step_where_no_tree_could_pay(caplog):
    """Where no tree would out-emit plain steps even with 80% of drafted tokens accepted, the first
    step is plain (no dozen poor cycles first), said once, and so is every later one, alone or in a
    batch: no probe tree (its draft step would read the kept prompt, untimed: it could not tell)."""
    planner = TreePlanner(AutoTree(), ZEN3_VERIFY, ZEN3_DRAFT)
    with caplog.at_level(logging.INFO, logger="dovetail_runtime.tree_planner"):
        assert planner.trees_futile() and not planner.trees_may_pay(1) and not planner.trees_may_pay(2)
        sizes = {planner.shape(1).tree_tokens for _ in range(2 * PROBE_EVERY_MAX)}
        assert sizes == {1} and planner.shape(2).tree_tokens == planner.shape(4).tree_tokens == 1
    assert caplog.text.count("no draft tree can beat plain decode steps") == 1
    assert "no tree can pay" in planner.describe()


@pytest.mark.parametrize("verify, draft", [
    ({size: 400.0 + 30.0 * size for size in (1, 2, 4, 8, 16, 32, 64)}, {d: 30.0 * d + 20 for d in range(1, 11)}),
    ({size: ms / 2 for size, ms in ZEN3_VERIFY.items()} | {1: 5.9}, {d: 0.3 * d for d in range(1, 11)}),
])
def test_where_a_good_draft_could_pay_trees_get_their_chance(verify, draft):
    """The 7B int8 stand-in with a CPU head, and a cheap target row with a GPU head: not futile."""
    planner = TreePlanner(AutoTree(), verify, draft)
    assert not planner.trees_futile() and planner.trees_may_pay(1)
    assert planner.shape(1).tree_tokens > 1
