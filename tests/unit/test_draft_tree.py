"""EAGLE-2 dynamic trees from the drafter: invariants, a brute-force reference built from
the head's own log-probs, chain mode, tie-breaking, tree-shape and drafter limits, and the
draft cache (incremental extends vs one extend, no pollution by tree expansion)."""

from __future__ import annotations

import math

import pytest
import torch
from test_draft_support import HIDDEN, VOCAB, PathOracle, brute_force_tree, tiny_head, tree_paths

from cpu_worker.engine import tree_ancestor_mask
from gpu_worker.drafter import DraftContextError, Drafter
from gpu_worker.tree import build_tree
from ipc.tree import ROOT_ONLY, TreeError, TreeShape, tree_depths, validate_parents

from tree_paths import path_to

SCORE_TOL = 1e-5
SHARPEN = 8.0  # random heads are near-uniform: spread the logits so top-k order is stable


def accepted_sequence(count: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, HIDDEN, generator=generator), torch.randint(0, VOCAB, (count,), generator=generator)


def drafter_for(head, features, tokens, max_len: int = 64, scratch_len: int = 64) -> Drafter:
    drafter = Drafter(head, max_len=max_len, scratch_len=scratch_len)
    drafter.extend(features, tokens)
    return drafter


def candidate_count(tree_tokens: int, depth: int, top_k: int) -> int:
    levels = min(depth, tree_tokens - 1)
    return top_k + (levels - 1) * top_k * top_k


def check_invariants(tree, root_token: int, depth: int, oracle: PathOracle | None = None) -> None:
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    validate_parents(parents)
    assert len(tokens) == len(parents) == int(tree.scores.shape[0])
    depths = tree_depths(parents)
    assert max(depths) <= depth
    assert tokens[0] == root_token and float(tree.scores[0]) == 0.0
    mask = tree_ancestor_mask(parents)
    for node in range(len(parents)):
        assert mask[node].nonzero().flatten().tolist() == sorted(path_to(parents, node))
        assert int(mask[node].sum()) == depths[node] + 1
        if node:
            parent = parents[node]
            assert tree.scores[node] <= tree.scores[parent]
            # score = parent's score + log(draft prob of this token given the parent's path)
            prob = math.exp(float(tree.scores[node] - tree.scores[parent]))
            assert 0.0 < prob <= 1.0
            if oracle is not None:
                path = tuple(tokens[n] for n in path_to(parents, parent)[1:])
                expected = math.exp(float(oracle(path)[1][tokens[node]]))
                assert math.isclose(prob, expected, rel_tol=1e-4, abs_tol=1e-6), (node, prob, expected)
    assert len(set(tree_paths(tree))) == len(parents) - 1  # no duplicate paths


@pytest.mark.parametrize("fusion,tree_tokens,depth,top_k", [
    ("dgf", 16, 6, 4),
    ("fc", 8, 4, 3),
    ("dgf", 30, 3, 5),
    ("fc", 5, 8, 4),    # depth capped by T-1
    ("dgf", 64, 8, 8),
    ("fc", 7, 4, 8),    # the laptop setting: beam wider than T-1
])
def test_tree_matches_brute_force(fusion, tree_tokens, depth, top_k):
    head = tiny_head(fusion, layers=2, sharpen=SHARPEN, seed=11)
    features, tokens = accepted_sequence(9)
    tree = drafter_for(head, features, tokens).propose(TreeShape.clamped(tree_tokens, depth, top_k))
    assert len(tree) == min(tree_tokens, 1 + candidate_count(tree_tokens, depth, top_k))
    oracle = PathOracle(head, features, tokens)
    check_invariants(tree, int(tokens[-1]), depth, oracle)
    expected = brute_force_tree(oracle, tree_tokens, depth, top_k)
    got = tree_paths(tree)
    assert set(got) == set(expected)
    for path, score in expected.items():
        assert abs(got[path] - score) < SCORE_TOL, path
    # Nodes come in selection (rank) order, so the first n nodes are the tree for T = n.
    assert list(got) == list(expected)


def test_a_smaller_tree_is_a_prefix_of_a_larger_one():
    head = tiny_head("dgf", layers=2, sharpen=SHARPEN, seed=11)
    features, tokens = accepted_sequence(9)
    drafter = drafter_for(head, features, tokens)
    big = drafter.propose(TreeShape.clamped(24, 5, 4))
    big_depths = tree_depths(big.parents.tolist())
    for tree_tokens in (2, 5, 9, 16):
        small = drafter.propose(TreeShape.clamped(tree_tokens, 5, 4))
        assert small.tokens.tolist() == big.tokens[:tree_tokens].tolist()
        assert small.parents.tolist() == big.parents[:tree_tokens].tolist()
    # A shallower tree: the first n nodes of the big tree that are no deeper than its depth.
    shallow = drafter.propose(TreeShape.clamped(8, 2, 4))
    keep = [0] + [node for node in range(1, len(big)) if big_depths[node] <= 2][:7]
    assert shallow.tokens.tolist() == big.tokens[keep].tolist()


