"""The gpu_worker process: the draft head behind the coordinator's control channel.

    python -m gpu_worker.server --endpoint ipc://... --parent-pid N --settings '{json}'

Feature blocks arrive as RingRefs into the ring the cpu_worker writes; on CUDA the ring
is registered as page-locked memory so the copy to the GPU is DMA.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dovetail_runtime.worker_loop import SequenceError, worker_main
from ipc import messages as m
from ipc.shm_ring import ShmRing, get_block

from .drafter import DraftContextError, Drafter

log = logging.getLogger(__name__)


class DraftService:
    def __init__(self, drafter: Drafter, ring: ShmRing | None):
        self.drafter = drafter
        self.ring = ring
        self.seq_id: int | None = None

    def draft(self, request: m.DraftRequest) -> m.DraftResult:
        started = time.perf_counter()
        if request.reset:
            self.drafter.reset()
            self.seq_id = request.seq_id
        elif request.seq_id != self.seq_id:
            raise SequenceError(f"sequence {request.seq_id} is not active (active: {self.seq_id})")
        features = get_block(request.features, self.ring, device=self.drafter.device)
        try:
            self.drafter.extend(features, request.tokens)
            tree = self.drafter.propose(request.tree_tokens, request.depth, request.top_k)
        except (DraftContextError, ValueError) as error:
            raise SequenceError(str(error)) from None
        return m.DraftResult(seq_id=request.seq_id, tokens=tree.tokens.tolist(),
                             parents=tree.parents.tolist(), scores=tree.scores.tolist(),
                             compute_ms=(time.perf_counter() - started) * 1e3)

    def release(self, request: m.ReleaseSequence) -> None:
        if request.seq_id == self.seq_id:
            self.seq_id = None
            self.drafter.reset()

    def handlers(self) -> dict[type, Any]:
        return {m.DraftRequest: self.draft, m.ReleaseSequence: self.release}


def load_service(settings: dict[str, Any]) -> tuple[dict[str, Any], dict[type, Any]]:
    drafter = Drafter.from_pretrained(settings["draft"], settings.get("target"), max_len=settings["max_len"],
                                      device=settings.get("device", "auto"), dtype=settings.get("dtype"),
                                      scratch_len=settings.get("scratch_len", 256))
    ring = ShmRing.attach(settings["ring"]) if settings.get("ring") else None
    pinned = bool(ring and drafter.device.type == "cuda" and ring.pin_for_cuda())
    service = DraftService(drafter, ring)
    info = {"device": str(drafter.device), "dtype": str(drafter.dtype).removeprefix("torch."),
            "layers": drafter.head.spec.num_layers, "ring_pinned": pinned}
    return info, service.handlers()


def main() -> int:
    return worker_main("gpu_worker", m.TO_GPU_WORKER, load_service)


if __name__ == "__main__":
    raise SystemExit(main())
