"""The tools' comma-list options: a bad item is a one-line usage error (exit 2) before any worker
starts or model loads, never a traceback after minutes of set-up."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tools import bench_e2e


class NoWorkers:
    """Stands in for the Coordinator: a run that gets this far has not checked its options."""

    def __init__(self, *_args, **_kwargs):
        raise AssertionError("the workers started before --temperatures was checked")


@pytest.mark.parametrize(("value", "says"), [
    ("x", "'x' is not a number"),
    ("0,hot", "'hot' is not a number"),
    ("-1", "at least 0"),
    ("nan", "not a finite number"),
    ("1e-9", "temperature must be 0 (greedy) or >= "),
    ("2000", "<= 1000"),
    (",", "give at least one value"),
])
def test_bench_e2e_rejects_a_bad_temperature_before_starting_workers(monkeypatch, value, says):
    monkeypatch.setattr(bench_e2e, "Coordinator", NoWorkers)
    result = CliRunner().invoke(bench_e2e.main, ["--target", "t", "--draft", "d", "--temperatures", value])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--temperatures'" in result.output and says in result.output
    assert "Traceback" not in result.output


def test_bench_e2e_temperatures_parse_to_floats():
    assert bench_e2e.parse_temperatures(None, None, "0, 0.7,,1") == [0.0, 0.7, 1.0]
