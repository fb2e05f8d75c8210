"""Server counters add up every request's statistics and read as Prometheus text (prometheus_client's)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dovetail_runtime.metrics import PrometheusExport, ServerMetrics, prometheus_text
from ipc import messages as m


def done(reason: str, **stats) -> m.GenerateDone:
    return m.GenerateDone(request_id="r", token_ids=[], text="", finish_reason=reason,
                          stats=m.RequestStats(**stats))


def parse(text: str, model: str) -> dict[str, float]:
    """{'name{labels}': value} for every sample, read by prometheus_client's own parser; every
    sample carries the model label, left out of the key."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model") == model, sample
            shown = ",".join(f'{name}="{value}"' for name, value in sorted(labels.items()))
            samples[f"{sample.name}{{{shown}}}"] = sample.value
    return samples


def test_counters_add_up_and_render():
    metrics = ServerMetrics()
    metrics.record(done("stop", prompt_tokens=10, new_tokens=20, cycles=5, tau=19 / 5, prefill_ms=100.0,
                        draft_ms=50.0, verify_ms=200.0, ipc_ms=25.0))
    metrics.record(done("length", prompt_tokens=4, new_tokens=8, cycles=3, tau=7 / 3, draft_ms=10.0))
    metrics.record(m.ErrorReply(request_id="r", code="prompt_too_long", message="x"))
    metrics.worker_restarted()
    metrics.worker_restarted()
    reply = metrics.reply(queue_depth=3, running=1)
    assert (reply.prompt_tokens, reply.new_tokens, reply.cycles, reply.cycle_tokens) == (14, 28, 8, 26)
    assert reply.finished == {"stop": 1, "length": 1} and reply.errors == {"prompt_too_long": 1}

    samples = parse(prometheus_text(reply, 'my "model"'), 'my "model"')
    assert samples['dovetail_requests_total{finish_reason="stop"}'] == 1
    assert samples['dovetail_requests_total{finish_reason="length"}'] == 1
    assert samples['dovetail_requests_total{finish_reason="cancelled"}'] == 0
    assert samples['dovetail_request_errors_total{code="prompt_too_long"}'] == 1
    assert samples["dovetail_prompt_tokens_total{}"] == 14
    assert samples["dovetail_generation_tokens_total{}"] == 28
    assert samples["dovetail_tau{}"] == 26 / 8
    assert samples["dovetail_prefill_seconds_total{}"] == 0.1
    assert samples["dovetail_draft_seconds_total{}"] == 0.06
    assert samples["dovetail_verify_seconds_total{}"] == 0.2
    assert samples["dovetail_ipc_seconds_total{}"] == 0.025
    assert samples["dovetail_queue_depth{}"] == 3
    assert samples["dovetail_requests_running{}"] == 1
    assert samples["dovetail_worker_restarts_total{}"] == 2
    assert 'model="my \\"model\\""' in prometheus_text(reply, 'my "model"')  # label values escaped
    assert "# TYPE dovetail_requests_total counter" in prometheus_text(reply, "m")
    assert "# TYPE dovetail_queue_depth gauge" in prometheus_text(reply, "m")
    assert samples["dovetail_target_busy_seconds_total{}"] == samples["dovetail_draft_busy_seconds_total{}"] == 0


def test_the_workers_busy_seconds_are_shown_apart_from_the_requests_sums():
    # Four ar streams for 3.46 s of wall time showed dovetail_verify_seconds_total 9.8: each request's
    # verify time is its batch's whole pass. The workers' own time is shown beside it.
    metrics = ServerMetrics()
    for _ in range(4):  # four requests verified together: each saw the batch's 300 ms
        metrics.record(done("length", verify_ms=300.0))
    reply = metrics.reply(queue_depth=0, busy_ms={"cpu": 300.0, "gpu": 120.0})
    samples = parse(prometheus_text(reply, "m"), "m")
    assert samples["dovetail_verify_seconds_total{}"] == 1.2
    assert samples["dovetail_target_busy_seconds_total{}"] == 0.3
    assert samples["dovetail_draft_busy_seconds_total{}"] == 0.12
    assert "summed over requests" in prometheus_text(reply, "m")


