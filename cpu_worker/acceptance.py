"""Which path of a verified draft tree the target accepts.

One rule serves greedy decoding and sampling: walk from the root; at each node the target
picks its next token (argmax, or a sample from its processed distribution); if a child of
the node carries that token, move to it, otherwise that token is the bonus and the walk
ends. Every emitted token is therefore exactly the token the target itself picks at that
position, so the output has the target's distribution by construction (DESIGN.md 6).

For a tree whose children are chosen deterministically (top-k by draft score), this accepts
child c of a node with probability p(c), the same as recursive rejection sampling with a
one-hot draft distribution (accept c with p(c); on rejection zero it, renormalise, try the
next child): both accept some child with probability sum p(c). Sampling first has one more
property: with a per-position random stream (``Sampler.pick``) the emitted tokens do not
depend on the tree at all, so a seeded request gives the same tokens whatever tree shape
was drafted, and the same as ``--mode ar`` with that seed wherever the two compute equal
probabilities.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def children_lists(parents: Sequence[int]) -> list[list[int]]:
    """children[i]: the node indices whose parent is i, in index order."""
    children: list[list[int]] = [[] for _ in parents]
    for index in range(1, len(parents)):
        children[int(parents[index])].append(index)
    return children


def accept_path(tokens: Sequence[int], parents: Sequence[int],
                target_pick: Callable[[int], int]) -> tuple[list[int], int]:
    """Walk from the root while some child's token equals the target's pick at the current
    node (``target_pick(node)``: asked only for the nodes the walk reaches). Returns the
    accepted node indices (root first) and the bonus token (the pick at the last node)."""
    children = children_lists(parents)
    node = 0
    path = [0]
    while True:
        wanted = target_pick(node)
        next_node = next((child for child in children[node] if int(tokens[child]) == wanted), None)
        if next_node is None:
            return path, wanted
        path.append(next_node)
        node = next_node
