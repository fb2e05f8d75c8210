"""tools.sim_planner: the planner replayed on recorded trees. The walk must be the runtime's (a tree's
accepted path, lookup's branch, the planner told every cycle), or what it says about planners is wrong."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from gguf_support import need_fixture

from dovetail_runtime.demo_models import SMOLLM2_DIR, SMOLLM2_DRAFT
from ipc.tree import TreeShape, tree_depths
from tools import sim_planner
from tools.sim_planner import CycleCosts, followed, simulate, subtree

QUIET = dict(quiet=True)


def chain_tree(truth: list[int], position: int, length: int = 10, wrong: int = 0) -> list[list[int]]:
    """The root (the token before ``position``) and a chain of the next ``length`` tokens (each + ``wrong``:
    a draft that is always wrong when non-zero), in selection order."""
    tokens = [truth[position - 1]] + [token + wrong for token in truth[position:position + length]]
    return [tokens, [-1] + list(range(len(tokens) - 1))]


def answers_with(trees, prompt_len: int = 5, answer_len: int = 40, period: int | None = None) -> list[dict]:
    """One answer (distinct tokens, or a loop of ``period``) with ``trees(truth, position)`` at every position."""
    prompt = list(range(1000, 1000 + prompt_len))
    truth = [100 + (index % period if period else index) for index in range(answer_len)]
    recorded = [trees(truth, position) for position in range(1, answer_len)]
    return [{"prompt": prompt, "answer": truth, "trees": {"4": recorded, "8": recorded}}]


def test_subtree_keeps_the_root_and_the_first_nodes_no_deeper_than_the_depth():
    # Selection order: a(d1) b(d1) a1(d2, under a) c(d1) a11(d3) b1(d2, under b)
    tokens, parents = [0, 1, 2, 11, 3, 111, 21], [-1, 0, 0, 1, 0, 3, 2]
    assert subtree(tokens, parents, 4, 1) == ([0, 1, 2, 3], [-1, 0, 0, 0])
    assert subtree(tokens, parents, 4, 2) == ([0, 1, 2, 11], [-1, 0, 0, 1])
    small_tokens, small_parents = subtree(tokens, parents, 6, 3)
    assert small_tokens == [0, 1, 2, 11, 3, 111] and max(tree_depths(small_parents)) == 3
    assert followed(tokens, parents, [1, 11, 111, 5]) == [1, 11, 111]
    assert followed(tokens, parents, [2, 22]) == [2] and followed(tokens, parents, [9]) == []


@pytest.mark.parametrize("size, depth", [(4, 3), (3, 2), (8, 5), (2, 1)])
def test_a_fixed_tree_of_a_right_draft_emits_its_depth_plus_one_each_cycle(size, depth):
    answers = answers_with(chain_tree)
    run = simulate(answers, TreeShape.clamped(size, depth, 4), CycleCosts(), seed=0, lookup_tokens=0, **QUIET)
    per_cycle = min(size - 1, depth) + 1
    remaining, cycles = len(answers[0]["answer"]) - 1, 0
    while remaining > 0:  # the last cycle emits what is left (its bonus token included)
        remaining -= min(per_cycle, remaining)
        cycles += 1
    assert (run.tokens, run.cycles) == (len(answers[0]["answer"]) - 1, cycles)
    costs = CycleCosts()
    full = costs.draft(depth) + costs.verify(min(size, depth + 1)) + costs.rest_ms
    assert run.ms == pytest.approx(full * cycles, rel=0.2)


def test_a_wrong_draft_emits_one_token_a_cycle_and_lookup_copies_a_loop():
    wrong = lambda truth, position: chain_tree(truth, position, wrong=7)  # noqa: E731
    answers = answers_with(wrong, answer_len=80, period=5)
    plain = simulate(answers, TreeShape.clamped(3, 2, 4), CycleCosts(), 0, 0, **QUIET)
    assert plain.tau == 1.0
    looped = simulate(answers, TreeShape.clamped(3, 2, 4), CycleCosts(), 0, 4, **QUIET)
    assert looped.tokens == plain.tokens and looped.tau > 3.5  # 4 copied tokens + the bonus once the loop shows


def test_with_dear_rows_the_planner_grafts_only_the_branch_rows_that_pay():
    """Text whose 2-grams recur with new continuations (7 8 x, 7 8 y, ...): lookup's branch is always wrong
    at its first token; a draft right at its first node, so 2-node trees pay. On AVX2-like costs (a row
    ~0.45 of a step) whole branches grafted onto every tree cost rows that bring nothing; cut, no more
    than the probes."""
    truth = [token for index in range(100) for token in (7, 8, 200 + index)]

    def first_right(position: int) -> list[list[int]]:
        tokens, parents = chain_tree(truth, position, wrong=1000)
        tokens[1] = truth[position]
        return [tokens, parents]

    recorded = [first_right(position) for position in range(1, len(truth))]
    answers = [{"prompt": [1000, 1001], "answer": truth, "trees": {"4": recorded, "8": recorded}}]
    dear = CycleCosts({size: 200.0 + 90.0 * (size - 1) for size in range(1, 65)}, 25.0, 26.0, 3.0)
    cut = simulate(answers, None, dear, 0, 4, **QUIET)
    whole = simulate(answers, sim_planner.AUTO_WHOLE, dear, 0, 4, **QUIET)
    assert cut.tokens_per_s > 1.1 * whole.tokens_per_s, (cut, whole)
    # Cut, the 2-node trees keep paying (~2 tokens a cycle); whole, their wasted rows made them look poor
    # and plain steps took over for much of the text.
    assert cut.tau > 1.9 > whole.tau


def test_the_planner_climbs_from_its_first_shape_when_every_draft_token_is_right():
    """If the planner were not told each cycle (or told the wrong path) it would stay at its first shape
    (4/3/8 at these costs: the deepest within 1.3x the cheapest cycle). It climbs slowly: a deeper cell
    seen only by probes takes many of them to be rated (docs/performance.md, the thirteenth session)."""
    answers = answers_with(chain_tree, answer_len=1000)
    auto = simulate(answers, None, CycleCosts(), seed=0, lookup_tokens=0, **QUIET)
    assert max(depth for (_, depth, _) in auto.chosen) >= 7 and auto.tau > 5.0, auto.chosen
    first = simulate(answers, TreeShape.clamped(4, 3, 8), CycleCosts(), seed=0, lookup_tokens=0, **QUIET)
    assert auto.tokens_per_s > 1.2 * first.tokens_per_s


def test_every_policy_meets_the_same_host_for_a_seed():
    answers = answers_with(chain_tree)
    first = simulate(answers, None, CycleCosts(), seed=3, lookup_tokens=4)
    again = simulate(answers, None, CycleCosts(), seed=3, lookup_tokens=4)
    other = simulate(answers, None, CycleCosts(), seed=4, lookup_tokens=4)
    assert (first.ms, first.chosen) == (again.ms, again.chosen) and first.ms != other.ms


def test_run_prints_a_row_per_policy_and_refuses_shapes_it_has_no_trees_for(tmp_path):
    path = tmp_path / "trees.json"
    path.write_text(json.dumps({"answers": answers_with(chain_tree)}))
    done = CliRunner().invoke(sim_planner.main, ["run", "--trees", str(path), "--shapes",
                                                 "auto,auto-whole,plain,3/2/4,2/1/8", "--seeds", "2"])
    assert done.exit_code == 0, done.output
    assert "/ plain: mean" in done.output  # the reference, when plain is among the policies
    rows = [line for line in done.output.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split("|")[1].strip() for row in rows] == ["auto", "auto-whole", "plain", "3/2/4", "2/1/8"]
    for bad in ("3/2/5", "2/2/4", "x", "65/3/8"):
        refused = CliRunner().invoke(sim_planner.main, ["run", "--trees", str(path), "--shapes", bad])
        assert refused.exit_code == 2 and ("expected" in refused.output or "recorded trees" in refused.output), \
            refused.output


def test_dump_records_trees_the_trained_head_is_right_about(tmp_path):
    """Teacher forcing fed out of step (a feature beside the wrong token) leaves a trained head near one
    token a cycle; in step, the committed head drafts the real model's answers."""
    need_fixture()
    answers = sim_planner.record_answers(SMOLLM2_DIR, SMOLLM2_DRAFT, ["Give me three tips for learning to swim."], 32)
    (answer,) = answers
    assert len(answer["trees"]["8"]) == len(answer["answer"]) - 1
    for position, (tokens, parents) in enumerate(answer["trees"]["8"], 1):
        assert tokens[0] == answer["answer"][position - 1] and parents[0] == -1
        assert len(tokens) == 64 and all(parents[node] < node for node in range(1, 64))
    run = simulate(answers, TreeShape.clamped(8, 4, 4), CycleCosts(), 0, 0, **QUIET)
    assert run.tau > 1.5, run.tau


@pytest.mark.parametrize(("trees", "curve", "says"), [
    ("not json", None, "not JSON"),  # a JSONDecodeError traceback
    ("{}", None, "holds no answers"),  # KeyError: 'answers'
    ('{"answers": []}', None, "holds no answers"),  # ZeroDivisionError in tokens_per_s
    ("[1]", None, "expected a JSON object"),
    (None, "not json", "not JSON"),
    (None, '{"x": 1}', "expected a JSON object of T: ms"),
])
def test_run_names_a_file_it_cannot_use(tmp_path, trees, curve, says):
    path, curve_path = tmp_path / "trees.json", tmp_path / "curve.json"
    path.write_text(trees if trees is not None else json.dumps({"answers": answers_with(chain_tree)}))
    arguments = ["run", "--trees", str(path), "--shapes", "3/2/4", "--seeds", "1"]
    if curve is not None:
        curve_path.write_text(curve)
        arguments += ["--verify-curve", str(curve_path)]
    done = CliRunner().invoke(sim_planner.main, arguments)
    assert done.exit_code == 2, done.output
    assert says in done.output
