"""EAGLE-2 dynamic draft tree (DESIGN.md section 3, step 2).

Expansion: the root's ``top_k`` best children form the first beam. Each further level is
ONE batched head forward over the beam; every beam node offers its ``top_k`` best children
(scored by cumulative log-probability), and the ``top_k`` best of those ``top_k**2``
children form the next beam. Levels stop at ``depth`` below the root.
Selection: of all candidates (every child produced, expanded or not) keep the ``T-1`` best
under the total order (score descending, then shallower, then earlier produced). A parent
always precedes its children in that order (its score is >= theirs and it is shallower),
so the kept set never holds a node without its parent. Output order: that order (rank), so
parents precede children as the compact format requires, and the first n nodes of a tree
are exactly the tree the same draft gives for T = n (and, among nodes no deeper than d, for
depth d): the tree planner reads the acceptance of every smaller tree off one verified tree.

Scratch layout seen by the ``expand`` callback: the beam at depth d occupies scratch
slots ``[(d-1)*top_k, d*top_k)`` (relative to the committed length); ``ancestors[j, s]``
says beam node j may attend scratch slot s (its non-root ancestors and itself). The mask
rows are carried incrementally: a new beam node copies its parent's row and marks itself.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from ipc.tree import TreeShape

# expand(tokens [k] (target ids), parent_features [k, d], depth, ancestors bool [k, depth*k])
#   -> (output_features [k, d], log_probs fp32 [k, vocab]) (vocab: the head's, maybe a reduced one)
ExpandCall = tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]
ExpandResult = tuple[torch.Tensor, torch.Tensor]
ExpandFn = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], ExpandResult]
# A tree's beam search as a generator: yields ExpandCalls, is sent their results, returns the tree.
TreeSearch = Generator[ExpandCall, ExpandResult, "DraftTree"]


@dataclass
class DraftTree:
    """A compact draft tree (node 0 = root, parents before children), on the CPU.

    ``tokens`` and ``parents`` are what crosses to the target. ``scores`` (the cumulative
    draft log-probability of the path to each node, root 0) is what the selection ranked
    by; it stays in the draft worker.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def root_only(root_token: int) -> DraftTree:
    return DraftTree(tokens=torch.tensor([root_token]), parents=torch.tensor([-1]), scores=torch.zeros(1))


