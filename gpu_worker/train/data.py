"""Batches of training pairs from a ``FeatureSet``.

A window of n tokens x_0..x_{n-1} with features f_0..f_{n-1} gives n-1 pairs: input
(f_i, x_{i+1}) at draft position i, target f_{i+1}. Pair i is weighted by the loss mask of
x_{i+1}, the token whose feature it predicts (for conversations: assistant tokens only).
Rows are padded at the end to the longest window of the batch (weight 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .shards import FeatureSet


@dataclass
class Batch:
    features: torch.Tensor  # [B, S, d] fp32: inputs f_0..f_{S-1}
    tokens: torch.Tensor  # [B, S] long: x_1..x_S
    targets: torch.Tensor  # [B, S, d] fp32: f_1..f_S
    weight: torch.Tensor  # [B, S] fp32: 1 where the pair counts

    @property
    def rows(self) -> int:
        return int((self.weight > 0).sum())


def make_batch(data: FeatureSet, windows: list[int]) -> Batch:
    lengths = [int(data.offsets[w + 1] - data.offsets[w]) - 1 for w in windows]
    size, dim = max(lengths), data.features.shape[1]
    features = torch.zeros(len(windows), size, dim)
    targets = torch.zeros(len(windows), size, dim)
    tokens = torch.zeros(len(windows), size, dtype=torch.long)
    weight = torch.zeros(len(windows), size)
    for row, (window, pairs) in enumerate(zip(windows, lengths)):
        ids, feats, mask = data.window(window)
        features[row, :pairs] = feats[:-1].float()
        targets[row, :pairs] = feats[1:].float()
        tokens[row, :pairs] = ids[1:]
        weight[row, :pairs] = mask[1:].float()
    return Batch(features, tokens, targets, weight)


def epoch_order(num_windows: int, seed: int, epoch: int) -> list[int]:
    """The window order of one epoch: a permutation fixed by (seed, epoch), so a resumed run
    sees the same batches as an uninterrupted one."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_windows, generator=generator).tolist()


def batches_per_epoch(num_windows: int, batch_size: int) -> int:
    return num_windows // batch_size  # the ragged tail is dropped (it joins a later epoch's order)


def batch_at(data: FeatureSet, step: int, batch_size: int, seed: int) -> Batch:
    """The batch of global step ``step`` (0-based)."""
    per_epoch = max(1, batches_per_epoch(data.num_windows, batch_size))
    epoch, index = divmod(step, per_epoch)
    order = epoch_order(data.num_windows, seed, epoch)
    return make_batch(data, order[index * batch_size:(index + 1) * batch_size])


def eval_batches(data: FeatureSet, batch_size: int) -> Iterator[Batch]:
    for begin in range(0, data.num_windows, batch_size):
        yield make_batch(data, list(range(begin, min(begin + batch_size, data.num_windows))))
