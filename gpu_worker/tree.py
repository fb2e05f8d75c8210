"""EAGLE-2 dynamic draft tree (DESIGN.md section 3, step 2).

Expansion: the root's ``top_k`` best children form the first beam. Each further level is
ONE batched head forward over the beam; every beam node offers its ``top_k`` best children
(scored by cumulative log-probability), and the ``top_k`` best of those ``top_k**2``
children form the next beam. Levels stop at ``depth`` below the root.
Selection: of all candidates (every child produced, expanded or not) keep the ``T-1`` best
under the total order (score descending, then shallower, then earlier produced). A parent
always precedes its children in that order (its score is >= theirs and it is shallower),
so the kept set never holds a node without its parent. Output order: by depth, then by
that order, so parents precede children as the compact format requires.

Scratch layout seen by the ``expand`` callback: the beam at depth d occupies scratch
slots ``[(d-1)*top_k, d*top_k)`` (relative to the committed length); ``ancestors[j, s]``
says beam node j may attend scratch slot s (its non-root ancestors and itself). The mask
rows are carried incrementally: a new beam node copies its parent's row and marks itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# expand(tokens [k], parent_features [k, d], depth, ancestors bool [k, depth*k])
#   -> (output_features [k, d], log_probs fp32 [k, vocab])
ExpandFn = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class TreeArgumentError(ValueError):
    """Tree-shape arguments that cannot describe a draft tree."""


@dataclass
class DraftTree:
    """A compact draft tree (node 0 = root, parents before children), on the CPU.

    ``scores``: cumulative draft log-probability of the path to each node (root 0).
    ``probs``: draft probability of each node's token given its parent (root 1).
    ``child_log_probs`` (only when asked for): fp32 [T, vocab] on the draft device, the
    draft's full next-token log-distribution at each node that was expanded (the root and
    the beam nodes); NaN rows for nodes never expanded (leaves of the last level and
    non-beam candidates). A distribution at such a node would cost one more head forward
    over those nodes, at the same positions and mask an expansion would use.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    probs: torch.Tensor
    depths: torch.Tensor
    child_log_probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def check_tree_args(tree_tokens: int, depth: int, top_k: int, vocab_size: int | None = None) -> None:
    """Raise TreeArgumentError with the rule broken."""
    if tree_tokens < 1:
        raise TreeArgumentError(f"tree size T must be >= 1 (the root), got {tree_tokens}")
    if tree_tokens == 1:
        return
    if depth < 1:
        raise TreeArgumentError(f"depth must be >= 1 when T > 1, got depth {depth} with T {tree_tokens}")
    if top_k < 1:
        raise TreeArgumentError(f"top_k must be >= 1, got {top_k}")
    if vocab_size is not None and top_k > vocab_size:
        raise TreeArgumentError(f"top_k {top_k} exceeds the vocabulary size {vocab_size}")


def effective_depth(tree_tokens: int, depth: int) -> int:
    """Levels worth expanding: a depth-d node needs its d-1 non-root ancestors kept too,
    so nodes deeper than T-1 can never be kept (dropping them leaves the result unchanged)."""
    return min(depth, tree_tokens - 1)


def scratch_slots(tree_tokens: int, depth: int, top_k: int) -> int:
    """Cache slots past the committed length that ``build_tree`` will write."""
    if tree_tokens <= 1:
        return 0
    return (effective_depth(tree_tokens, depth) - 1) * top_k


def root_only(root_token: int, log_probs: torch.Tensor | None = None, keep: bool = False) -> DraftTree:
    child = log_probs.float().unsqueeze(0).clone() if keep and log_probs is not None else None
    return DraftTree(tokens=torch.tensor([root_token]), parents=torch.tensor([-1]),
                     scores=torch.zeros(1), probs=torch.ones(1), depths=torch.zeros(1, dtype=torch.long),
                     child_log_probs=child)


