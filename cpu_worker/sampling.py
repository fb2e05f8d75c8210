"""Sampling from the target: temperature, top-k, top-p, and a seeded source of randomness.

The same ``processed_probs`` serves plain decoding (``--mode ar``) and tree verification,
so both sample from exactly the same distribution. The randomness is keyed by position: the
token at sequence position i is drawn from a stream seeded by (seed, i), so what a position
gets does not depend on how many draws the tree walks made before it (DESIGN.md 6).
"""

from __future__ import annotations

import os

import torch

from ipc.messages import Sampling


def top_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's largest logit's index (the first where several tie, as ``torch.argmax``; a NaN is
    the largest, as there) for logits [..., V]: numpy's argmax where the rows are CPU fp32 (~4 us a
    49152-token row against torch's ~50 us, once a decode step and once a tree node)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        found = logits.detach().numpy().argmax(axis=-1)
    else:
        found = logits.argmax(dim=-1).numpy(force=True)
    return found.reshape(-1).tolist()


def top_token(logits: torch.Tensor) -> int:
    """``int(logits.argmax())``, the flat index of the largest logit, as ``top_tokens`` finds it."""
    return top_tokens(logits.reshape(-1))[0]


def processed_probs(logits: torch.Tensor, params: Sampling) -> torch.Tensor:
    """Probabilities [..., V] after temperature, then top-k, then top-p (the order
    transformers uses). Tokens filtered out have probability exactly 0."""
    # fp32 at least (bf16 logits would round the distribution); fp64 stays fp64.
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32)) / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p, and always the most likely token:
        # a top_p below fp32's smallest value (e.g. 1e-300) compares as 0 and would drop all.
        drop_sorted = before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


MASK_63 = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    """A well-mixed 63-bit seed for (seed, position) (splitmix64's finaliser): neighbouring
    positions and neighbouring seeds get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & MASK_63


class Sampler:
    """A sequence's sampling settings and its seed (given: reproducible; else random)."""

    def __init__(self, params: Sampling):
        # The protocol's schema range-checks params (ipc.messages.Sampling) before they get here.
        self.params = params
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator()

    def pick(self, logits: torch.Tensor, position: int) -> int:
        """The token at sequence ``position`` from one row of logits (argmax when greedy)."""
        if self.params.greedy:
            return top_token(logits)
        self.generator.manual_seed(position_seed(self.seed, position))
        return int(torch.multinomial(processed_probs(logits, self.params), 1, generator=self.generator))
