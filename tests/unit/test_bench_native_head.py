"""tools.bench_native_head: a CPU draft head's cycles on its native calls and on the torch layers, in turns."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from tools import bench_native_head

from conftest import DEMO_DRAFT, DEMO_TARGET


def test_it_times_both_paths_and_prints_their_ratio_per_shape():
    result = CliRunner().invoke(bench_native_head.main, [
        "--draft", str(DEMO_DRAFT), "--target", str(DEMO_TARGET), "--dtype", "int8", "--shapes", "2/1/1,4/2/2",
        "--cycles", "3", "--threads", "1"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[1] == "| T/depth/top_k | torch ms | native ms | native / torch |"
    rows = [line.split("|")[1:-1] for line in lines[3:]]
    assert [row[0].strip() for row in rows] == ["2/1/1", "4/2/2"]
    for _, torch_ms, native_ms, ratio in rows:
        assert float(torch_ms) > 0 and float(native_ms) > 0
        assert float(ratio) == pytest.approx(float(native_ms) / float(torch_ms), rel=0.02)  # from rounded ms


def test_the_torch_path_is_the_torch_layers_and_comes_back():
    drafter_head = type("Head", (), {"native_layers": lambda self: "native"})()
    restore = bench_native_head.torch_layers(drafter_head)
    assert drafter_head.native_layers() is None
    restore()
    assert drafter_head.native_layers() == "native"


def test_bad_shapes_and_heads_without_native_calls_are_refused(monkeypatch):
    with pytest.raises(click.BadParameter, match="T/depth/top_k"):
        bench_native_head.parse_shapes(None, None, "2/1")  # type: ignore[arg-type]
    with pytest.raises(click.BadParameter, match="at least 1"):
        bench_native_head.parse_shapes(None, None, "2/0/1")  # type: ignore[arg-type]
    monkeypatch.setenv("DOVETAIL_NATIVE_HEAD", "python")
    result = CliRunner().invoke(bench_native_head.main, ["--draft", str(DEMO_DRAFT), "--target", str(DEMO_TARGET),
                                                         "--dtype", "int8", "--cycles", "3"])
    assert result.exit_code == 1 and "no native calls here" in result.output
