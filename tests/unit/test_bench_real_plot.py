"""tools/bench_real.py --plot: the right panel has something to show for --trees auto runs (the
default), and an explicit --plot without matplotlib fails before any run starts."""

import sys
from collections import Counter
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dovetail_runtime.tree_planner import AutoTree
from ipc.tree import TreeShape
from tools import bench_real
from tools.bench_real import RunResult, TreeSetting


def fabricated(trees: list[TreeSetting], drafted: bool = True) -> RunResult:
    """One run with ar and every tree setting measured: 4 prompts, 64 tokens each, and a sweep."""
    result = RunResult("llama2-7b", "int8", 32, trees, Path("/nowhere"))
    for label, totals in result.modes.items():
        totals.requests, totals.new_tokens, totals.wall_ms, totals.prefill_ms = 4, 256, 40_000.0, 4_000.0
        if label != "ar" and drafted:
            totals.cycles, totals.cycle_tokens = 100, 250.0
            totals.draft_ms, totals.verify_ms, totals.ipc_ms = 1_000.0, 20_000.0, 300.0
            totals.trees = Counter({"16/6/8": 60, "4/3/4": 40})
    result.sweep_ms = {size: 100.0 + 2 * size for size in bench_real.SWEEP_SIZES}
    return result


def right_panel(result: RunResult):
    figure = bench_real.sweep_figure([result])
    return figure.axes[1]


def test_an_auto_run_is_modelled_at_the_mean_tree_size():
    result = fabricated([AutoTree(max_tree_tokens=64, max_depth=6, top_k=8)])
    assert bench_real.mean_tree_size(result.modes["auto"].trees) == pytest.approx(0.6 * 16 + 0.4 * 4)
    assert bench_real.modelled_setting(result) == ("auto", pytest.approx(11.2), "mean T=11.2")
    panel = right_panel(result)
    labels = [line.get_label() for line in panel.lines]
    assert any("auto: model, tau 2.50" in label for label in labels)
    assert any("auto: measured at mean T=11.2" in label for label in labels)
    assert not panel.texts


def test_a_fixed_setting_is_still_preferred_and_placed_at_its_t():
    result = fabricated([AutoTree(), TreeShape.clamped(8, 5, 8)])
    assert bench_real.modelled_setting(result) == ("8/5/8", 8.0, "T=8")


def test_a_panel_with_nothing_to_model_says_so():
    panel = right_panel(fabricated([AutoTree()], drafted=False))
    assert [line.get_label() for line in panel.lines if not line.get_label().startswith("_")] == []
    assert "nothing to model" in panel.texts[0].get_text()
    assert panel.get_legend() is None


def test_the_plot_is_written(tmp_path, capsys):
    path = tmp_path / "plots" / "bench_real.png"
    bench_real.write_plot([fabricated([AutoTree()])], path)
    assert path.read_bytes().startswith(b"\x89PNG")
    assert f"plot written to {path}" in capsys.readouterr().out


class RunsStarted(Exception):
    pass


@pytest.fixture
def no_runs(monkeypatch):
    """main's first step after its checks raises: the tests never start a benchmark."""
    def started():
        raise RunsStarted
    monkeypatch.setattr(bench_real, "load_shapes", started)


def test_an_explicit_plot_without_matplotlib_fails_before_the_runs(monkeypatch, tmp_path, no_runs):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    done = CliRunner().invoke(bench_real.main, ["--plot", str(tmp_path / "p.png")])
    assert done.exit_code != 0 and not isinstance(done.exception, RunsStarted)
    message = done.output.strip()
    assert "\n" not in message and "--plot needs matplotlib" in message


def test_the_default_plot_without_matplotlib_does_not_stop_the_bench(monkeypatch, no_runs, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    done = CliRunner().invoke(bench_real.main, [])
    assert isinstance(done.exception, RunsStarted)  # the runs would start; write_plot skips with a note
    bench_real.write_plot([fabricated([AutoTree()])], Path("/nowhere/p.png"))
    assert "plot skipped: matplotlib is missing" in capsys.readouterr().err


def test_an_explicit_plot_without_the_sweep_fails_before_the_runs(tmp_path, no_runs):
    done = CliRunner().invoke(bench_real.main, ["--plot", str(tmp_path / "p.png"), "--no-verify-sweep"])
    assert done.exit_code != 0 and not isinstance(done.exception, RunsStarted)
    assert "--no-verify-sweep" in done.output


def test_a_tree_setting_may_name_its_lookup_tokens():
    """--trees auto,3/2/4@0: the same tree with and without prompt lookup, each its own column."""
    trees, lookups = bench_real.parse_trees("auto,auto@0,3/2/4@8", None, 8)
    assert lookups == [None, 0, 8]
    result = RunResult("llama2-7b", "q4_0", 32, trees, Path("/nowhere"), lookups=lookups)
    assert result.tree_labels == ["auto", "auto@0", "3/2/4@8"]
    assert list(result.modes) == ["ar", "auto", "auto@0", "3/2/4@8"]
    with pytest.raises(click.BadParameter, match="lookup"):
        bench_real.parse_trees("auto@99", None, 8)
