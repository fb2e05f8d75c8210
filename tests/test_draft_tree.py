"""EAGLE-2 dynamic trees from the drafter: invariants, a brute-force reference built from
the head's own log-probs, chain mode, tie-breaking, argument checks, and the draft cache
(incremental extends vs one extend, no pollution by tree expansion)."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker import DraftContextError, Drafter, TreeArgumentError, build_tree
from ipc.tree import path_to, tree_ancestor_mask, tree_depths, validate_parents
from test_draft_support import HIDDEN, VOCAB, PathOracle, brute_force_tree, tiny_head, tree_paths

SCORE_TOL = 1e-5
SHARPEN = 8.0  # random heads are near-uniform: spread the logits so top-k order is stable


def accepted_sequence(count: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, HIDDEN, generator=generator), torch.randint(0, VOCAB, (count,), generator=generator)


def drafter_for(head, features, tokens, max_len: int = 64) -> Drafter:
    drafter = Drafter(head, max_len=max_len)
    drafter.extend(features, tokens)
    return drafter


def candidate_count(tree_tokens: int, depth: int, top_k: int) -> int:
    levels = min(depth, tree_tokens - 1)
    return top_k + (levels - 1) * top_k * top_k


def check_invariants(tree, root_token: int, depth: int) -> None:
    parents = tree.parents.tolist()
    validate_parents(parents)
    depths = tree_depths(parents)
    assert depths == tree.depths.tolist()
    assert max(depths) <= depth
    assert int(tree.tokens[0]) == root_token and float(tree.scores[0]) == 0.0 and float(tree.probs[0]) == 1.0
    mask = tree_ancestor_mask(parents)
    for node in range(len(parents)):
        assert mask[node].nonzero().flatten().tolist() == sorted(path_to(parents, node))
        assert int(mask[node].sum()) == depths[node] + 1
        if node:
            parent = parents[node]
            assert tree.scores[node] <= tree.scores[parent]
            # score = parent's score + log(prob of this token given the parent)
            assert math.isclose(float(tree.scores[node]), float(tree.scores[parent] + tree.probs[node].log()),
                                abs_tol=1e-4)
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
    tree = drafter_for(head, features, tokens).propose(tree_tokens, depth, top_k)
    assert len(tree) == min(tree_tokens, 1 + candidate_count(tree_tokens, depth, top_k))
    check_invariants(tree, int(tokens[-1]), depth)
    expected = brute_force_tree(PathOracle(head, features, tokens), tree_tokens, depth, top_k)
    got = tree_paths(tree)
    assert set(got) == set(expected)
    for path, score in expected.items():
        assert abs(got[path] - score) < SCORE_TOL, path


def test_too_few_candidates_returns_them_all():
    head = tiny_head("dgf", sharpen=SHARPEN)
    features, tokens = accepted_sequence(6)
    tree = drafter_for(head, features, tokens).propose(64, 2, 3)  # 3 + 9 candidates
    assert len(tree) == 13
    check_invariants(tree, int(tokens[-1]), 2)


@pytest.mark.parametrize("tree_tokens,depth", [(6, 8), (9, 5), (2, 1)])
def test_chain_mode(tree_tokens, depth):
    head = tiny_head("fc", sharpen=SHARPEN)
    features, tokens = accepted_sequence(6)
    tree = drafter_for(head, features, tokens).propose(tree_tokens, depth, 1)
    size = min(tree_tokens, depth + 1)
    assert tree.parents.tolist() == list(range(-1, size - 1))
    # The chain is the greedy draft: each token is the argmax after the previous ones.
    oracle = PathOracle(head, features, tokens)
    path = tuple(tree.tokens[1:].tolist())
    for index, token in enumerate(path):
        assert int(oracle(path[:index])[1].argmax()) == token


def test_root_only_and_argument_errors():
    head = tiny_head("dgf")
    features, tokens = accepted_sequence(4)
    drafter = drafter_for(head, features, tokens)
    tree = drafter.propose(1, 0, 0)
    assert tree.tokens.tolist() == [int(tokens[-1])] and tree.parents.tolist() == [-1]
    with pytest.raises(TreeArgumentError, match="T must be >= 1"):
        drafter.propose(0, 3, 2)
    with pytest.raises(TreeArgumentError, match="depth must be >= 1"):
        drafter.propose(4, 0, 2)
    with pytest.raises(TreeArgumentError, match="top_k must be >= 1"):
        drafter.propose(4, 2, 0)
    with pytest.raises(TreeArgumentError, match="exceeds the vocabulary"):
        drafter.propose(4, 2, VOCAB + 1)
    with pytest.raises(RuntimeError, match="before extend"):
        Drafter(head, max_len=8).propose(4, 2, 2)


def test_ties_break_towards_shallower_nodes():
    # Fake head: root children have probs 0.5 / 0.25 / 0.25; every deeper node has one child
    # of probability 1 (log 0), so a node and its best child tie on score.
    root = torch.tensor([0.5, 0.25, 0.25]).log()
    certain = torch.tensor([0.0, -30.0, -30.0])

    def expand(tokens, features, depth, ancestors):
        return features, certain.expand(tokens.shape[0], -1)

    feature = torch.zeros(4)
    tree = build_tree(7, feature, root, expand, tree_tokens=3, depth=3, top_k=1)
    assert tree.depths.tolist() == [0, 1, 2]  # of three tied nodes keep the two shallowest
    tree = build_tree(7, feature, root, expand, tree_tokens=3, depth=3, top_k=2)
    assert tree.tokens.tolist() == [7, 0, 0] and tree.parents.tolist() == [-1, 0, 1]
    tree = build_tree(7, feature, root, expand, tree_tokens=5, depth=3, top_k=2)
    # a (-0.69), a->0 (-0.69), a->0->0 (-0.69), then b (-1.39): ties resolved shallow first
    assert tree.depths.tolist() == [0, 1, 1, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 3]


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
        stepped.propose(16, 6, 4)
    assert stepped.length == 20
    fresh = drafter_for(head, features, tokens, max_len=32)
    for args in ((16, 6, 4), (10, 4, 8), (6, 5, 1)):
        a, b = stepped.propose(*args), fresh.propose(*args)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert (a.scores - b.scores).abs().max() < SCORE_TOL
    expected = brute_force_tree(PathOracle(head, features, tokens), 16, 6, 4)
    got = tree_paths(stepped.propose(16, 6, 4))
    assert set(got) == set(expected)


def test_propose_does_not_pollute_the_cache():
    head = tiny_head("dgf", layers=3, sharpen=SHARPEN)
    features, tokens = accepted_sequence(10)
    drafter = drafter_for(head, features, tokens)
    keys_before = drafter.cache.keys[:, :, :, :10].clone()
    first = drafter.propose(16, 6, 4)
    drafter.propose(40, 8, 6)  # a bigger tree in between
    second = drafter.propose(16, 6, 4)
    assert torch.equal(drafter.cache.keys[:, :, :, :10], keys_before)
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.parents, second.parents)
    assert torch.equal(first.scores, second.scores)
    drafter.reset()
    drafter.extend(features, tokens)
    third = drafter.propose(16, 6, 4)
    assert torch.equal(first.tokens, third.tokens) and torch.equal(first.scores, third.scores)


def test_child_log_probs():
    head = tiny_head("fc", sharpen=SHARPEN, seed=2)
    features, tokens = accepted_sequence(8)
    drafter = drafter_for(head, features, tokens)
    tree = drafter.propose(12, 4, 3, keep_child_log_probs=True)
    assert drafter.propose(12, 4, 3).child_log_probs is None
    child = tree.child_log_probs
    assert child.shape == (12, VOCAB)
    oracle = PathOracle(head, features, tokens)
    paths = {node: tuple(tree.tokens[n].item() for n in path_to(tree.parents.tolist(), node)[1:])
             for node in range(len(tree))}
    expanded = 0
    for node in range(len(tree)):
        if not torch.isnan(child[node]).any():
            expanded += 1
            assert (child[node] - oracle(paths[node])[1]).abs().max() < SCORE_TOL
        if node:
            parent = int(tree.parents[node])
            if not torch.isnan(child[parent]).any():
                assert math.isclose(float(child[parent, tree.tokens[node]].exp()), float(tree.probs[node]),
                                    rel_tol=1e-4)
    assert expanded >= 2  # the root and at least one beam node


def test_context_limits_and_bad_inputs():
    head = tiny_head("dgf")
    features, tokens = accepted_sequence(10)
    drafter = Drafter(head, max_len=8, scratch_len=6)
    with pytest.raises(DraftContextError, match="max_len 8"):
        drafter.extend(features, tokens)
    with pytest.raises(ValueError, match="features must be"):
        drafter.extend(features[:3], tokens[:4])
    drafter.extend(features[:8], tokens[:8])
    drafter.propose(8, 3, 3)  # needs (3-1)*3 = 6 scratch slots
    with pytest.raises(DraftContextError, match="scratch"):
        drafter.propose(8, 4, 3)
