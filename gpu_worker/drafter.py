"""The drafter: a draft head, its KV cache over the accepted sequence, and the tree builder.

Draft-position convention (DESIGN.md sections 3 and 5). The pair (f_i, x_{i+1}) sits at
draft position i, one less than the target's position of x_{i+1}, in cache slot i.
``length`` = committed pairs L; with the coordinator feeding as below, L always equals
the target's ``prefix_len`` (tokens in the target's KV cache).

- Prefill of prompt x_0..x_{n-1}, first emitted token x_n: ``extend(f_0..f_{n-1},
  x_1..x_n)`` -> positions 0..n-1, L = n.
- After a verify that accepted k drafts and emitted a bonus token: ``extend(f_root, f_1..f_k;
  x_1..x_k, x_bonus)`` -> k+1 more pairs.
- The root of the next tree is the last token passed to ``extend`` (x_n, x_bonus); the
  head's output at the last committed position (draft position L-1) is its predicted
  feature of the root, and its log-probabilities score the root's children.
- A tree node at depth d >= 1 (target position L + d) is fed, when expanded, as the pair
  (its parent's predicted feature, its token) at draft position L - 1 + d. Its KV goes to a
  scratch slot past L (see ``gpu_worker.tree``), attending to the committed prefix, its
  non-root ancestors and itself; the root's own pair is the committed slot L-1.
  Scratch slots are overwritten by the next ``extend`` and never read as committed.

An EAGLE-3 head (``gpu_worker.eagle3``) reads target rows of 3 x hidden (``feature_size``)
and scores a reduced draft vocabulary: the tree maps each chosen draft id to its target id
(``d2t``) as it is chosen, so the head's next step embeds target ids and the tree that leaves
the drafter holds target ids only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cpu_worker.model import CacheSegment, KVCache, RotaryTable
from cpu_worker.model.embedding import device_of, output_dtype
from ipc.tree import TreeShape

from .checkpoint import AnyHead, draft_fusion, head_spec, load_head
from .cpu_format import fastest_cpu_format
from .device import resolve_device, resolve_dtype
from .eagle3 import EAGLE3_FUSIONS, Eagle3Head
from .head_formats import PROJECTION_FORMATS
from .tree import DraftTree, ExpandCall, ExpandResult, build_trees, root_only, tree_search

# Attention on CUDA without cuDNN's: torch tries cuDNN first for half precision on Hopper, and it
# builds an execution plan for every new key length, tens of ms each; a draft's keys grow by a few
# every cycle, so no plan is ever reused. Flash and memory-efficient attention take any length.
CUDA_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device) -> AbstractContextManager[None]:
    """The attention kernels a draft step may use on ``device`` (CPU: torch's own choice)."""
    return sdpa_kernel(CUDA_ATTENTION_BACKENDS) if device.type == "cuda" else nullcontext()


log = logging.getLogger(__name__)


# What --draft-dtype auto picks from on the CPU (cpu_format measures which is fastest here).
AUTO_CPU_FORMATS = ("fp32", "int8", "q4_0")


class DraftContextError(ValueError):
    """The sequence (or a tree's scratch) does not fit the draft cache."""


class Drafter:
    """Holds a head (``DraftHead`` or ``Eagle3Head``) and its cache; the coordinator calls
    ``reset``, ``extend`` and ``propose`` only.

    ``max_len``: most committed pairs (match the target's context length). ``scratch_len``:
    slots past the committed length for tree expansion: ``TreeShape.scratch_slots`` of the
    largest tree it will be asked for (the coordinator sizes it so).
    """

    def __init__(self, head: AnyHead, max_len: int, scratch_len: int = TreeShape().scratch_slots):
        if max_len < 1 or scratch_len < 0:
            raise ValueError(f"max_len must be >= 1 and scratch_len >= 0, got {max_len}, {scratch_len}")
        self.head = head.eval()
        self.device = device_of(head.embed_tokens)
        self.dtype = output_dtype(head.embed_tokens)  # the activations' (a quantized head's table may be fp16)
        self.max_len = max_len
        self.scratch_len = scratch_len
        spec = head.spec
        # What a target row holds (3 x the target's hidden size for EAGLE-3), how many ids the
        # head scores, and how its ids become target ids (None: they are target ids).
        self.feature_size: int = spec.hidden_size
        self.draft_vocab_size: int = spec.vocab_size
        self.to_target: Callable[[torch.Tensor], torch.Tensor] | None = None
        if isinstance(head, Eagle3Head):
            self.feature_size = head.feature_size
            self.draft_vocab_size = head.draft_vocab_size
            self.to_target = head.draft_to_target
        total = max_len + scratch_len
        self.cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, total, self.dtype, self.device)
        self.rotary = RotaryTable(spec, total, self.dtype, self.device)
        self.reset()

    def sibling(self) -> Drafter:
        """Another sequence on the same head: its own KV cache (empty), the same head, rotary
        table and settings (the gpu_worker holds one per active sequence)."""
        twin = object.__new__(Drafter)
        twin.__dict__.update(self.__dict__)
        spec = self.head.spec
        twin.cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.max_len + self.scratch_len,
                             self.dtype, self.device)
        twin.reset()
        return twin

    @classmethod
    def from_pretrained(cls, draft_dir: str | Path, target_dir: str | Path | None = None, max_len: int = 2048,
                        device: str | torch.device = "auto", dtype: str | torch.dtype | None = None,
                        scratch_len: int = TreeShape().scratch_slots) -> Drafter:
        """Load a draft folder (Dovetail, EAGLE-1/2 or EAGLE-3 layout) onto ``device`` (auto: CUDA if any).
        ``dtype``: fp32/fp16/bf16; int8 or q4_0 (CPU only: quantized projections, fp32 activations,
        ``head_formats``); or ``auto``: fp16 on CUDA, and on the CPU the fastest of fp32, int8 and q4_0 as
        measured here (a big head is memory-bound: int8 moves a quarter of fp32's bytes, q4_0 an eighth; a
        tiny one is overhead-bound; ``cpu_format``)."""
        resolved = resolve_device(device)
        name = dtype.lower() if isinstance(dtype, str) else None
        if name == "auto":
            name, dtype = ("measure", None) if resolved.type == "cpu" else (None, None)
        if name in PROJECTION_FORMATS and resolved.type != "cpu":
            raise ValueError(f"an {name} draft runs on the CPU only, not on {resolved}")
        projections = name if name in PROJECTION_FORMATS else None
        if name == "measure":
            spec = head_spec(draft_dir)
            eagle3 = draft_fusion(draft_dir) in EAGLE3_FUSIONS  # q/k/v read [embedding; hidden]
            projections = fastest_cpu_format(spec, attention_input=2 * spec.hidden_size if eagle3 else None,
                                             formats=AUTO_CPU_FORMATS)
        # Quantised tensor by tensor while loading: the head never sits in fp32 first.
        float_dtype = torch.float32 if name in (*PROJECTION_FORMATS, "measure") else resolve_dtype(resolved, dtype)
        head = load_head(draft_dir, target_dir, device=resolved, dtype=float_dtype, projections=projections)
        return cls(head, max_len=max_len, scratch_len=scratch_len)

    @property
    def length(self) -> int:
        """Committed pairs (= the target's prefix_len when fed as documented above)."""
        return self._length

    def reset(self) -> None:
        """Forget the sequence (the cache rows are simply overwritten later)."""
        self._length = 0
        self._root_token: int | None = None
        self._root_feature: torch.Tensor | None = None
        self._root_scores: torch.Tensor | None = None  # _root_log_probs, once a tree needed them
        self._deferred: PendingExtend | None = None  # pairs kept to be read with the next extend (``defer``)

    def check_extend(self, features: torch.Tensor, tokens: torch.Tensor | Sequence[int]) -> PendingExtend:
        """``extend``'s pairs checked against this sequence (ValueError, DraftContextError) and moved
        to the head's device, nothing computed yet; after the pairs ``defer`` kept, which it reads too."""
        tokens_cpu = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).cpu()
        count = int(tokens_cpu.shape[0])
        if count == 0:
            raise ValueError("extend needs at least one (feature, token) pair")
        width = self.feature_size
        if tuple(features.shape) != (count, width):
            raise ValueError(f"features must be [{count}, {width}] to pair with {count} tokens, "
                             f"got {list(features.shape)}")
        kept = self._deferred
        start = self._length + (0 if kept is None else kept.count)
        if start + count > self.max_len:
            raise DraftContextError(f"draft cache full: {start} + {count} pairs exceed max_len {self.max_len}")
        pending = PendingExtend(features=features.to(device=self.device, dtype=self.dtype, non_blocking=True),
                                tokens=tokens_cpu, token_ids=tokens_cpu.to(self.device, non_blocking=True),
                                start=start)
        if kept is None:
            return pending
        return PendingExtend(features=torch.cat([kept.features, pending.features]),
                             tokens=torch.cat([kept.tokens, pending.tokens]),
                             token_ids=torch.cat([kept.token_ids, pending.token_ids]), start=kept.start)

    def defer(self, features: torch.Tensor, tokens: torch.Tensor | Sequence[int]) -> None:
        """Take n pairs as ``extend`` does but compute nothing yet: they are read with the next
        ``extend`` (or a batch's), in one head forward with its pairs. A sequence that decodes
        plainly to its end (a busy batch) never pays for reading its prompt."""
        self._deferred = self.check_extend(features, tokens)

    @property
    def deferred(self) -> int:
        """Pairs kept by ``defer``, not read yet."""
        return 0 if self._deferred is None else self._deferred.count

    def extend(self, features: torch.Tensor, tokens: torch.Tensor | Sequence[int]) -> None:
        """Commit n pairs (f_i, x_{i+1}) at the next draft positions.

        features: [n, feature_size] target rows (any device/dtype; converted here);
        tokens: [n] the (target) tokens that follow each row's position.
        """
        Drafter.extend_together([(self, self.check_extend(features, tokens))])

    def _commit(self, pending: PendingExtend, out: torch.Tensor) -> None:
        self._deferred = None  # read now, with these pairs (check_extend put them first)
        self._root_feature = out[-1]
        self._root_scores = None
        self._root_token = int(pending.tokens[-1])
        self._length = pending.start + pending.count

    @property
    def _root_log_probs(self) -> torch.Tensor | None:
        """The head's log-probabilities at the root, computed when a tree first needs them: a
        one-node tree (plain decoding, as a busy batch plans) only keeps the cache in step, and
        skips the head's vocabulary projection, most of a small head's cost."""
        if self._root_scores is None and self._root_feature is not None:
            self._root_scores = self.head.log_probs(self._root_feature[None])[0]
        return self._root_scores

    def check_shape(self, shape: TreeShape) -> None:
        """Whether ``propose(shape)`` can run on this sequence (RuntimeError, DraftContextError)."""
        if self._root_token is None or self._root_feature is None:
            raise RuntimeError("propose() before extend(): the drafter has no sequence")
        if shape.tree_tokens == 1:
            return
        if shape.top_k > self.draft_vocab_size:
            raise DraftContextError(f"top_k {shape.top_k} exceeds the vocabulary size {self.draft_vocab_size} "
                                    "the draft head scores")
        if shape.scratch_slots > self.scratch_len:
            raise DraftContextError(
                f"tree T={shape.tree_tokens} depth={shape.depth} top_k={shape.top_k} needs {shape.scratch_slots} "
                f"scratch slots, this drafter was sized for {self.scratch_len}")

    def propose(self, shape: TreeShape) -> DraftTree:
        """An EAGLE-2 tree of ``shape.tree_tokens`` nodes (root included; fewer only when the
        expansion yields fewer candidates). The root is the last token passed to ``extend``.
        Leaves the committed cache as is, so calling it twice gives the same tree."""
        return Drafter.propose_together([self], [shape])[0]

    def _beam_segment(self, ancestors: torch.Tensor, begin: int) -> CacheSegment:
        """Where a beam of ``ancestors.shape[0]`` nodes goes (rows [begin, ...) of a head forward): its
        scratch slots past the committed pairs, attending to all of them and to its own ancestors (``tree``)."""
        committed = self._length
        count, scratch = ancestors.shape
        mask = torch.empty(count, committed + scratch, dtype=torch.bool, device=ancestors.device)
        mask[:, :committed] = True
        mask[:, committed:] = ancestors
        return CacheSegment(self.cache, committed + scratch - count, begin, begin + count, mask=mask)

    def _beam_rotary(self, node_depth: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        position = self._length - 1 + node_depth
        return self.rotary.cos[position].expand(count, -1), self.rotary.sin[position].expand(count, -1)

    # --- several sequences in one head forward (the gpu_worker's DraftBatch) -------------------

    @staticmethod
    @torch.inference_mode()
    def extend_together(steps: Sequence[tuple[Drafter, PendingExtend]]) -> None:
        """Each drafter's checked ``extend`` (``check_extend``), all in one head forward: every
        projection over all the rows at once, each sequence's rows attending over its own cache."""
        if not steps:
            return
        head = _shared_head([drafter for drafter, _ in steps])
        segments, cos, sin = [], [], []
        begin = 0
        for drafter, pending in steps:
            end = pending.start + pending.count
            cos.append(drafter.rotary.cos[pending.start:end])
            sin.append(drafter.rotary.sin[pending.start:end])
            segments.append(CacheSegment(drafter.cache, pending.start, begin, begin + pending.count))
            begin += pending.count
        features = torch.cat([pending.features for _, pending in steps])
        tokens = torch.cat([pending.token_ids for _, pending in steps])
        with attention_backends(steps[0][0].device):
            out = head.forward_segments(features, tokens, torch.cat(cos), torch.cat(sin), segments)
        for (drafter, pending), segment in zip(steps, segments, strict=True):
            drafter._commit(pending, out[segment.begin:segment.end])

    @staticmethod
    @torch.inference_mode()
    def propose_together(drafters: Sequence[Drafter], shapes: Sequence[TreeShape]) -> list[DraftTree]:
        """Each drafter's ``propose(shape)`` (checked first: ``check_shape``), their trees grown level
        by level in lockstep, each level of all of them in one head forward (``tree.build_trees``).
        Each tree is the one its sequence gets alone wherever the head's projections are row-invariant."""
        for drafter, shape in zip(drafters, shapes, strict=True):
            drafter.check_shape(shape)
        if not drafters:
            return []
        head = _shared_head(drafters)
        trees: list[DraftTree | None] = [None] * len(drafters)
        growing: list[int] = []
        for index, (drafter, shape) in enumerate(zip(drafters, shapes, strict=True)):
            if shape.tree_tokens == 1:  # plain decoding: no vocabulary projection at all
                assert drafter._root_token is not None
                trees[index] = root_only(drafter._root_token)
            else:
                growing.append(index)
        unscored = [drafters[index] for index in growing if drafters[index]._root_scores is None]
        if unscored:  # the roots' log-probabilities in one vocabulary projection
            scores = head.log_probs(torch.stack([drafter._root_feature for drafter in unscored]))  # type: ignore[misc]
            for drafter, row in zip(unscored, scores, strict=True):
                drafter._root_scores = row
        searches = []
        for index in growing:
            drafter = drafters[index]
            assert drafter._root_token is not None and drafter._root_feature is not None
            assert drafter._root_scores is not None
            searches.append(tree_search(drafter._root_token, drafter._root_feature, drafter._root_scores,
                                        shapes[index], drafter.to_target))

        def expand_many(calls: list[tuple[int, ExpandCall]]) -> list[ExpandResult]:
            segments, cos, sin = [], [], []
            begin = 0
            for search, (_, _, depth, ancestors) in calls:
                drafter = drafters[growing[search]]
                segments.append(drafter._beam_segment(ancestors, begin))
                rows_cos, rows_sin = drafter._beam_rotary(depth, ancestors.shape[0])
                cos.append(rows_cos)
                sin.append(rows_sin)
                begin += ancestors.shape[0]
            tokens = torch.cat([call[0] for _, call in calls])
            features = torch.cat([call[1] for _, call in calls])
            out = head.forward_segments(features, tokens, torch.cat(cos), torch.cat(sin), segments)
            log_probs = head.log_probs(out)
            return [(out[segment.begin:segment.end], log_probs[segment.begin:segment.end]) for segment in segments]

        with attention_backends(drafters[0].device):
            for index, tree in zip(growing, build_trees(searches, expand_many), strict=True):
                trees[index] = tree
        return [tree for tree in trees if tree is not None]

@dataclass(frozen=True)
class PendingExtend:
    """An ``extend`` checked against its sequence (``Drafter.check_extend``): its pairs on the
    head's device and the committed length they start at."""

    features: torch.Tensor
    tokens: torch.Tensor  # on the CPU
    token_ids: torch.Tensor  # on the head's device
    start: int

    @property
    def count(self) -> int:
        return int(self.tokens.shape[0])


def _shared_head(drafters: Sequence[Drafter]) -> AnyHead:
    """The one head several drafters share (``Drafter.sibling``); a batched step needs that."""
    head = drafters[0].head
    if any(drafter.head is not head for drafter in drafters):
        raise ValueError("drafters batched together must share one head (Drafter.sibling)")
    return head
