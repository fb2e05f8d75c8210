"""tools.bench_draft's table: one row per tree shape that runs (depth clamped to T - 1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
