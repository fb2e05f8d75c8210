"""EAGLE-3's training-time test: the head unrolled on its own outputs for K steps.

Window x_0..x_{n-1} with three-layer rows a_0..a_{n-1}. Step 0 at row j is the pair
(fc(a_j), x_{j+1}) at position j, exactly as inference feeds the committed context. Step k >= 1
at row j is the pair (step k-1's output at row j, x_{j+1+k}) at position j + k: the depth-k draft
node of a chain grown from context position j along the true tokens. Its attention sees what that
node sees at inference: step 0's keys at rows j' <= j (the committed prefix) and its own chain,
steps 1..k at row j (its ancestors and itself). Every step's output is scored against the
target's distribution of x_{j+2+k}.

The attention is computed as one causal block over step 0 plus one diagonal term per later
step, so a step costs O(S^2 + k S), not O(k S^2). A test checks every step against the head's
inference forward (KV cache + tree mask).
"""

from __future__ import annotations

import math
from functools import partial

import torch

from cpu_worker.model import Attention, apply_rope
from gpu_worker.eagle3 import Eagle3Head


def ttt_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """x [B, S, 2H] of step k = len(keys); appends this step's keys/values to the lists."""
    batch, length, _ = x.shape
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = apply_rope(attn.q_proj(x).view(batch, length, heads, dim).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(batch, length, kv_heads, dim).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(batch, length, kv_heads, dim).transpose(1, 2)
    group = heads // kv_heads
    keys.append(k.repeat_interleave(group, dim=1) if group > 1 else k)
    values.append(v.repeat_interleave(group, dim=1) if group > 1 else v)
    scale = 1.0 / math.sqrt(dim)
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    first = (q @ keys[0].transpose(2, 3)) * scale
    first = first.masked_fill(~causal, float("-inf"))
    own = [((q * later).sum(-1) * scale).unsqueeze(-1) for later in keys[1:]]  # [B, h, S, 1] each
    weights = torch.softmax(torch.cat([first] + own, dim=-1).float(), dim=-1).to(q.dtype)
    out = weights[..., :length] @ values[0]
    for index, later in enumerate(values[1:]):
        out = out + weights[..., length + index:length + index + 1] * later
    return attn.o_proj(out.transpose(1, 2).reshape(batch, length, heads * dim))


def ttt_forward(head: Eagle3Head, rows: torch.Tensor, tokens: torch.Tensor, steps: int,
                cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """rows [B, S, 3Ht] (a_0..a_{S-1}); tokens [B, S + steps - 1] with tokens[:, i] = x_{i+1}
    (padding past a window's end is fine: no real row attends to it); cos/sin [S + steps - 1, hd]
    for positions 0... Returns the outputs [B, S, H] of steps 0..steps-1."""
    length = rows.shape[1]
    if tokens.shape[1] < length + steps - 1:
        raise ValueError(f"tokens need {length + steps - 1} columns for {steps} steps over {length} rows")
    g = head.reduce(rows)
    # Every decoder layer keeps its own steps' keys and values (a deeper head's plain layers too).
    attentions = [head.midlayer.self_attn, *(layer.self_attn for layer in head.plain_layers)]
    keys: list[list[torch.Tensor]] = [[] for _ in attentions]
    values: list[list[torch.Tensor]] = [[] for _ in attentions]
    outs = []
    for step in range(steps):
        cos_k = cos[step:step + length].to(g.dtype)
        sin_k = sin[step:step + length].to(g.dtype)
        attends = [partial(_attend_layer, attn, cos_k, sin_k, layer_keys, layer_values)
                   for attn, layer_keys, layer_values in zip(attentions, keys, values, strict=True)]
        g = head.layer_with(g, tokens[:, step:step + length], attends[0])
        g = head.post_layers_with(g, attends[1:])
        outs.append(g)
    return outs


def _attend_layer(attn: Attention, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
                  values: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return ttt_attention(attn, x, cos, sin, keys, values)
