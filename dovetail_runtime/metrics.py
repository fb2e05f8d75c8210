"""Server-wide counters: kept by the coordinator, read with a MetricsRequest, shown as Prometheus text.

The coordinator adds every finished request's statistics (``ServerMetrics.record``) and
answers ``MetricsRequest`` with a ``MetricsReply``; the HTTP front end turns that reply into
the Prometheus exposition format for ``GET /metrics`` with prometheus_client
(``PrometheusExport``), which keeps the format right (escaping, OpenMetrics for scrapers that
ask). Nothing here imports torch or a web framework.
"""

from __future__ import annotations

import bisect
import collections
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from ipc import messages as m

# The HTTP front end's response counts, {(method, route, status): count} (``http_counts.HttpCounts.snapshot``).
HttpCountsReader = Callable[[], Mapping[tuple[str, str, str], int]]

# Bucket bounds in seconds: vLLM's, with longer tails (a CPU target's steps and prompts are slower).
LATENCY_BOUNDS = {
    "queue_time": (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0),
    "time_to_first_token": (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                            40.0, 80.0, 160.0, 640.0),
    "inter_token_latency": (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                            10.0, 20.0),
    "e2e_request_latency": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
                            480.0, 960.0, 1920.0),
}
LATENCY_HELP = {
    "queue_time": "Seconds a request waited in the queue before it ran.",
    "time_to_first_token": "Seconds from a request's arrival to its first new token.",
    "inter_token_latency": "Seconds between a request's new tokens (a cycle's tokens share its time).",
    "e2e_request_latency": "Seconds from a request's arrival to its answer.",
}


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times

    def message(self) -> m.HistogramCounts:
        return m.HistogramCounts(bounds=list(self.bounds), counts=list(self.counts), total=self.total)


def spec_tokens(stats: m.RequestStats) -> tuple[int, int]:
    """(drafted, accepted) tokens of one request: every verified tree's nodes but its root (prompt
    lookup's among them), and the draft tokens its cycles accepted (trees are keyed "T/depth/top_k")."""
    drafted = stats.lookup_nodes + sum((int(shape.split("/")[0]) - 1) * cycles for shape, cycles in stats.trees.items())
    accepted = sum(depth * cycles for depth, cycles in enumerate(stats.accept_per_depth))
    return drafted, accepted


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
    worker_restarts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    latency: dict[str, Histogram] = field(
        default_factory=lambda: {name: Histogram(bounds) for name, bounds in LATENCY_BOUNDS.items()})

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
        drafted, accepted = spec_tokens(stats)
        self.draft_tokens += drafted
        self.accepted_tokens += accepted

    def record_latency(self, arrived: float, started: float, token_times: Iterable[tuple[float, int]],
                       answered: float) -> None:
        """One request's latencies (time.monotonic() values): it arrived, began to run, had
        ``count`` new tokens final at each ``when`` of ``token_times``, and was answered."""
        self.latency["queue_time"].observe(max(started - arrived, 0.0))
        previous: float | None = None
        for when, count in token_times:
            if previous is None:
                self.latency["time_to_first_token"].observe(max(when - arrived, 0.0))
                gap, count = 0.0, count - 1  # tokens final with the first one waited no longer
            else:
                gap = max(when - previous, 0.0)
            if count > 0:  # a cycle's tokens arrive together: its time is shared among them
                self.latency["inter_token_latency"].observe(gap / count, count)
            previous = when
        self.latency["e2e_request_latency"].observe(max(answered - arrived, 0.0))

    def record_cancelled(self, count: int = 1) -> None:
        """Count requests cancelled before they ran (their client left): finished, with no tokens."""
        self.finished["cancelled"] += count

    def worker_restarted(self) -> None:
        self.worker_restarts += 1

    def reply(self, queue_depth: int, running: int = 0, busy_ms: Mapping[str, float] | None = None) -> m.MetricsReply:
        """Everything counted so far, with the queue's depth, the requests running now and each worker's
        compute time in ms (``Batcher.busy_ms``: "cpu", "gpu"), serving's."""
        busy = busy_ms or {}
        return m.MetricsReply(
            target_busy_s=busy.get("cpu", 0.0) / 1e3, draft_busy_s=busy.get("gpu", 0.0) / 1e3,
            finished=dict(self.finished), errors=dict(self.errors), prompt_tokens=self.prompt_tokens,
            new_tokens=self.new_tokens, cycles=self.cycles, cycle_tokens=self.cycle_tokens,
            prefill_s=self.prefill_ms / 1e3, draft_s=self.draft_ms / 1e3, verify_s=self.verify_ms / 1e3,
            ipc_s=self.ipc_ms / 1e3, queue_depth=queue_depth, running=running,
            worker_restarts=self.worker_restarts, uptime_s=time.monotonic() - self.started,
            draft_tokens=self.draft_tokens, accepted_tokens=self.accepted_tokens,
            latency={name: histogram.message() for name, histogram in self.latency.items()})


