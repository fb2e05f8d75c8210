"""The weight formats of a draft head's projections on the CPU.

There the draft shares the memory bus with the target, so the bytes a draft step reads matter: the
7B-wide one-layer demo head streams 302 MB a tree level at int8, 187 MB at q4_0. ``int8`` is W8A8 per row
(``RowwiseInt8Linear``); ``q4_0`` is the target's 4-bit block kernel (Q4_0 weights, activations
per block of 32 at 8 bits), with the vocabulary projection at Q8_0 so the
ranking the tree is built from stays near fp32's. Only speed depends on the format: the target
verifies every drafted token.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from cpu_worker.model import BlockQuantLinear, RowwiseInt8Linear, fuse_projections

if TYPE_CHECKING:
    from .eagle3 import Eagle3Head
    from .head import DraftHead

PROJECTION_FORMATS = ("int8", "q4_0")
FUSION_WEIGHTS = ("W_1", "W_2", "W_z")  # DGF's, used as x @ W ([in, out])
Head = TypeVar("Head", "DraftHead", "Eagle3Head")
LinearMaker = Callable[[torch.Tensor, "torch.Tensor | None", str], nn.Module]
Native = TypeVar("Native")
log = logging.getLogger(__name__)

# Each head's layers on the native kernels (or None), with the projection format they were built for. Kept
# beside the head, not in it: a module holding the library cannot be deep-copied (the trainer copies heads).
_NATIVE: weakref.WeakKeyDictionary[nn.Module, tuple[str | None, Any]] = weakref.WeakKeyDictionary()


def native_layers_of(head: DraftHead | Eagle3Head, build: Callable[[], Native | None]) -> Native | None:
    """``head``'s layers on the native kernels (``cpu_worker.model.native_head``), built by ``build``
    once per projection format: None for a head whose projections are not on our CPU kernels."""
    entry = _NATIVE.get(head)
    if entry is None or entry[0] != head.projection_format:
        entry = (head.projection_format, build() if head.projection_format is not None else None)
        _NATIVE[head] = entry
        if entry[1] is not None:
            log.info("draft head: %s projections, its layers in native calls (DOVETAIL_NATIVE_HEAD=python: torch's)",
                     head.projection_format)
    return entry[1]


def projection_maker(projections: str) -> LinearMaker:
    """What a head's nn.Linear (its weight, bias and attribute name) becomes in ``projections``."""
    if projections == "int8":
        return lambda weight, bias, name: RowwiseInt8Linear(weight.float(), bias)
    if projections == "q4_0":
        make = BlockQuantLinear.maker("q4_0", head_kind="q8_0", activation_bits=8)
        return lambda weight, bias, name: make(weight.float(), bias, name)
    raise ValueError(f"unknown draft projection format {projections!r}; known: {', '.join(PROJECTION_FORMATS)}")


def _swap_linears(module: nn.Module, make: LinearMaker) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child.weight.detach(), child.bias, name))
        else:
            _swap_linears(child, make)


@torch.no_grad()
def quantize_projections(head: Head, projections: str) -> Head:
    """Every projection of a draft head (decoder layers, fc, lm_head, DGF's W_1/W_2/W_z) in
    ``projections``, in place; q/k/v and gate/up then fused into one call each, the same bits.
    Each row's output depends on that row alone in both formats."""
    make = projection_maker(projections)
    _swap_linears(head, make)
    if all(isinstance(getattr(head, name, None), nn.Parameter) for name in FUSION_WEIGHTS):
        # x @ W is x W'^T with W' = W^T.
        head.int8_fusion = nn.ModuleDict({name: make(getattr(head, name).detach().t().contiguous(), None, name)
                                          for name in FUSION_WEIGHTS})
        for name in FUSION_WEIGHTS:
            delattr(head, name)
    fuse_projections(head)
    head.projection_format = projections
    return head

