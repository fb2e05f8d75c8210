"""The target engine's model: the decoder from ``cpu_worker.model`` at a target precision
(fp32, bf16, int8, the block formats), its integer projections fused, and what its weights occupy."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from cpu_worker.kernels.bf16_rows import bf16_linear_maker
from cpu_worker.kernels.block_quant import BlockQuantLinear
from cpu_worker.kernels.huge_pages import release_freed_memory
from cpu_worker.kernels.progress import progress_bar
from cpu_worker.model import LlamaDecoder, fuse_projections, load_decoder, load_spec, resolve_model_dir
from cpu_worker.model.gguf_loading import load_gguf_decoder
from cpu_worker.model.loading import LinearMaker
from cpu_worker.model.model_dir import is_gguf
from cpu_worker.precision import activation_bits, activation_dtype, block_type, head_block_type, is_integer

log = logging.getLogger(__name__)


def load_target_model(path_or_id: str | Path, precision: str = "fp32") -> LlamaDecoder:
    """Build the decoder at ``precision`` (fp32, bf16, a block format, int8-row) tensor by tensor from
    the checkpoint folder or GGUF file, converting or quantising each as it is read; every weight
    must be present. A GGUF's weights already in the precision's blocks go in as they are
    (``gguf_loading``)."""
    model_dir = resolve_model_dir(path_or_id)
    kind = block_type(precision)
    bf16 = precision == "bf16"  # bf16 weights (and table), fp32 activations: ``bf16_rows``
    if is_gguf(model_dir):
        model = load_gguf_decoder(model_dir, activation_dtype(precision), kind, head_block_type(precision),
                                  activation_bits(precision), int8_row=precision == "int8-row", bf16=bf16)
    else:
        quantize: bool | LinearMaker = precision == "int8-row"
        if kind is not None:
            quantize = BlockQuantLinear.maker(kind, head_block_type(precision), activation_bits(precision))
        elif bf16:
            quantize = bf16_linear_maker()
        model = load_decoder(model_dir, activation_dtype(precision), quantize=quantize, spec=load_spec(model_dir),
                             table_dtype=torch.bfloat16 if bf16 else None)
    spec = model.spec
    if is_integer(precision) or bf16:
        fuse_layers(model)  # q/k/v and gate/up in one call each, the same bits
    release_freed_memory()
    log.info("loaded %s: %s, %d layers, hidden %d, %s, %.2f GB resident", model_dir, spec.model_type,
             spec.num_layers, spec.hidden_size, precision, weight_bytes(model) / 1e9)
    return model.eval().requires_grad_(False)


def fuse_layers(model: LlamaDecoder, dense: bool = False) -> int:
    """``fusion.fuse_projections`` a layer at a time, trimming the heap as it goes: the separate
    matrices freed here would otherwise sit in glibc's arenas (+0.9 GB of peak RSS at 7B int8)."""
    fused = 0
    with progress_bar(len(model.layers), "fuse q/k/v and gate/up", "layer") as bar:
        for count, layer in enumerate(model.layers, 1):
            fused += fuse_projections(layer, dense)
            bar.update()
            if count % 2 == 0:
                release_freed_memory()
    release_freed_memory()
    return fused


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy (what one decode step streams from memory)."""
    total = sum(tensor.numel() * tensor.element_size() for tensor in model.parameters())
    # Packed and quantised layers hold their weights outside parameters (``nbytes``).
    total += sum(getattr(module, "nbytes", 0) for module in model.modules())
    return total
