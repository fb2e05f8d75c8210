"""Server counters add up every request's statistics and read as Prometheus text."""

from __future__ import annotations

import re

import pytest

from dovetail_runtime.metrics import ServerMetrics, prometheus_text
from ipc import messages as m


def done(reason: str, **stats) -> m.GenerateDone:
    return m.GenerateDone(request_id="r", token_ids=[], text="", finish_reason=reason,
                          stats=m.RequestStats(**stats))


def parse(text: str) -> dict[str, float]:
    """{'name{labels}': value} for every sample line; HELP and TYPE lines checked for each name."""
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#"):
            continue
        match = re.fullmatch(r'([a-z_]+)\{([^}]*)\} (\S+)', line)
        assert match, line
        assert match.group(1) in typed, f"{match.group(1)} has no TYPE line"
        labels = ",".join(part for part in match.group(2).split(",") if not part.startswith("model="))
        samples[f"{match.group(1)}{{{labels}}}"] = float(match.group(3))
    return samples


def test_counters_add_up_and_render():
    metrics = ServerMetrics()
    metrics.record(done("stop", prompt_tokens=10, new_tokens=20, cycles=5, tau=19 / 5, prefill_ms=100.0,
                        draft_ms=50.0, verify_ms=200.0, ipc_ms=25.0))
    metrics.record(done("length", prompt_tokens=4, new_tokens=8, cycles=3, tau=7 / 3, draft_ms=10.0))
    metrics.record(m.ErrorReply(request_id="r", code="prompt_too_long", message="x"))
    metrics.worker_restarted()
    metrics.worker_restarted()
    with metrics.running_request():
        reply = metrics.reply(queue_depth=3)
    assert (reply.prompt_tokens, reply.new_tokens, reply.cycles, reply.cycle_tokens) == (14, 28, 8, 26)
    assert reply.finished == {"stop": 1, "length": 1} and reply.errors == {"prompt_too_long": 1}

    samples = parse(prometheus_text(reply, 'my "model"'))
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


def test_a_running_request_is_counted_until_it_ends_however_it_ends():
    metrics = ServerMetrics()
    with metrics.running_request():
        assert metrics.reply(queue_depth=0).running == 1
    with pytest.raises(RuntimeError), metrics.running_request():
        raise RuntimeError("a request's bug")
    assert metrics.reply(queue_depth=0).running == 0


def test_a_request_cancelled_before_it_ran_counts_as_cancelled_with_no_tokens():
    metrics = ServerMetrics()
    metrics.record_cancelled()
    metrics.record_cancelled(2)
    metrics.record_cancelled(0)
    metrics.record(done("stop", prompt_tokens=3, new_tokens=2, cycles=1, tau=2.0))
    reply = metrics.reply(queue_depth=0)
    assert reply.finished == {"cancelled": 3, "stop": 1}
    assert (reply.prompt_tokens, reply.new_tokens, reply.cycles, reply.cycle_tokens) == (3, 2, 1, 2)
