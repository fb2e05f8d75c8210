"""tools.bench_draft's table: one row per tree shape that runs (depth clamped to T - 1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import bench_draft

REPO = Path(__file__).resolve().parents[2]


def table_rows(*arguments: str) -> list[list[str]]:
    done = subprocess.run([sys.executable, "-m", "tools.bench_draft", "--layers", "1", "--repeats", "1", "--warmup",
                           "0", "--prefix", "8", "--threads", "1", "--device", "cpu", *arguments],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    return [line.split() for line in done.stdout.splitlines() if line.startswith("testbed")]


def test_depths_clamped_to_the_same_shape_give_one_row():
    """--trees 4 --depths 4 6: both depths clamp to 3 at T=4; the table showed T=4 depth 3 twice."""
    rows = table_rows("--trees", "4", "8", "--depths", "4", "6")
    assert [(row[2], row[3]) for row in rows] == [("3", "4"), ("4", "8"), ("6", "8")]


@pytest.mark.parametrize(("arguments", "says"), [
    (["--repeats", "0"], "argument --repeats: 0 is below 1"),  # 'no median for empty data' after the first head
    (["--layers", "0"], "argument --layers: 0 is below 1"),
    (["--trees", "4", "-8"], "argument --trees: -8 is below 1"),
    (["--warmup", "-1"], "argument --warmup: -1 is below 0"),
    (["--threads", "0"], "argument --threads: 0 is below 1"),
])
def test_counts_below_their_least_are_usage_lines(monkeypatch, capsys, arguments, says):
    def no_head(*_args, **_kwargs):
        raise AssertionError("a head was built before the arguments were checked")

    monkeypatch.setattr(bench_draft, "random_head", no_head)
    monkeypatch.setattr(sys, "argv", ["bench_draft", *arguments])
    with pytest.raises(SystemExit) as exit_:
        bench_draft.main()
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_no_accepted_drafts_and_no_warm_up_are_allowed():
    rows = table_rows("--trees", "4", "--depths", "2", "--accepted", "0", "--warmup", "0")
    assert [(row[2], row[3]) for row in rows] == [("2", "4")]
