"""The cpu_worker process: the target engine behind the coordinator's control channel.

    python -m cpu_worker.server --endpoint ipc://... --parent-pid N --settings '{TargetSettings as JSON}'

Feature rows go into the shared-memory rings the coordinator created: a prompt's rows into
the prefill ring (one slot sized for the whole context), a verification's few rows into the
cycle ring. Nothing large ever travels inside a message. A row is the last layer's state after
the final norm, or, for an EAGLE-3 head (``TargetSettings.aux_layers``), the residual streams
entering three target layers side by side (3 * hidden floats).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from cpu_worker.batched import SequenceStep, run_steps
from cpu_worker.engine import ContextOverflowError, StepOutput, TargetEngine, VerifyOutcome
from cpu_worker.kernels import block_quant, int8_kernel
from cpu_worker.kernels.bf16_rows import bf16_kernel_name
from cpu_worker.kernels.fp32_packed import pack_fp32_linears
from cpu_worker.kernels.fp32_rows import use_fp32_row_kernel
from cpu_worker.logprobs import path_logprobs, token_logprob
from cpu_worker.precision import activation_dtype, block_type, kv_cache_dtype
from cpu_worker.repeat_watch import RepeatWatch
from cpu_worker.sampling import Sampler
from cpu_worker.target_loading import fuse_layers, load_target_model, weight_bytes
from cpu_worker.verify_cost import OnlineCurve, VerifyCostCache, cache_key, measure_verify_ms
from ipc import messages as m
from ipc.core_load import CoreLoadProbe
from ipc.cost_cache import loaded_note
from ipc.placement import apply_placement
from ipc.shm_ring import ShmRing
from ipc.worker_loop import Handlers, SequenceError, exit_process, worker_main

log = logging.getLogger(__name__)


PrefillReply = m.PrefillPending | m.PrefillPartial | m.PrefillResult  # an answer to a PrefillRequest
StepResult = m.DecodeResult | m.VerifyResult | PrefillReply


@dataclass
class _Sequence:
    engine: TargetEngine  # its own KV cache on the shared model
    sampler: Sampler
    logprobs: int | None  # alternatives per token; None: off
    prompt_complete: bool = False  # False while its prompt arrives in chunks
    return_features: bool = True
    # While its prompt arrives in chunks: each chunk's (start, feature rows) no answer has carried
    # since the draft last read (``PrefillRequest.features_from``).
    unread: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Its tokens so far (the prompt's, then each one picked): where a run stops for prompt lookup.
    watch: RepeatWatch = field(default_factory=RepeatWatch)


class TargetService:
    """Up to ``max_sequences`` sequences at once, each with its own KV cache on the one model
    (``TargetEngine.sibling``); a StepBatch verifies several of them in one forward. A prefill of
    a new sequence beyond that many ends the longest-held one (the coordinator releases each
    sequence when it ends: this only keeps a worker's memory bounded)."""

    def __init__(self, engine: TargetEngine, cycle_ring: ShmRing, prefill_ring: ShmRing,
                 cost_key: str | None = None, max_sequences: int = 1):
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.engine = engine  # the first sequence's, and the one cost measurements run on
        self.max_sequences = max_sequences
        self.cost_key = cost_key  # what the verify-cost cache files this target's timings under
        # The cached t_verify(T), kept up to date by the verifications this worker runs.
        self.curve = OnlineCurve(VerifyCostCache(), cost_key) if cost_key else None
        self.cycle_ring = cycle_ring
        self.prefill_ring = prefill_ring
        self.sequences: dict[int, _Sequence] = {}  # in the order they were prefilled
        self._spare: list[TargetEngine] = [engine]  # caches no sequence holds, reused before new ones

    def _sequence(self, seq_id: int, prompt_complete: bool = True) -> _Sequence:
        """An active sequence; with ``prompt_complete`` one whose whole prompt is in (a step of a
        sequence still between prompt chunks is refused), else one still between them."""
        sequence = self.sequences.get(seq_id)
        if sequence is None:
            raise SequenceError(f"sequence {seq_id} is not active (active: {sorted(self.sequences) or 'none'})")
        if prompt_complete and not sequence.prompt_complete:
            raise SequenceError(f"sequence {seq_id}'s prompt is not complete: more chunks must come first")
        if not prompt_complete and sequence.prompt_complete:
            raise SequenceError(f"sequence {seq_id}'s prompt is complete: no chunk can follow it")
        return sequence

    def _end(self, seq_id: int) -> None:
        sequence = self.sequences.pop(seq_id, None)
        if sequence is not None:
            sequence.engine.reset()
            self._spare.append(sequence.engine)

    def _end_all(self) -> None:
        for seq_id in list(self.sequences):
            self._end(seq_id)

    def prefill(self, request: m.PrefillRequest) -> PrefillReply:
        """A prompt, or one chunk of it (``offset``, ``more``); each answer writes the prompt's feature
        rows from ``features_from`` through this chunk to the prefill ring (the coordinator has the
        draft read them, or asks for them again with the next chunk, before the ring's one slot is
        written again), and the last chunk answers with the first new token. With ``budget_ms`` a
        chunk may take several calls (PrefillPending, then ``resume``)."""
        started = time.perf_counter()
        sequence, kept = self._prompt_sequence(request)
        try:
            step = sequence.engine.prefill_part(request.token_ids, request.offset, request.budget_ms, request.resume)
        except (ContextOverflowError, ValueError) as error:
            self._end(request.seq_id)
            raise SequenceError(str(error)) from None
        return self._prefill_answer(request, sequence, kept, step, (time.perf_counter() - started) * 1e3)

    def _prompt_sequence(self, request: m.PrefillRequest) -> tuple[_Sequence, list[tuple[int, torch.Tensor]]]:
        """The sequence a prompt chunk goes to (a new one for the first) and the kept rows its
        answer carries before its own (``_rows_from``). SequenceError, before anything changes, for
        a chunk at another offset than its sequence holds, a new chunk while one is part way through
        its layers (or a resume of another), or rows asked from where none are kept. (A first chunk,
        offset 0, starts the sequence over.)"""
        if request.offset == 0 and request.features_from != 0:
            raise SequenceError(f"features_from {request.features_from} on a prompt's first chunk (it must be 0)")
        if request.resume:  # the chunk part way through its layers: its sequence as it stands
            sequence = self._sequence(request.seq_id, prompt_complete=False)
            try:
                sequence.engine.resumable(request.token_ids, request.offset)
            except ValueError as error:
                raise SequenceError(str(error)) from None
            return sequence, _rows_from(sequence, request) if request.offset else []
        if request.offset == 0:
            return self._start(request), []
        sequence = self._sequence(request.seq_id, prompt_complete=False)
        if (pending := sequence.engine.pending) is not None:
            raise SequenceError(f"sequence {request.seq_id}'s chunk at offset {pending.offset} is part way through "
                                "the layers: resume it before another chunk")
        if request.offset != sequence.engine.committed:
            raise SequenceError(f"a prompt chunk at offset {request.offset}, but sequence {request.seq_id} holds "
                                f"{sequence.engine.committed} tokens")
        return sequence, _rows_from(sequence, request)

    def _prefill_answer(self, request: m.PrefillRequest, sequence: _Sequence, kept: list[tuple[int, torch.Tensor]],
                        step: StepOutput | None, compute_ms: float) -> PrefillReply:
        if step is None:  # layers of the chunk are left (PrefillRequest.budget_ms)
            pending = sequence.engine.pending
            assert pending is not None
            return m.PrefillPending(seq_id=request.seq_id, layers_done=pending.layers_done,
                                    layers=sequence.engine.spec.num_layers, compute_ms=compute_ms)
        sequence.watch.add(request.token_ids)  # a whole chunk, once (a chunk in parts: at its end)
        ring_ref = None
        if sequence.return_features:
            kept.append((request.offset, step.features))
            if request.features_now or not request.more:
                rows = [features for _, features in kept]
                ring_ref = self.prefill_ring.write(rows[0] if len(rows) == 1 else torch.cat(rows))
        if request.more:
            sequence.unread = kept
            return m.PrefillPartial(seq_id=request.seq_id, features=ring_ref, compute_ms=compute_ms)
        sequence.prompt_complete, sequence.unread = True, []
        # The new token's position is the prompt's length.
        prompt_length = request.offset + len(request.token_ids)
        token = sequence.sampler.pick(step.logits, prompt_length)
        sequence.watch.add([token])
        return m.PrefillResult(seq_id=request.seq_id, token=token, features=ring_ref, compute_ms=compute_ms,
                               logprob=_logprob(sequence, step.logits, token))

    def _start(self, request: m.PrefillRequest) -> _Sequence:
        """A new sequence for a prompt's first chunk, on a free cache (ending the longest-held
        sequence when all ``max_sequences`` are taken)."""
        self._end(request.seq_id)
        while len(self.sequences) >= self.max_sequences:
            oldest = next(iter(self.sequences))
            log.warning("sequence %d ended to make room for sequence %d (at most %d at once)", oldest,
                        request.seq_id, self.max_sequences)
            self._end(oldest)
        engine = self._spare.pop() if self._spare else self.engine.sibling()
        engine.reset()
        sequence = _Sequence(engine, Sampler(request.sampling), request.logprobs,
                             return_features=request.return_features)
        self.sequences[request.seq_id] = sequence
        return sequence

    def verify(self, request: m.VerifyRequest) -> m.VerifyResult:
        sequence = self._sequence(request.seq_id)
        started = time.perf_counter()
        try:
            outcome = sequence.engine.verify(request.tokens, request.parents, sequence.sampler)
        except (ContextOverflowError, ValueError) as error:
            raise SequenceError(str(error)) from None
        compute_ms = (time.perf_counter() - started) * 1e3
        if self.curve is not None:
            self.curve.observe(len(request.tokens), compute_ms)
        return self._verify_result(request, sequence, outcome, compute_ms)

    def _verify_result(self, request: m.VerifyRequest, sequence: _Sequence, outcome: VerifyOutcome,
                       compute_ms: float) -> m.VerifyResult:
        sequence.watch.add(outcome.tokens)
        features = self.cycle_ring.write(outcome.features)
        # Accepted token i was picked from the logits of the i-th node on the path (root first).
        logprobs = ([] if sequence.logprobs is None else
                    path_logprobs(outcome.logits, outcome.accepted_nodes, outcome.tokens, sequence.logprobs))
        return m.VerifyResult(seq_id=request.seq_id, accepted_tokens=outcome.tokens, features=features,
                              compute_ms=compute_ms, logprobs=logprobs)

    def decode(self, request: m.DecodeRequest) -> m.DecodeResult:
        sequence = self._sequence(request.seq_id)
        started = time.perf_counter()
        try:
            step = sequence.engine.decode(request.token)
        except ContextOverflowError as error:
            raise SequenceError(str(error)) from None
        compute_ms = (time.perf_counter() - started) * 1e3
        if self.curve is not None:
            self.curve.observe(1, compute_ms)  # a decode step is the one-node tree
        return self._decode_result(request, sequence, step, compute_ms)

    def decode_run(self, request: m.DecodeRun) -> m.DecodeRunResult:
        """Up to ``steps`` decode steps, each exactly a DecodeRequest's; ends after a stop id, or with
        ``stop_at_repeat`` after a token that repeats an earlier pair (``repeat_watch``). A run
        that could not fit the context is refused before any step (nothing changes)."""
        sequence = self._sequence(request.seq_id)
        engine = sequence.engine
        if engine.committed + request.steps > engine.max_len:
            raise SequenceError(f"a run of {request.steps} steps from {engine.committed} cached tokens exceeds "
                                f"the context of {engine.max_len} tokens")
        stop_ids = frozenset(request.stop_ids)
        token, tokens, logprobs, total_ms = request.token, [], [], 0.0
        for index in range(request.steps):
            started = time.perf_counter()
            step = engine.decode(token)
            compute_ms = (time.perf_counter() - started) * 1e3
            total_ms += compute_ms
            if self.curve is not None and index == 0:
                # A run's later steps find the threads awake and the caches warm (a 9M target's step
                # half the first's): no tree cycle or lone step costs that little.
                self.curve.observe(1, compute_ms)
            token = sequence.sampler.pick(step.logits, engine.committed)
            tokens.append(token)
            if (logprob := _logprob(sequence, step.logits, token)) is not None:
                logprobs.append(logprob)
            repeated = sequence.watch.add([token])
            if token in stop_ids or (repeated and request.stop_at_repeat):
                break
        return m.DecodeRunResult(seq_id=request.seq_id, tokens=tokens, compute_ms=total_ms, logprobs=logprobs)

    def _decode_result(self, request: m.DecodeRequest, sequence: _Sequence, step: StepOutput,
                       compute_ms: float) -> m.DecodeResult:
        token = sequence.sampler.pick(step.logits, sequence.engine.committed)
        sequence.watch.add([token])
        return m.DecodeResult(seq_id=request.seq_id, token=token, compute_ms=compute_ms,
                              logprob=_logprob(sequence, step.logits, token))

    def step_batch(self, request: m.StepBatch) -> m.StepBatchResult:
        """Every item's decode step, tree or prompt chunk in one forward (``cpu_worker.batched``); an
        item that names no active sequence, repeats one, or does not fit its context gets a
        WorkerError and the others run."""
        results: list[StepResult | m.WorkerError | None] = [None] * len(request.items)
        steps: list[SequenceStep] = []
        taken: list[tuple[int, _Sequence, list[tuple[int, torch.Tensor]]]] = []
        for index, item in enumerate(request.items):
            try:
                if any(item.seq_id == request.items[other].seq_id for other, _, _ in taken):
                    raise SequenceError(f"sequence {item.seq_id} appears twice in one batch")
                if isinstance(item, m.PrefillRequest) and any(step.prompt for step in steps):
                    # Each answer's rows take the prefill ring's one slot.
                    raise SequenceError("one prompt chunk per batch")
                sequence, kept, step = self._batch_step(item)
            except (SequenceError, ValueError) as error:  # ContextOverflowError is a ValueError
                results[index] = m.WorkerError(worker="cpu_worker", message=str(error), seq_id=item.seq_id)
                continue
            steps.append(step)
            taken.append((index, sequence, kept))
        started = time.perf_counter()
        outcomes = run_steps(steps)
        compute_ms = (time.perf_counter() - started) * 1e3
        if self.curve is not None and steps and not any(step.prompt for step in steps):
            self.curve.observe(sum(len(step.tokens) for step in steps), compute_ms)
        for (index, sequence, kept), outcome in zip(taken, outcomes, strict=True):
            item = request.items[index]
            if isinstance(item, m.PrefillRequest):
                assert outcome is None or isinstance(outcome, StepOutput)
                results[index] = self._prefill_answer(item, sequence, kept, outcome, compute_ms)
            elif isinstance(item, m.DecodeRequest):
                assert isinstance(outcome, StepOutput)
                results[index] = self._decode_result(item, sequence, outcome, compute_ms)
            else:
                assert isinstance(outcome, VerifyOutcome)
                results[index] = self._verify_result(item, sequence, outcome, compute_ms)
        return m.StepBatchResult(items=[result for result in results if result is not None], compute_ms=compute_ms)

    def _batch_step(self, item: m.DecodeRequest | m.VerifyRequest | m.PrefillRequest,
                    ) -> tuple[_Sequence, list[tuple[int, torch.Tensor]], SequenceStep]:
        """An item's sequence, the prompt rows its answer carries first (a chunk's) and its checked
        step (SequenceError, ValueError: nothing has run; a prompt that cannot fit ends its sequence,
        as ``prefill`` does)."""
        if not isinstance(item, m.PrefillRequest):
            sequence = self._sequence(item.seq_id)
            step = (SequenceStep(sequence.engine, [item.token]) if isinstance(item, m.DecodeRequest) else
                    SequenceStep(sequence.engine, item.tokens, item.parents, sequence.sampler))
            step.check()
            return sequence, [], step
        others = len(self.sequences) - (item.seq_id in self.sequences)
        if item.offset == 0 and others >= self.max_sequences:
            raise SequenceError(f"no room for sequence {item.seq_id} in a batch: {others} sequences are active")
        sequence, kept = self._prompt_sequence(item)
        step = SequenceStep(sequence.engine, item.token_ids, prompt=True, budget_ms=item.budget_ms, resume=item.resume)
        try:
            step.check()
        except ValueError:
            self._end(item.seq_id)
            raise
        return sequence, kept, step

    def release(self, request: m.ReleaseSequence) -> None:
        self._end(request.seq_id)
        if self.curve is not None:
            self.curve.save()  # between requests (off the cycle's path): the next start plans with today's costs

    def measure_verify_cost(self, request: m.MeasureVerifyCost) -> m.VerifyCost:
        """t_verify(T) from the cache, or measured now (which ends any active sequence)."""
        cache = VerifyCostCache()
        cached = cache.get(self.cost_key, request.tree_sizes) if self.cost_key else None
        if cached is not None:
            return m.VerifyCost(tree_sizes=request.tree_sizes, ms=cached, cached=True, cache_path=str(cache.path))
        log.info("measuring tree verification for T in %s (cached afterwards in %s)", request.tree_sizes, cache.path)
        self._end_all()
        try:
            with CoreLoadProbe() as probe:
                ms = measure_verify_ms(self.engine, request.tree_sizes)
        except ValueError as error:
            raise SequenceError(str(error)) from None
        if self.cost_key:
            note = loaded_note("t_verify", cache.put_measured(self.cost_key, request.tree_sizes, ms,
                                                              probe.others_share), probe.describe())
            if note:
                log.warning("%s", note)
            self.curve = OnlineCurve(cache, self.cost_key)  # seeded with what was just measured
        return m.VerifyCost(tree_sizes=request.tree_sizes, ms=ms, cache_path=str(cache.path))

    def handlers(self) -> Handlers:
        return {m.PrefillRequest: self.prefill, m.VerifyRequest: self.verify, m.DecodeRequest: self.decode,
                m.DecodeRun: self.decode_run, m.StepBatch: self.step_batch, m.ReleaseSequence: self.release,
                m.MeasureVerifyCost: self.measure_verify_cost}


def _rows_from(sequence: _Sequence, request: m.PrefillRequest) -> list[tuple[int, torch.Tensor]]:
    """The kept chunks' rows from ``request.features_from`` on (the earlier ones are dropped: read);
    SequenceError, before anything runs, where that is not a kept chunk's start or this chunk's."""
    if not sequence.return_features:
        return []
    starts = [start for start, _ in sequence.unread] + [request.offset]
    if request.features_from not in starts:
        raise SequenceError(f"features_from {request.features_from} is not where a chunk whose rows are kept "
                            f"starts ({', '.join(map(str, starts))})")
    return [(start, rows) for start, rows in sequence.unread if start >= request.features_from]


def _logprob(sequence: _Sequence, logits: torch.Tensor, token: int) -> m.TokenLogprob | None:
    return None if sequence.logprobs is None else token_logprob(logits, token, sequence.logprobs)


FP32_KERNEL_VARIABLE = "DOVETAIL_FP32_KERNEL"  # auto (default), dovetail or mkl: force one, for comparisons


def forced_fp32_kernel() -> str:
    """$DOVETAIL_FP32_KERNEL: auto, dovetail (our row kernel or else F.linear) or mkl (MKL's
    packed sgemm or else F.linear); anything else is auto, said in the log."""
    value = os.environ.get(FP32_KERNEL_VARIABLE, "auto").strip().lower() or "auto"
    if value not in ("auto", "dovetail", "mkl"):
        log.warning("%s=%r is not auto, dovetail or mkl; fp32 takes the automatic kernel", FP32_KERNEL_VARIABLE, value)
        return "auto"
    return value


def build_engine(target: str, precision: str, max_len: int | None, kv_dtype: str = "auto",
                 aux_layers: list[int] | None = None) -> tuple[TargetEngine, str | None]:
    """The target engine exactly as the cpu_worker runs it (benchmarks time this one too), and
    its linear layers' kernel (fp32: dovetail-fp32, mkl-packed or F.linear; int8-row: dovetail-amx,
    dovetail-vnni, dovetail-avx2, dovetail-portable or fbgemm; block formats: dovetail-blocks-vnni,
    -avx2 or -portable; bf16: dovetail-bf16 or F.linear)."""
    model = load_target_model(target, precision)
    kernel = None
    if precision == "fp32":
        # Fewer, larger GEMMs (q/k/v and gate/up fused: 0.94x the time per token at 1B), then a
        # kernel whose rows never depend on their call-mates (exact trees): ours, faster than MKL's
        # packed sgemm for one row and for trees (fp32_rows.py); MKL's where no C compiler is found.
        fuse_layers(model, dense=True)
        wanted = forced_fp32_kernel()
        if wanted != "mkl" and use_fp32_row_kernel(model):
            kernel = "dovetail-fp32"
        elif wanted != "dovetail" and pack_fp32_linears(model):
            kernel = "mkl-packed"
        else:
            kernel = "F.linear"
            log.warning("fp32 linears run on F.linear (no exact row kernel here): trees are verified to float "
                        "tolerance, so a near-tied token may differ from --mode ar")
    elif precision == "bf16":
        kernel = bf16_kernel_name(model)
        if kernel != "dovetail-bf16":
            log.warning("bf16 linears run on F.linear (no exact row kernel here): trees are verified to float "
                        "tolerance, so a near-tied token may differ from --mode ar")
    elif precision == "int8-row":
        kernel = int8_kernel.kernel_name()
    elif block_type(precision) is not None:
        kernel = block_quant.kernel_name()
    # aux_layers: an EAGLE-3 head's three target layers (the coordinator read them from its folder).
    engine = TargetEngine(model, max_len=max_len, activation_dtype=activation_dtype(precision),
                          aux_layers=aux_layers, kv_dtype=kv_cache_dtype(precision, kv_dtype))
    return engine, kernel


def verify_cost_label(precision: str, kernel: str | None) -> str:
    """The precision as the verify-cost cache keys it: each kernel's timings apart (their trees
    cost differently), and so int8 weights in a forced layout (DOVETAIL_INT8_LAYOUT)."""
    label = f"{precision}/{kernel}" if kernel else precision
    if precision == "int8-row" and int8_kernel.forced_layout() != "auto":
        label += f"/{int8_kernel.forced_layout()}"
    return label


def load_service(settings: m.TargetSettings) -> tuple[m.TargetInfo, Handlers]:
    placement = apply_placement(settings.threads, settings.cores)
    precision = settings.dtype
    engine, kernel = build_engine(settings.target, precision, settings.max_len, settings.kv_dtype,
                                  list(settings.aux_layers))
    kv_name = str(engine.kv_dtype).removeprefix("torch.")
    cost_precision = verify_cost_label(precision, kernel)
    service = TargetService(engine, ShmRing.attach(settings.rings.cycle), ShmRing.attach(settings.rings.prefill),
                            cost_key=cache_key(settings.target, f"{cost_precision}/kv-{kv_name}",
                                               placement.intra_op_threads, placement.cores),
                            max_sequences=settings.max_sequences)
    info = m.TargetInfo(threads=placement.intra_op_threads, cores=placement.cores, max_len=engine.max_len,
                        hidden_size=engine.spec.hidden_size, vocab_size=engine.spec.vocab_size, dtype=precision,
                        weight_bytes=weight_bytes(engine.model), kv_cache_bytes=engine.cache.nbytes,
                        kv_dtype=kv_name, exact_tree=engine.exact_tree, kernel=kernel,
                        feature_size=engine.feature_size, aux_layers=list(engine.aux_layers or []),
                        chunk_invariant=engine.chunk_invariant)
    return info, service.handlers()


def main() -> int:
    return worker_main("cpu_worker", m.TO_CPU_WORKER, m.TargetSettings, load_service)


if __name__ == "__main__":
    exit_process(main())
