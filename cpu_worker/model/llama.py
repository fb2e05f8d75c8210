"""A compact Llama-family decoder (Llama 2/3, Mistral, Qwen2) with an explicit KV cache.

Module names mirror Hugging Face's (``embed_tokens``, ``layers.N.self_attn.q_proj``, ...)
so checkpoints load by name. The draft head in ``gpu_worker`` reuses these decoder layers,
both for inference and for training (``gpu_worker.train.forward``).

Inference works on one sequence (batch 1) of S new tokens that sit at cache slots
``[start, start + S)``; their positions are given explicitly so a draft tree can put
several nodes at the same position, and the attention mask is explicit whenever the
new tokens are not a plain causal continuation. Without a cache, ``Attention`` and
``DecoderLayer`` take [B, S] windows instead: causal attention within each row, positions
0..S-1 (the draft head's training forward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from cpu_worker.kernels import attention as attention_kernels
from cpu_worker.kernels import layer_ops
from cpu_worker.kernels.attention import AttentionKernel
from cpu_worker.kernels.exact_attention import TreePaths
from cpu_worker.model.embedding import new_embedding

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """A model config that this decoder cannot run faithfully."""


@dataclass(frozen=True)
class LlamaSpec:
    """The architecture facts the decoder needs, parsed from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    model_type: str = "llama"

    @property
    def context_limit(self) -> int:
        """The longest context served: the trained one, or a smaller sliding window (sliding-window
        attention is not implemented, so contexts that would need it are refused)."""
        limit = self.max_position_embeddings
        return limit if self.sliding_window is None else min(limit, self.sliding_window)

    @classmethod
    def from_hf_config(cls, config: Any) -> LlamaSpec:
        """Parse a transformers PretrainedConfig (either rope field style)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        rope = dict(getattr(config, "rope_parameters", None) or {})
        legacy_scaling = getattr(config, "rope_scaling", None)
        if not rope:
            rope = dict(legacy_scaling or {})
            rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"RoPE scaling type {rope_type!r} is not implemented; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        rope_theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0) or 10000.0))
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
        scaling["rope_type"] = rope_type
        num_heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
        sliding_window = None
        if model_type == "mistral" or getattr(config, "use_sliding_window", False):
            sliding_window = getattr(config, "sliding_window", None)
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=rope_theta,
            max_position_embeddings=int(config.max_position_embeddings),
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=int(sliding_window) if sliding_window else None,
            model_type=model_type,
        )


def rope_inverse_frequencies(spec: LlamaSpec) -> torch.Tensor:
    """inv_freq [head_dim/2] in fp64-then-fp32, with linear or llama3 scaling applied."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).double() / dim))
    scaling = spec.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_context / low
        high_wavelen = old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq.float()


class RotaryTable:
    """cos/sin rows for every position up to ``max_len``, looked up by explicit positions."""

    def __init__(self, spec: LlamaSpec, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        inv_freq = rope_inverse_frequencies(spec).to(device)
        angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(dtype)
        self.sin = angles.sin().to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # A decode step: a view of one row, no gather (CPU positions: reading a CUDA one would wait for it).
        if positions.dim() == 1 and positions.numel() == 1 and positions.device.type == "cpu":
            position = int(positions)
            if 0 <= position < self.cos.shape[0]:
                return self.cos[position:position + 1], self.sin[position:position + 1]
        return self.cos[positions], self.sin[positions]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, head_dim]; cos/sin [S, head_dim] (shared by every row)."""
    return x * cos + _rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if layer_ops.applies(x, self.weight):
            return layer_ops.rms_norm(x, self.weight, self.eps)  # one call, not torch's chain of ten ops
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 like the reference implementations, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class KVCache:
    """Preallocated keys and values of every layer for one sequence.

    ``keys[layer]`` is [1, kv_heads, max_len, head_dim]. Slots past the committed length
    may hold stale rows (a rejected tree) or nothing yet; the attention length and mask never
    read them. Allocated empty, not zeroed: on the CPU the pages of a large allocation are
    committed only as they are first written, so memory grows with the context actually used
    (a Llama-3.1-8B at its full 128k context would otherwise commit 32 GB of fp32 KV at once).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, 1, num_kv_heads, max_len, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        """Bytes at full context (committed as the sequence fills it)."""
        return 2 * self.keys.numel() * self.keys.element_size()

    def gather_rows(self, source: torch.Tensor, destination_start: int) -> None:
        """Copy slots ``source`` (1-D index tensor) to ``destination_start...`` in every layer."""
        count = source.numel()
        end = destination_start + count
        self.keys[:, :, :, destination_start:end] = self.keys.index_select(3, source)
        self.values[:, :, :, destination_start:end] = self.values.index_select(3, source)


