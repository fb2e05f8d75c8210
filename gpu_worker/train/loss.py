"""The draft loss of DESIGN.md section 7 and its metrics.

loss = 1.0 * SmoothL1(predicted feature, next feature)
     + 0.1 * CE(lm_head(pred), softmax(lm_head(next feature)))   (soft targets)

The soft target is the target model's own next-token distribution (its lm_head applied to
its feature), so the head learns the whole ranking the tree builder uses, not just the
argmax. Only rows with weight > 0 pass through the lm_head (8192 x d per row dominates the
cost, and padding rows would only be thrown away).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.head import DraftHead

FEATURE_WEIGHT = 1.0
TOKEN_WEIGHT = 0.1


@dataclass
class LossParts:
    loss: torch.Tensor  # scalar, differentiable
    feature: float  # mean SmoothL1 per row
    token: float  # mean soft cross-entropy per row (nats)
    top1: float  # fraction of rows where argmax lm_head(pred) == argmax lm_head(next feature)
    rows: int


def draft_loss(head: DraftHead, predicted: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> LossParts:
    """predicted/target [..., d]; weight [...] (0 = ignore: padding or a masked-out token)."""
    keep = weight.reshape(-1) > 0
    predicted = predicted.reshape(-1, predicted.shape[-1])[keep]
    target = target.reshape(-1, target.shape[-1])[keep].to(predicted.dtype)
    row_weight = weight.reshape(-1)[keep].to(predicted.dtype)
    total = row_weight.sum().clamp(min=1e-8)
    feature_loss = F.smooth_l1_loss(predicted, target, reduction="none").mean(-1)
    with torch.no_grad():
        target_logits = head.lm_head(target).float()
        target_probs = torch.softmax(target_logits, dim=-1)
    log_probs = torch.log_softmax(head.lm_head(predicted).float(), dim=-1)
    token_loss = -(target_probs * log_probs).sum(-1)
    feature_mean = (feature_loss * row_weight).sum() / total
    token_mean = (token_loss * row_weight).sum() / total
    loss = FEATURE_WEIGHT * feature_mean + TOKEN_WEIGHT * token_mean
    with torch.no_grad():
        agree = (log_probs.argmax(-1) == target_logits.argmax(-1)).to(row_weight.dtype)
        top1 = float((agree * row_weight).sum() / total)
    return LossParts(loss, float(feature_mean.detach()), float(token_mean.detach()), top1, int(keep.sum()))
