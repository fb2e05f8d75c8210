"""The gpu_worker process: the draft head behind the coordinator's control channel.

    python -m gpu_worker.server --endpoint ipc://... --parent-pid N --settings '{DraftSettings as JSON}'

Feature blocks arrive as RingRefs into the rings the cpu_worker writes; on CUDA the cycle
ring is registered as page-locked memory so its copies to the GPU are DMA.
"""

from __future__ import annotations

import logging
import time

import torch

from ipc import messages as m
from ipc.core_load import CoreLoadProbe
from ipc.cost_cache import OnlineCurve, loaded_note
from ipc.placement import apply_placement
from ipc.shm_ring import ShmRing, get_block
from ipc.tree import TreeShape
from ipc.worker_loop import Handlers, SequenceError, exit_process, worker_main

from .device import resolve_device
from .draft_cost import DraftCostCache, beam_key, draft_cost_key, measure_draft_ms
from .drafter import DraftContextError, Drafter, PendingExtend

log = logging.getLogger(__name__)


class DraftService:
    """Up to ``max_sequences`` sequences' draft caches at once (``Drafter.sibling``), as the
    cpu_worker holds their targets; a reset draft of a new sequence beyond that many ends the
    longest-held one."""

    def __init__(self, drafter: Drafter, rings: dict[str, ShmRing], cost_key: str | None = None,
                 max_sequences: int = 1):
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.drafter = drafter  # the first sequence's, and the one cost measurements run on
        self.max_sequences = max_sequences
        self.rings = rings  # by segment name: a RingRef names the ring it points into
        self.sequences: dict[int, Drafter] = {}  # in the order they started
        self._spare: list[Drafter] = [drafter]
        self.cost_key = cost_key  # what the draft-cost cache files this head's timings under (per beam)
        self.cost_cache = DraftCostCache()
        # t_draft(depth) per beam the planner asked for, kept current by the draft steps run here.
        self.curves: dict[int, OnlineCurve] = {}

    def _end(self, seq_id: int) -> None:
        drafter = self.sequences.pop(seq_id, None)
        if drafter is not None:
            drafter.reset()
            self._spare.append(drafter)

    def _drafter(self, request: m.DraftRequest | m.DraftExtend) -> Drafter:
        if not request.reset:
            drafter = self.sequences.get(request.seq_id)
            if drafter is None:
                raise SequenceError(f"sequence {request.seq_id} is not active "
                                    f"(active: {sorted(self.sequences) or 'none'})")
            return drafter
        self._end(request.seq_id)
        while len(self.sequences) >= self.max_sequences:
            oldest = next(iter(self.sequences))
            log.warning("draft of sequence %d ended to make room for sequence %d (at most %d at once)", oldest,
                        request.seq_id, self.max_sequences)
            self._end(oldest)
        drafter = self._spare.pop() if self._spare else self.drafter.sibling()
        self.sequences[request.seq_id] = drafter
        return drafter

    def _extended(self, request: m.DraftRequest | m.DraftExtend, drafter: Drafter | None = None) -> Drafter:
        """The request's sequence with its pairs fed in, or kept unread where it says ``defer``
        (SequenceError where they do not fit)."""
        drafter = self._drafter(request) if drafter is None else drafter
        features = get_block(request.features, self.rings, device=drafter.device)
        try:
            if isinstance(request, m.DraftExtend) and request.defer:
                drafter.defer(features, request.tokens)
            else:
                drafter.extend(features, request.tokens)
        except (DraftContextError, ValueError) as error:
            raise SequenceError(str(error)) from None
        return drafter

    def draft(self, request: m.DraftRequest) -> m.DraftResult:
        started = time.perf_counter()
        drafter = self._drafter(request)
        kept = drafter.deferred  # pairs an earlier DraftExtend left unread: this step reads them too
        self._extended(request, drafter)
        try:
            tree = drafter.propose(request.shape)
        except (DraftContextError, ValueError) as error:
            raise SequenceError(str(error)) from None
        compute_ms = (time.perf_counter() - started) * 1e3
        if not kept:
            self._observe(request, compute_ms)
        return m.DraftResult(seq_id=request.seq_id, tokens=tree.tokens.tolist(), parents=tree.parents.tolist(),
                             compute_ms=compute_ms)

    def extend(self, request: m.DraftExtend) -> m.DraftExtended:
        """A prompt chunk into the sequence's draft cache, no tree (or kept for the next draft step)."""
        started = time.perf_counter()
        self._extended(request)
        return m.DraftExtended(seq_id=request.seq_id, compute_ms=(time.perf_counter() - started) * 1e3)

    def draft_batch(self, request: m.DraftBatch) -> m.DraftBatchResult:
        """Every item's draft step, the sequences together: their extends in one head forward, then
        their trees' levels in lockstep, each level in one forward (``Drafter.extend_together``,
        ``propose_together``). An item that does not fit its sequence gets a WorkerError and the
        others run; each result's compute_ms is its share of the batch's time."""
        started = time.perf_counter()
        results: dict[int, m.DraftResult | m.DraftExtended | m.WorkerError] = {}

        def fail(index: int, error: Exception) -> None:
            item = request.items[index]
            results[index] = m.WorkerError(worker="gpu_worker", message=str(error), seq_id=item.seq_id)

        extends: dict[int, tuple[Drafter, PendingExtend]] = {}
        seen: set[int] = set()
        for index, item in enumerate(request.items):
            try:
                if item.seq_id in seen:
                    raise SequenceError(f"sequence {item.seq_id} appears twice in one batch")
                seen.add(item.seq_id)
                drafter = self._drafter(item)
                for other, (taken, _) in list(extends.items()):
                    if taken is drafter:  # that sequence was ended to make room for this one (_drafter)
                        del extends[other]
                        fail(other, SequenceError(f"sequence {request.items[other].seq_id} was ended to make room"))
                if isinstance(item, m.DraftExtend) and item.defer:  # kept unread: nothing to compute
                    self._extended(item, drafter)
                    results[index] = m.DraftExtended(seq_id=item.seq_id)
                    continue
                features = get_block(item.features, self.rings, device=drafter.device)
                extends[index] = drafter, drafter.check_extend(features, item.tokens)
            except (SequenceError, DraftContextError, ValueError) as error:
                fail(index, error)
        Drafter.extend_together(list(extends.values()))
        proposals: dict[int, tuple[Drafter, TreeShape]] = {}
        for index, (drafter, _) in extends.items():
            item = request.items[index]
            if isinstance(item, m.DraftExtend):
                continue  # a prompt chunk: its extend was all
            try:
                drafter.check_shape(item.shape)
                proposals[index] = drafter, item.shape
            except (DraftContextError, RuntimeError) as error:
                fail(index, error)
        trees = Drafter.propose_together([drafter for drafter, _ in proposals.values()],
                                         [shape for _, shape in proposals.values()])
        compute_ms = (time.perf_counter() - started) * 1e3
        share = compute_ms / max(len(extends), 1)
        for index, tree in zip(proposals, trees, strict=True):
            results[index] = m.DraftResult(seq_id=request.items[index].seq_id, tokens=tree.tokens.tolist(),
                                           parents=tree.parents.tolist(), compute_ms=share)
        for index in extends:
            if isinstance(request.items[index], m.DraftExtend):
                results[index] = m.DraftExtended(seq_id=request.items[index].seq_id, compute_ms=share)
        return m.DraftBatchResult(items=[results[index] for index in range(len(request.items))],
                                  compute_ms=compute_ms)

    def _observe(self, request: m.DraftRequest, compute_ms: float) -> None:
        """A cycle's draft step into its beam's curve; not a sequence's first (it absorbs the
        prompt, or its last chunk: more pairs than a tree's accepted path can bring)."""
        curve = self.curves.get(request.shape.top_k)
        if curve is not None and not request.reset and len(request.tokens) <= request.shape.depth + 1:
            curve.observe(request.shape.depth, compute_ms)

    def release(self, request: m.ReleaseSequence) -> None:
        self._end(request.seq_id)
        for curve in self.curves.values():
            curve.save()  # between requests (off the cycle's path): the next start plans with today's costs

    def measure_draft_cost(self, request: m.MeasureDraftCost) -> m.DraftCost:
        """t_draft per depth from the cache, or measured now on random features (which ends any
        active sequence)."""
        cache = self.cost_cache
        key = beam_key(self.cost_key, request.top_k) if self.cost_key else None
        cached = cache.get(key, request.depths) if key else None
        probe = CoreLoadProbe()
        if cached is None:
            with probe:
                ms = self._measure(request)
        else:
            ms = cached
        if key:
            if cached is None:
                note = loaded_note(f"t_draft (top_k {request.top_k})",
                                   cache.put_measured(key, request.depths, ms, probe.others_share), probe.describe())
                if note:
                    log.warning("%s", note)
            self.curves[request.top_k] = OnlineCurve(cache, key)  # seeded with the cached or measured curve
        return m.DraftCost(depths=request.depths, ms=ms, cached=cached is not None,
                           cache_path=str(cache.path) if key else "")

    def _measure(self, request: m.MeasureDraftCost) -> list[float]:
        for seq_id in list(self.sequences):
            self._end(seq_id)
        try:
            return measure_draft_ms(self.drafter, request.depths, request.top_k)
        except (DraftContextError, ValueError) as error:
            raise SequenceError(str(error)) from None

    def handlers(self) -> Handlers:
        return {m.DraftRequest: self.draft, m.DraftExtend: self.extend, m.DraftBatch: self.draft_batch,
                m.ReleaseSequence: self.release, m.MeasureDraftCost: self.measure_draft_cost}