@dataclass(frozen=True)
class CacheSegment:
    """One sequence's rows in a forward over several sequences' stacked rows: rows [begin, end)
    go to slots [start, start + end - begin) of its own ``cache`` and attend over that cache only,
    as the sequence alone would (``mask`` or ``paths`` as ``Attention.forward`` takes them)."""

    cache: KVCache
    start: int
    begin: int
    end: int
    mask: torch.Tensor | None = None
    paths: TreePaths | None = None


class Projection(Protocol):
    """How a layer gets its rotated queries and keys and its values [B, heads, S, head_dim]:
    on the separate q/k/v layers or the fused one, rotated by torch's ops or, with a cache, in
    the native call that also writes the keys and values to their slots. Chosen once: unfused
    layers project separately, ``fusion.fuse_projections`` sets the fused default, an engine
    fixes its own (``Attention.choose_kernels``)."""

    name: str

    def window(self, attention: Attention, x: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of x [B, S, d], no cache involved."""
        ...

    def into_cache(self, attention: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor,
                   start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of x [B, S, d], with k and v written to slots [start, start + S) of the cache."""
        ...


def _into_slots(rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor,
                start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, k, v = rows
    end = start + k.shape[2]
    keys[:, :, start:end] = k
    values[:, :, start:end] = v
    return rows


class SeparateProjection:
    """q, k and v on their own layers, each rotated on its own."""

    name = "separate"

    def window(self, attention: Attention, x: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, _ = x.shape
        q = attention.q_proj(x).view(batch, length, attention.num_heads, attention.head_dim).transpose(1, 2)
        k = attention.k_proj(x).view(batch, length, attention.num_kv_heads, attention.head_dim).transpose(1, 2)
        v = attention.v_proj(x).view(batch, length, attention.num_kv_heads, attention.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def into_cache(self, attention: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor,
                   start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _into_slots(self.window(attention, x, cos, sin), keys, values, start)


class FusedProjection:
    """One q/k/v projection, and one rotary pass over the query and key heads side by side
    (the same values as two: every element is rotated on its own)."""

    name = "fused"

    def window(self, attention: Attention, x: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert attention.qkv_proj is not None
        return self._rotated(attention, attention.qkv_proj(x), cos, sin)

    def _rotated(self, attention: Attention, projected: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, length, _ = projected.shape
        heads = projected.view(batch, length, -1, attention.head_dim).transpose(1, 2)
        split = attention.num_heads + attention.num_kv_heads
        rotated = apply_rope(heads[:, :split], cos, sin)
        return rotated[:, :attention.num_heads], rotated[:, attention.num_heads:], heads[:, split:]

    def into_cache(self, attention: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   keys: torch.Tensor, values: torch.Tensor,
                   start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert attention.qkv_proj is not None
        return self.from_projected(attention, attention.qkv_proj(x), cos, sin, keys, values, start)

    def from_projected(self, attention: Attention, projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor,
                       start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``into_cache`` of rows whose q/k/v projection ``projected`` [B, S, width] is already
        done (a batched forward projects several sequences' rows in one call, ``cpu_worker.batched``)."""
        return _into_slots(self._rotated(attention, projected, cos, sin), keys, values, start)


class NativeRopeProjection(FusedProjection):
    """The fused projection, then one native call (``layer_ops.rope_qkv``) that rotates q and k and
    writes this call's keys and values to their slots: fp32 rows on the CPU, a one-sequence
    contiguous fp32 or bf16 cache, no autograd (whoever picks it has checked)."""

    name = "native-rope"

    def from_projected(self, attention: Attention, projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor,
                       start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = layer_ops.rope_qkv(projected, cos, sin, keys, values, start, attention.num_heads, attention.num_kv_heads)
        end = start + projected.shape[1]
        return q, keys[:, :, start:end], values[:, :, start:end]


class AutoFusedProjection(NativeRopeProjection):
    """A fused layer's default until an engine chooses: the native call where this call allows it,
    the torch rotary otherwise (a draft head's layers move between devices and dtypes, and train)."""

    name = "fused-auto"

    def from_projected(self, attention: Attention, projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor,
                       start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if _native_cache_layer(keys, values) and layer_ops.applies(projected):
            return super().from_projected(attention, projected, cos, sin, keys, values, start)
        return _into_slots(self._rotated(attention, projected, cos, sin), keys, values, start)


SEPARATE, FUSED, NATIVE_ROPE, AUTO_FUSED = (SeparateProjection(), FusedProjection(), NativeRopeProjection(),
                                            AutoFusedProjection())


class Attention(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.gqa = spec.num_heads != spec.num_kv_heads
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=spec.o_bias)
        # Set by ``fusion.fuse_projections`` (which then drops q/k/v_proj): all three in one call.
        self.qkv_proj: nn.Module | None = None
        # The kernels, chosen once: these defaults test each call (a draft head's layers move and
        # train); an engine fixes its own (``choose_kernels``).
        self.projection: Projection = SEPARATE
        self.kernel: AttentionKernel = attention_kernels.AUTO

    def use_fused(self, qkv: nn.Module) -> None:
        """q/k/v as the one layer ``qkv`` from now on (``fusion.fuse_projections``)."""
        self.qkv_proj = qkv
        del self.q_proj, self.k_proj, self.v_proj
        self.projection = AUTO_FUSED

    def choose_kernels(self, kernel: AttentionKernel, native_rope: bool) -> None:
        """Fix this layer's kernels (an engine's choice, ``cpu_worker.engine.choose_kernels``):
        ``kernel`` attends; a fused layer rotates and writes the cache in one native call where
        ``native_rope``, with torch's ops otherwise."""
        self.kernel = kernel
        if self.qkv_proj is None:
            self.projection = SEPARATE
        else:
            self.projection = NATIVE_ROPE if native_rope else FUSED

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: torch.Tensor | None = None, values: torch.Tensor | None = None, start: int = 0,
                mask: torch.Tensor | None = None, paths: TreePaths | None = None) -> torch.Tensor:
        """x [B, S, d]; cos/sin [S, head_dim] for the S tokens' positions.

        With a cache, ``keys``/``values`` are this layer's views [B, kv, max_len, hd] (B = 1
        in the engine and drafter): the new rows go to slots [start, start + S) and attend to
        every slot before them. ``keys=None``: no cache, the S tokens are the whole sequence
        (``start`` must be 0). ``mask``: bool [S, start + S] (True = may attend) or None for
        a causal continuation. ``paths`` (a tree, with a cache; replaces ``mask``): each row's
        ancestors and itself, root first (``TreePaths``, made once per tree, used by every
        layer); each row then attends exactly as a one-token decode at its position would, bit
        for bit (``kernels.attention``: the exact kernel, else row by row).
        """
        batch, length, _ = x.shape
        if keys is None or values is None:
            if start != 0:
                raise ValueError("attention without a KV cache starts at slot 0")
            q, k, v = self.projection.window(self, x, cos, sin)
            out = attention_kernels.attend_causal(q, k, v, 0, mask, self.gqa)
        else:
            q, k, v = self.projection.into_cache(self, x, cos, sin, keys, values, start)
            out = self.kernel.attend(q, k, v, keys, values, start, mask, paths, self.gqa)
        return self.o_proj(out.to(x.dtype).transpose(1, 2).reshape(batch, length, -1))

    def forward_segments(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         segments: Sequence[CacheSegment], layer: int) -> torch.Tensor:
        """``forward`` for several sequences' rows stacked in x [1, N, d] (cos/sin [N, head_dim]),
        each segment on layer ``layer`` of its own cache: one q/k/v projection and one output
        projection over all N rows, each segment's cache write and attention on its own. A row
        gets the bits it would get alone wherever the projections are row-invariant."""
        projection = self.projection
        fused = self.qkv_proj is not None and isinstance(projection, FusedProjection)
        projected = self.qkv_proj(x) if fused and self.qkv_proj is not None else None
        rows = None if projected is not None else projection.window(self, x, cos, sin)
        pieces = []
        for segment in segments:
            begin, end = segment.begin, segment.end
            keys, values = segment.cache.keys[layer], segment.cache.values[layer]
            if projected is not None:
                assert isinstance(projection, FusedProjection)
                q, k, v = projection.from_projected(self, projected[:, begin:end], cos[begin:end], sin[begin:end],
                                                    keys, values, segment.start)
            else:
                assert rows is not None
                q, k, v = _into_slots(tuple(part[:, :, begin:end] for part in rows),  # type: ignore[arg-type]
                                      keys, values, segment.start)
            out = self.kernel.attend(q, k, v, keys, values, segment.start, segment.mask, segment.paths, self.gqa)
            pieces.append(out.to(x.dtype).transpose(1, 2).reshape(1, end - begin, -1))
        return self.o_proj(torch.cat(pieces, dim=1))


def _native_cache_layer(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """A one-sequence fp32 or bf16 cache layer that ``layer_ops.rope_qkv`` can write into."""
    return (keys.dtype in layer_ops.CACHE_DTYPES and values.dtype == keys.dtype and keys.shape[0] == 1
            and keys.is_contiguous() and values.is_contiguous())


class MLP(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        # Set by ``fusion.fuse_projections`` (which then drops gate/up_proj): both in one call.
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if layer_ops.applies(gate, up):
            # One call, the kernel ``native_layers`` chains too: every path gives the same bits.
            return self.down_proj(layer_ops.silu_mul(gate, up))
        if self.gate_up_proj is not None:
            return self.down_proj(F.silu(gate).mul_(up))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm Llama block. ``input_norm=False`` drops the attention input norm
    (the first layer of an EAGLE/DGF draft head has none)."""

    def __init__(self, spec: LlamaSpec, input_norm: bool = True):
        super().__init__()
        self.input_layernorm: nn.Module = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keys: torch.Tensor | None = None, values: torch.Tensor | None = None, start: int = 0,
                mask: torch.Tensor | None = None, paths: TreePaths | None = None) -> torch.Tensor:
        """x [B, S, d] -> [B, S, d]; cache arguments as in ``Attention.forward`` (None: no cache)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, keys, values, start, mask, paths)
        return x + self.mlp(self.post_attention_layernorm(x))


class LayerLoop(Protocol):
    """Runs the decoder layers of some forwards elsewhere, and their final norm and lm_head where it can
    (``finish``: None where not), with the modules' bits (``native_layers.NativeLayers``: foreign calls)."""

    def applies(self, x: torch.Tensor, cache: KVCache, mask: torch.Tensor | None,
                paths: TreePaths | None) -> bool: ...

    def finish(self, x: torch.Tensor,
               logits_rows: slice | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int,
            paths: TreePaths | None, first: int, end: int, streams: list[torch.Tensor] | None = None,
            capture: Sequence[int] = ()) -> torch.Tensor: ...


class LlamaDecoder(nn.Module):
    """The whole causal LM: embeddings, decoder layers, final norm, lm_head."""

    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.spec = spec
        # The loaders build this on the meta device and place the checkpoint's weights (new_embedding).
        # A quantized model may hold its table as stored instead (``embedding``: rows widened on lookup).
        self.embed_tokens: nn.Module = new_embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # Set by the target engine where the layers qualify (``native_layers``); forwards it
        # applies to skip the Python layers.
        self.layer_loop: LayerLoop | None = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                rotary: RotaryTable, start: int, mask: torch.Tensor | None,
                logits_rows: slice | torch.Tensor | None = None,
                paths: TreePaths | None = None,
                aux_layers: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions: [S]. Returns (features, logits [R, vocab] for the rows
        ``logits_rows`` selects, all rows by default). Features: [S, d] after the final norm;
        with ``aux_layers`` (EAGLE-3 heads; increasing layer indices) [S, len * d] instead, the
        residual streams entering those layers (before their input norm), concatenated in order.
        ``paths``: tree rows attend exactly as decoding would (Attention.forward)."""
        cos, sin = rotary.lookup(positions)
        x = self.embed_tokens(tokens).unsqueeze(0)
        streams: list[torch.Tensor] = []
        x = self.run_layers(x, cos, sin, cache, start, mask, paths, aux_layers, streams, 0, len(self.layers))
        return self.finish(x, streams, logits_rows, aux_layers)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int,
                   mask: torch.Tensor | None, paths: TreePaths | None, aux_layers: Sequence[int] | None,
                   streams: list[torch.Tensor], first: int, end: int) -> torch.Tensor:
        """Layers ``first`` to ``end - 1`` of ``forward`` (the residual stream entering each aux layer
        appended to ``streams``): a forward may run in several such parts, with the same bits."""
        aux = [layer for layer in aux_layers or () if first <= layer < end]
        loop = self.layer_loop
        if loop is not None and loop.applies(x, cache, mask, paths):
            # Every layer in one call, the aux layers' streams copied out of it.
            return loop.run(x, cos, sin, cache, start, paths, first, end, streams, aux)
        for index in range(first, end):
            if index in aux:
                streams.append(x)  # layers return new tensors: keeping a reference copies nothing
            x = self.layers[index](x, cos, sin, cache.keys[index], cache.values[index], start, mask, paths)
        return x

    def finish(self, x: torch.Tensor, streams: list[torch.Tensor], logits_rows: slice | torch.Tensor | None,
               aux_layers: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s features and logits from the last layer's output ``x`` and the aux streams."""
        # Logits exactly as without aux rows, so --mode ar on the same worker rounds alike.
        done = self.layer_loop.finish(x, logits_rows) if self.layer_loop is not None else None
        if done is not None:  # the same kernels in one call
            features, logits = done
        else:
            features = self.norm(x)[0]
            head_input = features if logits_rows is None else features[logits_rows]
            logits = self.lm_head(head_input)
        if aux_layers:
            # aux_layers is increasing (checked by the engine), so streams are in its order.
            features = torch.cat(streams, dim=-1)[0]
        return features, logits