class ReplyCollector:
    """A prometheus_client collector that shows the last MetricsReply given to it; every series
    carries ``model``. The coordinator keeps the counts (one process, one place), so this only
    names them: no prometheus_client metric objects count anything here."""

    def __init__(self, model: str, http_counts: HttpCountsReader | None = None):
        self.model = model
        self.reply: m.MetricsReply | None = None
        self.http_counts = http_counts

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
        for name, counts in sorted(reply.latency.items()):
            yield _histogram(f"dovetail_{name}_seconds", LATENCY_HELP.get(name, name), model, counts)
        if self.http_counts is not None:
            yield _http_responses(model, self.http_counts())


def _counters(reply: m.MetricsReply) -> list[tuple[str, str, float]]:
    return [
        ("dovetail_prompt_tokens_total", "Prompt tokens of finished requests.", reply.prompt_tokens),
        ("dovetail_generation_tokens_total", "Tokens generated.", reply.new_tokens),
        ("dovetail_cycles_total", "Draft/verify cycles (decode steps in ar mode).", reply.cycles),
        ("dovetail_cycle_tokens_total", "Tokens the cycles emitted (tau = this / cycles).", reply.cycle_tokens),
        # Sums of the requests' statistics: a batched verify pass counts once for each request in it (4 streams
        # showed ~2.8 s of verify a second of wall time); the workers' real time is *_busy_seconds_total.
        ("dovetail_prefill_seconds_total", "Prompt time of finished requests, summed over requests.", reply.prefill_s),
        ("dovetail_draft_seconds_total", "Draft time of finished requests, summed over requests (a batched draft "
         "step shared among them).", reply.draft_s),
        ("dovetail_verify_seconds_total", "Verify or decode time of finished requests, summed over requests (a "
         "batched pass counted for each request in it).", reply.verify_s),
        ("dovetail_ipc_seconds_total", "Time finished requests spent beyond their computing (messages, copies, "
         "the rest of their batch), summed over requests.", reply.ipc_s),
        ("dovetail_target_busy_seconds_total", "Seconds the target worker computed for requests, a batched pass "
         "once: its rate is the target's utilisation.", reply.target_busy_s),
        ("dovetail_draft_busy_seconds_total", "Seconds the draft worker computed for requests, a batched step "
         "once.", reply.draft_busy_s),
        ("dovetail_worker_restarts_total", "Worker processes restarted after a failure.", reply.worker_restarts),
        # vLLM's names for the same counts (its spec_decode_* metrics).
        ("dovetail_spec_decode_num_draft_tokens_total", "Draft tokens verified (tree nodes but the root).",
         reply.draft_tokens),
        ("dovetail_spec_decode_num_accepted_tokens_total", "Draft tokens the target accepted.",
         reply.accepted_tokens),
    ]


def _gauges(reply: m.MetricsReply) -> list[tuple[str, str, float]]:
    return [
        ("dovetail_tau", "Mean tokens per cycle since the server started.",
         reply.cycle_tokens / reply.cycles if reply.cycles else 0.0),
        ("dovetail_queue_depth", "Requests waiting to run.", reply.queue_depth),
        ("dovetail_requests_running", "Requests running now.", reply.running),
        ("dovetail_num_requests_waiting", "Requests waiting to run (vLLM's name).", reply.queue_depth),
        ("dovetail_num_requests_running", "Requests running now (vLLM's name).", reply.running),
        ("dovetail_uptime_seconds", "Seconds since the server started.", reply.uptime_s),
    ]


def _http_responses(model: str, counts: Mapping[tuple[str, str, str], int]) -> Metric:
    family = CounterMetricFamily("dovetail_http_requests_total", "HTTP requests answered, by method, route and "
                                 "status; the front end's own refusals (400, 401, 404, 413, 503 while loading) "
                                 "included, which never reach the request counters.",
                                 labels=["model", "method", "route", "status"])
    for (method, route, status), count in sorted(counts.items()):
        family.add_metric([model, method, route, status], count)
    return family


def _one(kind: type[Metric], name: str, help_text: str, model: str, value: float) -> Metric:
    family = kind(name, help_text, labels=["model"])  # type: ignore[call-arg]
    family.add_metric([model], value)  # type: ignore[attr-defined]
    return family


def _histogram(name: str, help_text: str, model: str, counts: m.HistogramCounts) -> Metric:
    family = HistogramMetricFamily(name, help_text, labels=["model"])
    cumulative, buckets = 0, []
    for bound, count in zip([*map(str, counts.bounds), "+Inf"], counts.counts, strict=True):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric([model], buckets, sum_value=counts.total)
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

    def __init__(self, model: str, http_counts: HttpCountsReader | None = None):
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = ReplyCollector(model, http_counts)
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
