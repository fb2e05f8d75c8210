"""Greedy tau of an EAGLE-3 head in process: the target engine with its three-layer rows taken by
hooks, and the Drafter driving the head through an adapter that puts the draft vocabulary's
log-probabilities at their target ids (the others -inf, so the tree only proposes draft-vocabulary
tokens and its nodes carry target ids).

The cycle is the runtime's (``dovetail_runtime.generation.generate_dovetail``) without the
workers: prefill, then draft / verify / commit, the draft fed (row of the node, next token) pairs
exactly as the coordinator feeds a Dovetail head, only with three-layer rows for features.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from cpu_worker.engine import TargetEngine
from dovetail_runtime.draft_eval import TauResult
from gpu_worker.drafter import Drafter
from gpu_worker.eagle3 import Eagle3Head
from ipc.tree import TreeShape


class AuxRows:
    """Keeps the residual streams entering the given layers during the model's last forward."""

    def __init__(self, model: Any, layers: Sequence[int]):
        self.layers = tuple(layers)
        self.taken: dict[int, torch.Tensor] = {}
        self.handles = [model.layers[index].register_forward_pre_hook(self._hook(index)) for index in self.layers]

    def _hook(self, index: int) -> Any:
        def keep(_module: nn.Module, args: tuple[Any, ...]) -> None:
            self.taken[index] = args[0][0].detach().clone()  # x [1, S, d] -> [S, d]
        return keep

    def rows(self) -> torch.Tensor:
        """[S, 3d] of the last forward."""
        return torch.cat([self.taken[index] for index in self.layers], dim=-1)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class FullVocabHead(nn.Module):
    """An ``Eagle3Head`` seen by the Drafter as a head over the target vocabulary with
    ``feature_size``-wide input rows."""

    ids: torch.Tensor  # [Vd] target id of each draft id

    def __init__(self, head: Eagle3Head):
        super().__init__()
        self.inner = head
        self.spec = dataclasses.replace(head.spec, hidden_size=head.feature_size)
        self.embed_tokens = head.embed_tokens
        self.draft_vocab_size = head.draft_vocab_size
        self.register_buffer("ids", head.target_draft_ids(), persistent=False)

    def forward(self, *args: Any) -> torch.Tensor:
        return self.inner(*args)

    def forward_segments(self, *args: Any) -> torch.Tensor:
        return self.inner.forward_segments(*args)

    def log_probs(self, output: torch.Tensor) -> torch.Tensor:
        draft = self.inner.log_probs(output)
        full = draft.new_full((draft.shape[0], self.inner.vocab_size), float("-inf"))
        full[:, self.ids] = draft
        return full


def eagle3_drafter(head: Eagle3Head, max_len: int, scratch_len: int) -> Drafter:
    return Drafter(FullVocabHead(head), max_len=max_len, scratch_len=scratch_len)  # type: ignore[arg-type]


def speculative_greedy_eagle3(engine: TargetEngine, aux: AuxRows, drafter: Drafter, prompt: Sequence[int],
                              new_tokens: int, eos: int | None, tree_tokens: int, depth: int, top_k: int,
                              result: TauResult) -> list[int]:
    """Greedy speculative decoding; adds cycles and emitted tokens to ``result``; returns the
    kept tokens (cut at ``new_tokens`` and after ``eos``, as the runtime's budget does)."""
    shape = TreeShape.clamped(tree_tokens, depth, top_k)
    draft_vocab = int(getattr(drafter.head, "draft_vocab_size", drafter.head.spec.vocab_size))
    if top_k > draft_vocab:
        raise ValueError(f"top_k {top_k} exceeds the draft vocabulary of {draft_vocab}")
    out: list[int] = []

    def push(tokens: Sequence[int]) -> bool:
        for token in tokens[:new_tokens - len(out)]:
            out.append(int(token))
            if token == eos:
                return True
        return len(out) >= new_tokens

    step = engine.prefill(list(prompt))
    first = int(step.logits.argmax())
    drafter.reset()
    drafter.extend(aux.rows(), list(prompt[1:]) + [first])
    length = len(prompt) + 1
    if push([first]):
        return out
    while True:
        room = engine.max_len - (length - 1)
        if room < 1:
            break
        tree = drafter.propose(shape.fitted(room))
        outcome = engine.verify(tree.tokens.tolist(), tree.parents.tolist())
        rows = aux.rows()[torch.as_tensor(outcome.accepted_nodes)]
        accepted = outcome.tokens
        result.cycles += 1
        result.accepted_hist[len(accepted) - 1] += 1
        kept_before = len(out)
        done = push(accepted)
        result.cycle_tokens += len(out) - kept_before
        if done:
            break
        drafter.extend(rows, accepted)
        length += len(accepted)
    return out
