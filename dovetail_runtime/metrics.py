"""Server-wide counters: kept by the coordinator, read with a MetricsRequest, shown as Prometheus text.

The coordinator adds every finished request's statistics (``ServerMetrics.record``) and
answers ``MetricsRequest`` with a ``MetricsReply``; the HTTP front end turns that reply into
the Prometheus text exposition format for ``GET /metrics`` (``prometheus_text``). Nothing here
imports torch or a web framework.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ipc import messages as m


@dataclass
class ServerMetrics:
    started: float = field(default_factory=time.monotonic)
    finished: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    prompt_tokens: int = 0
    new_tokens: int = 0
    cycles: int = 0
    cycle_tokens: int = 0
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    ipc_ms: float = 0.0
    running: int = 0
    worker_restarts: int = 0

    def record(self, reply: m.GenerateDone | m.ErrorReply) -> None:
        """Count one request's end."""
        if isinstance(reply, m.ErrorReply):
            self.errors[reply.code] += 1
            return
        self.finished[reply.finish_reason] += 1
        stats = reply.stats
        self.prompt_tokens += stats.prompt_tokens
        self.new_tokens += stats.new_tokens
        self.cycles += stats.cycles
        self.cycle_tokens += round(stats.tau * stats.cycles)  # tau = cycle tokens / cycles, exactly
        self.prefill_ms += stats.prefill_ms
        self.draft_ms += stats.draft_ms
        self.verify_ms += stats.verify_ms
        self.ipc_ms += stats.ipc_ms

    def record_cancelled(self, count: int = 1) -> None:
        """Count requests cancelled before they ran (their client left): finished, with no tokens."""
        self.finished["cancelled"] += count

    @contextlib.contextmanager
    def running_request(self) -> Iterator[None]:
        """Count a request as running while the block runs (it ends however the block does)."""
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1

    def worker_restarted(self) -> None:
        self.worker_restarts += 1

    def reply(self, queue_depth: int) -> m.MetricsReply:
        return m.MetricsReply(
            finished=dict(self.finished), errors=dict(self.errors), prompt_tokens=self.prompt_tokens,
            new_tokens=self.new_tokens, cycles=self.cycles, cycle_tokens=self.cycle_tokens,
            prefill_s=self.prefill_ms / 1e3, draft_s=self.draft_ms / 1e3, verify_s=self.verify_ms / 1e3,
            ipc_s=self.ipc_ms / 1e3, queue_depth=queue_depth, running=self.running,
            worker_restarts=self.worker_restarts, uptime_s=time.monotonic() - self.started)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(reply: m.MetricsReply, model: str) -> str:
    """The counters in Prometheus' text format (version 0.0.4); every series carries ``model``."""
    lines: list[str] = []
    base = f'model="{_label(model)}"'

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            number = str(value) if isinstance(value, int) else repr(float(value))
            lines.append(f"{name}{{{','.join(filter(None, (base, labels)))}}} {number}")

    reasons = {"stop": 0, "length": 0, "cancelled": 0, **reply.finished}
    metric("dovetail_requests_total", "counter", "Requests finished, by finish reason.",
           [(f'finish_reason="{_label(reason)}"', count) for reason, count in sorted(reasons.items())])
    metric("dovetail_request_errors_total", "counter", "Requests that failed, by error code.",
           [(f'code="{_label(code)}"', count) for code, count in sorted(reply.errors.items())])
    metric("dovetail_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
           [("", reply.prompt_tokens)])
    metric("dovetail_generation_tokens_total", "counter", "Tokens generated.", [("", reply.new_tokens)])
    metric("dovetail_cycles_total", "counter", "Draft/verify cycles (decode steps in ar mode).",
           [("", reply.cycles)])
    metric("dovetail_cycle_tokens_total", "counter", "Tokens the cycles emitted (tau = this / cycles).",
           [("", reply.cycle_tokens)])
    metric("dovetail_tau", "gauge", "Mean tokens per cycle since the server started.",
           [("", reply.cycle_tokens / reply.cycles if reply.cycles else 0.0)])
    for part, value, what in (("prefill", reply.prefill_s, "the target spent on prompts"),
                              ("draft", reply.draft_s, "the draft head spent"),
                              ("verify", reply.verify_s, "the target spent verifying or decoding"),
                              ("ipc", reply.ipc_s, "not spent computing in a worker (messages, copies)")):
        metric(f"dovetail_{part}_seconds_total", "counter", f"Time {what}.", [("", float(value))])
    metric("dovetail_queue_depth", "gauge", "Requests waiting to run.", [("", reply.queue_depth)])
    metric("dovetail_requests_running", "gauge", "Requests running now.", [("", reply.running)])
    metric("dovetail_worker_restarts_total", "counter", "Worker processes restarted after a failure.",
           [("", reply.worker_restarts)])
    metric("dovetail_uptime_seconds", "gauge", "Seconds since the server started.", [("", float(reply.uptime_s))])
    return "\n".join(lines) + "\n"
