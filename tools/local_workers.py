"""Both workers in this process: the coordinator's cycle without sockets or processes.

``LocalWorker`` gives a worker's request handlers (``cpu_worker.server.TargetService``,
``gpu_worker.server.DraftService``) the ``request``/``send`` interface of ``WorkerHandle``,
so ``generation.generate_dovetail`` / ``generate_ar`` run unchanged over them: the same
messages, the same cycle, no IPC. Used by tests and in-process measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .worker_loop import SequenceError
from .workers import WorkerRequestError


class LocalWorker:
    def __init__(self, name: str, handlers: dict[type, Callable[[Any], Any]]):
        self.name = name
        self.handlers = handlers

    def request(self, message: Any, expect: type) -> Any:
        try:
            reply = self.handlers[type(message)](message)
        except SequenceError as error:
            raise WorkerRequestError(f"{self.name}: {error}") from None
        if not isinstance(reply, expect):
            raise TypeError(f"{self.name} answered {type(reply).__name__}, expected {expect.__name__}")
        return reply

    def send(self, message: Any) -> None:
        handler = self.handlers.get(type(message))
        if handler is not None:
            handler(message)


def local_workers(engine: Any, drafter: Any | None = None) -> tuple[LocalWorker, LocalWorker | None]:
    """(cpu, gpu) local workers over an in-process TargetEngine and Drafter (features travel
    as inline blocks)."""
    from cpu_worker.server import TargetService
    from gpu_worker.server import DraftService

    cpu = LocalWorker("cpu_worker", TargetService(engine, ring=None).handlers())
    gpu = None if drafter is None else LocalWorker("gpu_worker", DraftService(drafter, ring=None).handlers())
    return cpu, gpu
