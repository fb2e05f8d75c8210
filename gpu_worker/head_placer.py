"""Put checkpoint tensors into a draft head built on the meta device, one at a time.

Each tensor is converted to the head's final dtype and device as it arrives and, for an int8
or q4_0 head, its projection is quantised at once, so loading never holds the head in fp32 next to
its int8 copy (a 13B-shaped 4-layer head peaked at 8.5 GB that way). Peak memory is the
finished head plus one source tensor and its fp32 copy. The placing is the model box's
(``cpu_worker.model.WeightPlacer``); a head adds DGF's fusion matrices.
"""

from __future__ import annotations

import torch
from torch import nn

from cpu_worker.model import WeightPlacer

from .head import DraftHead
from .head_formats import FUSION_WEIGHTS, projection_maker


class HeadPlacer(WeightPlacer):
    """``place(name, tensor)`` for every state-dict entry of ``head``; ``projections`` (int8 or
    q4_0, ``head_formats``) turns every projection (decoder layers, fc, lm_head, DGF's
    W_1/W_2/W_z) into that format as ``head_formats.quantize_projections`` would, with the rest
    (embedding, norms) in ``dtype``."""

    def __init__(self, head: DraftHead, device: torch.device | str, dtype: torch.dtype, projections: str | None):
        if projections and (torch.device(device).type != "cpu" or dtype != torch.float32):
            raise ValueError(f"a {projections} draft head runs on the CPU with fp32 activations")
        self.make = projection_maker(projections) if projections else None
        super().__init__(head, dtype, self.make or False, device, trainable=True)
        self.head = head
        self.projections = projections

    def place(self, name: str, tensor: torch.Tensor) -> None:
        head = self.head
        if self.make is not None and name in FUSION_WEIGHTS:
            if head.int8_fusion is None:
                head.int8_fusion = nn.ModuleDict()
            # Used as x @ W, i.e. x W'^T with W' = W^T.
            head.int8_fusion[name] = self.make(tensor.t().contiguous(), None, name)
            delattr(head, name)
            return
        super().place(name, tensor)
