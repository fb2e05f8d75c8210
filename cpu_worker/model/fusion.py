"""A decoder layer's input projections fused: q/k/v as one linear layer, gate/up as another.

Why: the three (two) read the same input, so one call streams one larger matrix instead of
several smaller ones, and an int8 call quantizes its input once. At the 1B shape that is 66
fewer calls per token, and the GEMV kernel streams a 6144x2048 matrix closer to the bandwidth
roofline than a 2048x2048 one. int8 layers quantize and sum each row exactly, so the fused
layer gives the separate layers' values bit for bit (tested). An fp32 GEMM blocks, and so
rounds, a larger matrix differently, so float layers are fused only when asked (``dense``:
the cpu_worker's fp32 targets, whose packed kernel is then checked on the fused shapes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from cpu_worker.kernels.bf16_rows import Bf16Linear
from cpu_worker.kernels.block_quant import BlockQuantLinear
from cpu_worker.kernels.int8 import RowwiseInt8Linear
from cpu_worker.model.llama import MLP, Attention


def _concatenate(layers: Sequence[nn.Module], dense: bool) -> nn.Module | None:
    """One layer computing ``layers`` side by side, or None (left unfused): int8 layers on one
    kernel, bf16 layers of one kind and block layers of one type always, float ``nn.Linear`` layers of
    one dtype when ``dense``."""
    if all(isinstance(layer, RowwiseInt8Linear) for layer in layers):
        int8_layers = [layer for layer in layers if isinstance(layer, RowwiseInt8Linear)]
        if len({layer.kernel for layer in int8_layers}) == 1:
            return RowwiseInt8Linear.concatenate(int8_layers)
        return None
    halves = [layer for layer in layers if isinstance(layer, Bf16Linear)]
    if len(halves) == len(layers):  # bf16 weights: rows independent on the row kernel
        return type(halves[0]).concatenate(halves) if len({type(layer) for layer in halves}) == 1 else None
    blocks = [layer for layer in layers if isinstance(layer, BlockQuantLinear)]
    if len(blocks) == len(layers):
        same = len({(layer.weights.kind, layer.activation_bits) for layer in blocks}) == 1
        return BlockQuantLinear.concatenate(blocks) if same else None
    linears = [layer for layer in layers if isinstance(layer, nn.Linear)]
    if not dense or len(linears) != len(layers) or len({layer.weight.dtype for layer in linears}) != 1 \
            or any(layer.weight.is_meta for layer in linears):
        return None
    weight = torch.cat([layer.weight.detach() for layer in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=any(layer.bias is not None for layer in linears),
                      device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([layer.bias.detach() if layer.bias is not None else
                                             torch.zeros(layer.out_features, dtype=weight.dtype)
                                             for layer in linears]), requires_grad=False)
    return fused


def fuse_projections(model: nn.Module, dense: bool = False) -> int:
    """Fuse q/k/v and gate/up of every attention and MLP under ``model`` (a target, or a draft
    head drafting on the CPU), in place; returns the number of fused groups. int8 groups are
    always fused (the same bits); float groups only with ``dense`` (fp32 targets before MKL
    packing: fewer, larger GEMMs, whose rounding differs from the separate ones by ~1e-7).
    Groups already fused, or of mixed kinds, are left as they are."""
    fused = 0
    for module in model.modules():
        if isinstance(module, Attention) and module.qkv_proj is None:
            qkv = _concatenate([module.q_proj, module.k_proj, module.v_proj], dense)
            if qkv is not None:
                module.use_fused(qkv)  # and the fused projection's default kernels
                fused += 1
        elif isinstance(module, MLP) and module.gate_up_proj is None:
            gate_up = _concatenate([module.gate_proj, module.up_proj], dense)
            if gate_up is not None:
                module.gate_up_proj = gate_up
                del module.gate_proj, module.up_proj
                fused += 1
    return fused
