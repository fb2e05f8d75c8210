"""A batched, full-sequence forward of a ``DraftHead`` for training.

``DraftHead.forward`` serves inference: batch 1, a KV cache, explicit cache slots. Training
wants [B, S] windows in one pass with a causal mask and no cache, so this module runs the
head's own modules (fusion, q/k/v/o projections, norms, MLP) in that shape. A test checks it
against the inference path (DraftHead with a KV cache) to 1e-5 in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpu_worker.llama import DecoderLayer, RotaryTable, apply_rope
from gpu_worker.head import DraftHead


def rotary_rows(head: DraftHead, length: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [length, head_dim] for draft positions 0..length-1 (fp32, like the drafter's table)."""
    table = RotaryTable(head.spec, length, torch.float32, device)
    return table.cos, table.sin


def _layer_forward(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One pre-norm decoder layer over x [B, S, d], causal attention from position 0."""
    batch, length, _ = x.shape
    attention = layer.self_attn
    h = layer.input_layernorm(x)
    q = attention.q_proj(h).view(batch, length, attention.num_heads, attention.head_dim).transpose(1, 2)
    k = attention.k_proj(h).view(batch, length, attention.num_kv_heads, attention.head_dim).transpose(1, 2)
    v = attention.v_proj(h).view(batch, length, attention.num_kv_heads, attention.head_dim).transpose(1, 2)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                         enable_gqa=attention.num_heads != attention.num_kv_heads)
    x = x + attention.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


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
        x = _layer_forward(layer, x, cos, sin)
    return x
