"""The EAGLE-3 draft head (EAGLE-3 paper; layout of SafeAILab/EAGLE's published checkpoints).

Inputs at draft position i: a feature row and the target token id ``x_{i+1}``. The feature row is
either the target's aux row ``[h_a; h_b; h_c]`` (3 * Ht floats: the residual stream entering target
layers a < b < c), reduced by ``fc`` to the head's width H, or the head's own earlier output [H]
(a deeper draft step). With ``g`` that H-wide feature and ``e`` the target's embedding of the token:

    eagle3 fusion (published):
        a = hidden_norm(g);  b = input_layernorm(e)
        x = g + Attn([b; a])                      # q/k/v read 2H, o_proj writes H
        out = x + MLP(post_attention_layernorm(x))

    dgf-eagle3 fusion (Dovetail's): as above, plus DGF's gate between g and the embedding joined
    to the residual stream, so the MLP sees the token directly and not only through attention:
        h1 = a W_1;  h2 = silu(b W_2);  z = sigmoid([h1; h2] W_z);  u = z * h1 + (1 - z) * h2
        x = g + u + Attn([b; a])
        out = x + MLP(post_attention_layernorm(x))

A deeper head (``num_hidden_layers`` L > 1, Dovetail's; published heads have one layer) follows
that layer with L - 1 plain Llama decoder layers at width H (``post_layers``, each with its own
KV cache layer): out = post_layers(out).

``out`` (pre-norm) is what the next draft step takes as its feature; the draft distribution is
``log_softmax(lm_head(norm(out)))`` over the reduced draft vocabulary, whose id d is target id
``d + d2t[d]``; ``t2d[t]`` says whether target id t is in the draft vocabulary.

Parameter and buffer names are the published checkpoint's so a ``model.safetensors`` loads by name.
The embedding is the target's and is not part of the head's files (``file_state_dict``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from cpu_worker.model import (
    MLP,
    Attention,
    CacheSegment,
    DecoderLayer,
    KVCache,
    LlamaSpec,
    NativeEagle3Layer,
    RMSNorm,
    RowwiseInt8Linear,
)
from cpu_worker.model.embedding import new_embedding

from .head_formats import FUSION_WEIGHTS, native_layers_of, quantize_projections

# The layer rule and the names are torch-free (the coordinator reads them): one copy, there.
from .head_layout import AUX_LAYERS_KEY as AUX_LAYERS_KEY
from .head_layout import EAGLE3_FUSIONS as EAGLE3_FUSIONS
from .head_layout import resolve_aux_layers as resolve_aux_layers


class Eagle3Layer(nn.Module):
    """The head's one decoder layer (``midlayer``): attention over [input_layernorm(e); hidden_norm(g)]."""

    def __init__(self, spec: LlamaSpec):
        super().__init__()
        d = spec.hidden_size
        self.input_layernorm = RMSNorm(d, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, spec.rms_norm_eps)
        # The shared attention, built 2H wide, with its output projection back to H.
        self.self_attn = Attention(dataclasses.replace(spec, hidden_size=2 * d))
        self.self_attn.o_proj = nn.Linear(spec.num_heads * spec.head_dim, d, bias=spec.o_bias)
        self.mlp = MLP(spec)


