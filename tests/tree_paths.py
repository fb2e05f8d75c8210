"""Test helper: the path of a node in a compact tree (``ipc.tree``'s format)."""

from __future__ import annotations

from collections.abc import Sequence


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root down to ``node`` inclusive."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]
