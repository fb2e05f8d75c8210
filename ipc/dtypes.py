"""Dtype names, one map for every layer: user flags, ring blocks, checkpoints.

Canonical float names are torch's (``float16``, ``bfloat16``, ``float32``); the short forms
users type (``fp16``, ``bf16``, ``fp32``, ``half``) map onto them. No torch import at module
level: the coordinator uses the names without torch.
"""

from __future__ import annotations

from typing import Any

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
_ALIASES = {
    "fp16": "float16", "float16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}
# Precisions of the CPU target (a target precision is more than a dtype). int8: Q8_0's weights (blocks
# of 32, an fp16 scale each) times activations quantized to 16 bits per block of 32, the 8-bit that
# keeps a real model's text; q8_0, q4_0 (alias int4) and q4_1: llama.cpp's block formats and their
# arithmetic, activations int8 per block of 32; int8-row: W8A8 with one scale per weight row and per
# token (the fastest 8-bit on AMX, but coarse: a real model's greedy text leaves fp32's early).
# q4_0-a16, q4_1-a16: the 4-bit weights times 16-bit activations, as int8 is to q8_0 (for a 4-bit GGUF
# the file's own weights with none of llama.cpp's activation rounding: its text stays nearer fp32's).
TARGET_PRECISIONS = ("fp32", "bf16", "int8", "q8_0", "q4_0", "int4", "q4_1", "q4_0-a16", "q4_1-a16", "int8-row")
BLOCK_PRECISIONS = {"int8": "q8_0", "q8_0": "q8_0", "q4_0": "q4_0", "int4": "q4_0",
                    "q4_1": "q4_1", "q4_0-a16": "q4_0", "q4_1-a16": "q4_1"}  # precision -> block type
# Block precisions whose activations are quantized to 16 bits per block (the others: 8).
WIDE_ACTIVATION_PRECISIONS = ("int8", "q4_0-a16", "q4_1-a16")
# KV cache dtypes of the CPU target (auto: see cpu_worker.precision.kv_cache_dtype).
KV_DTYPES = ("auto", "fp32", "bf16")


def canonical(name: str) -> str:
    """``fp16`` -> ``float16`` etc.; ValueError naming the accepted spellings otherwise."""
    try:
        return _ALIASES[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown float dtype {name!r}: use one of {', '.join(sorted(_ALIASES))}") from None


def torch_dtype(name: str) -> Any:
    """The torch dtype for a name in any accepted spelling."""
    import torch

    return getattr(torch, canonical(name))


def dtype_name(dtype: Any) -> str:
    """The canonical name of a torch float dtype (ValueError for any other dtype)."""
    name = str(dtype).removeprefix("torch.")
    if name not in FLOAT_DTYPES:
        raise ValueError(f"expected one of {', '.join(FLOAT_DTYPES)}, got {dtype}")
    return name