def test_too_few_candidates_returns_them_all():
    head = tiny_head("dgf", sharpen=SHARPEN)
    features, tokens = accepted_sequence(6)
    tree = drafter_for(head, features, tokens).propose(TreeShape(tree_tokens=64, depth=2, top_k=3))  # 3 + 9 candidates
    assert len(tree) == 13
    check_invariants(tree, int(tokens[-1]), 2, PathOracle(head, features, tokens))


@pytest.mark.parametrize("tree_tokens,depth", [(6, 8), (9, 5), (2, 1)])
def test_chain_mode(tree_tokens, depth):
    head = tiny_head("fc", sharpen=SHARPEN)
    features, tokens = accepted_sequence(6)
    tree = drafter_for(head, features, tokens).propose(TreeShape.clamped(tree_tokens, depth, 1))
    size = min(tree_tokens, depth + 1)
    assert tree.parents.tolist() == list(range(-1, size - 1))
    # The chain is the greedy draft: each token is the argmax after the previous ones.
    oracle = PathOracle(head, features, tokens)
    path = tuple(tree.tokens[1:].tolist())
    for index, token in enumerate(path):
        assert int(oracle(path[:index])[1].argmax()) == token


def test_root_only_and_propose_before_extend():
    head = tiny_head("dgf")
    features, tokens = accepted_sequence(4)
    drafter = drafter_for(head, features, tokens)
    for shape in (ROOT_ONLY, TreeShape(tree_tokens=1, depth=0, top_k=5)):
        tree = drafter.propose(shape)
        assert tree.tokens.tolist() == [int(tokens[-1])] and tree.parents.tolist() == [-1]
        assert tree.scores.tolist() == [0.0]
    with pytest.raises(RuntimeError, match="before extend"):
        Drafter(head, max_len=8).propose(TreeShape.clamped(4, 2, 2))


def test_tree_shape_rules():
    with pytest.raises(TreeError, match="T must be in"):
        TreeShape(tree_tokens=0, depth=3, top_k=2)
    with pytest.raises(TreeError, match="T must be in"):
        TreeShape.clamped(0, 3, 2)
    with pytest.raises(TreeError, match="depth must be in 1..64"):
        TreeShape.clamped(4, 0, 2)
    with pytest.raises(TreeError, match="top_k must be in"):
        TreeShape(tree_tokens=4, depth=2, top_k=0)
    with pytest.raises(TreeError, match="top_k must be in"):
        TreeShape.clamped(4, 2, 0)
    # A depth that T cannot hold is refused; clamped() caps it at T - 1.
    with pytest.raises(TreeError, match="does not fit"):
        TreeShape(tree_tokens=5, depth=8, top_k=4)
    with pytest.raises(TreeError, match="does not fit"):
        TreeShape(tree_tokens=4, depth=0, top_k=2)  # depth 0 only for a root-only tree
    assert TreeShape.clamped(5, 8, 4) == TreeShape(tree_tokens=5, depth=4, top_k=4)
    assert TreeShape.clamped(16, 6, 4) == TreeShape(tree_tokens=16, depth=6, top_k=4)
    assert TreeShape.clamped(1, 3, 2) == TreeShape(tree_tokens=1, depth=0, top_k=2)
    # Scratch: one beam of top_k per expanded level, levels 1 .. depth-1.
    assert TreeShape.clamped(8, 3, 3).scratch_slots == 6
    assert TreeShape.clamped(40, 8, 6).scratch_slots == 42
    assert ROOT_ONLY.scratch_slots == 0
    assert TreeShape().scratch_slots == 40


def test_top_k_beyond_the_vocabulary_is_refused():
    small = 16
    head = tiny_head("dgf", vocab=small)
    generator = torch.Generator().manual_seed(3)
    features, tokens = torch.randn(4, HIDDEN, generator=generator), torch.randint(0, small, (4,), generator=generator)
    drafter = drafter_for(head, features, tokens, scratch_len=64)
    assert len(drafter.propose(TreeShape.clamped(4, 2, small))) == 4  # top_k == vocab is fine
    with pytest.raises(DraftContextError, match="exceeds the vocabulary"):
        drafter.propose(TreeShape.clamped(4, 2, small + 1))
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        build_tree(1, torch.zeros(4), torch.zeros(3).log_softmax(-1), lambda *args: None,
                   TreeShape.clamped(4, 2, 4))


