"""How a layer's queries attend over its KV cache: one strategy object per model, chosen once.

Two strategies, each declaring ``row_invariant``: whether a tree's rows, attended in one call,
get the bits each row's one-token decode would.
- ``TorchAttention``: torch's ``scaled_dot_product_attention``. Its batched masked call rounds
  differently from its one-row call (~1e-6), which an int8 target's per-row activation rounding
  can amplify into another token, so an exact tree attends row by row (``attend_per_row``), each
  row re-reading the whole cached prefix.
- ``ExactAttention``: decode steps, tree rows and prompt chunks on our kernels
  (``exact_attention``), which read the prefix once for the whole tree or chunk and round every
  row as its one-token decode does (so a prompt's bits do not depend on its chunks either). It needs fp32
  queries on the CPU over an fp32 or bf16 cache, without autograd: the engine picks it when it is
  built (``cpu_worker.engine.choose_kernels``) where its model and cache are so.

``AutoAttention`` is a layer's default until an engine chooses: it tests each call, as a draft
head's layers must (they move between devices and dtypes after they are built, and train with
autograd), and takes the kernel where the call allows it, torch's otherwise.

With a cache, every strategy receives this call's rows ``k``/``v`` [1, kv_heads, S, head_dim]
already written to slots [start, start + S) of one layer's ``keys``/``values`` [1, kv_heads,
max_len, head_dim]; ``mask`` (bool [S, start + S]) or ``paths`` (a tree) as in
``cpu_worker.model.llama.Attention.forward``.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from cpu_worker.kernels import exact_attention
from cpu_worker.kernels.exact_attention import TreePaths


class AttentionKernel(Protocol):
    """What ``Attention.forward`` calls once its rows are in the cache."""

    name: str
    row_invariant: bool

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               start: int, mask: torch.Tensor | None, paths: TreePaths | None, gqa: bool) -> torch.Tensor: ...


def causal_mask(start: int, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool [length, start + length] for ``length`` new tokens continuing ``start`` cached ones."""
    rows = torch.arange(length, device=device).unsqueeze(1) + start
    cols = torch.arange(start + length, device=device).unsqueeze(0)
    return cols <= rows


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, gqa: bool) -> torch.Tensor:
    """One query row over every key given: the one call both decoding and exact tree
    verification make, so both round alike."""
    return F.scaled_dot_product_attention(q.contiguous(), keys, values, enable_gqa=gqa)


def attend_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                  mask: torch.Tensor | None, gqa: bool) -> torch.Tensor:
    """S query rows at slots [start, start + S) over ``keys``/``values`` [B, kv, start + S, hd]:
    as ``mask`` allows, else causally (a cache-free window too, with ``start`` 0)."""
    length = q.shape[2]
    if mask is not None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
    if length == 1 or start == 0:
        # One new token sees everything; a prefill from slot 0 (or a cache-free window) is plain causal.
        return F.scaled_dot_product_attention(q, keys, values, is_causal=length > 1, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_mask(start, length, q.device),
                                          enable_gqa=gqa)


def attend_per_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   start: int, paths: TreePaths, gqa: bool) -> torch.Tensor:
    """Tree attention that equals one-token decoding bit for bit where the exact kernel does
    not apply (no compiler, or torch forced): for each row, its path's key/value rows are laid
    right after the cached prefix (slots start, start + 1, ...) as a decode would have them, and
    the row attends there with the decode's own call. A batched masked call reads the prefix once
    but rounds differently (~1e-6), which an int8 target's per-row activation rounding can amplify
    into a different token."""
    # k and v may be views of the very slots this loop overwrites (rope_qkv wrote them there).
    k, v = k.clone(), v.clone()
    outs = []
    for row, path in enumerate(paths.rows):
        end = start + len(path)
        keys[:, :, start:end] = k.index_select(2, path)
        values[:, :, start:end] = v.index_select(2, path)
        outs.append(attend_one(q[:, :, row:row + 1], keys[:, :, :end], values[:, :, :end], gqa))
    # The tree's rows back in node order, where commit_path expects them.
    keys[:, :, start:start + k.shape[2]] = k
    values[:, :, start:start + v.shape[2]] = v
    return torch.cat(outs, dim=2)


