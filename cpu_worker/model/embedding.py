"""Token embeddings kept as the checkpoint stores them, a looked-up row widened to fp32 at a time.

Why: a quantized model's activations are fp32, and an fp32 copy of its embedding table was the
largest tensor that is not a projection: 0.8 GB of a 7B stand-in's 5 GB at q4_0 (49k x 4096). A
forward reads only its tokens' rows, so the table stays as stored (fp16 or bf16 values, or a GGUF
file's blocks) and each row is widened on lookup, exactly: the fp32 values the fp32 table held.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cpu_worker.native import library as native

if TYPE_CHECKING:  # gguf is imported where a GGUF file is read (93 ms)
    from gguf import GGMLQuantizationType

# Stored dtypes that widen to fp32 exactly.
NARROW_FLOATS = (torch.float16, torch.bfloat16)
# GGUF block types the native library widens (block_rows.c), by GGMLQuantizationType name.
NATIVE_BLOCKS = {"Q8_0": native.BLOCK_Q8_0, "Q4_0": native.BLOCK_Q4_0, "Q4_1": native.BLOCK_Q4_1}


class StoredEmbedding(nn.Module):
    """An fp16 or bf16 table whose rows come out as fp32."""

    out_dtype = torch.float32

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if weight.dtype not in NARROW_FLOATS:
            raise ValueError(f"a stored embedding is fp16 or bf16, not {weight.dtype}")
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight).float()

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, stored {self.weight.dtype}, out fp32"


class BlockEmbedding(nn.Module):
    """A GGUF file's table in its blocks (any type ``gguf.quants.dequantize`` reads): each looked-up
    row dequantized on lookup. Dequantizing works block by block, so a row's values are the ones the
    whole table's dequantization gives. Q8_0, Q4_0 and Q4_1 rows go through the native library where
    it loads (the same floats in a fraction of the time: a decode step's lookup), others through gguf."""

    out_dtype = torch.float32

    def __init__(self, rows: np.ndarray, kind: GGMLQuantizationType, hidden_size: int):
        super().__init__()
        from gguf.constants import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        block, block_bytes = GGML_QUANT_SIZES[kind]
        row_bytes = hidden_size // block * block_bytes
        if rows.ndim != 2 or rows.dtype != np.uint8 or hidden_size % block or rows.shape[1] != row_bytes:
            raise ValueError(f"a {kind.name} table of {hidden_size} values a row is {row_bytes} bytes a row "
                             f"({block} values in {block_bytes} bytes), not {rows.dtype} {rows.shape}")
        self.rows = np.ascontiguousarray(rows)  # [vocab, bytes a row], a copy owned here (not the file's map)
        self.kind = kind
        self.hidden_size = hidden_size
        self.nbytes = self.rows.nbytes  # weight_bytes counts it
        self._dequantize = dequantize  # imported here, not on every lookup (a decode step's path)
        # The library itself is looked up on each lookup (a cached call): a module holding it could not be
        # copied or pickled (a head's trainer copies the head it saves).
        self._native_type = NATIVE_BLOCKS.get(kind.name)

    @property
    def num_embeddings(self) -> int:
        return self.rows.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.detach().cpu().reshape(-1).numpy()
        if ids.size == 1:  # a decode step's one id, checked as a Python int: numpy's min and max cost more
            low = high = int(ids[0])
        else:
            low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
        if low < 0 or high >= self.num_embeddings:
            raise IndexError(f"token ids must be in 0..{self.num_embeddings - 1}")
        library = native.load() if self._native_type is not None else None
        if library is not None:
            return self._widen_natively(library, ids).reshape(*tokens.shape, self.hidden_size)
        values = np.asarray(self._dequantize(self.rows[ids], self.kind), dtype=np.float32)
        return torch.from_numpy(values.reshape(*tokens.shape, self.hidden_size))

    def _widen_natively(self, library: ctypes.CDLL, ids: np.ndarray) -> torch.Tensor:
        """The rows ``ids`` (checked) as fp32 [len(ids), hidden_size], by block_rows.c (whose row
        stride is the width checked at construction)."""
        wanted = np.ascontiguousarray(ids, dtype=np.int64)
        out = torch.empty(wanted.size, self.hidden_size)
        if library.dovetail_dequantize_rows(self.rows.ctypes.data, self._native_type, self.hidden_size,
                                            wanted.ctypes.data, wanted.size, out.data_ptr()) != 0:
            raise ValueError(f"a {self.kind.name} table of {self.hidden_size} values a row is not whole blocks")
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.hidden_size}, stored {self.kind.name}, out fp32"


def table(embedding: nn.Module) -> torch.Tensor:
    """An embedding module's table as a tensor (nn.Embedding's or StoredEmbedding's weight); a block
    table has none."""
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(embedding).__name__} holds no table tensor")
    return weight


def device_of(embedding: nn.Module) -> torch.device:
    """Where an embedding module's rows come out: its table's device (a block table's is the CPU)."""
    if isinstance(embedding, BlockEmbedding):
        return torch.device("cpu")
    return table(embedding).device


def output_dtype(embedding: nn.Module) -> torch.dtype:
    """The dtype an embedding module's rows come out in (a model's activations)."""
    dtype = getattr(embedding, "out_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else table(embedding).dtype


def new_embedding(vocab_size: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(vocab_size, dim)``, its normal_ init skipped on the meta device, where loaders build
    models to place a checkpoint's tensors: there that init first imports torch._dynamo (1.3-2.1 s of a
    worker's start) to fill a table nobody reads. Elsewhere (a head trained from scratch) it is initialised
    as nn.Embedding initialises it."""
    embedding = nn.Embedding(vocab_size, dim, _weight=torch.empty(vocab_size, dim))
    if not embedding.weight.is_meta:
        embedding.reset_parameters()
    return embedding
