"""A CPU draft head's layers in native calls (``decoder_layers.c``): an EAGLE-3 head's layer in one
(``dovetail_eagle3_layer``) and any plain layers after it on the target's layer loop; a DGF or
EAGLE-1/2 head's fusion in one (``dovetail_draft_fusion``) and its layers on the loop.

Why: a small head's step on the CPU is torch dispatch, not arithmetic. The real pair's head
(SmolLM2-135M, one layer, q4_0 projections) spent ~1 ms extending by two tokens and as much again
per tree level, of which its eight projections took ~0.2 ms: the rest was ~90 tensor allocations,
views, concatenations and a masked SDPA per step. Here the layers are the kernels the target's loop
calls (block, int8 or row-invariant fp32 linears, RMSNorm, rotary and cache write, exact attention
over paths or, for a prompt read at once, causal, SiLU).

The draft only proposes, and the target verifies every token, so this path is not held to the torch
layers' bits: its sigmoid and SiLU are the library's, its attention sums in another order. The two
differ by float rounding (~1e-7 of the largest value) until an activation lands on the other side of
an int8 or block quantization step in one of them; then that row's later values differ by up to about
1% of the largest (neither is more exact: the same arithmetic in another order). Each row's result
depends on that row alone, so a batch drafts each sequence's solo tree. It takes a head whose
projections are all on our kernels (``gpu_worker.head_formats``: int8 or q4_0), fp32 rows over fp32
caches on the CPU; a float head, a CUDA head and training keep the torch layers.
``DOVETAIL_NATIVE_HEAD=python`` forces those (for comparisons; ``DOVETAIL_NATIVE_LAYERS=python`` forces
the target's and the head's).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cpu_worker.kernels import exact_attention, layer_ops
from cpu_worker.kernels.fp32_rows import MAX_KERNEL_ROWS
from cpu_worker.model.llama import CacheSegment, LlamaSpec
from cpu_worker.model.native_views import (
    LAYERS_VARIABLE,
    Scratch,
    describe_layer,
    describe_linear,
    loop_shape,
    norm_weight,
)
from cpu_worker.native import library as native
from cpu_worker.native.library import FUSION_DGF, FUSION_FC
from cpu_worker.native.library import Eagle3 as _Eagle3
from cpu_worker.native.library import Fusion as _Fusion
from cpu_worker.native.library import Layer as _Layer
from cpu_worker.native.library import Linear as _Linear
from cpu_worker.native.library import Segment as _Segment
from cpu_worker.native.library import Shape as _Shape
from ipc.cost_cache import sources_digest

FORCE_VARIABLE = "DOVETAIL_NATIVE_HEAD"

# The sources whose changes change what a CPU draft step costs (the draft cost cache's key reads them).
SOURCES = ("model/native_head.py", "model/native_views.py", "native/decoder_layers.c", "native/layer_ops.c",
           "native/attention.c", "native/block_gemv.c", "native/int8_gemv.c", "native/fp32_rows.c",
           "native/block_rows.c", "native/dovetail.h", "native/library.py", "kernels/block_quant.py",
           "kernels/int8.py", "kernels/layer_ops.py")


def kernel_digest() -> str:
    """A short hash of ``SOURCES``: a draft step measured on other kernels is measured again."""
    return sources_digest(Path(__file__).parents[1], SOURCES)


# Most rows in one call (a prompt read at once: its causal rows carry no paths); more take the torch layers.
MAX_ROWS = MAX_KERNEL_ROWS
KEPT_SCRATCH_FLOATS = 4 << 20  # scratch kept between calls (``Scratch``)

Span = tuple[int, torch.Tensor | None, torch.Tensor | None]  # (shared, extra, extra_start)


def attention_span(segment: CacheSegment) -> Span:
    """(shared, extra, extra_start) of a segment's rows as dovetail_attention reads them: row r attends
    to slots [0, shared) and shared + extra[extra_start[r]:extra_start[r + 1]]. A segment without a
    mask is a causal continuation: no extra slots (None), row r attending to slots [0, start + r]
    (the C loop's causal kernel); a mask [rows, start + rows] becomes its leading columns that every
    row may attend (shared) and each row's other allowed slots."""
    count = segment.end - segment.begin
    if segment.paths is not None:
        if segment.paths.size != count:
            raise ValueError(f"paths of {segment.paths.size} rows for a segment of {count}")
        return segment.start, segment.paths.flat, segment.paths.offsets
    if segment.mask is None:
        return segment.start, None, None
    mask = segment.mask
    if tuple(mask.shape) != (count, segment.start + count) or mask.dtype != torch.bool:
        raise ValueError(f"a {mask.dtype} mask of shape {tuple(mask.shape)} for {count} rows at slot "
                         f"{segment.start} (a bool one of [{count}, {segment.start + count}])")
    shared = int(mask.all(0).to(torch.int8).cumprod(0).sum())
    tail = mask[:, shared:]
    offsets = torch.zeros(count + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(tail.sum(1), 0)
    return shared, tail.nonzero()[:, 1].contiguous(), offsets


def holders(modules: Iterable[nn.Module]) -> list[object]:
    """What descriptors of ``modules`` point into: each module and submodule, their parameters and
    buffers, and the objects holding weights outside those (a block layer's ``weights``, an int8
    layer's ``_int8``), so they outlive a module that lets go of them."""
    kept: list[object] = []
    for module in modules:
        for part in module.modules():
            kept += [part, *part.parameters(recurse=False), *part.buffers(recurse=False)]
            kept += [value for name in ("weights", "_int8") if (value := getattr(part, name, None)) is not None]
    return kept


def check_status(status: int, rows: int) -> None:
    """A C call's status as an exception: MemoryError when its scratch could not be allocated, ValueError
    for anything it refused (which the checks before it should have caught)."""
    if status == native.NO_MEMORY:
        raise MemoryError(f"draft head layers: no memory for {rows} rows' scratch")
    if status != 0:
        raise ValueError(f"draft head layers refused the call (status {status}): its rows or segments do not fit")


def gate_shapes(hidden: int) -> list[tuple[int, int]]:
    """(out, in) of DGF's gate: W_1 and W_2 read hidden, W_z the two joined."""
    return [(hidden, hidden), (hidden, hidden), (hidden, 2 * hidden)]


def _checked(module: nn.Module, out_features: int, in_features: int) -> _Linear | None:
    view = describe_linear(module)
    if view is None or (view[0].n_out, view[0].k) != (out_features, in_features):
        return None
    return view[0]


@dataclass
class _Call:
    """One head forward's rows as the C calls read them (``_HeadLayers.prepare``)."""

    rows: int
    out: torch.Tensor  # [rows, hidden] fp32: the calls' input and output
    embedded: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    spans: list[Span]  # held until the calls return
    shape: _Shape
    bf16: int
    threads: int


class _HeadLayers:
    """What both kinds of head share: the checks, the shapes by cache length, a scratch buffer that grows
    to the largest call (up to ``KEPT_SCRATCH_FLOATS``), and the segments as the C calls read them. The
    descriptors are built once and point into the head's tensors: ``weights`` holds the norms and the
    modules (and their weight holders) they point into, so those stay alive as long as this; a head
    whose weights are replaced (a reload) is a new head, or a new projection format, and gets new
    descriptors."""

    def __init__(self, spec: LlamaSpec, weights: list[object], library: ctypes.CDLL):
        self.spec = spec
        self._weights = weights
        self.library = library
        self._scratch = Scratch(KEPT_SCRATCH_FLOATS)
        self._shapes: dict[int, _Shape] = {}

    @staticmethod
    def loaded() -> ctypes.CDLL | None:
        """The library, where these calls may run in this process (not forced to torch)."""
        if "python" in (os.environ.get(FORCE_VARIABLE, "").lower(), os.environ.get(LAYERS_VARIABLE, "").lower()):
            return None
        library = native.load()
        if library is None or not (layer_ops.available() and exact_attention.available()):
            return None
        return library

    def applies(self, x: torch.Tensor, segments: Sequence[CacheSegment]) -> bool:
        """Whether these rows can take the C calls: at most ``MAX_ROWS`` fp32 CPU rows without
        autograd, each segment's cache one sequence's, contiguous fp32 (a drafter's cache has its rows'
        dtype: torch's layers would attend over a bf16 one in bf16, these in fp32), all of one length."""
        if not segments or x.shape[0] > MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
            return False
        if torch.is_grad_enabled() and x.requires_grad:
            return False
        first = segments[0].cache
        return all(segment.cache.max_len == first.max_len and segment.cache.keys.dtype == torch.float32
                   and segment.cache.values.dtype == torch.float32 and segment.cache.keys.shape[1] == 1
                   and segment.cache.keys.is_contiguous() and segment.cache.values.is_contiguous()
                   for segment in segments)

    def _shape(self, max_len: int) -> _Shape:
        shape = self._shapes.get(max_len)
        if shape is None:
            shape = self._shapes[max_len] = loop_shape(self.spec, max_len)
        return shape

    def prepare(self, x: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Sequence[CacheSegment]) -> _Call:
        """The call's rows checked (ValueError) and laid out: x and embedded [S, hidden], cos/sin
        [S, head_dim], the segments covering the S rows in order."""
        rows, head_dim = x.shape[0], self.spec.head_dim
        if x.shape != (rows, self.spec.hidden_size) or embedded.shape != x.shape \
                or cos.shape != (rows, head_dim) or sin.shape != cos.shape:
            raise ValueError(f"rows {tuple(x.shape)}, embeddings {tuple(embedded.shape)} and rotary rows "
                             f"{tuple(cos.shape)} / {tuple(sin.shape)} do not fit a head of width "
                             f"{self.spec.hidden_size} and head_dim {head_dim}")
        if [segment.begin for segment in segments] != [0, *(segment.end for segment in segments[:-1])] \
                or segments[-1].end != rows:
            raise ValueError(f"segments must cover the {rows} rows in order")
        cache = segments[0].cache
        return _Call(rows, x.to(torch.float32).contiguous().clone(), embedded.to(torch.float32).contiguous(),
                     cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous(),
                     [attention_span(segment) for segment in segments], self._shape(cache.max_len),
                     int(cache.keys.dtype == torch.bfloat16), torch.get_num_threads())

    def scratch(self, floats: int) -> torch.Tensor:
        """At least ``floats`` floats of scratch (``Scratch``), held by the caller for its call."""
        return self._scratch.at_least(floats)

    def layers(self, call: _Call, layers: ctypes.Array[_Layer], segments: Sequence[CacheSegment],
               first: int) -> int:
        """``dovetail_decoder_layers`` over ``call.out``, the segments' caches from layer ``first`` on."""
        scratch = self.scratch(self.library.dovetail_decoder_scratch(ctypes.byref(call.shape), call.rows))
        return self.library.dovetail_decoder_layers(
            call.out.data_ptr(), layers, len(layers), ctypes.byref(call.shape), call.cos.data_ptr(),
            call.sin.data_ptr(), self.segments(segments, call.spans, first), len(segments), call.bf16, call.rows,
            scratch.data_ptr(), call.threads)

    @staticmethod
    def segments(segments: Sequence[CacheSegment], spans: list[Span], layer: int) -> ctypes.Array[_Segment]:
        """The segments as the C call reads them, their caches from ``layer`` on."""
        described = (_Segment * len(segments))()
        for index, (segment, (shared, extra, offsets)) in enumerate(zip(segments, spans, strict=True)):
            cache = segment.cache
            if segment.start < 0 or segment.start + segment.end - segment.begin > cache.max_len:
                raise ValueError(f"slots from {segment.start} outside a {cache.max_len}-slot cache")
            described[index] = _Segment(segment.end - segment.begin, cache.keys[layer].data_ptr(),
                                        cache.values[layer].data_ptr(), segment.start, shared,
                                        None if extra is None else extra.data_ptr(),
                                        None if offsets is None else offsets.data_ptr())
        return described


class NativeEagle3Layer(_HeadLayers):
    """An EAGLE-3 head's layers (``gpu_worker.eagle3``) on the C kernels."""

    def __init__(self, spec: LlamaSpec, layer: _Eagle3, post: ctypes.Array[_Layer] | None,
                 weights: list[object], library: ctypes.CDLL):
        super().__init__(spec, weights, library)
        self._layer = layer
        self._post = post

    @classmethod
    def build(cls, spec: LlamaSpec, norms: Sequence[nn.Module], linears: Sequence[nn.Module],
              gate: Sequence[nn.Module] | None, post_layers: Sequence[nn.Module]) -> NativeEagle3Layer | None:
        """The layer on the C kernels, or None when a part or this process does not qualify.
        ``norms``: input_layernorm, hidden_norm, post_attention_layernorm; ``linears``: the fused
        q/k/v (reading 2 hidden), o, the fused gate/up and down; ``gate``: dgf-eagle3's W_1, W_2, W_z
        as linears, or None; ``post_layers``: plain decoder layers after it, on cache layers 1..."""
        library = cls.loaded()
        if library is None:
            return None
        d, width = spec.hidden_size, spec.intermediate_size
        attention = spec.num_heads * spec.head_dim
        qkv_out = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        shapes = [(qkv_out, 2 * d), (d, attention), (2 * width, d), (d, width)]
        views = [_checked(module, *shape) for module, shape in zip(linears, shapes, strict=True)]
        gates = [_checked(module, *shape) for module, shape in zip(gate or (), gate_shapes(d), strict=False)]
        weights = [norm_weight(norm) for norm in norms]
        post = [describe_layer(layer) for layer in post_layers]
        if any(item is None for item in [*views, *gates, *weights, *post]):
            return None
        unused = _Linear()
        layer = _Eagle3(*(weight.data_ptr() for weight in weights if weight is not None), *views,
                        int(gate is not None), *(gates if gate is not None else [unused] * 3))
        post_array = (_Layer * len(post))(*(item[0] for item in post if item is not None)) if post else None
        return cls(spec, layer, post_array, holders([*norms, *linears, *(gate or ()), *post_layers]), library)

    def run(self, g: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            segments: Sequence[CacheSegment]) -> torch.Tensor:
        """The head's layers on rows [S, hidden] (``applies`` must hold): ``g`` the features after fc,
        ``embedded`` the tokens' embeddings, cos/sin [S, head_dim] the rows' rotary rows; each segment's
        rows [begin, end) go to its cache's slots start.. and attend as ``attention_span`` says.
        Returns the pre-norm outputs [S, hidden]."""
        call = self.prepare(g, embedded, cos, sin, segments)
        scratch = self.scratch(self.library.dovetail_eagle3_scratch(ctypes.byref(call.shape), call.rows))
        status = self.library.dovetail_eagle3_layer(
            call.out.data_ptr(), call.embedded.data_ptr(), ctypes.byref(self._layer), ctypes.byref(call.shape),
            call.cos.data_ptr(), call.sin.data_ptr(), self.segments(segments, call.spans, 0), len(segments), call.bf16,
            call.rows, scratch.data_ptr(), call.threads)
        if status == 0 and self._post is not None:
            status = self.layers(call, self._post, segments, 1)
        check_status(status, call.rows)
        return call.out


class NativeDraftLayers(_HeadLayers):
    """A DGF or EAGLE-1/2 head's fusion and decoder layers (``gpu_worker.head``) on the C kernels."""

    def __init__(self, spec: LlamaSpec, fusion: _Fusion, layers: ctypes.Array[_Layer], weights: list[object],
                 library: ctypes.CDLL):
        super().__init__(spec, weights, library)
        self._fusion = fusion
        self._layers = layers

    @classmethod
    def build(cls, spec: LlamaSpec, input_norm: nn.Module | None, fusion: Sequence[nn.Module],
              layers: Sequence[nn.Module]) -> NativeDraftLayers | None:
        """The head on the C kernels, or None when a part or this process does not qualify.
        ``fusion``: DGF's W_1, W_2, W_z as linears (with ``input_norm``, the embedding's), or EAGLE-1/2's fc
        alone (``input_norm`` None); ``layers``: its decoder layers, the first without an input norm."""
        library = cls.loaded()
        if library is None or not layers:
            return None
        d = spec.hidden_size
        unused = _Linear()
        norm = None if input_norm is None else norm_weight(input_norm)
        if input_norm is None:  # EAGLE-1/2: fc alone
            kind, views = FUSION_FC, [unused] * 3 + [_checked(fusion[0], d, 2 * d) if len(fusion) == 1 else None]
        else:  # DGF: its gate
            kind = FUSION_DGF
            views = [_checked(module, *shape) for module, shape in zip(fusion, gate_shapes(d), strict=True)]
            views.append(unused)
        described = [describe_layer(layer, first_of_head=index == 0) for index, layer in enumerate(layers)]
        if any(item is None for item in [*views, *described]) or (input_norm is not None and norm is None):
            return None
        described_fusion = _Fusion(kind, None if norm is None else norm.data_ptr(), *views)
        array = (_Layer * len(described))(*(item[0] for item in described if item is not None))
        modules = [*fusion, *layers] if input_norm is None else [input_norm, *fusion, *layers]
        return cls(spec, described_fusion, array, holders(modules), library)

    def run(self, features: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            segments: Sequence[CacheSegment]) -> torch.Tensor:
        """``NativeEagle3Layer.run`` for this head: its fusion of ``features`` (the target's rows) and
        ``embedded``, then its layers. Returns the output features [S, hidden]."""
        call = self.prepare(features, embedded, cos, sin, segments)
        fused = torch.empty_like(call.out)
        scratch = self.scratch(self.library.dovetail_fusion_scratch(self.spec.hidden_size, call.rows))
        status = self.library.dovetail_draft_fusion(
            fused.data_ptr(), call.out.data_ptr(), call.embedded.data_ptr(), ctypes.byref(self._fusion),
            self.spec.hidden_size, self.spec.rms_norm_eps, call.rows, scratch.data_ptr(), call.threads)
        if status == 0:
            call.out = fused
            status = self.layers(call, self._layers, segments, 0)
        check_status(status, call.rows)
        return call.out
