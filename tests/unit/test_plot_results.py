"""tools.plot_results: the chart goes to the checkout's docs/results.png from wherever it runs, and an
--out in a missing folder is a usage error."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from tools import plot_results

REPO = Path(__file__).resolve().parents[2]


def test_the_default_chart_is_the_checkouts(monkeypatch, tmp_path):
    """Run outside the repo, the default docs/results.png was relative: a FileNotFoundError traceback."""
    monkeypatch.chdir(tmp_path)
    drawn = []
    monkeypatch.setattr(plot_results, "draw", drawn.append)
    result = CliRunner().invoke(plot_results.main, [])
    assert result.exit_code == 0, result.output
    assert drawn == [REPO / "docs" / "results.png"]


def test_an_out_in_a_missing_folder_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(plot_results.main, ["--out", str(tmp_path / "nowhere" / "chart.png")])
    assert result.exit_code == 2, result.output
    assert f"{tmp_path / 'nowhere'} is not a folder" in result.output


def test_a_chart_is_written(tmp_path):
    result = CliRunner().invoke(plot_results.main, ["--out", str(tmp_path / "chart.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