def build_tree(root_token: int, root_feature: torch.Tensor, root_log_probs: torch.Tensor, expand: ExpandFn,
               tree_tokens: int, depth: int, top_k: int, keep_child_log_probs: bool = False) -> DraftTree:
    """Expand and select a tree of at most ``tree_tokens`` nodes (fewer only when fewer
    candidates exist). ``root_feature`` [d] / ``root_log_probs`` [vocab]: the head's output
    at the root (the last committed pair)."""
    check_tree_args(tree_tokens, depth, top_k, int(root_log_probs.shape[-1]))
    if tree_tokens == 1:
        return root_only(root_token, root_log_probs, keep_child_log_probs)
    device = root_log_probs.device
    k = top_k
    levels = effective_depth(tree_tokens, depth)

    # Candidate arrays, appended level by level so ids grow with depth (tie-break shallower).
    beam_log_probs, beam_tokens = root_log_probs.topk(k)
    beam_scores = beam_log_probs
    beam_ids = torch.arange(k, device=device)
    cand_tokens = [beam_tokens]
    cand_scores = [beam_scores]
    cand_log_probs = [beam_log_probs]
    cand_parents = [torch.full((k,), -1, device=device, dtype=torch.long)]
    cand_depths = [torch.ones(k, device=device, dtype=torch.long)]
    beam_features = root_feature.unsqueeze(0).expand(k, -1)
    ancestors = torch.zeros(k, max(levels - 1, 0) * k, dtype=torch.bool, device=device)
    eye = torch.eye(k, dtype=torch.bool, device=device)
    expanded_ids: list[torch.Tensor] = []
    expanded_rows: list[torch.Tensor] = []
    next_id = k

    for level in range(1, levels):
        offset = (level - 1) * k
        ancestors[:, offset:offset + k] = eye
        features, log_probs = expand(beam_tokens, beam_features, level, ancestors[:, :offset + k])
        if keep_child_log_probs:
            expanded_ids.append(beam_ids)
            expanded_rows.append(log_probs)
        child_log_probs, child_tokens = log_probs.topk(k, dim=-1)  # [k, k]
        scores = (beam_scores.unsqueeze(1) + child_log_probs).reshape(-1)
        child_tokens = child_tokens.reshape(-1)
        cand_tokens.append(child_tokens)
        cand_scores.append(scores)
        cand_log_probs.append(child_log_probs.reshape(-1))
        cand_parents.append(beam_ids.repeat_interleave(k))
        cand_depths.append(torch.full((k * k,), level + 1, device=device, dtype=torch.long))
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

    all_scores = torch.cat(cand_scores)
    all_depths = torch.cat(cand_depths)
    keep = min(tree_tokens - 1, int(all_scores.shape[0]))
    # Stable sort: equal scores keep production order, i.e. shallower first.
    ranked = torch.sort(all_scores, descending=True, stable=True).indices[:keep]
    kept = ranked[torch.sort(all_depths[ranked], stable=True).indices]
    node_of = torch.full_like(all_depths, -1)
    node_of[kept] = torch.arange(1, keep + 1, device=device)
    parent_ids = torch.cat(cand_parents)[kept]
    parents = torch.where(parent_ids < 0, 0, node_of[parent_ids.clamp(min=0)])

    zero = torch.zeros(1, device=device, dtype=torch.long)
    ints = torch.stack([
        torch.cat([torch.full_like(zero, int(root_token)), torch.cat(cand_tokens)[kept]]),
        torch.cat([zero - 1, parents]),
        torch.cat([zero, all_depths[kept]]),
    ]).cpu()  # one transfer for the ints, one for the floats
    floats = torch.stack([
        torch.cat([zero.float(), all_scores[kept]]),
        torch.cat([zero.float() + 1, torch.cat(cand_log_probs)[kept].exp()]),
    ]).cpu()

    child = None
    if keep_child_log_probs:
        child = torch.full((keep + 1, root_log_probs.shape[-1]), float("nan"), device=device)
        child[0] = root_log_probs
        if expanded_ids:
            nodes = node_of[torch.cat(expanded_ids)]
            rows = torch.cat(expanded_rows)
            present = nodes >= 0
            child[nodes[present]] = rows[present]
    return DraftTree(tokens=ints[0], parents=ints[1], scores=floats[0], probs=floats[1], depths=ints[2],
                     child_log_probs=child)
