"""A batched, full-sequence forward of a ``DraftHead`` for training.

``DraftHead.forward`` serves inference: batch 1, a KV cache, explicit cache slots. Training
wants [B, S] windows in one pass with a causal mask and no cache. The draft reuses
``cpu_worker``'s decoder layers, which run that shape when given no cache, so this module only
fuses the inputs and calls the head's layers. A test checks it against the inference path
(DraftHead with a KV cache) to 1e-5 in fp32.
"""

from __future__ import annotations

import torch

from cpu_worker.model import RotaryTable
from gpu_worker.head import DraftHead


def rotary_rows(head: DraftHead, length: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [length, head_dim] for draft positions 0..length-1 (fp32, like the drafter's table)."""
    table = RotaryTable(head.spec, length, torch.float32, device)
    return table.cos, table.sin


def train_forward(head: DraftHead, features: torch.Tensor, tokens: torch.Tensor,
                  rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Pairs (f_i, x_{i+1}) at draft positions 0..S-1 of each row -> output features [B, S, d]
    (predictions of f_{i+1}). features [B, S, d], tokens [B, S]. Rows padded at the end are
    fine: causal attention never lets a real position see the padding."""
    length = tokens.shape[1]
    cos, sin = rotary if rotary is not None else rotary_rows(head, length, features.device)
    cos, sin = cos[:length].to(features.dtype), sin[:length].to(features.dtype)
    x = head.fuse(features, tokens)
    for layer in head.layers:
        x = layer(x, cos, sin)  # no cache: causal attention within each row, from position 0
    return x
