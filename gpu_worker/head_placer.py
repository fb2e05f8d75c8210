"""Put checkpoint tensors into a draft head built on the meta device, one at a time.

Each tensor is converted to the head's final dtype and device as it arrives and, for an int8
head, its projection is quantised at once, so loading never holds the head in fp32 next to
its int8 copy (a 13B-shaped 4-layer head peaked at 8.5 GB that way). Peak memory is the
finished head plus one source tensor and its fp32 copy.
"""

from __future__ import annotations

import torch
from torch import nn

from cpu_worker.kernels.int8 import RowwiseInt8Linear

from .head import DraftHead

_FUSION_WEIGHTS = ("W_1", "W_2", "W_z")


class HeadPlacer:
    """``place(name, tensor)`` for every state-dict entry of ``head``; ``quantize`` turns every
    projection (decoder layers, fc, lm_head, DGF's W_1/W_2/W_z) into W8A8 int8 as
    ``DraftHead.quantize_int8`` would, with the rest (embedding, norms) in ``dtype``."""

    def __init__(self, head: DraftHead, device: torch.device | str, dtype: torch.dtype, quantize: bool):
        if quantize and (torch.device(device).type != "cpu" or dtype != torch.float32):
            raise ValueError("an int8 draft head runs on the CPU with fp32 activations")
        self.head = head
        self.device = torch.device(device)
        self.dtype = dtype
        self.quantize = quantize

    def place(self, name: str, tensor: torch.Tensor) -> None:
        head = self.head
        if self.quantize and name in _FUSION_WEIGHTS:
            if head.int8_fusion is None:
                head.int8_fusion = nn.ModuleDict()
            # Used as x @ W, i.e. x W'^T with W' = W^T.
            head.int8_fusion[name] = RowwiseInt8Linear(tensor.t())
            delattr(head, name)
            return
        module_name, _, attribute = name.rpartition(".")
        module = head.get_submodule(module_name) if module_name else head
        if self.quantize and isinstance(module, (nn.Linear, RowwiseInt8Linear)):
            self._place_quantized(module_name, module, attribute, tensor)
            return
        old = getattr(module, attribute)
        setattr(module, attribute, nn.Parameter(tensor.to(device=self.device, dtype=self.dtype),
                                                requires_grad=old.requires_grad))

    def _place_quantized(self, module_name: str, module: nn.Module, attribute: str, tensor: torch.Tensor) -> None:
        bias = module.bias if isinstance(module.bias, torch.Tensor) and not module.bias.is_meta else None
        if attribute == "weight":
            parent_name, _, child = module_name.rpartition(".")
            parent = self.head.get_submodule(parent_name) if parent_name else self.head
            setattr(parent, child, RowwiseInt8Linear(tensor, bias))
        else:  # a bias, before or after its weight
            module.bias = nn.Parameter(tensor.to(torch.float32), requires_grad=False)

    def unplaced(self) -> list[str]:
        """Names of parameters still on the meta device (none once every tensor came)."""
        return sorted(name for name, parameter in self.head.named_parameters() if parameter.is_meta)
