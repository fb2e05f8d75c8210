"""KV-memory admission: what a request reserves, when it fits, and where the budget comes from
(--kv-memory, or a share of the free memory). Serving's use of it: tests/system/test_serving.py."""

from __future__ import annotations

import types
from pathlib import Path

import click.testing
import pytest

from dovetail_runtime import cli
from dovetail_runtime.admission import KvBudget
from dovetail_runtime.cli_options import run_options
from dovetail_runtime.coordinator import KV_MEMORY_SHARE, Coordinator, RuntimeSettings
from ipc import messages as m

INFO = m.TargetInfo(threads=2, cores=[0, 1], max_len=1000, hidden_size=32, vocab_size=100, dtype="fp32",
                    weight_bytes=1000, kv_cache_bytes=4_000_000, kv_dtype="float32", exact_tree=True,
                    kernel="dovetail-fp32", feature_size=96, aux_layers=[1, 2, 3])


def test_a_request_reserves_its_prompt_plus_new_tokens_at_most_the_context():
    budget = KvBudget(10_000, bytes_per_token=4.0, max_len=1000)
    assert budget.need(prompt_tokens=10, max_new_tokens=90) == 400
    assert budget.need(prompt_tokens=10, max_new_tokens=10**9) == 4000  # the context caps it
    budget.reserve("a", 4000)
    budget.reserve("b", 4000)
    assert budget.reserved_bytes == 8000
    assert budget.fits(2000) and not budget.fits(2001) and budget.ever_fits(10_000) and not budget.ever_fits(10_001)
    budget.release("a")
    budget.release("a")  # twice: harmless
    assert budget.reserved_bytes == 4000 and budget.fits(6000)
    assert "--kv-memory" in budget.refusal(20_000)


def test_the_refusal_shows_sizes_a_small_model_can_tell_apart():
    # The 9M demo with --kv-memory 0.001: "can grow to 0.00 GB (206 tokens x 0.01 MB), more than ... 0.00 GB".
    refusal = KvBudget(1_000_000, bytes_per_token=12_288.0, max_len=96).refusal(int(206 * 12_288))
    assert "2.53 MB (206 tokens x 12.3 kB)" in refusal and "budget of 1 MB" in refusal, refusal
    assert "3.5 GB" in KvBudget(4_000_000_000, 1e5, 1000).refusal(3_500_000_000)


def test_a_budget_needs_positive_sizes():
    with pytest.raises(ValueError, match="positive"):
        KvBudget(0, 1.0, 10)


def coordinator_with(max_batch: int, kv_memory_bytes: int | None) -> Coordinator:
    coordinator = Coordinator(RuntimeSettings(target="/t", draft=None, max_batch=max_batch,
                                              kv_memory_bytes=kv_memory_bytes))
    coordinator.cpu = types.SimpleNamespace(info=INFO)  # type: ignore[assignment]
    return coordinator


def test_the_budget_is_the_flag_or_a_share_of_free_memory_and_none_for_one_request_at_a_time(monkeypatch):
    budget = coordinator_with(4, 2_000_000_000).kv_budget()
    assert budget is not None and budget.budget_bytes == 2_000_000_000 and budget.bytes_per_token == 4000.0
    monkeypatch.setattr("psutil.virtual_memory",
                        lambda: types.SimpleNamespace(total=40_000_000_000, available=10_000_000_000))
    monkeypatch.setattr("dovetail_runtime.memory_fit.CGROUP_ROOT", Path("/nonexistent-cgroup"))  # no container
    budget = coordinator_with(4, None).kv_budget()
    assert budget is not None and budget.budget_bytes == int(10_000_000_000 * KV_MEMORY_SHARE)
    assert coordinator_with(1, None).kv_budget() is None  # one at a time: no share of free memory imposed


def test_the_flag_is_kept_for_one_request_at_a_time():
    # --max-batch 1 --kv-memory 0.5 served a request that could grow past 0.5 GB: the flag was ignored.
    budget = coordinator_with(1, 1_000_000).kv_budget()
    assert budget is not None and budget.budget_bytes == 1_000_000
    assert budget.ever_fits(budget.need(10, 100)) and not budget.ever_fits(budget.need(INFO.max_len, 1))


def test_the_flag_sets_the_budget_in_gb_and_the_help_says_so():
    context = cli.run_main.make_context("dovetail-run", ["--target", "/t", "--kv-memory", "1.5"])
    assert cli.runtime_settings(run_options(context.params), "/t", None).kv_memory_bytes == 1_500_000_000
    context = cli.run_main.make_context("dovetail-run", ["--target", "/t"])
    assert cli.runtime_settings(run_options(context.params), "/t", None).kv_memory_bytes is None
    shown = " ".join(click.testing.CliRunner().invoke(cli.run_main, ["--help"]).output.split())
    assert "--kv-memory" in shown and "kv_budget_exceeded" in shown
    refused = click.testing.CliRunner().invoke(cli.run_main, ["--target", "/t", "--kv-memory", "0"])
    assert refused.exit_code == 2 and "--kv-memory" in refused.output
