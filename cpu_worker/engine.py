"""The target engine: prefill, one-token decode and tree verification over one sequence.

State is the KV cache plus ``committed``, the number of tokens whose keys and values are
in it. The last emitted token is never cached yet: it is the next decode input, or the
root of the next draft tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpu_worker.acceptance import accept_path
from cpu_worker.kernels import attention as attention_kernels
from cpu_worker.kernels import layer_ops
from cpu_worker.kernels.attention import AttentionKernel
from cpu_worker.kernels.bf16_rows import RowInvariantBf16Linear
from cpu_worker.kernels.exact_attention import TreePaths
from cpu_worker.kernels.fp32_packed import PackedFp32Linear
from cpu_worker.kernels.fp32_rows import PROMPT_GEMM_ROWS, RowInvariantFp32Linear, prompt_rows
from cpu_worker.kernels.linear import row_invariant_linears
from cpu_worker.model.embedding import output_dtype
from cpu_worker.model.llama import Attention, KVCache, LlamaDecoder, RotaryTable
from cpu_worker.native_layers import NativeLayers
from cpu_worker.prompt_parts import PendingChunk
from cpu_worker.sampling import Sampler, top_token, top_tokens
from ipc.tree import tree_depths, validate_parents


class ContextOverflowError(ValueError):
    """The sequence would not fit in the engine's context (KV cache)."""


def tree_paths(parents: Sequence[int]) -> list[list[int]]:
    """Each node's ancestors and itself, root first."""
    paths: list[list[int]] = []
    for index, parent in enumerate(parents):
        paths.append((paths[int(parent)] if parent >= 0 else []) + [index])
    return paths


@dataclass(frozen=True)
class Kernels:
    """What an engine chose when it was built: every forward takes these, none re-tests."""

    attention: AttentionKernel  # every layer's (the exact kernel, or torch's)
    projections: tuple[str, ...]  # each layer's q/k/v projection (``Projection.name``)
    row_invariant_linears: bool  # every linear layer declares its rows independent of their call-mates


def choose_kernels(model: LlamaDecoder, kv_dtype: torch.dtype) -> Kernels:
    """Fix the kernels of ``model``'s layers for an engine over a ``kv_dtype`` cache (one sequence,
    contiguous, run without autograd), from what is fixed once the model is built: its activations'
    dtype (its embedding's output) and device and which native kernels this process has. The exact
    attention kernel and the native rotary + cache write take fp32 activations on the CPU over an
    fp32 or bf16 cache, where the library builds (or is not forced off); torch's ops otherwise.
    A model shared by several engines runs with the last one's choice (as ``layer_loop``)."""
    dtype, device = output_dtype(model.embed_tokens), model.norm.weight.device
    fp32_cpu = dtype == torch.float32 and device.type == "cpu"
    # Only row-invariant linears without a prompt GEMM (whose bits follow the row count) can make a
    # prompt's bits independent of its chunks; elsewhere its prompts keep torch's attention (faster
    # over long contexts, and what a model run outside an engine, as feature extraction, computes).
    invariant_linears = row_invariant_linears(model)
    exact_prompts = invariant_linears and not prompt_gemm_linears(model)
    kernel = attention_kernels.choose(dtype, device, kv_dtype, exact_prompts=exact_prompts)
    native_rope = fp32_cpu and kv_dtype in layer_ops.CACHE_DTYPES and layer_ops.available()
    projections = []
    for module in model.modules():
        if isinstance(module, Attention):
            module.choose_kernels(kernel, native_rope)
            projections.append(module.projection.name)
    return Kernels(kernel, tuple(projections), invariant_linears)


def prompt_gemm_linears(model: LlamaDecoder) -> bool:
    """Whether the model's linears are fp32's or bf16's exact kernels, whose prompt calls from
    ``PROMPT_GEMM_ROWS`` rows on take a GEMM (ours hands them to F.linear; MKL's packed sgemm is
    checked row-invariant only up to 64 rows)."""
    return any(isinstance(module, (RowInvariantFp32Linear, PackedFp32Linear, RowInvariantBf16Linear))
               for module in model.modules())


