"""A target's decoder layers in one foreign call per forward (``decoder_layers.c``), for decode
steps, tree verification and prompt chunks.

Why: a decode step of a small target spends a tenth of its time between the linear layers, in
torch ops and foreign calls that each cost microseconds (docs/kernels.md has the numbers).
The C loop calls the very kernels the Python layers call, in the same order, and does the two
steps torch did (the residual add, the attention output's transpose) exactly, so its rows carry
the Python path's bits: decode, tree and prefill still agree.

It takes a model whose every decoder layer is fused (q/k/v, gate/up) on our kernels (int8-row
W8A8 on the GEMV kernel, the block formats, or fp32 or bf16 weights on the row kernel), with
RMSNorms, and a call that is a decode step, a tree or a prompt chunk over a one-sequence fp32 or
bf16 cache; a prompt chunk only where the layers attend to prompts on the exact causal kernel
(``attention.EXACT``: not fp32's or bf16's, whose prompts take a GEMM and torch's attention). Anything
else (masks, autograd, fbgemm or MKL linears, torch's attention forced, more rows than ``max_rows``)
runs the Python layers. A 40-token prompt of the 135M GGUF took ~15% less time in the loop than on
the Python layers' ~250 calls. After the layers, ``finish`` runs the final norm and the lm_head in one
more call (the modules' kernels, so their bits) for up to 63 logit rows.
``DOVETAIL_NATIVE_LAYERS=python`` forces them (for comparisons).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpu_worker.kernels import exact_attention, layer_ops
from cpu_worker.kernels.attention import EXACT
from cpu_worker.kernels.exact_attention import TreePaths
from cpu_worker.kernels.fp32_rows import MAX_KERNEL_ROWS, PROMPT_GEMM_ROWS
from cpu_worker.model.llama import DecoderLayer, KVCache, LlamaDecoder
from cpu_worker.model.native_views import (
    LAYERS_VARIABLE,
    Scratch,
    describe_layer,
    describe_linear,
    loop_shape,
    norm_weight,
)
from cpu_worker.native import library as native
from cpu_worker.native.library import Capture as _Capture
from cpu_worker.native.library import Layer as _Layer
from cpu_worker.native.library import Linear as _Linear
from cpu_worker.native.library import Segment as _Segment
from cpu_worker.native.library import Shape as _Shape

FORCE_VARIABLE = LAYERS_VARIABLE
# Scratch kept between calls (a step's or a tree's: a few MB; a 1024-row chunk of a 7B takes 270 MB).
KEPT_SCRATCH_FLOATS = 16 << 20


@dataclass(frozen=True)
class Causal:
    """A segment's rows that are a prompt chunk: row r attends to its cache's slots [0, start + r]."""

    rows: int


Segment = tuple[KVCache, int, TreePaths | Causal | None]  # (cache, start, how its rows attend); None: a decode step


class NativeLayers:
    """The C descriptors of a model's decoder layers, built once (the weights never move), and
    their scratch (``Scratch``: kept up to ``KEPT_SCRATCH_FLOATS``)."""

    def __init__(self, model: LlamaDecoder, layers: ctypes.Array[_Layer], max_rows: int,
                 library: ctypes.CDLL, head: tuple[_Linear, int] | None = None):
        self._model = model  # the descriptors point into its tensors: keep them alive
        self._layers = layers
        self._layer_size = ctypes.sizeof(_Layer)
        self.max_rows = max_rows
        self.library = library  # where the layers' calls go (tools.bench_library_ab swaps in another build)
        self._finish_library = library  # the final norm and head's: this build's, whichever runs the layers
        self.scratch = Scratch(KEPT_SCRATCH_FLOATS)
        self._shapes: dict[int, _Shape] = {}  # by cache length: built once, not per forward
        self._no_extra = torch.zeros(max_rows + 1, dtype=torch.int64)
        # The final norm and the lm_head as the C call reads them, and the most logit rows a call of the
        # head keeps its Python bits for (``finish``); None where either is not on our kernels.
        norm = norm_weight(model.norm)
        self._head = None if head is None or norm is None or head[0].k != model.spec.hidden_size else head
        self._final_norm = norm

    @classmethod
    def build(cls, model: LlamaDecoder) -> NativeLayers | None:
        """The model's layers on the C loop, or None when a layer or this process does not qualify."""
        if os.environ.get(FORCE_VARIABLE, "").lower() == "python":
            return None
        library = native.load()
        if library is None or not (layer_ops.available() and exact_attention.available()):
            return None
        described = []
        max_rows = MAX_KERNEL_ROWS
        for layer in model.layers:
            view = describe_layer(layer)
            if view is None:
                return None
            described.append(view[0])
            max_rows = min(max_rows, view[1])
        if not described or max_rows < 1:
            return None
        return cls(model, (_Layer * len(described))(*described), max_rows, library, describe_linear(model.lm_head))

    def applies(self, x: torch.Tensor, cache: KVCache, mask: torch.Tensor | None, paths: TreePaths | None) -> bool:
        """Whether this forward can take the C loop: a decode step (one row, no mask), a tree
        (``paths``) or a prompt chunk (rows without a mask, where ``causal_prompts``) of at most
        ``max_rows`` fp32 rows without autograd, over a contiguous one-sequence fp32 or bf16 cache."""
        rows = x.shape[1]
        kind = paths is not None or (mask is None and (rows == 1 or self.causal_prompts()))
        return (kind and x.shape[0] == 1 and rows <= self.max_rows and x.dtype == torch.float32
                and x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad)
                and self.cache_qualifies(cache))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int,
            paths: TreePaths | None, first: int, end: int, streams: list[torch.Tensor] | None = None,
            capture: Sequence[int] = ()) -> torch.Tensor:
        """x [1, S, d] through layers [first, end); returns a new tensor (x is left as it was).
        The rows go to cache slots start.. as ``Attention.forward`` puts them; a tree (``paths``)
        attends as it does there, a decode step to slots [0, start + 1), a prompt chunk (several rows,
        no paths) causally. ``capture``: layers in [first, end), increasing, whose entering residual
        stream [1, S, d] is appended to ``streams``, from the same call (an EAGLE-3 target's feature rows)."""
        rows = x.shape[1]
        how = paths if paths is not None or rows == 1 else Causal(rows)
        return self.run_segments(x, cos, sin, [(cache, start, how)], first, end, streams, capture)

    def finish(self, x: torch.Tensor,
               logits_rows: slice | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``LlamaDecoder.finish``'s features (the final norm of x [1, S, d]'s rows) and logits (the lm_head
        of the rows ``logits_rows`` picks, all by default) in one foreign call, or None where this call
        cannot take it (a head or norm off our kernels, more logit rows than the head's kernel keeps its
        bits for, or than a prompt's GEMM leaves to it)."""
        rows = x.shape[1]
        if self._head is None or self._final_norm is None or x.shape[0] != 1 or x.device.type != "cpu" \
                or not layer_ops.applies(x, self._final_norm):  # the norm module's own test for its kernel
            return None
        if not (logits_rows is None or isinstance(logits_rows, slice) or logits_rows.dim() == 1):
            return None  # the modules keep an index tensor's shape
        # Held in a local for the call (a strided slice's picks are a fresh copy).
        picked = torch.arange(rows)[logits_rows if logits_rows is not None else slice(None)].contiguous()
        count = picked.numel()
        head, head_rows = self._head
        if not 0 < count <= min(head_rows, PROMPT_GEMM_ROWS - 1):
            return None
        rows_in = x[0].contiguous()
        features = torch.empty_like(rows_in)
        logits = torch.empty(count, head.n_out)
        status = self._finish_library.dovetail_decoder_finish(
            rows_in.data_ptr(), self._final_norm.data_ptr(), self._model.norm.eps, ctypes.byref(head), rows,
            rows_in.shape[-1], picked.data_ptr(), count, features.data_ptr(),
            logits.data_ptr(), torch.get_num_threads())
        if status == native.BAD_SHAPE:  # the checks above make this a bug, said as one
            raise ValueError(f"the final norm and head refused {count} of {rows} rows")
        if status != 0:
            raise MemoryError(f"the lm_head: no memory for {count} rows")
        return features, logits

    def causal_prompts(self) -> bool:
        """Whether the model's layers attend to a prompt chunk on the exact causal kernel, which the C
        loop calls too (the engine chose ``attention.EXACT`` for them: row-invariant linears, no prompt GEMM)."""
        return all(isinstance(layer, DecoderLayer) and layer.self_attn.kernel is EXACT for layer in self._model.layers)

    def cache_qualifies(self, cache: KVCache) -> bool:
        """A contiguous one-sequence fp32 or bf16 cache, as the C loop reads it."""
        keys, values = cache.keys, cache.values
        return (keys.dtype in layer_ops.CACHE_DTYPES and values.dtype == keys.dtype and keys.shape[1] == 1
                and keys.is_contiguous() and values.is_contiguous())

    def run_segments(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     segments: Sequence[Segment], first: int, end: int,
                     streams: list[torch.Tensor] | None = None, capture: Sequence[int] = ()) -> torch.Tensor:
        """``run`` for several sequences' rows in one call (``cpu_worker.batched``): x [1, S, d]
        holds each segment's rows in order, a segment (cache, start, how) being one sequence's
        decode step (how None, one row), tree (TreePaths) or prompt chunk (``Causal``); the linear layers
        take all rows at once, each segment attends over its own cache. Every cache has the same dtype
        and length."""
        rows = x.shape[1]
        if rows > self.max_rows or not 0 <= first <= end <= len(self._layers):
            raise ValueError(f"{rows} rows through layers [{first}, {end}) of {len(self._layers)} "
                             f"(at most {self.max_rows} rows)")
        if list(capture) != sorted(set(capture)) or any(not first <= layer < end for layer in capture):
            raise ValueError(f"capture layers {list(capture)} must increase within [{first}, {end})")
        caches = [cache for cache, _, _ in segments]
        max_len, dtype = caches[0].max_len, caches[0].keys.dtype
        if any(cache.max_len != max_len or cache.keys.dtype != dtype for cache in caches):
            raise ValueError("the segments' caches differ in length or dtype")
        described = self._describe(segments, first, rows)
        out = x[0].contiguous().clone()
        if first == end:
            return out.unsqueeze(0)
        shape = self._shape(max_len)
        scratch = self.scratch.at_least(self.library.dovetail_decoder_scratch(ctypes.byref(shape), rows))
        cos, sin = cos.contiguous(), sin.contiguous()
        layers = ctypes.byref(self._layers, first * self._layer_size)
        arguments = (out.data_ptr(), layers, end - first, ctypes.byref(shape), cos.data_ptr(), sin.data_ptr(),
                     described, len(segments), int(dtype == torch.bfloat16), rows, scratch.data_ptr())
        if capture:
            captured = torch.empty(len(capture), rows, out.shape[-1], dtype=torch.float32)
            indices = torch.tensor([layer - first for layer in capture], dtype=torch.int64)
            status = self.library.dovetail_decoder_layers_capturing(
                *arguments, ctypes.byref(_Capture(len(capture), indices.data_ptr(), captured.data_ptr())),
                torch.get_num_threads())
        else:
            status = self.library.dovetail_decoder_layers(*arguments, torch.get_num_threads())
        if status == native.BAD_SHAPE:  # the checks above make this a bug, said as one
            raise ValueError(f"decoder layers refused {rows} rows in {len(segments)} segments, capture {list(capture)}")
        if status != 0:
            raise MemoryError(f"decoder layers: no memory for {rows} rows' scratch")
        if capture:
            assert streams is not None, "captured streams need a list to go to"
            streams.extend(captured.unsqueeze(1).unbind(0))
        return out.unsqueeze(0)

    def _describe(self, segments: Sequence[Segment], first: int, rows: int) -> ctypes.Array[_Segment]:
        """The segments as the C loop reads them, their caches from layer ``first`` on."""
        described = (_Segment * len(segments))()
        counted = 0
        for index, (cache, start, how) in enumerate(segments):
            length = 1 if how is None else how.size if isinstance(how, TreePaths) else how.rows
            if length < 1 or start < 0 or start + length > cache.max_len:
                raise ValueError(f"slots [{start}, {start + length}) outside a {cache.max_len}-slot cache")
            if isinstance(how, TreePaths):
                shared, extra, extra_start = start, how.flat.data_ptr(), how.offsets.data_ptr()
            elif isinstance(how, Causal):  # no extra slots: the C loop attends causally from start
                shared, extra, extra_start = start, None, None
            else:
                shared, extra, extra_start = start + 1, self._no_extra.data_ptr(), self._no_extra.data_ptr()
            described[index] = _Segment(length, cache.keys[first].data_ptr(), cache.values[first].data_ptr(), start,
                                        shared, extra, extra_start)
            counted += length
        if counted != rows:
            raise ValueError(f"{rows} rows for segments of {counted} (a decode step is one row, a tree its nodes)")
        return described

    def _shape(self, max_len: int) -> _Shape:
        shape = self._shapes.get(max_len)
        if shape is None:
            shape = self._shapes[max_len] = loop_shape(self._model.spec, max_len)
        return shape
