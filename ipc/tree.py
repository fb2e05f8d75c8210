"""The draft tree both workers share: its shape rules and its compact form.

``TreeShape`` holds every tree-size rule in one place: T (``tree_tokens``, root included),
``depth`` (the most draft tokens on one path) and ``top_k`` (the beam width). A shape is
always consistent (``depth <= T - 1``); ``TreeShape.clamped`` makes one from any user
request, ``fitted`` shrinks it to the room left in the context, ``scratch_slots`` is what the
draft's KV cache needs beyond the committed sequence, ``feature_rows`` what a verification
returns.

A tree of T nodes travels as two int lists: ``tokens[T]`` and ``parents[T]``. Node 0 is the
root (the last emitted token, whose KV is not cached yet) with parent -1; every other node's
parent has a smaller index. Depths, the attention mask and positions are derived from
``parents`` on each side, so only 2*T ints cross processes.

No torch here: the coordinator, which never imports torch, uses these rules too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from msgspec import Meta, Struct

MAX_TREE_TOKENS = 1024
MAX_DEPTH = 64
MAX_TOP_K = 64


class TreeError(ValueError):
    """A compact tree or a tree shape that breaks the rules."""


class TreeShape(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """T nodes (root included), at most ``depth`` draft tokens on a path, beam ``top_k``."""

    tree_tokens: Annotated[int, Meta(ge=1, le=MAX_TREE_TOKENS)] = 16
    depth: Annotated[int, Meta(ge=0, le=MAX_DEPTH)] = 6
    top_k: Annotated[int, Meta(ge=1, le=MAX_TOP_K)] = 8

    def __post_init__(self) -> None:
        # Range checks on construction too (msgspec checks Meta only when decoding).
        if not 1 <= self.tree_tokens <= MAX_TREE_TOKENS:
            raise TreeError(f"tree size T must be in 1..{MAX_TREE_TOKENS} (root included), got {self.tree_tokens}")
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise TreeError(f"top_k must be in 1..{MAX_TOP_K}, got {self.top_k}")
        # A depth-d node needs its d-1 non-root ancestors kept too, so depth <= T - 1.
        expected = min(max(self.depth, 1), self.tree_tokens - 1)
        if self.depth != expected or self.depth > MAX_DEPTH:
            raise TreeError(f"depth {self.depth} does not fit T={self.tree_tokens}: need 1 <= depth <= "
                            f"min(T - 1, {MAX_DEPTH}) (depth 0 only with T = 1); TreeShape.clamped() fixes it")

    @classmethod
    def clamped(cls, tree_tokens: int, depth: int, top_k: int) -> TreeShape:
        """The shape a user asked for, with depth clamped to what T allows (deeper nodes could
        never be kept, so the tree is the same)."""
        if not 1 <= depth <= MAX_DEPTH:
            raise TreeError(f"depth must be in 1..{MAX_DEPTH}, got {depth}")
        return cls(tree_tokens=tree_tokens, depth=min(depth, tree_tokens - 1), top_k=top_k)

    def fitted(self, room: int) -> TreeShape:
        """The largest shape no bigger than this one whose tree fits in ``room`` cache slots
        (room >= 1: the root always needs one)."""
        if room < 1:
            raise TreeError(f"no room left in the context for a tree (room {room})")
        if room >= self.tree_tokens:
            return self
        return TreeShape.clamped(room, max(self.depth, 1), self.top_k) if room > 1 else ROOT_ONLY

    @property
    def scratch_slots(self) -> int:
        """Draft cache slots past the committed sequence that one tree expansion writes: one
        beam of top_k per expanded level, levels 1 .. depth-1."""
        return max(self.depth - 1, 0) * self.top_k

    @property
    def feature_rows(self) -> int:
        """Feature rows a verification returns at most: the root and up to depth accepted nodes."""
        return self.depth + 1


ROOT_ONLY = TreeShape(tree_tokens=1, depth=0, top_k=1)


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


def children_by_token(tokens: Sequence[int], parents: Sequence[int]) -> dict[int, dict[int, int]]:
    """{node: {token: child}} of a compact tree (siblings carry distinct tokens)."""
    children: dict[int, dict[int, int]] = {}
    for node in range(1, len(parents)):
        children.setdefault(int(parents[node]), {})[int(tokens[node])] = node
    return children


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (root 0)."""
    depths = [0] * len(parents)
    for index in range(1, len(parents)):
        depths[index] = depths[int(parents[index])] + 1
    return depths