def tree_ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """Bool [T, T]: mask[i, j] is True when j is i itself or one of its ancestors."""
    size = len(parents)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for index in range(size):
        mask[index, index] = True
        parent = int(parents[index])
        if parent >= 0:
            mask[index] |= mask[parent]
    return mask


def check_aux_layers(aux_layers: Sequence[int] | None, num_layers: int) -> tuple[int, ...] | None:
    """``aux_layers`` as a tuple (None when empty), or ValueError unless increasing and in range."""
    if not aux_layers:
        return None
    layers = tuple(int(layer) for layer in aux_layers)
    if any(b <= a for a, b in zip(layers, layers[1:], strict=False)) or layers[0] < 0 or layers[-1] >= num_layers:
        raise ValueError(f"aux layers {list(layers)} must be distinct, increasing and in 0..{num_layers - 1} "
                         f"for this {num_layers}-layer target")
    return layers


@dataclass
class StepOutput:
    features: torch.Tensor  # [n, feature_size] one row per input token (TargetEngine.feature_size)
    logits: torch.Tensor  # [vocab] at the last input token


@dataclass
class VerifyOutcome:
    accepted_nodes: list[int]  # tree node indices on the accepted path, root (0) first
    tokens: list[int]  # the k accepted draft tokens, then the bonus token
    features: torch.Tensor  # [k + 1, feature_size] at the root and the k accepted nodes
    logits: torch.Tensor  # [T, vocab] target logits at every tree node


