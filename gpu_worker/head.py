"""The feature-level draft head (DESIGN.md section 5).

At draft position i the head sees the target's feature ``f_i`` (last hidden state after
the final norm) and the token ``x_{i+1}``; it fuses them, runs N Llama decoder layers
(the first without its input norm, no final norm) and scores with a frozen copy of the
target's lm_head. Its output feature predicts ``f_{i+1}`` and feeds the next draft step.

Parameter names follow the published layouts so checkpoints load by name:
``embed_tokens``, ``fc`` (EAGLE-1/2), ``W_1``/``W_2``/``W_z``/``input_layernorm`` (DGF),
``layers.N.*``, ``lm_head``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from cpu_worker.model import (
    CacheSegment,
    DecoderLayer,
    KVCache,
    LlamaSpec,
    NativeDraftLayers,
    RMSNorm,
    RowwiseInt8Linear,
)
from cpu_worker.model.embedding import new_embedding

from .head_formats import FUSION_WEIGHTS, native_layers_of, quantize_projections

FUSIONS = ("dgf", "fc")


class DraftHead(nn.Module):
    """Fusion + ``spec.num_layers`` decoder layers + frozen lm_head.

    ``spec`` describes the head (its ``num_layers`` is the number of draft layers); hidden
    size and vocabulary are the target's.
    """

    def __init__(self, spec: LlamaSpec, fusion: str = "dgf", fc_bias: bool = True):
        super().__init__()
        if fusion not in FUSIONS:
            raise ValueError(f"unknown draft fusion {fusion!r}; supported: {', '.join(FUSIONS)}")
        if spec.num_layers < 1:
            raise ValueError("a draft head needs at least one decoder layer")
        self.spec = spec
        self.fusion = fusion
        d = spec.hidden_size
        # Frozen copies of the target's embedding and head: trained heads never update them.
        self.embed_tokens: nn.Module = new_embedding(spec.vocab_size, d)  # or a StoredEmbedding (HeadPlacer)
        self.embed_tokens.weight.requires_grad_(False)
        if fusion == "dgf":
            self.input_layernorm = RMSNorm(d, spec.rms_norm_eps)
            # Used as x @ W (Dovetail's layout), hence [in, out].
            self.W_1 = nn.Parameter(torch.empty(d, d))
            self.W_2 = nn.Parameter(torch.empty(d, d))
            self.W_z = nn.Parameter(torch.empty(2 * d, d))
            for weight in (self.W_1, self.W_2, self.W_z):
                if not weight.is_meta:  # on meta (a loader's build) normal_ first imports torch._dynamo: seconds
                    nn.init.normal_(weight, std=weight.shape[0] ** -0.5)
        else:
            self.fc: nn.Linear | RowwiseInt8Linear = nn.Linear(2 * d, d, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(spec, input_norm=index > 0) for index in range(spec.num_layers))
        self.lm_head: nn.Linear | RowwiseInt8Linear = nn.Linear(d, spec.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        # DGF's W_1/W_2/W_z as quantized layers after quantize_projections (int8 or q4_0).
        self.int8_fusion: nn.ModuleDict | None = None
        self.projection_format: str | None = None  # int8 or q4_0 once quantized (head_formats)

    def quantize_int8(self) -> DraftHead:
        """Every projection in W8A8 int8, per-token (``cpu_worker.kernels.int8``), for drafting on a CPU:
        there the draft shares the memory bus with the target, so its bytes per step matter."""
        quantize_projections(self, "int8")
        return self

    def _project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.int8_fusion is not None:
            return self.int8_fusion[name](x)
        return x @ getattr(self, name)

    @property
    def fc_bias(self) -> bool:
        return self.fusion == "fc" and self.fc.bias is not None

    def fuse(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """features [S, d], tokens [S] -> fused input [S, d] of the first decoder layer."""
        embedded = self.embed_tokens(tokens)
        if self.fusion == "fc":
            # EAGLE order: raw embedding first, then the feature; no activation.
            return self.fc(torch.cat([embedded, features], dim=-1))
        h1 = self._project("W_1", features)
        h2 = F.silu(self._project("W_2", self.input_layernorm(embedded)))
        gate = torch.sigmoid(self._project("W_z", torch.cat([h1, h2], dim=-1)))
        return gate * h1 + (1 - gate) * h2

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """S pairs (f_i, x_{i+1}) written to cache slots [start, start + S).

        cos/sin: rotary rows [S, head_dim] for the pairs' draft positions; ``mask``: bool
        [S, start + S] (True = may attend) or None for a causal continuation.
        Returns the output features [S, d] (predictions of the next target features).
        """
        x = self.fuse(features, tokens).unsqueeze(0)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.keys[index], cache.values[index], start, mask)
        return x[0]

    def forward_segments(self, features: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         segments: Sequence[CacheSegment]) -> torch.Tensor:
        """``forward`` for several sequences' pairs stacked [N, ...] (a batched draft step): every
        projection over all N rows at once, each segment's rows attending over its own cache. A head
        quantized for the CPU runs its fusion and layers in native calls (``native_layers``)."""
        native = self.native_layers()
        if native is not None and native.applies(features, segments):
            return native.run(features, self.embed_tokens(tokens), cos, sin, segments)
        x = self.fuse(features, tokens).unsqueeze(0)
        for index, module in enumerate(self.layers):
            layer = cast(DecoderLayer, module)
            # DecoderLayer.forward's two residual steps, the attention split by sequence.
            x = x + layer.self_attn.forward_segments(layer.input_layernorm(x), cos, sin, segments, index)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x[0]

    def native_layers(self) -> NativeDraftLayers | None:
        """The head's fusion and layers on the native kernels (``cpu_worker.model.native_head``): a head
        whose projections are all on our CPU kernels (``head_formats``), else None. Built once per format."""
        return native_layers_of(self, self._build_native_layers)

    def _build_native_layers(self) -> NativeDraftLayers | None:
        if self.fusion == "fc":
            return NativeDraftLayers.build(self.spec, None, [self.fc], list(self.layers))
        if self.int8_fusion is None:
            return None
        return NativeDraftLayers.build(self.spec, self.input_layernorm,
                                       [self.int8_fusion[name] for name in FUSION_WEIGHTS], list(self.layers))

    def log_probs(self, output_features: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [S, vocab] in fp32 (half-precision log_softmax loses ranks)."""
        return torch.log_softmax(self.lm_head(output_features).float(), dim=-1)
