"""The model both workers build: Llama-family blocks, fused projections, model folders, the weight streamer.

What ``gpu_worker`` may use of ``cpu_worker`` is named here (DESIGN.md 11), with the int8 and
block-quantized layers a model can be built from. The names load on first use: the coordinator reads model folders
through ``cpu_worker.model.model_dir`` and never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # For type checkers; at run time ``__getattr__`` imports each name from its home below.
    from cpu_worker.kernels.block_quant import (
        BlockQuantLinear as BlockQuantLinear,
    )
    from cpu_worker.kernels.block_quant import (
        block_kernels_available as block_kernels_available,
    )
    from cpu_worker.kernels.huge_pages import (
        release_freed_memory as release_freed_memory,
    )
    from cpu_worker.kernels.int8 import (
        RowwiseInt8Linear as RowwiseInt8Linear,
    )
    from cpu_worker.kernels.int8 import (
        quantize_linears as quantize_linears,
    )
    from cpu_worker.model.fusion import (
        fuse_projections as fuse_projections,
    )
    from cpu_worker.model.llama import (
        MLP as MLP,
    )
    from cpu_worker.model.llama import (
        Attention as Attention,
    )
    from cpu_worker.model.llama import (
        CacheSegment as CacheSegment,
    )
    from cpu_worker.model.llama import (
        DecoderLayer as DecoderLayer,
    )
    from cpu_worker.model.llama import (
        KVCache as KVCache,
    )
    from cpu_worker.model.llama import (
        LlamaDecoder as LlamaDecoder,
    )
    from cpu_worker.model.llama import (
        LlamaSpec as LlamaSpec,
    )
    from cpu_worker.model.llama import (
        ModelConfigError as ModelConfigError,
    )
    from cpu_worker.model.llama import (
        RMSNorm as RMSNorm,
    )
    from cpu_worker.model.llama import (
        RotaryTable as RotaryTable,
    )
    from cpu_worker.model.llama import (
        apply_rope as apply_rope,
    )
    from cpu_worker.model.loading import (
        WeightPlacer as WeightPlacer,
    )
    from cpu_worker.model.loading import (
        iter_tensors as iter_tensors,
    )
    from cpu_worker.model.loading import (
        keeps_stored_tables as keeps_stored_tables,
    )
    from cpu_worker.model.loading import (
        load_decoder as load_decoder,
    )
    from cpu_worker.model.loading import (
        load_spec as load_spec,
    )
    from cpu_worker.model.loading import (
        read_tensors as read_tensors,
    )
    from cpu_worker.model.loading import (
        tensor_shapes as tensor_shapes,
    )
    from cpu_worker.model.loading import (
        weight_files as weight_files,
    )
    from cpu_worker.model.model_dir import (
        ModelLoadError as ModelLoadError,
    )
    from cpu_worker.model.model_dir import (
        context_limit as context_limit,
    )
    from cpu_worker.model.model_dir import (
        read_config as read_config,
    )
    from cpu_worker.model.model_dir import (
        resolve_model_dir as resolve_model_dir,
    )
    from cpu_worker.model.native_head import (
        NativeDraftLayers as NativeDraftLayers,
    )
    from cpu_worker.model.native_head import (
        NativeEagle3Layer as NativeEagle3Layer,
    )
    from cpu_worker.model.native_head import (
        kernel_digest as kernel_digest,
    )

_HOMES = {
    "cpu_worker.kernels.block_quant": ("BlockQuantLinear", "block_kernels_available"),
    "cpu_worker.kernels.huge_pages": ("release_freed_memory",),
    "cpu_worker.kernels.int8": ("RowwiseInt8Linear", "quantize_linears"),
    "cpu_worker.model.fusion": ("fuse_projections",),
    "cpu_worker.model.llama": ("MLP", "Attention", "CacheSegment", "DecoderLayer", "KVCache", "LlamaDecoder",
                               "LlamaSpec", "ModelConfigError", "RMSNorm", "RotaryTable", "apply_rope"),
    "cpu_worker.model.loading": ("WeightPlacer", "iter_tensors", "keeps_stored_tables", "load_decoder", "load_spec",
                                 "read_tensors", "tensor_shapes", "weight_files"),
    "cpu_worker.model.model_dir": ("ModelLoadError", "context_limit", "read_config", "resolve_model_dir"),
    "cpu_worker.model.native_head": ("NativeDraftLayers", "NativeEagle3Layer", "kernel_digest"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once found, a plain attribute
    return value
