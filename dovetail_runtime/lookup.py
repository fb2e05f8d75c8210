"""Prompt lookup: a branch of tokens copied from earlier in the sequence, grafted onto each draft tree.

Why: text repeats itself (a chat answer restates its question, a list repeats its pattern, code
repeats names), and where it does the continuation after the last few tokens' earlier occurrence is
a free guess that the head often misses. On the real pair's held-out chat (24 prompts x 96 greedy
tokens, the head's own 3/2/4 trees with a branch of up to 4 tokens grafted, verified cycle by cycle;
docs/performance.md, 2026-12-06 thirteenth session) tau rose from 2.03 to 2.17 for 0.45 more verified
rows a cycle. (A first estimate, 2.29, added each cycle's gain along the decode without the branch,
where a copied stretch takes several cycles instead of one, so it counted copies several times.)
A branch grown while copies keep being accepted added under 1% more; not worth its rule.

Lossless by construction: the target accepts a path of any tree by its own picks
(``cpu_worker.acceptance``), so a grafted branch changes how many tokens a cycle emits, never which.
"""

from __future__ import annotations

from collections.abc import Sequence

from ipc.tree import children_by_token

DEFAULT_LOOKUP_TOKENS = 4  # dovetail-run's --lookup-tokens
MIN_NGRAM = 2  # a one-token match guesses right about a third of the time: mostly wasted rows
MAX_NGRAM = 4


class PromptLookup:
    """Where each n-gram (``min_ngram`` to ``max_ngram`` tokens) of a sequence last occurred, kept
    up to date as tokens are appended; ``continuation`` reads the tokens that followed the latest
    earlier occurrence of the sequence's longest matching suffix."""

    def __init__(self, tokens: Sequence[int], max_tokens: int, min_ngram: int = MIN_NGRAM,
                 max_ngram: int = MAX_NGRAM):
        if max_tokens < 0:
            raise ValueError(f"a lookup branch of {max_tokens} tokens")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram lengths {min_ngram}..{max_ngram}")
        self.max_tokens = max_tokens
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        # n-gram -> the index just after its latest occurrence that has a token following it.
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens; every n-gram that now has a following token is indexed (the sequence's
        own suffix is not: it would match itself)."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending just before this token now have a successor
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._next[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(token))

    def continuation(self, limit: int | None = None) -> list[int]:
        """``max_tokens`` (at most ``limit``) tokens copied from what followed the latest earlier
        occurrence of the longest suffix of ``min_ngram``..``max_ngram`` tokens seen before; [] when
        none was. A copy that reaches the sequence's end goes on from the copy itself, as an LZ77
        copy overlaps: a text looping with period p (the occurrence p tokens back) goes on looping."""
        count = self.max_tokens if limit is None else min(self.max_tokens, limit)
        if count <= 0:
            return []
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            start = self._next.get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                period = len(tokens) - start
                return [tokens[start + index % period] for index in range(count)]
        return []


def graft(tokens: Sequence[int], parents: Sequence[int], branch: Sequence[int]) -> tuple[list[int], list[int]]:
    """The tree (``tokens``, ``parents``: compact, root first) with ``branch`` hung from its root: the
    branch follows the tree's nodes while they carry its tokens and goes on as new nodes, appended
    after the tree's (so parents still come before children and siblings keep distinct tokens)."""
    tokens, parents = [int(token) for token in tokens], [int(parent) for parent in parents]
    children = children_by_token(tokens, parents)
    node = 0
    for token in branch:
        child = children.get(node, {}).get(int(token))
        if child is None:
            tokens.append(int(token))
            parents.append(node)
            child = len(tokens) - 1
            children.setdefault(node, {})[int(token)] = child
        node = child
    return tokens, parents


def shared_prefix(tokens: Sequence[int], parents: Sequence[int], branch: Sequence[int]) -> int:
    """How many of ``branch``'s first tokens lie on the tree's own nodes, from its root: ``graft``
    adds rows only for the ones after them."""
    children = children_by_token(tokens, parents)
    node, count = 0, 0
    for token in branch:
        child = children.get(node, {}).get(int(token))
        if child is None:
            break
        node, count = child, count + 1
    return count


def copied(branch: Sequence[int], accepted: Sequence[int]) -> int:
    """How many of ``branch``'s tokens the target accepted (``accepted``: a verification's tokens,
    its bonus token last): their common prefix. A bonus token equal to the branch's next one is
    never counted where that token was verified (it would have been accepted as a node)."""
    count = 0
    for mine, theirs in zip(branch, accepted):
        if int(mine) != int(theirs):
            break
        count += 1
    return count


def accepted_rows(tree_depth: int, lookup_tokens: int) -> int:
    """Feature rows a verification returns at most (a ring slot's rows): the root's and one per
    accepted node, on a path as deep as the deepest tree or a grafted branch."""
    return max(tree_depth, lookup_tokens) + 1
