"""The cpu_worker process: the target engine behind the coordinator's control channel.

    python -m cpu_worker.server --endpoint ipc://... --parent-pid N --settings '{json}'

It writes feature blocks into the shared-memory ring the coordinator created (falling
back to inline blocks for ones that do not fit, e.g. a long prompt's prefill).
"""

from __future__ import annotations

import time
from typing import Any

from dovetail_runtime.worker_loop import SequenceError, worker_main
from ipc import messages as m
from ipc.shm_ring import ShmRing, put_block

from .engine import ContextOverflowError, TargetEngine
from .loading import load_target_model
from .precision import apply_precision
from .sampling import Sampler, SamplingParams
from .threads import apply_placement


class TargetService:
    """One sequence at a time: requests for any other sequence are refused."""

    def __init__(self, engine: TargetEngine, ring: ShmRing | None):
        self.engine = engine
        self.ring = ring
        self.seq_id: int | None = None
        self.sampler: Sampler | None = None

    def _check_sequence(self, seq_id: int) -> None:
        if seq_id != self.seq_id:
            raise SequenceError(f"sequence {seq_id} is not active (active: {self.seq_id})")

    def prefill(self, request: m.PrefillRequest) -> m.PrefillResult:
        started = time.perf_counter()
        self.seq_id = None
        sampling = request.sampling
        try:
            sampler = Sampler(SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed))
            step = self.engine.prefill(request.token_ids)
        except (ContextOverflowError, ValueError) as error:
            raise SequenceError(str(error)) from None
        self.seq_id = request.seq_id
        self.sampler = sampler
        features = put_block(self.ring, step.features) if request.return_features else None
        return m.PrefillResult(seq_id=request.seq_id, token=sampler.pick(step.logits), features=features,
                               n_features=len(request.token_ids), compute_ms=(time.perf_counter() - started) * 1e3)

    def verify(self, request: m.VerifyRequest) -> m.VerifyResult:
        self._check_sequence(request.seq_id)
        started = time.perf_counter()
        try:
            outcome = self.engine.verify(request.tokens, request.parents, self.sampler)
        except (ContextOverflowError, ValueError) as error:
            raise SequenceError(str(error)) from None
        return m.VerifyResult(seq_id=request.seq_id, accepted_tokens=outcome.tokens,
                              accepted_nodes=outcome.accepted_nodes, features=put_block(self.ring, outcome.features),
                              compute_ms=(time.perf_counter() - started) * 1e3)

    def decode(self, request: m.DecodeRequest) -> m.DecodeResult:
        self._check_sequence(request.seq_id)
        started = time.perf_counter()
        try:
            step = self.engine.decode(request.token)
        except ContextOverflowError as error:
            raise SequenceError(str(error)) from None
        return m.DecodeResult(seq_id=request.seq_id, token=self.sampler.pick(step.logits),
                              compute_ms=(time.perf_counter() - started) * 1e3)

    def release(self, request: m.ReleaseSequence) -> None:
        if request.seq_id == self.seq_id:
            self.seq_id = None
            self.engine.reset()

    def handlers(self) -> dict[type, Any]:
        return {m.PrefillRequest: self.prefill, m.VerifyRequest: self.verify,
                m.DecodeRequest: self.decode, m.ReleaseSequence: self.release}


def load_service(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[type, Any]]:
    placement = apply_placement(settings.get("threads"), settings.get("cores"))
    model, activation_dtype = apply_precision(load_target_model(settings["target"]), settings.get("dtype", "fp32"))
    engine = TargetEngine(model, max_len=settings.get("max_len"), activation_dtype=activation_dtype)
    ring = ShmRing.attach(settings["ring"]) if settings.get("ring") else None
    service = TargetService(engine, ring)
    info = {"threads": placement.intra_op_threads, "cores": placement.cores, "max_len": engine.max_len,
            "hidden_size": engine.spec.hidden_size, "vocab_size": engine.spec.vocab_size,
            "dtype": settings.get("dtype", "fp32")}
    return info, service.handlers()


def main() -> int:
    return worker_main("cpu_worker", m.TO_CPU_WORKER, load_service)


if __name__ == "__main__":
    raise SystemExit(main())