class TargetEngine:
    def __init__(self, model: LlamaDecoder, max_len: int | None = None, activation_dtype: torch.dtype = torch.float32,
                 exact_tree: bool | None = None, aux_layers: Sequence[int] | None = None,
                 kv_dtype: torch.dtype | None = None):
        """``exact_tree``: verify a tree with exact attention (the kernel of ``exact_attention``,
        else row by row) so every node's logits equal a decode's bit for bit (default: when every
        linear layer declares itself row-invariant, ``kernels.linear``: int8 W8A8 or fp32 on an exact
        kernel; ``F.linear`` rounds differently per batch size anyway, so exact attention would buy
        nothing there). The kernels are chosen here, once (``choose_kernels``, ``self.kernels``).
        ``aux_layers`` (an EAGLE-3 head's, increasing): feature rows are the residual streams
        entering those layers, concatenated, instead of the last layer's
        state after the final norm (``LlamaDecoder.forward``). ``kv_dtype``: the KV cache's
        dtype (default: the activations'); attention then runs in it (``Attention.forward``)."""
        spec = model.spec
        limit = spec.context_limit
        max_len = limit if max_len is None else max_len
        if not 1 <= max_len <= limit:
            raise ValueError(f"max_len must be in 1..{limit} for this model, got {max_len}")
        self.aux_layers = check_aux_layers(aux_layers, spec.num_layers)
        self.feature_size = spec.hidden_size * (len(self.aux_layers) if self.aux_layers else 1)
        self.model = model
        self.spec = spec
        self.max_len = max_len
        self.dtype = activation_dtype
        self.kv_dtype = activation_dtype if kv_dtype is None else kv_dtype
        self.kernels = self.choose_kernels()
        self.exact_tree = self.kernels.row_invariant_linears if exact_tree is None else exact_tree
        self.cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, max_len, self.kv_dtype)
        self.rotary = RotaryTable(spec, max_len, activation_dtype)
        self.committed = 0
        self.pending: PendingChunk | None = None  # a prompt chunk part of the way through the layers

    def choose_kernels(self) -> Kernels:
        """Choose the model's kernels for this engine (``choose_kernels``; done when it is built, and
        again only by whoever changed what they depend on: a bench forcing another attention)."""
        self.kernels = choose_kernels(self.model, self.kv_dtype)
        # Decode steps, trees and (chunk-invariant) prompt chunks through every layer in one foreign call,
        # where the layers allow it.
        self.model.layer_loop = NativeLayers.build(self.model)
        # Prompt chunks of this many rows or more may not share a batch's forward (``cpu_worker.batched``):
        # fp32's exact kernels keep a row's bits among others only below it.
        self.prompt_gemm_rows = PROMPT_GEMM_ROWS if prompt_gemm_linears(self.model) else None
        # A prompt's bits then do not depend on how it is cut into chunks: every row attends as its
        # decode would (the exact kernels) through row-invariant linears, with no prompt GEMM.
        # (The native norms and SiLU too: torch's may round a row by its call-mates.)
        self.chunk_invariant = (self.kernels.attention is attention_kernels.EXACT
                                and self.kernels.row_invariant_linears and self.prompt_gemm_rows is None
                                and layer_ops.available())
        return self.kernels

    def sibling(self) -> TargetEngine:
        """Another sequence on the same model: its own KV cache (empty, committed as it fills), the
        same kernels, rotary table and settings. Sequences verified together in one forward
        (``cpu_worker.batched``) are siblings."""
        twin = object.__new__(TargetEngine)
        twin.__dict__.update(self.__dict__)
        spec = self.spec
        twin.cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.max_len, self.kv_dtype)
        twin.committed = 0
        twin.pending = None
        return twin

    def reset(self) -> None:
        self.committed = 0
        self.pending = None

    def _check_room(self, extra: int) -> None:
        if self.committed + extra > self.max_len:
            raise ContextOverflowError(
                f"sequence of {self.committed + extra} tokens exceeds the context of {self.max_len} tokens"
            )

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], offset: int = 0) -> StepOutput:
        """Run the prompt from an empty cache, or (``offset`` > 0) one more chunk of it after the
        ``offset`` prompt tokens cached so far; features for every position of the chunk."""
        if len(token_ids) == 0:
            raise ValueError("prefill needs at least one token")
        self.pending = None  # a chunk left part way through is dropped (its rows are overwritten)
        if offset == 0:
            self.reset()
        elif offset != self.committed:
            raise ValueError(f"a prompt chunk at offset {offset}, but the sequence holds {self.committed} tokens")
        # Every mode prefills a prompt in the same chunks (``Job.prefill_chunk``; by load only where
        # ``chunk_invariant``), so its rows may take a faster GEMM whose bits depend on the row count
        # (fp32); decodes and trees never do.
        with prompt_rows():
            return self.extend(token_ids)

    def prefill_part(self, token_ids: Sequence[int], offset: int, budget_ms: float,
                     resume: bool = False) -> StepOutput | None:
        """``prefill`` of a chunk in parts (``prompt_parts``), with its bits: layers until about
        ``budget_ms`` have passed (at least one), then None while layers are left (call again with
        ``resume`` and the same chunk), or the chunk's StepOutput once all have run. A new chunk
        without a budget is ``prefill``."""
        if budget_ms <= 0 and not resume:
            return self.prefill(token_ids, offset)
        if resume:
            pending = self.resumable(token_ids, offset)
        else:
            self.pending = pending = PendingChunk.start(self, token_ids, offset)
        try:
            step = pending.advance(self, budget_ms)
        except BaseException:
            self.pending = None
            raise
        if step is not None:
            self.pending = None
        return step

    def resumable(self, token_ids: Sequence[int], offset: int) -> PendingChunk:
        """The chunk part way through its layers, if it is this one (ValueError otherwise)."""
        pending = self.pending
        if pending is None or pending.offset != offset or pending.tokens != [int(token) for token in token_ids]:
            raise ValueError(f"no prompt chunk of {len(token_ids)} tokens at offset {offset} is part way through "
                             "the layers: nothing to resume")
        return pending

    @torch.inference_mode()
    def extend(self, token_ids: Sequence[int]) -> StepOutput:
        """Append tokens to the cached sequence (one token = a plain decode step)."""
        count = len(token_ids)
        self._check_room(count)
        start = self.committed
        tokens = torch.as_tensor(token_ids, dtype=torch.long)
        positions = torch.arange(start, start + count)
        features, logits = self.model(tokens, positions, self.cache, self.rotary, start, None,
                                      logits_rows=slice(count - 1, count), aux_layers=self.aux_layers)
        self.committed += count
        return StepOutput(features=features, logits=logits[0].float())

    def decode(self, token: int) -> StepOutput:
        return self.extend([token])

    @torch.inference_mode()
    def tree_logits(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the tree; node i at position committed + depth(i), attending to the
        cached prefix, its ancestors and itself. Leaves the tree's KV in the scratch slots."""
        positions = self.tree_positions(tokens, parents)
        prefix = self.committed
        size = len(tokens)
        tokens_tensor = torch.as_tensor(tokens, dtype=torch.long)
        if self.exact_tree:
            features, logits = self.model(tokens_tensor, positions, self.cache, self.rotary, prefix, None,
                                          paths=TreePaths.from_paths(tree_paths(parents)),
                                          aux_layers=self.aux_layers)
        else:
            mask = torch.cat([torch.ones(size, prefix, dtype=torch.bool), tree_ancestor_mask(parents)], dim=1)
            features, logits = self.model(tokens_tensor, positions, self.cache, self.rotary, prefix, mask,
                                          aux_layers=self.aux_layers)
        return features, logits.float()

    def tree_positions(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Each node's position (committed + its depth), once the tree is checked: well formed, one
        parent per token, room in the context (ValueError, ContextOverflowError)."""
        validate_parents(parents)
        if len(parents) != len(tokens):
            raise ValueError(f"tree has {len(tokens)} tokens but {len(parents)} parents")
        self._check_room(len(tokens))
        return torch.as_tensor(tree_depths(parents), dtype=torch.long) + self.committed

    def commit_path(self, accepted_nodes: Sequence[int]) -> None:
        """Keep the KV rows of the accepted path (root first) as the next committed tokens."""
        prefix = self.committed
        if list(accepted_nodes) != list(range(len(accepted_nodes))):
            source = torch.as_tensor(accepted_nodes, dtype=torch.long) + prefix
            self.cache.gather_rows(source, prefix)
        self.committed = prefix + len(accepted_nodes)

    def verify(self, tokens: Sequence[int], parents: Sequence[int], sampler: Sampler | None = None) -> VerifyOutcome:
        """Verify a draft tree and keep the accepted path; the cache then holds exactly the
        accepted sequence. At each node the walk reaches, the target picks its next token
        (argmax without a sampler or when greedy; else ``sampler.pick`` at that position) and
        the walk follows the child carrying it (``accept_path``)."""
        features, logits = self.tree_logits(tokens, parents)
        return self.accept_tree(tokens, parents, features, logits, sampler)

    def accept_tree(self, tokens: Sequence[int], parents: Sequence[int], features: torch.Tensor,
                    logits: torch.Tensor, sampler: Sampler | None = None) -> VerifyOutcome:
        """The second half of ``verify``: walk the verified tree (its rows' ``features`` and
        ``logits``, in the scratch slots) and keep the accepted path."""
        prefix = self.committed
        if sampler is None or sampler.params.greedy:
            choices = top_tokens(logits)
            nodes, bonus = accept_path(tokens, parents, choices.__getitem__)
        else:
            depths = tree_depths(parents)
            # Node i sits at position prefix + depth(i); the token after it at the next one.
            nodes, bonus = accept_path(tokens, parents,
                                       lambda node: sampler.pick(logits[node], prefix + depths[node] + 1))
        self.commit_path(nodes)
        accepted = [int(tokens[node]) for node in nodes[1:]] + [bonus]
        return VerifyOutcome(accepted_nodes=nodes, tokens=accepted,
                             features=features[torch.as_tensor(nodes)], logits=logits)


def greedy_decode(engine: TargetEngine, prompt_ids: Sequence[int], max_new_tokens: int,
                  eos_token_id: int | None = None) -> list[int]:
    """Plain autoregressive greedy decoding: the reference the speculative path must equal."""
    step = engine.prefill(prompt_ids)
    generated: list[int] = []
    while True:
        token = top_token(step.logits)
        generated.append(token)
        if len(generated) >= max_new_tokens or token == eos_token_id:
            return generated
        step = engine.decode(token)