def build_tree(root_token: int, root_feature: torch.Tensor, root_log_probs: torch.Tensor, expand: ExpandFn,
               shape: TreeShape, to_target: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DraftTree:
    """Expand and select a tree of at most ``shape.tree_tokens`` nodes (fewer only when fewer
    candidates exist). ``root_feature`` [d] / ``root_log_probs`` [vocab]: the head's output
    at the root (the last committed pair). ``to_target``: maps the ids the log-probabilities
    are over to target ids (a reduced draft vocabulary's ``d2t``), applied to every child as it
    is chosen, so ``expand`` and the returned tree see target ids only."""
    search = tree_search(root_token, root_feature, root_log_probs, shape, to_target)
    return build_trees([search], lambda calls: [expand(*call) for _, call in calls])[0]


def build_trees(searches: Sequence[TreeSearch],
                expand_many: Callable[[list[tuple[int, ExpandCall]]], list[ExpandResult]]) -> list[DraftTree]:
    """Several sequences' trees level by level in lockstep: each round, every search still
    expanding hands its beam (with its index in ``searches``) to ONE ``expand_many`` call (a
    batched head forward over all the beams, each over its own cache), which answers in order."""
    trees: list[DraftTree | None] = [None] * len(searches)
    pending: dict[int, ExpandCall] = {}
    for index, search in enumerate(searches):
        _step(index, search, None, pending, trees)
    while pending:
        indices = list(pending)
        results = expand_many([(index, pending.pop(index)) for index in indices])
        for index, result in zip(indices, results, strict=True):
            _step(index, searches[index], result, pending, trees)
    assert all(tree is not None for tree in trees)
    return [tree for tree in trees if tree is not None]


def _step(index: int, search: TreeSearch, result: ExpandResult | None, pending: dict[int, ExpandCall],
          trees: list[DraftTree | None]) -> None:
    try:
        pending[index] = next(search) if result is None else search.send(result)
    except StopIteration as done:
        trees[index] = done.value


def tree_search(root_token: int, root_feature: torch.Tensor, root_log_probs: torch.Tensor, shape: TreeShape,
                to_target: Callable[[torch.Tensor], torch.Tensor] | None = None) -> TreeSearch:
    """``build_tree`` as a generator: it yields each level's expand call (``ExpandFn``'s
    arguments), is sent that call's result, and returns the tree; a caller can so run several
    sequences' levels in one batched forward (``build_trees``)."""
    def chosen(ids: torch.Tensor) -> torch.Tensor:
        return ids if to_target is None else to_target(ids)

    if shape.tree_tokens == 1:
        return root_only(root_token)
    if shape.top_k > root_log_probs.shape[-1]:
        raise ValueError(f"top_k {shape.top_k} exceeds the vocabulary size {root_log_probs.shape[-1]}")
    candidates = yield from _expand_levels(root_feature, root_log_probs, shape, chosen)
    return _select(root_token, candidates, shape.tree_tokens)


@dataclass
class _Candidates:
    """Every expanded node, level by level, so ids grow with depth (tie-break shallower): its
    token, its path's score, and its parent's id (-1 for the root's children)."""

    tokens: list[torch.Tensor]
    scores: list[torch.Tensor]
    parents: list[torch.Tensor]


def _expand_levels(root_feature: torch.Tensor, root_log_probs: torch.Tensor, shape: TreeShape,
                   chosen: Callable[[torch.Tensor], torch.Tensor]) -> Generator[ExpandCall, ExpandResult, _Candidates]:
    """The beam search: the root's top-k children, then each level's k best nodes expanded."""
    device = root_log_probs.device
    k = shape.top_k
    levels = shape.depth  # TreeShape keeps depth <= T - 1: deeper nodes could never be kept

    beam_log_probs, beam_tokens = root_log_probs.topk(k)
    beam_tokens = chosen(beam_tokens)
    beam_scores = beam_log_probs
    beam_ids = torch.arange(k, device=device)
    candidates = _Candidates([beam_tokens], [beam_scores], [torch.full((k,), -1, device=device, dtype=torch.long)])
    beam_features = root_feature.unsqueeze(0).expand(k, -1)
    ancestors = torch.zeros(k, max(levels - 1, 0) * k, dtype=torch.bool, device=device)
    eye = torch.eye(k, dtype=torch.bool, device=device)
    next_id = k

    for level in range(1, levels):
        offset = (level - 1) * k
        ancestors[:, offset:offset + k] = eye
        features, log_probs = yield beam_tokens, beam_features, level, ancestors[:, :offset + k]
        child_log_probs, child_tokens = log_probs.topk(k, dim=-1)  # [k, k]
        child_tokens = chosen(child_tokens)
        scores = (beam_scores.unsqueeze(1) + child_log_probs).reshape(-1)
        child_tokens = child_tokens.reshape(-1)
        candidates.tokens.append(child_tokens)
        candidates.scores.append(scores)
        candidates.parents.append(beam_ids.repeat_interleave(k))
        if level + 1 < levels:
            # Stable sort, not topk: equal scores resolve to the earlier child, reproducibly.
            best = torch.sort(scores, descending=True, stable=True).indices[:k]
            parent_slot = best // k
            beam_ids = next_id + best
            beam_tokens = child_tokens[best]
            beam_scores = scores[best]
            beam_features = features[parent_slot]
            ancestors = ancestors[parent_slot]  # a copy: the parent's row, own column set next level
        next_id += k * k
    return candidates


def _select(root_token: int, candidates: _Candidates, tree_tokens: int) -> DraftTree:
    """The root and the ``tree_tokens - 1`` best-scoring candidates, numbered by score."""
    all_scores = torch.cat(candidates.scores)
    device = all_scores.device
    keep = min(tree_tokens - 1, int(all_scores.shape[0]))
    # Stable sort: equal scores keep production order, i.e. shallower first.
    kept = torch.sort(all_scores, descending=True, stable=True).indices[:keep]
    node_of = torch.full_like(all_scores, -1, dtype=torch.long)
    node_of[kept] = torch.arange(1, keep + 1, device=device)
    parent_ids = torch.cat(candidates.parents)[kept]
    parents = torch.where(parent_ids < 0, 0, node_of[parent_ids.clamp(min=0)])

    zero = torch.zeros(1, device=device, dtype=torch.long)
    ints = torch.stack([
        torch.cat([torch.full_like(zero, int(root_token)), torch.cat(candidates.tokens)[kept]]),
        torch.cat([zero - 1, parents]),
    ]).cpu()  # one transfer for the ints, one for the scores
    scores = torch.cat([zero.float(), all_scores[kept].float()]).cpu()
    return DraftTree(tokens=ints[0], parents=ints[1], scores=scores)