def test_each_export_has_its_own_registry_and_scrapers_get_the_format_they_ask_for():
    first, second = PrometheusExport("a"), PrometheusExport("b")
    assert first.registry is not second.registry
    reply = ServerMetrics().reply(queue_depth=5)
    body, kind = first.render(reply)
    assert kind.startswith("text/plain; version=0.0.4") and parse(body.decode(), "a")["dovetail_queue_depth{}"] == 5
    body, kind = second.render(reply, "application/openmetrics-text; version=1.0.0")
    assert kind.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


def test_a_request_cancelled_before_it_ran_counts_as_cancelled_with_no_tokens():
    metrics = ServerMetrics()
    metrics.record_cancelled()
    metrics.record_cancelled(2)
    metrics.record_cancelled(0)
    metrics.record(done("stop", prompt_tokens=3, new_tokens=2, cycles=1, tau=2.0))
    reply = metrics.reply(queue_depth=0)
    assert reply.finished == {"cancelled": 3, "stop": 1}
    assert (reply.prompt_tokens, reply.new_tokens, reply.cycles, reply.cycle_tokens) == (3, 2, 1, 2)


def test_drafted_and_accepted_tokens_come_from_the_trees_and_the_acceptance():
    metrics = ServerMetrics()
    # 3 cycles of 8-node trees and 2 of 4-node trees; 1 cycle accepted nothing, 2 one token, 2 three.
    metrics.record(done("stop", new_tokens=12, cycles=5, tau=12 / 5, trees={"8/4/4": 3, "4/2/8": 2},
                        accept_per_depth=[1, 2, 0, 2]))
    metrics.record(done("stop", new_tokens=4, cycles=3, tau=4 / 3))  # ar: no trees
    reply = metrics.reply(queue_depth=0)
    assert (reply.draft_tokens, reply.accepted_tokens) == (3 * 7 + 2 * 3, 2 * 1 + 2 * 3)
    samples = parse(prometheus_text(reply, "m"), "m")
    assert samples["dovetail_spec_decode_num_draft_tokens_total{}"] == 27
    assert samples["dovetail_spec_decode_num_accepted_tokens_total{}"] == 8


def test_latency_histograms_with_a_cycles_tokens_sharing_its_time():
    metrics = ServerMetrics()
    # Arrived at 10, ran at 10.5, first token at 11, then 4 tokens at 11.5 and 1 at 11.75; answered at 12.
    metrics.record_latency(10.0, 10.5, [(11.0, 1), (11.5, 4), (11.75, 1)], 12.0)
    metrics.record_latency(20.0, 20.0, [(20.2, 3)], 20.25)  # 3 tokens with the first: no wait after it
    reply = metrics.reply(queue_depth=0)
    families = {family.name: family for family in text_string_to_metric_families(prometheus_text(reply, "m"))}
    assert {"dovetail_queue_time_seconds", "dovetail_time_to_first_token_seconds",
            "dovetail_inter_token_latency_seconds", "dovetail_e2e_request_latency_seconds"} <= set(families)

    def observed(name: str) -> tuple[float, float, dict[str, float]]:
        samples = families[name].samples
        buckets = {sample.labels["le"]: sample.value for sample in samples if sample.name.endswith("_bucket")}
        (count,) = [sample.value for sample in samples if sample.name.endswith("_count")]
        (total,) = [sample.value for sample in samples if sample.name.endswith("_sum")]
        return count, total, buckets

    count, total, buckets = observed("dovetail_queue_time_seconds")
    assert (count, total) == (2, 0.5) and buckets["0.01"] == 1 and buckets["0.5"] == 2
    count, total, _ = observed("dovetail_time_to_first_token_seconds")
    assert count == 2 and total == pytest.approx(1.2)
    count, total, buckets = observed("dovetail_inter_token_latency_seconds")
    # 4 tokens at 0.125 s each, 1 at 0.25 s, 2 at 0 s (they came with the first token).
    assert count == 7 and total == 0.75 and buckets["0.005"] == 2 and buckets["0.15"] == 6 and buckets["0.3"] == 7
    count, total, buckets = observed("dovetail_e2e_request_latency_seconds")
    assert count == 2 and total == 2.25 and buckets["0.3"] == 1 and buckets["2.0"] == 2
