"""Build our decoder from a GGUF file, tensor by tensor from its memory map.

Weights already in a block type the kernels run (Q8_0, Q4_0, Q4_1) go into ``BlockWeights`` as the
file stores them, never dequantized; the rest are dequantized (F16, BF16, F32 are read as floats,
other types through ``gguf.quants.dequantize``) and then converted like an HF folder's weights.

Which block type a projection runs at (``block_kind``): the narrower of the asked one and the one
nearest its own type (q4_0 < q4_1 < q8_0), so a file's weights are never widened into an
approximation of themselves; a weight already of that type is taken as is.

llama.cpp's converter permutes the rows of a Llama's attn_q and attn_k (its rotary pairs
neighbouring values, Hugging Face's the two halves of a head); our decoder follows Hugging Face,
so those rows are put back (``unpermute_rows``). For block types a row is whole blocks, so the
permutation moves the file's bytes and dequantizes nothing.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from cpu_worker.kernels.bf16_rows import bf16_linear_maker
from cpu_worker.kernels.block_quant import BlockQuantLinear, BlockWeights
from cpu_worker.kernels.huge_pages import release_freed_memory
from cpu_worker.kernels.int8 import RowwiseInt8Linear
from cpu_worker.kernels.progress import progress_bar
from cpu_worker.model.embedding import BlockEmbedding, StoredEmbedding, table
from cpu_worker.model.gguf_file import GGUFError, GGUFFile, TensorInfo
from cpu_worker.model.gguf_model import (
    NATIVE_TYPES,
    PERMUTED_ARCHITECTURES,
    architecture,
    hf_config,
    nearest_native,
    tensor_names,
)
from cpu_worker.model.llama import LlamaDecoder, LlamaSpec, ModelConfigError
from cpu_worker.model.loading import LinearMaker, WeightPlacer

log = logging.getLogger(__name__)

_WIDTH = {"q4_0": 0, "q4_1": 1, "q8_0": 2}  # bits per weight: 4.5, 5, 8.5


def gguf_spec(file: GGUFFile) -> LlamaSpec:
    try:
        return LlamaSpec.from_hf_config(SimpleNamespace(**hf_config(file)))
    except ModelConfigError as error:
        raise GGUFError(f"{file.path}: {error}") from None


def _meta_model(file: GGUFFile, spec: LlamaSpec) -> LlamaDecoder:
    """The decoder on the meta device (no memory), or GGUFError for a config it cannot be built from."""
    try:
        with torch.device("meta"):
            return LlamaDecoder(spec)
    except (ValueError, RuntimeError) as error:
        raise GGUFError(f"{file.path}: no decoder can be built from its config: {error}") from None


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row indices that put llama.cpp's rotary order back into Hugging Face's: HF row
    h * d + p * d/2 + i is GGUF row h * d + 2 * i + p (d the head dimension, p 0 or 1)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)


def _row_order(file: GGUFFile, spec: LlamaSpec, name: str) -> np.ndarray | None:
    if architecture(file) not in PERMUTED_ARCHITECTURES:
        return None
    if ".attn_q." in name:
        return unpermute_rows(spec.num_heads * spec.head_dim, spec.num_heads)
    if ".attn_k." in name:
        return unpermute_rows(spec.num_kv_heads * spec.head_dim, spec.num_kv_heads)
    return None


def _rows(file: GGUFFile, info: TensorInfo, order: np.ndarray | None) -> np.ndarray:
    raw = file.data(info.name)
    return raw if order is None else raw[order]


def read_float(file: GGUFFile, info: TensorInfo, order: np.ndarray | None = None) -> torch.Tensor:
    """A tensor as fp32 in torch's shape, dequantized when it is stored in blocks."""
    raw = _rows(file, info, order)
    if info.type == GGMLQuantizationType.BF16:
        values = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.bfloat16).float()
    else:
        try:
            values = torch.from_numpy(np.array(dequantize(raw, info.type), dtype=np.float32))
        except (NotImplementedError, ValueError) as error:
            raise GGUFError(f"{file.path}: tensor {info.name} of type {info.type.name} cannot be read: "
                            f"{error}") from None
    return values.reshape(info.shape)