class Eagle3Head(nn.Module):
    """fc over three target layers + the EAGLE-3 decoder layer (+ any plain ones after it) + norm
    + lm_head over a draft vocabulary."""

    d2t: torch.Tensor  # [Vd] int64: target id of draft id d is d + d2t[d]
    t2d: torch.Tensor  # [V] bool: target id in the draft vocabulary

    def __init__(self, spec: LlamaSpec, *, target_hidden_size: int, draft_vocab_size: int, fusion: str = "eagle3"):
        super().__init__()
        if fusion not in EAGLE3_FUSIONS:
            raise ValueError(f"unknown EAGLE-3 fusion {fusion!r}; supported: {', '.join(EAGLE3_FUSIONS)}")
        if spec.num_layers < 1:
            raise ValueError(f"an EAGLE-3 head has at least one decoder layer, the config says {spec.num_layers}")
        if not 0 < draft_vocab_size <= spec.vocab_size:
            raise ValueError(f"draft vocabulary size {draft_vocab_size} must be in 1..{spec.vocab_size} "
                             "(the target's vocabulary size)")
        d = spec.hidden_size
        if 3 * target_hidden_size == d:
            # forward tells target rows from its own outputs by width.
            raise ValueError(f"3 * target hidden size equals the head's hidden size ({d}): rows are ambiguous")
        self.spec = spec
        self.fusion = fusion
        self.feature_size = 3 * target_hidden_size
        self.hidden_size = d
        self.vocab_size = spec.vocab_size
        self.draft_vocab_size = draft_vocab_size
        # The target's embedding, frozen; loaded from the target folder, not the head's.
        self.embed_tokens: nn.Module = new_embedding(spec.vocab_size, d)  # or a StoredEmbedding (HeadPlacer)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc: nn.Linear | RowwiseInt8Linear = nn.Linear(self.feature_size, d, bias=False)
        self.midlayer = Eagle3Layer(spec)
        # Empty for a published (one-layer) head, so its files load unchanged.
        self.post_layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers - 1))
        self.norm = RMSNorm(d, spec.rms_norm_eps)
        self.lm_head: nn.Linear | RowwiseInt8Linear = nn.Linear(d, draft_vocab_size, bias=False)
        # Identity mapping until a vocabulary is set: draft id d is target id d.
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[:draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        if fusion == "dgf-eagle3":
            # Used as x @ W ([in, out]), as in gpu_worker.head.DraftHead.
            self.W_1 = nn.Parameter(torch.empty(d, d))
            self.W_2 = nn.Parameter(torch.empty(d, d))
            self.W_z = nn.Parameter(torch.empty(2 * d, d))
            for weight in (self.W_1, self.W_2, self.W_z):
                if not weight.is_meta:  # on meta (a loader's build) normal_ first imports torch._dynamo: seconds
                    nn.init.normal_(weight, std=weight.shape[0] ** -0.5)
        self.int8_fusion: nn.ModuleDict | None = None
        self.projection_format: str | None = None  # int8 or q4_0 once quantized (head_formats)

    # -- vocabulary ---------------------------------------------------------------------------

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Make the draft vocabulary the given distinct target ids (stored sorted, as EAGLE-3 does)."""
        ids = torch.unique(target_ids.to(torch.int64).flatten())  # sorted
        if ids.numel() != self.draft_vocab_size:
            raise ValueError(f"{ids.numel()} distinct target ids for a draft vocabulary of {self.draft_vocab_size}")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size:
            raise ValueError(f"target ids must be in 0..{self.vocab_size - 1}")
        self.d2t.copy_(ids.to(self.d2t.device) - torch.arange(ids.numel(), device=self.d2t.device))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_draft_ids(self) -> torch.Tensor:
        """[Vd] the target id of every draft id, in draft-id order."""
        return self.draft_to_target(torch.arange(self.draft_vocab_size, device=self.d2t.device))

    # -- forward ------------------------------------------------------------------------------

    def _project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.int8_fusion is not None:
            return self.int8_fusion[name](x)
        weight: torch.Tensor = getattr(self, name)
        return x @ weight

    def reduce(self, features: torch.Tensor) -> torch.Tensor:
        """Target rows [..., 3Ht] go through ``fc``; the head's own outputs [..., H] pass unchanged."""
        width = features.shape[-1]
        if width == self.feature_size:
            return self.fc(features)
        if width == self.hidden_size:
            return features
        raise ValueError(f"feature rows of width {width}: expected {self.feature_size} (3 target layers) "
                         f"or {self.hidden_size} (the head's own output)")

    def layers(self, g: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
               start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """g [B, S, H] (already reduced), tokens [B, S] -> outputs [B, S, H] through every decoder
        layer, layer l on ``cache`` layer l; start and mask as in ``cpu_worker.model.llama.Attention.forward``."""
        attn = self.midlayer.self_attn
        x = self.layer_with(g, tokens, lambda h: attn(h, cos, sin, cache.keys[0], cache.values[0], start, mask))
        for index, layer in enumerate(self.plain_layers, 1):
            x = layer(x, cos, sin, cache.keys[index], cache.values[index], start, mask)
        return x

    @property
    def plain_layers(self) -> list[DecoderLayer]:
        """``post_layers`` typed: the plain decoder layers after the EAGLE-3 one."""
        return [cast(DecoderLayer, layer) for layer in self.post_layers]

    def post_layers_with(self, x: torch.Tensor, attends: Sequence[Callable[[torch.Tensor], torch.Tensor]]
                         ) -> torch.Tensor:
        """The plain layers after the EAGLE-3 one, each attention given as ``attends[i]`` (normed
        input [B, S, H] -> [B, S, H] after o_proj), as ``layer_with`` takes the first's."""
        for layer, attend in zip(self.plain_layers, attends, strict=True):
            x = x + attend(layer.input_layernorm(x))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def layer_with(self, g: torch.Tensor, tokens: torch.Tensor,
                   attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The EAGLE-3 layer's equations with the attention given as ``attend`` (attention input
        [B, S, 2H] -> [B, S, H] after o_proj): training-time test supplies its own key set."""
        mid = self.midlayer
        b = mid.input_layernorm(self.embed_tokens(tokens).to(g.dtype))
        a = mid.hidden_norm(g)
        x = g + attend(torch.cat([b, a], dim=-1))
        if self.fusion == "dgf-eagle3":
            h1 = self._project("W_1", a)
            h2 = F.silu(self._project("W_2", b))
            z = torch.sigmoid(self._project("W_z", torch.cat([h1, h2], dim=-1)))
            x = x + z * h1 + (1 - z) * h2
        return x + mid.mlp(mid.post_attention_layernorm(x))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """S pairs (feature row, target token) written to cache slots [start, start + S).

        cos/sin: rotary rows [S, head_dim] for the rows' positions; ``mask``: bool [S, start + S]
        (True = may attend) or None for a causal continuation. Returns pre-norm outputs [S, H].
        """
        g = self.reduce(features).unsqueeze(0)
        return self.layers(g, tokens.unsqueeze(0), cos, sin, cache, start, mask)[0]

    def forward_segments(self, features: torch.Tensor, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         segments: Sequence[CacheSegment]) -> torch.Tensor:
        """``forward`` for several sequences' rows stacked [N, ...] (a batched draft step): every
        projection over all N rows at once, each segment's rows attending over its own cache. A head
        quantized for the CPU runs its layers in one native call (``native_layer``)."""
        native = self.native_layer()
        if native is not None and native.applies(features, segments):
            reduced = self.reduce(features)
            return native.run(reduced, self.embed_tokens(tokens).to(reduced.dtype), cos, sin, segments)
        g = self.reduce(features).unsqueeze(0)
        attn = self.midlayer.self_attn
        x = self.layer_with(g, tokens.unsqueeze(0), lambda h: attn.forward_segments(h, cos, sin, segments, 0))
        attends = [partial(layer.self_attn.forward_segments, cos=cos, sin=sin, segments=segments, layer=index)
                   for index, layer in enumerate(self.plain_layers, 1)]
        return self.post_layers_with(x, attends)[0]

    def native_layer(self) -> NativeEagle3Layer | None:
        """The head's layers on the native kernels (``cpu_worker.model.native_head``): a head whose
        projections are all on our CPU kernels (``head_formats``), else None. Built once per format."""
        return native_layers_of(self, self._build_native_layer)

    def _build_native_layer(self) -> NativeEagle3Layer | None:
        mid = self.midlayer
        attention, mlp = mid.self_attn, mid.mlp
        if attention.qkv_proj is None or mlp.gate_up_proj is None:
            return None
        gate = None
        if self.fusion == "dgf-eagle3":
            if self.int8_fusion is None:
                return None
            gate = [self.int8_fusion[name] for name in FUSION_WEIGHTS]
        return NativeEagle3Layer.build(
            self.spec, [mid.input_layernorm, mid.hidden_norm, mid.post_attention_layernorm],
            [attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj], gate, self.plain_layers)

    def log_probs(self, output: torch.Tensor) -> torch.Tensor:
        """Draft log-probabilities [S, draft_vocab] in fp32 (half-precision log_softmax loses ranks)."""
        return torch.log_softmax(self.lm_head(self.norm(output)).float(), dim=-1)

    def new_cache(self, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> KVCache:
        return KVCache(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, max_len, dtype, device)

    # -- files and int8 -----------------------------------------------------------------------

    def file_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors of a head folder's ``model.safetensors``: everything but the target's embedding."""
        return {name: tensor for name, tensor in self.state_dict().items() if not name.startswith("embed_tokens.")}

    def quantize_int8(self) -> Eagle3Head:
        """Every projection in W8A8 int8, per token (``cpu_worker.kernels.int8``): a row's output never
        depends on the other rows of its call, as for ``DraftHead.quantize_int8``."""
        quantize_projections(self, "int8")
        return self
