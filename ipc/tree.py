"""The compact draft tree both workers share.

A tree of T nodes is two int sequences: ``tokens[T]`` and ``parents[T]``. Node 0 is the
root (the last emitted token, whose KV is not cached yet) with parent -1; every other
node's parent has a smaller index. Everything else (depths, the attention mask, the
positions) is derived from ``parents`` on each side, so only 2*T ints cross processes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TreeError(ValueError):
    """A compact tree that breaks the format's rules."""


def validate_parents(parents: Sequence[int]) -> None:
    """Raise TreeError unless ``parents`` is a valid compact tree."""
    if len(parents) == 0:
        raise TreeError("a tree needs at least its root node")
    if int(parents[0]) != -1:
        raise TreeError(f"node 0 must be the root with parent -1, got parent {int(parents[0])}")
    for index in range(1, len(parents)):
        parent = int(parents[index])
        if not 0 <= parent < index:
            raise TreeError(f"node {index} has parent {parent}; parents must come before children")


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (root 0)."""
    depths = [0] * len(parents)
    for index in range(1, len(parents)):
        depths[index] = depths[int(parents[index])] + 1
    return depths


def tree_ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """Bool [T, T]: mask[i, j] is True when j is i itself or one of its ancestors."""
    size = len(parents)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for index in range(size):
        mask[index, index] = True
        parent = int(parents[index])
        if parent >= 0:
            mask[index] |= mask[parent]
    return mask


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root down to ``node`` inclusive."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]
