"""--worker-timeout's default fits the model: a multiple of the longest step its measured costs
predict, at least a floor; the flag still overrides it."""

from __future__ import annotations

import types

import click.testing
import pytest

from dovetail_runtime import cli
from dovetail_runtime.cli_options import run_options
from dovetail_runtime.coordinator import (
    UNMEASURED_WORKER_TIMEOUT_S,
    WORKER_TIMEOUT_FLOOR_S,
    WORKER_TIMEOUT_STEPS,
    Coordinator,
    RuntimeSettings,
    fitted_worker_timeout,
)

SMALL = {1: 1.3, 16: 6.0, 64: 19.7}  # the 9M demo target, ms
BIG = {1: 315.0, 16: 900.0, 64: 3000.0}  # a 7B target on few cores, ms


def test_a_small_model_gets_the_floor_and_a_big_one_a_multiple_of_a_full_context_prefill():
    assert fitted_worker_timeout(SMALL, [5.0, 60.0], max_len=2048) == WORKER_TIMEOUT_FLOOR_S
    prefill_s = 3000.0 / 64 * 4096 / 1000  # the largest tree's cost per token, a whole context of tokens
    assert fitted_worker_timeout(BIG, [40.0], max_len=4096) == pytest.approx(WORKER_TIMEOUT_STEPS * prefill_s)
    assert fitted_worker_timeout(BIG, [40.0], max_len=4096) > UNMEASURED_WORKER_TIMEOUT_S  # 300 s would cut it short


def test_a_draft_step_longer_than_any_verification_sets_the_timeout():
    assert fitted_worker_timeout({1: 1.0, 2: 2.0}, [20_000.0], max_len=4) == pytest.approx(WORKER_TIMEOUT_STEPS * 20)


def _coordinator(timeout) -> Coordinator:
    coordinator = Coordinator(RuntimeSettings(target="unused", draft="unused", worker_timeout_s=timeout))
    coordinator.max_len = 4096
    coordinator.cpu = types.SimpleNamespace(reply_timeout_s=coordinator._initial_worker_timeout())  # type: ignore
    coordinator.gpu = types.SimpleNamespace(reply_timeout_s=coordinator._initial_worker_timeout())  # type: ignore
    return coordinator


def test_the_default_waits_the_fallback_until_measured_then_fits_both_workers():
    coordinator = _coordinator("auto")
    assert [w.reply_timeout_s for w in coordinator.workers()] == [UNMEASURED_WORKER_TIMEOUT_S] * 2
    coordinator.fit_worker_timeout(BIG, [40.0])
    expected = fitted_worker_timeout(BIG, [40.0], 4096)
    assert [w.reply_timeout_s for w in coordinator.workers()] == [expected, expected]


def test_the_flag_overrides_the_fitted_default():
    coordinator = _coordinator(12.0)
    coordinator.fit_worker_timeout(BIG, [40.0])
    assert [w.reply_timeout_s for w in coordinator.workers()] == [12.0, 12.0]


def test_the_cli_default_is_auto_and_the_help_says_what_it_is():
    context = cli.run_main.make_context("dovetail-run", ["--target", "/t", "--draft", "/d"])
    assert run_options(context.params).workers.worker_timeout is None
    assert cli.runtime_settings(run_options(context.params), "/t", "/d").worker_timeout_s == "auto"
    context = cli.run_main.make_context("dovetail-run", ["--target", "/t", "--worker-timeout", "7"])
    assert cli.runtime_settings(run_options(context.params), "/t", None).worker_timeout_s == 7.0
    shown = " ".join(click.testing.CliRunner().invoke(cli.run_main, ["--help"]).output.split())
    assert "[default: 4x the longest step the measured costs predict" in shown and "at least 30 s" in shown
