"""Which path of a verified draft tree the target accepts."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def children_lists(parents: Sequence[int]) -> list[list[int]]:
    """children[i]: the node indices whose parent is i, in index order."""
    children: list[list[int]] = [[] for _ in parents]
    for index in range(1, len(parents)):
        children[int(parents[index])].append(index)
    return children


def accept_greedy(tokens: Sequence[int], parents: Sequence[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """Walk from the root while some child's token equals the target's argmax at the current
    node. Returns (accepted node indices, root first; the bonus token = argmax at the last)."""
    choices = logits.argmax(dim=-1).tolist()
    children = children_lists(parents)
    node = 0
    path = [0]
    while True:
        wanted = choices[node]
        next_node = next((child for child in children[node] if int(tokens[child]) == wanted), None)
        if next_node is None:
            return path, wanted
        path.append(next_node)
        node = next_node
