"""Server-wide counters: kept by the coordinator, read with a MetricsRequest, shown as Prometheus text.

The coordinator adds every finished request's statistics (``ServerMetrics.record``) and
answers ``MetricsRequest`` with a ``MetricsReply``; the HTTP front end turns that reply into
the Prometheus exposition format for ``GET /metrics`` with prometheus_client
(``PrometheusExport``), which keeps the format right (escaping, OpenMetrics for scrapers that
ask). Nothing here imports torch or a web framework.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

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


class ReplyCollector:
    """A prometheus_client collector that shows the last MetricsReply given to it; every series
    carries ``model``. The coordinator keeps the counts (one process, one place), so this only
    names them: no prometheus_client metric objects count anything here."""

    def __init__(self, model: str):
        self.model = model
        self.reply: m.MetricsReply | None = None

    def collect(self) -> Iterator[Metric]:
        reply = self.reply
        if reply is None:
            return
        model = self.model
        reasons = {"stop": 0, "length": 0, "cancelled": 0, **reply.finished}
        yield _labelled(CounterMetricFamily, "dovetail_requests_total", "Requests finished, by finish reason.",
                        model, "finish_reason", reasons)
        yield _labelled(CounterMetricFamily, "dovetail_request_errors_total", "Requests that failed, by error code.",
                        model, "code", reply.errors)
        for name, help_text, value in _counters(reply):
            yield _one(CounterMetricFamily, name, help_text, model, value)
        for name, help_text, value in _gauges(reply):
            yield _one(GaugeMetricFamily, name, help_text, model, value)


def _counters(reply: m.MetricsReply) -> list[tuple[str, str, float]]:
    return [
        ("dovetail_prompt_tokens_total", "Prompt tokens of finished requests.", reply.prompt_tokens),
        ("dovetail_generation_tokens_total", "Tokens generated.", reply.new_tokens),
        ("dovetail_cycles_total", "Draft/verify cycles (decode steps in ar mode).", reply.cycles),
        ("dovetail_cycle_tokens_total", "Tokens the cycles emitted (tau = this / cycles).", reply.cycle_tokens),
        ("dovetail_prefill_seconds_total", "Time the target spent on prompts.", reply.prefill_s),
        ("dovetail_draft_seconds_total", "Time the draft head spent.", reply.draft_s),
        ("dovetail_verify_seconds_total", "Time the target spent verifying or decoding.", reply.verify_s),
        ("dovetail_ipc_seconds_total", "Time not spent computing in a worker (messages, copies).", reply.ipc_s),
        ("dovetail_worker_restarts_total", "Worker processes restarted after a failure.", reply.worker_restarts),
    ]


def _gauges(reply: m.MetricsReply) -> list[tuple[str, str, float]]:
    return [
        ("dovetail_tau", "Mean tokens per cycle since the server started.",
         reply.cycle_tokens / reply.cycles if reply.cycles else 0.0),
        ("dovetail_queue_depth", "Requests waiting to run.", reply.queue_depth),
        ("dovetail_requests_running", "Requests running now.", reply.running),
        ("dovetail_uptime_seconds", "Seconds since the server started.", reply.uptime_s),
    ]


def _one(kind: type[Metric], name: str, help_text: str, model: str, value: float) -> Metric:
    family = kind(name, help_text, labels=["model"])  # type: ignore[call-arg]
    family.add_metric([model], value)  # type: ignore[attr-defined]
    return family


def _labelled(kind: type[Metric], name: str, help_text: str, model: str, label: str,
              counts: dict[str, int]) -> Metric:
    family = kind(name, help_text, labels=["model", label])  # type: ignore[call-arg]
    for value, count in sorted(counts.items()):
        family.add_metric([model, value], count)  # type: ignore[attr-defined]
    return family


class PrometheusExport:
    """One server's /metrics: a registry of its own (never prometheus_client's process-wide
    default, which would mix servers and tests) holding a ReplyCollector."""

    def __init__(self, model: str):
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = ReplyCollector(model)
        self.registry.register(self.collector)

    def render(self, reply: m.MetricsReply, accept: str | None = None) -> tuple[bytes, str]:
        """The body and its content type: the format ``accept`` asks for (OpenMetrics or
        Prometheus text 0.0.4, the default)."""
        encoder, content_type = choose_encoder(accept or "")
        self.collector.reply = reply
        return encoder(self.registry), content_type


def prometheus_text(reply: m.MetricsReply, model: str) -> str:
    """The counters in Prometheus' text format (version 0.0.4)."""
    return PrometheusExport(model).render(reply)[0].decode()