def read_blocks(file: GGUFFile, info: TensorInfo, order: np.ndarray | None = None) -> BlockWeights:
    """A Q8_0, Q4_0 or Q4_1 weight as the kernels' blocks: the file's values and fp16 scales."""
    kind = NATIVE_TYPES[info.type]
    block, size = GGML_QUANT_SIZES[info.type]
    k = info.dims[0]
    rows = torch.from_numpy(np.ascontiguousarray(_rows(file, info, order)))
    blocks = rows.reshape(rows.shape[0], k // block, size)
    scales = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    minimums = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1) if kind == "q4_1" else None
    values = blocks[..., 4 if kind == "q4_1" else 2:]  # a strided view: from_blocks moves each byte once
    return BlockWeights.from_blocks(kind, values, scales, minimums, k)


def block_kind(asked: str, stored: GGMLQuantizationType) -> str:
    """The block type a weight stored as ``stored`` runs at when ``asked`` is the precision's."""
    if stored in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        return asked
    own = nearest_native(stored)
    return own if _WIDTH[own] < _WIDTH[asked] else asked


def _is_projection(name: str) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight"


class _Reader:
    """Reads each tensor in the form the target precision places it: projections as BlockWeights at
    a block precision (``kind``; the lm_head at ``head_kind``), everything else as floats."""

    def __init__(self, file: GGUFFile, spec: LlamaSpec, kind: str | None, head_kind: str | None):
        self.file, self.spec, self.kind, self.head_kind = file, spec, kind, head_kind
        self.requantized: Counter[str] = Counter()  # "Q6_K -> q8_0": count
        self.dequantized: Counter[str] = Counter()

    def read(self, info: TensorInfo, name: str) -> torch.Tensor | BlockWeights:
        order = _row_order(self.file, self.spec, info.name)
        if self.kind is None or not _is_projection(name):
            if info.type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                self.dequantized[info.type.name] += 1
            return read_float(self.file, info, order)
        chosen = block_kind(self.head_kind or self.kind if name == "lm_head.weight" else self.kind, info.type)
        if NATIVE_TYPES.get(info.type) == chosen:
            return read_blocks(self.file, info, order)
        if info.type in NATIVE_TYPES or info.type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                                          GGMLQuantizationType.BF16):
            self.requantized[f"{info.type.name} -> {chosen}"] += 1
        return BlockWeights.quantize(read_float(self.file, info, order), chosen)

    def report(self) -> None:
        if self.requantized:
            log.info("%s: requantized %s from their dequantized values (the kernels run q8_0, q4_0, q4_1)",
                     self.file.path.name, ", ".join(f"{n} {kind}" for kind, n in sorted(self.requantized.items())))
        if self.dequantized:
            log.info("%s: dequantized %s to float", self.file.path.name,
                     ", ".join(f"{n} {kind}" for kind, n in sorted(self.dequantized.items())))


def stored_embedding(file: GGUFFile, info: TensorInfo, spec: LlamaSpec) -> torch.nn.Module | None:
    """A quantized model's embedding as the file stores it, rows widened on lookup (``embedding``):
    F16 and BF16 values, or any block type gguf dequantizes; None for F32 (placed as it is)."""
    if info.type == GGMLQuantizationType.F32:
        return None
    rows = np.array(file.data(info.name))  # a copy: the file's pages are dropped and the map closed after loading
    if info.type in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        narrow = torch.float16 if info.type == GGMLQuantizationType.F16 else torch.bfloat16
        return StoredEmbedding(torch.from_numpy(rows).view(narrow).reshape(info.shape))
    return BlockEmbedding(rows, info.type, spec.hidden_size)


def gguf_stored_table(path: str | Path) -> torch.nn.Module | None:
    """The embedding of the GGUF file at ``path`` as the file stores it (``stored_embedding``): what a
    quantized draft head on the CPU keeps of a GGUF target's table instead of an fp32 copy (a Llama-2-7B Q4_0
    file's 74 MB against 524 MB); None where the file's table is F32."""
    with GGUFFile(path) as file:
        spec = gguf_spec(file)
        names = {name: gguf_name for gguf_name, name in tensor_names(file, hf_config(file)).items()}
        info = file.tensors[names["embed_tokens.weight"]]
        stored = stored_embedding(file, info, spec)
        file.release(info.name)
    return stored