class TorchAttention:
    """torch's attention; exact trees row by row (``attend_per_row``)."""

    name = "torch"
    row_invariant = False

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               start: int, mask: torch.Tensor | None, paths: TreePaths | None, gqa: bool) -> torch.Tensor:
        # A cache in another dtype (bf16 KV for an fp32/int8 target): attention runs in the cache's
        # dtype and reads every key and value from the cache, this call's own rows included, so each
        # is rounded once, as stored, and a tree node sees exactly the values a later one-token decode
        # reads back. (The kernel reads them back too.) The same dtype: ``to`` is q itself.
        q = q.to(keys.dtype)
        if paths is not None:
            return attend_per_row(q, k, v, keys, values, start, paths, gqa)
        end = start + q.shape[2]
        if q.shape[2] == 1 and mask is None:
            return attend_one(q, keys[:, :, :end], values[:, :, :end], gqa)
        return attend_causal(q, keys[:, :, :end], values[:, :, :end], start, mask, gqa)


class ExactAttention:
    """Decode steps, tree rows and (``prompts``) prompt chunks on the exact kernels (fp32 queries,
    an fp32 or bf16 cache, the CPU, no autograd: whoever picks it has checked); masked calls, and
    prompt chunks otherwise, on torch's."""

    name = "exact"
    row_invariant = True

    def __init__(self, prompts: bool = True) -> None:
        self._torch = TorchAttention()
        self.prompts = prompts

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               start: int, mask: torch.Tensor | None, paths: TreePaths | None, gqa: bool) -> torch.Tensor:
        if paths is not None:
            return exact_attention.attend(q, keys, values, start, paths)
        if mask is None and q.shape[2] == 1:
            return exact_attention.attend(q, keys, values, start + 1)
        if mask is None and self.prompts:
            # A prompt chunk: each row as its decode would round it, so chunks of any size agree.
            return exact_attention.attend_causal(q, keys, values, start)
        return self._torch.attend(q, k, v, keys, values, start, mask, paths, gqa)


class AutoAttention:
    """A layer's default: the exact kernel where this call allows it (``exact_attention.applies``),
    else torch's. Not row-invariant as a promise: that depends on each call."""

    name = "auto"
    row_invariant = False

    def __init__(self) -> None:
        self._exact, self._torch = ExactAttention(), TorchAttention()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               start: int, mask: torch.Tensor | None, paths: TreePaths | None, gqa: bool) -> torch.Tensor:
        # Only a call the kernel would take asks (asking may build the library).
        kernel_call = paths is not None or (q.shape[2] == 1 and mask is None)
        chosen: AttentionKernel = self._exact if kernel_call and exact_attention.applies(q, keys) else self._torch
        return chosen.attend(q, k, v, keys, values, start, mask, paths, gqa)


TORCH = TorchAttention()
EXACT = ExactAttention()
EXACT_TREES = ExactAttention(prompts=False)  # for a model whose prompts are not chunk-invariant anyway
AUTO = AutoAttention()


def choose(query_dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype,
           exact_prompts: bool = True) -> AttentionKernel:
    """The strategy for a model whose queries are ``query_dtype`` on ``device`` over a cache of
    ``cache_dtype``, run without autograd: the exact kernel where it applies and builds, for its
    prompts too unless ``exact_prompts`` is False (torch's SDPA is faster over long contexts)."""
    if (query_dtype == torch.float32 and device.type == "cpu" and cache_dtype in exact_attention.CACHE_DTYPES
            and exact_attention.available()):
        return EXACT if exact_prompts else EXACT_TREES
    return TORCH