def test_ties_break_towards_shallower_nodes():
    # Fake head: root children have probs 0.5 / 0.25 / 0.25; every deeper node has one child
    # of probability 1 (log 0), so a node and its best child tie on score.
    root = torch.tensor([0.5, 0.25, 0.25]).log()
    certain = torch.tensor([0.0, -30.0, -30.0])

    def expand(tokens, features, depth, ancestors):
        return features, certain.expand(tokens.shape[0], -1)

    feature = torch.zeros(4)
    tree = build_tree(7, feature, root, expand, TreeShape.clamped(3, 3, 1))
    assert tree_depths(tree.parents.tolist()) == [0, 1, 2]  # of three tied nodes keep the two shallowest
    tree = build_tree(7, feature, root, expand, TreeShape.clamped(3, 3, 2))
    assert tree.tokens.tolist() == [7, 0, 0] and tree.parents.tolist() == [-1, 0, 1]
    tree = build_tree(7, feature, root, expand, TreeShape.clamped(5, 3, 2))
    # a (-0.69), a->0 (-0.69), a->0->0 (-0.69), then b (-1.39): ties resolved shallow first,
    # nodes in that (rank) order
    assert tree_depths(tree.parents.tolist()) == [0, 1, 2, 3, 1]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 0]


@pytest.mark.parametrize("fusion", ["dgf", "fc"])
def test_incremental_extends_match_one_extend(fusion):
    """k cycles of extend (with trees proposed in between, scribbling on scratch slots)
    give the same tree as a fresh drafter extended once with the whole sequence."""
    head = tiny_head(fusion, layers=2, sharpen=SHARPEN, seed=4)
    features, tokens = accepted_sequence(20, seed=8)
    stepped = Drafter(head, max_len=32)
    start = 0
    for size in (7, 3, 1, 4, 2, 3):
        stepped.extend(features[start:start + size], tokens[start:start + size])
        start += size
        stepped.propose(TreeShape.clamped(16, 6, 4))
    assert stepped.length == 20
    fresh = drafter_for(head, features, tokens, max_len=32)
    for args in ((16, 6, 4), (10, 4, 8), (6, 5, 1)):
        a, b = stepped.propose(TreeShape.clamped(*args)), fresh.propose(TreeShape.clamped(*args))
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert (a.scores - b.scores).abs().max() < SCORE_TOL
    expected = brute_force_tree(PathOracle(head, features, tokens), 16, 6, 4)
    got = tree_paths(stepped.propose(TreeShape.clamped(16, 6, 4)))
    assert set(got) == set(expected)


def test_propose_does_not_pollute_the_cache():
    head = tiny_head("dgf", layers=3, sharpen=SHARPEN)
    features, tokens = accepted_sequence(10)
    drafter = drafter_for(head, features, tokens)
    keys_before = drafter.cache.keys[:, :, :, :10].clone()
    shape = TreeShape.clamped(16, 6, 4)
    first = drafter.propose(shape)
    drafter.propose(TreeShape.clamped(40, 8, 6))  # a bigger tree in between (42 scratch slots)
    second = drafter.propose(shape)
    assert torch.equal(drafter.cache.keys[:, :, :, :10], keys_before)
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.parents, second.parents)
    assert torch.equal(first.scores, second.scores)
    drafter.reset()
    drafter.extend(features, tokens)
    third = drafter.propose(shape)
    assert torch.equal(first.tokens, third.tokens) and torch.equal(first.scores, third.scores)


def test_context_limits_and_bad_inputs():
    head = tiny_head("dgf")
    features, tokens = accepted_sequence(10)
    drafter = Drafter(head, max_len=8, scratch_len=6)
    with pytest.raises(DraftContextError, match="max_len 8"):
        drafter.extend(features, tokens)
    with pytest.raises(ValueError, match="features must be"):
        drafter.extend(features[:3], tokens[:4])
    drafter.extend(features[:8], tokens[:8])
    drafter.propose(TreeShape.clamped(8, 3, 3))  # needs (3-1)*3 = 6 scratch slots
    with pytest.raises(DraftContextError, match="needs 9 scratch slots"):
        drafter.propose(TreeShape.clamped(8, 4, 3))
    # The default scratch fits the default shape, and nothing bigger than its scratch.
    default = Drafter(head, max_len=16)
    assert default.scratch_len == TreeShape().scratch_slots
    default.extend(features[:8], tokens[:8])
    assert len(default.propose(TreeShape())) == TreeShape().tree_tokens
    with pytest.raises(DraftContextError, match="scratch"):
        default.propose(TreeShape.clamped(64, 8, 8))