def _linear_maker(activation_bits: int, int8_row: bool, bf16: bool) -> LinearMaker:
    bf16_linear = bf16_linear_maker() if bf16 else None

    def make(weight: Any, bias: torch.Tensor | None, name: str) -> torch.nn.Module:
        if isinstance(weight, BlockWeights):
            return BlockQuantLinear(weight, bias, activation_bits)
        if int8_row:
            return RowwiseInt8Linear(weight, bias)
        if bf16_linear is not None:
            return bf16_linear(weight, bias, name)
        raise GGUFError(f"{name}: a float weight reached the block placer")  # _Reader never sends one
    return make


def load_gguf_decoder(path: str | Path, dtype: torch.dtype, kind: str | None = None, head_kind: str | None = None,
                      activation_bits: int = 8, int8_row: bool = False, bf16: bool = False) -> LlamaDecoder:
    """The decoder in the GGUF file at ``path``: activations in ``dtype``; projections in blocks of
    ``kind`` (the lm_head of ``head_kind``; ``block_kind`` says when the file's own are kept) with
    activations of ``activation_bits`` per block, W8A8 rows with ``int8_row``, bf16 weights with
    ``bf16`` (``bf16_rows``; the token table in bf16 too, a tied head sharing it), else floats.
    Tensor by tensor, each one's file pages dropped once it is converted."""
    with GGUFFile(path) as file:
        spec = gguf_spec(file)
        model = _meta_model(file, spec)
        names = tensor_names(file, hf_config(file))
        reader = _Reader(file, spec, kind, head_kind)
        quantize = kind is not None or int8_row or bf16
        placer = WeightPlacer(model, dtype, _linear_maker(activation_bits, int8_row, bf16) if quantize else False,
                              table_dtype=torch.bfloat16 if bf16 else None)
        with progress_bar(len(names), f"load {Path(path).name}", "tensor") as bar:
            for count, (gguf_name, name) in enumerate(names.items(), 1):
                stored = stored_embedding(file, file.tensors[gguf_name], spec) if name == "embed_tokens.weight" \
                    and placer.keeps_tables and not bf16 else None  # bf16: the table in bf16, as a folder's
                if stored is not None:
                    placer.place_table("embed_tokens", stored)
                else:
                    placer.place(name, reader.read(file.tensors[gguf_name], name))  # type: ignore[arg-type]
                file.release(gguf_name)
                bar.update()
                if count % 16 == 0:
                    release_freed_memory()
        if "lm_head.weight" not in names.values():  # tied: the embedding's matrix, at the head's precision
            if bf16:  # the bf16 table itself, shared
                placer.place("lm_head.weight", table(model.embed_tokens))
            elif placer.quantize:
                head = reader.read(file.tensors["token_embd.weight"], "lm_head.weight")
                placer.place("lm_head.weight", head)  # type: ignore[arg-type]
                file.release("token_embd.weight")
            else:
                model.lm_head.weight = cast(torch.nn.Parameter, table(model.embed_tokens))
        reader.report()
    if placer.unplaced():  # tensor_names checked the file against the config; the decoder must agree
        raise GGUFError(f"{path}: the decoder still lacks {', '.join(placer.unplaced()[:5])}")
    return model.eval().requires_grad_(False)


def _hf_name(name: str) -> str:
    """Our name as a Hugging Face checkpoint spells it (the decoder's tensors under ``model.``)."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def gguf_tensors(path: str | Path, names: set[str] | None = None, shapes_only: bool = False) -> dict[str, Any]:
    """A GGUF file's tensors under Hugging Face's names (only ``names`` when given) as fp32, in
    Hugging Face's row order; or, with ``shapes_only``, their shapes. The readers of target tensors
    (a draft head's embedding and lm_head, a trainer's) see a GGUF as they see a folder."""
    found: dict[str, Any] = {}
    with GGUFFile(path) as file:
        config = hf_config(file)
        spec = gguf_spec(file)
        for gguf_name, name in tensor_names(file, config).items():
            hf_name = _hf_name(name)
            if names is not None and hf_name not in names:
                continue
            info = file.tensors[gguf_name]
            found[hf_name] = info.shape if shapes_only else read_float(file, info, _row_order(file, spec, gguf_name))
            file.release(gguf_name)
    return found