def draft_threads(requested: int | None, device: torch.device) -> int | None:
    """The draft worker's intra-op threads: as asked, else one for a CUDA draft, whose host side
    only launches kernels; a pool of threads there fights the target's for its cores (on an H200
    host, a fp16 draft step took 1.5-2x as long with 16 threads as with one beside a busy target)."""
    if requested is not None:
        return requested
    return 1 if device.type == "cuda" else None


def load_service(settings: m.DraftSettings) -> tuple[m.DraftInfo, Handlers]:
    device = resolve_device(settings.device)
    placement = apply_placement(draft_threads(settings.threads, device), settings.cores)
    drafter = Drafter.from_pretrained(settings.draft, settings.target, max_len=settings.max_len,
                                      device=device, dtype=settings.dtype or "auto", scratch_len=settings.scratch_len)
    # The coordinator sized the rings and told the cpu_worker what rows to return from the
    # folder's files alone (gpu_worker.head_layout); the loaded head must read exactly those.
    row_width = settings.row_width
    if row_width is not None and row_width != drafter.feature_size:
        raise ValueError(f"the draft head in {settings.draft} reads target rows of {drafter.feature_size} floats, "
                         f"but its folder was read as {settings.layout or row_width} (an EAGLE-3 head needs "
                         "draft_vocab_size in its config.json or safetensors weights with midlayer.* keys)")
    cycle = ShmRing.attach(settings.rings.cycle)
    prefill = ShmRing.attach(settings.rings.prefill)
    # Only the cycle ring is pinned: it is small and crosses every cycle; a prompt's block once.
    pinned = drafter.device.type == "cuda" and cycle.pin_for_cuda()
    activations = str(drafter.dtype).removeprefix("torch.")
    precision = drafter.head.projection_format or activations  # int8 or q4_0 projections, else the float dtype
    cost_key = draft_cost_key(drafter, settings.draft, settings.target, precision,
                              placement.intra_op_threads, placement.cores)
    service = DraftService(drafter, {cycle.name: cycle, prefill.name: prefill}, cost_key=cost_key,
                           max_sequences=settings.max_sequences)
    info = m.DraftInfo(device=str(drafter.device), dtype=precision,
                       threads=placement.intra_op_threads, cores=placement.cores,
                       layers=drafter.head.spec.num_layers, ring_pinned=pinned, scratch_len=drafter.scratch_len,
                       fusion=drafter.head.fusion, feature_size=drafter.feature_size,
                       draft_vocab_size=drafter.draft_vocab_size)
    return info, service.handlers()


def main() -> int:
    return worker_main("gpu_worker", m.TO_GPU_WORKER, m.DraftSettings, load_service)


if __name__ == "__main__":
    exit_process(main())
