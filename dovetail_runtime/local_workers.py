"""Both workers in this process: the coordinator's cycle without sockets or processes.

``LocalWorker`` gives a worker's request handlers (``cpu_worker.server.TargetService``,
``gpu_worker.server.DraftService``) the ``request``/``send`` interface of
``dovetail_runtime.workers.WorkerHandle``, so ``generate_dovetail`` / ``generate_ar`` run
unchanged over them. Every message still goes through the protocol's codec (encoded and
decoded, so validated exactly as between processes) and hidden states through real
shared-memory rings; only the sockets are gone. Used by tests and in-process measurements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeVar

from dovetail_runtime.lookup import accepted_rows
from dovetail_runtime.workers import WorkerRequestError
from ipc import messages as m
from ipc.codec import decode, encode
from ipc.shm_ring import ShmRing, cycle_slots, slot_bytes_for
from ipc.tree import TreeShape
from ipc.worker_loop import Handlers, handle

if TYPE_CHECKING:
    from cpu_worker.engine import TargetEngine
    from gpu_worker.drafter import Drafter

R = TypeVar("R", bound=m.Message)


class LocalWorker:
    def __init__(self, name: str, handlers: Handlers):
        self.name = name
        self.handlers = handlers

    def request(self, message: m.Message, expect: type[R]) -> R:
        reply = handle(self.name, self.handlers, decode(encode(message)))
        if isinstance(reply, m.WorkerError):
            raise WorkerRequestError(f"{self.name}: {reply.message}")
        if not isinstance(reply, expect):
            raise TypeError(f"{self.name} answered {type(reply).__name__}, expected {expect.__name__}")
        decoded = decode(encode(reply), (type(reply),))  # expect may be a base (PrefillAnswer)
        assert isinstance(decoded, expect)
        return decoded

    def send(self, message: m.Message) -> None:
        handle(self.name, self.handlers, decode(encode(message)))


@contextlib.contextmanager
def local_workers(engine: TargetEngine, drafter: Drafter | None = None, largest_tree: TreeShape = TreeShape(),
                  max_sequences: int = 1, lookup_tokens: int = 0) -> Iterator[tuple[LocalWorker, LocalWorker | None]]:
    """(cpu, gpu) local workers over an in-process TargetEngine and Drafter, with rings sized as
    the coordinator sizes them (for trees up to ``largest_tree`` with prompt-lookup branches up to
    ``lookup_tokens``, the engine's context and ``max_sequences`` sequences at once)."""
    from cpu_worker.server import TargetService
    from gpu_worker.server import DraftService

    width = engine.feature_size  # 3 x hidden for an EAGLE-3 head's target rows
    rows = accepted_rows(largest_tree.depth, lookup_tokens)
    cycle = ShmRing.create(slot_bytes_for(rows, width, "float32"), cycle_slots(max_sequences))
    prefill = ShmRing.create(slot_bytes_for(engine.max_len, width, "float32"), 1)
    try:
        cpu = LocalWorker("cpu_worker", TargetService(engine, cycle, prefill, max_sequences=max_sequences).handlers())
        gpu = None if drafter is None else LocalWorker(
            "gpu_worker", DraftService(drafter, {cycle.name: cycle, prefill.name: prefill},
                                       max_sequences=max_sequences).handlers())
        yield cpu, gpu
    finally:
        cycle.close()
        prefill.close()
