"""Which path of a verified draft tree the target accepts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

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


class Chooser(Protocol):
    """Where the randomness comes from: a seeded Sampler, or an enumerator in tests."""

    def bernoulli(self, probability: float) -> bool: ...

    def categorical(self, probs: torch.Tensor) -> int: ...


def accept_sampled(tokens: Sequence[int], parents: Sequence[int], probs_at: Callable[[int], torch.Tensor],
                   chooser: Chooser) -> tuple[list[int], int]:
    """Lossless acceptance for a tree whose children were chosen deterministically.

    ``probs_at(i)``: the target's processed distribution after node i (asked only for the
    nodes the walk reaches; a fresh tensor the routine may modify). At a node, try its
    children in order: accept child c with probability p(c); on rejection set p(c) = 0 and
    renormalise, then try the next. If all fail, the emitted token is drawn from what is
    left of p; at an accepted leaf, the bonus token is drawn from the target at the leaf.
    Each emitted token therefore has exactly the target's distribution (DESIGN.md 6).
    """
    children = children_lists(parents)
    node = 0
    path = [0]
    while True:
        residual = probs_at(node).double()
        mass = float(residual.sum())
        accepted = None
        for child in children[node]:
            token = int(tokens[child])
            p_child = float(residual[token]) / mass
            if mass - float(residual[token]) <= 1e-9 * mass:
                p_child = 1.0  # the child holds all that is left (rounding must not reject it)
            if p_child > 0.0 and chooser.bernoulli(p_child):
                accepted = child
                break
            if p_child > 0.0:
                mass -= float(residual[token])
                residual[token] = 0.0
        if accepted is None:
            return path, chooser.categorical(residual / residual.sum())
        path.append(accepted)
        node = accepted
